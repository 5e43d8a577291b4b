"""Advantage estimators on hand-computed numbers, and GAE against a plain per-row reference loop."""

from __future__ import annotations

import pytest
import torch

from meshrl.algorithms.advantages import dr_grpo, gae, grpo, reinforce_pp, rloo, whiten

T_ = True
F_ = False

# groups 7, 3, 9 interleaved; row 4 (group 7) is invalid and has an outlying reward that must not count
REWARDS = torch.tensor([1.0, 0.0, 2.0, 5.0, 100.0, 3.0, 4.0])
GROUPS = torch.tensor([7, 3, 7, 3, 7, 9, 7])
VALID = torch.tensor([T_, T_, T_, T_, F_, T_, T_])


def test_grpo_non_contiguous_groups_and_invalid_row() -> None:
    # group 7 valid rewards 1, 2, 4: mean 7/3, population std sqrt(14)/3 -> (-4, -1, 5) / sqrt(14)
    # group 3 rewards 0, 5: mean 2.5, std 2.5 -> -1, +1; group 9 is a singleton -> 0; invalid row -> 0
    expected = torch.tensor([-1.0690450, -1.0, -0.2672612, 1.0, 0.0, 0.0, 1.3363062])
    torch.testing.assert_close(grpo(REWARDS, GROUPS, VALID), expected, atol=1e-5, rtol=0)


def test_grpo_without_valid_and_nan_on_invalid_row() -> None:
    out = grpo(torch.tensor([1.0, 3.0, 2.0, 2.0]), torch.tensor([0, 0, 1, 1]))
    torch.testing.assert_close(out, torch.tensor([-1.0, 1.0, 0.0, 0.0]), atol=1e-5, rtol=0)
    nan_row = torch.tensor([1.0, 3.0, float("nan")])
    out = grpo(nan_row, torch.tensor([0, 0, 0]), torch.tensor([T_, T_, F_]))
    torch.testing.assert_close(out, torch.tensor([-1.0, 1.0, 0.0]), atol=1e-5, rtol=0)


def test_dr_grpo_is_centered_only() -> None:
    expected = torch.tensor([-4 / 3, -2.5, -1 / 3, 2.5, 0.0, 0.0, 5 / 3])
    torch.testing.assert_close(dr_grpo(REWARDS, GROUPS, VALID), expected)
    torch.testing.assert_close(grpo(REWARDS, GROUPS, VALID, scale=False), expected)


def test_rloo_leave_one_out_and_singleton() -> None:
    # group 7 (1, 2, 4): 1 - 3, 2 - 2.5, 4 - 1.5; group 3 (0, 5): -5, +5; singleton and invalid -> 0
    expected = torch.tensor([-2.0, -5.0, -0.5, 5.0, 0.0, 0.0, 2.5])
    torch.testing.assert_close(rloo(REWARDS, GROUPS, VALID), expected)


def test_reinforce_pp_global_normalisation() -> None:
    rewards = torch.tensor([1.0, 2.0, 3.0, 100.0, 6.0])
    valid = torch.tensor([T_, T_, T_, F_, T_])
    # valid 1, 2, 3, 6: mean 3, population std sqrt(3.5)
    expected = torch.tensor([-1.0690450, -0.5345225, 0.0, 0.0, 1.6035675])
    torch.testing.assert_close(reinforce_pp(rewards, valid), expected, atol=1e-5, rtol=0)
    assert torch.equal(reinforce_pp(torch.tensor([4.0])), torch.tensor([0.0]))


def test_gae_hand_values() -> None:
    big = 1e30  # padding values must not leak in
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, big]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.6, 0.7], [1.0, 0.5, big]], dtype=torch.float64)
    mask = torch.tensor([[T_, T_, T_], [T_, T_, F_]])
    adv, ret = gae(rewards, values, mask, gamma=0.5, lam=0.5)
    # row 0: deltas (-0.2, -0.25, 0.3); row 1: deltas (0 + 0.25 - 1, 2 - 0.5) = (-0.75, 1.5)
    exp_adv = torch.tensor([[-0.24375, -0.175, 0.3], [-0.375, 1.5, 0.0]], dtype=torch.float64)
    exp_ret = torch.tensor([[0.25625, 0.425, 1.0], [0.625, 2.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(adv, exp_adv)
    torch.testing.assert_close(ret, exp_ret)
    adv, ret = gae(rewards[:1], values[:1], mask[:1], gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.4, 0.3]], dtype=torch.float64))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0]], dtype=torch.float64))


def _gae_reference(rewards: list[float], values: list[float], gamma: float, lam: float) -> list[float]:
    out = [0.0] * len(rewards)
    running = 0.0
    for t in reversed(range(len(rewards))):
        next_value = values[t + 1] if t + 1 < len(rewards) else 0.0
        delta = rewards[t] + gamma * next_value - values[t]
        running = delta + gamma * lam * running
        out[t] = running
    return out


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.0, 0.7), (1.0, 0.5)])
@pytest.mark.parametrize("seed", [0, 1])
def test_gae_matches_per_row_reference_on_ragged_masks(gamma: float, lam: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    b, t = 6, 9
    lengths = torch.randint(0, t + 1, (b,), generator=g)
    lengths[0] = t
    mask = torch.arange(t)[None, :] < lengths[:, None]
    rewards = torch.randn(b, t, generator=g, dtype=torch.float64)
    values = torch.randn(b, t, generator=g, dtype=torch.float64)
    rewards[~mask], values[~mask] = 1e6, -1e6
    adv, ret = gae(rewards, values, mask, gamma=gamma, lam=lam)
    for i in range(b):
        n = int(lengths[i])
        ref = _gae_reference(rewards[i, :n].tolist(), values[i, :n].tolist(), gamma, lam)
        torch.testing.assert_close(adv[i, :n], torch.tensor(ref, dtype=torch.float64))
        torch.testing.assert_close(ret[i, :n], torch.tensor(ref, dtype=torch.float64) + values[i, :n])
        assert not adv[i, n:].any() and not ret[i, n:].any()


def test_gae_skips_gaps_inside_a_row() -> None:
    rewards = torch.tensor([[0.0, 9.0, 1.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 9.0, 0.7]], dtype=torch.float64)
    mask = torch.tensor([[T_, F_, T_]])
    adv, _ = gae(rewards, values, mask, gamma=0.5, lam=0.5)
    # as if the row were [0, 1] / [0.5, 0.7]: delta0 = 0.35 - 0.5 = -0.15, A0 = -0.15 + 0.25 * 0.3
    torch.testing.assert_close(adv, torch.tensor([[-0.075, 0.0, 0.3]], dtype=torch.float64))


def test_whiten_masked() -> None:
    x = torch.tensor([[1.0, 2.0, 1e9], [3.0, 6.0, -1e9]], dtype=torch.float64)
    mask = torch.tensor([[T_, T_, F_], [T_, T_, F_]])
    # valid 1, 2, 3, 6: mean 3, population std sqrt(3.5)
    expected = torch.tensor([[-1.0690450, -0.5345225, 0.0], [0.0, 1.6035675, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(whiten(x, mask), expected, atol=1e-6, rtol=0)


def test_token_rewards_put_the_outcome_on_the_last_token_and_the_penalty_everywhere() -> None:
    from meshrl.algorithms.advantages import token_rewards

    mask = torch.tensor([[T_, T_, T_], [T_, F_, F_], [F_, F_, F_]])
    out = token_rewards(torch.tensor([1.0, 2.0, 3.0]), mask)
    torch.testing.assert_close(out, torch.tensor([[0.0, 0.0, 1.0], [2.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    penalty = torch.full((3, 3), 0.5)
    out = token_rewards(torch.tensor([1.0, 2.0, 3.0]), mask, penalty)
    torch.testing.assert_close(out, torch.tensor([[-0.5, -0.5, 0.5], [1.5, 0.0, 0.0], [0.0, 0.0, 0.0]]))


def test_gae_on_token_rewards_with_gamma_one_and_lambda_one_is_reward_to_go_minus_value() -> None:
    from meshrl.algorithms.advantages import token_rewards

    mask = torch.tensor([[T_, T_, T_]])
    rewards = token_rewards(torch.tensor([1.0]), mask, torch.full((1, 3), 0.1))
    values = torch.tensor([[0.3, 0.2, 0.1]])
    advantages, returns = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(returns, torch.tensor([[0.7, 0.8, 0.9]]))
    torch.testing.assert_close(advantages, torch.tensor([[0.4, 0.6, 0.8]]))
