"""Aggregation, log-probs/entropy, KL estimators and the PPO/GSPO losses on hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from meshrl.algorithms.losses import AGGREGATIONS, aggregate, entropy, gspo, kl, ppo_clip, token_logprobs

T_ = True
F_ = False
HUGE = 1e30


def _ragged() -> tuple[torch.Tensor, torch.Tensor]:
    values = torch.tensor(
        [[1.0, 2.0, 3.0, HUGE], [4.0, HUGE, HUGE, HUGE], [HUGE, HUGE, HUGE, HUGE]], dtype=torch.float64
    )
    mask = torch.tensor([[T_, T_, T_, F_], [T_, F_, F_, F_], [F_, F_, F_, F_]])
    return values, mask


@pytest.mark.parametrize(
    ("mode", "normalizer", "expected"),
    [
        ("token-mean", None, 2.5),  # (1 + 2 + 3 + 4) / 4
        ("token-mean", 8.0, 1.25),
        ("seq-mean-token-mean", None, 2.0),  # (2 + 4 + 0) / 3
        ("seq-mean-token-mean", 4.0, 1.5),
        ("seq-mean-token-sum", None, 10 / 3),  # (6 + 4 + 0) / 3
        ("seq-mean-token-sum", 5.0, 2.0),
    ],
)
def test_aggregate_modes(mode: str, normalizer: float | None, expected: float) -> None:
    values, mask = _ragged()
    assert aggregate(values, mask, mode, normalizer).item() == pytest.approx(expected)


@pytest.mark.parametrize(
    ("mode", "global_normalizer"), [(AGGREGATIONS[0], 4.0), (AGGREGATIONS[1], 3.0), (AGGREGATIONS[2], 3.0)]
)
def test_aggregate_micro_batches_sum_to_full_batch(mode: str, global_normalizer: float) -> None:
    values, mask = _ragged()
    full = aggregate(values, mask, mode)
    parts = [aggregate(values[s], mask[s], mode, global_normalizer) for s in (slice(0, 1), slice(1, 3))]
    assert (parts[0] + parts[1]).item() == pytest.approx(full.item())


def test_aggregate_unknown_mode() -> None:
    values, mask = _ragged()
    with pytest.raises(ValueError, match="seq-mean-token-sum"):
        aggregate(values, mask, "sum")


def test_token_logprobs_hand_values_and_temperature() -> None:
    logits = torch.tensor([[[0.0, math.log(3.0)]]])  # probabilities 1/4, 3/4
    target = torch.tensor([[1]])
    assert token_logprobs(logits, target).item() == pytest.approx(-0.2876821, abs=1e-6)  # log 3/4
    # temperature 2: probabilities 1 : sqrt(3), log(sqrt3 / (1 + sqrt3))
    assert token_logprobs(logits, target, temperature=2.0).item() == pytest.approx(-0.4557464, abs=1e-6)
    assert token_logprobs(logits, target, temperature=0.0).item() == pytest.approx(-0.2876821, abs=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_chunked_equals_unchunked_and_log_softmax(temperature: float) -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 7, 11, generator=g).to(torch.bfloat16)
    targets = torch.randint(0, 11, (2, 7), generator=g)
    full = token_logprobs(logits, targets, temperature=temperature)
    assert full.dtype == torch.float32 and full.shape == (2, 7)
    manual = torch.log_softmax(logits.float() / temperature, -1).gather(-1, targets[..., None])[..., 0]
    torch.testing.assert_close(full, manual)
    for chunk in (1, 3, 7, 100):
        torch.testing.assert_close(
            token_logprobs(logits, targets, temperature=temperature, chunk=chunk), full
        )


def test_entropy() -> None:
    uniform = torch.zeros(2, 5, 13)
    torch.testing.assert_close(entropy(uniform), torch.full((2, 5), math.log(13)))
    logits = torch.tensor([[[0.0, math.log(3.0)]]])
    assert entropy(logits).item() == pytest.approx(0.5623351, abs=1e-6)
    rand = torch.randn(3, 8, 17, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(entropy(rand, temperature=1.5, chunk=3), entropy(rand, temperature=1.5))


def test_kl_estimators() -> None:
    logp = torch.tensor([math.log(0.5), math.log(0.25)], dtype=torch.float64)
    ref = torch.tensor([math.log(0.25), math.log(0.5)], dtype=torch.float64)
    torch.testing.assert_close(
        kl(logp, ref, "k1"), torch.tensor([0.6931472, -0.6931472], dtype=torch.float64)
    )
    torch.testing.assert_close(kl(logp, ref, "k2"), torch.tensor([0.2402265, 0.2402265], dtype=torch.float64))
    torch.testing.assert_close(kl(logp, ref), torch.tensor([0.1931472, 0.3068528], dtype=torch.float64))
    g = torch.Generator().manual_seed(2)
    assert (kl(torch.randn(1000, generator=g) * 3, torch.randn(1000, generator=g) * 3, "k3") >= 0).all()
    with pytest.raises(ValueError, match="k3"):
        kl(logp, ref, "k4")


def _ppo_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    ratios = torch.tensor([[1.1, 1.5], [0.5, 1.25], [0.5, 1.5], [0.9, 1.0]], dtype=torch.float64)
    logprobs = ratios.log()
    logprobs[3, 1] = 1e4  # masked position: exp would overflow if it reached the loss
    old = torch.zeros_like(logprobs)
    advantages = torch.tensor([1.0, 1.0, -2.0, -2.0], dtype=torch.float64)
    mask = torch.tensor([[T_, T_], [T_, T_], [T_, T_], [T_, F_]])
    return logprobs.requires_grad_(), old, advantages, mask


def test_ppo_clip_asymmetric_band() -> None:
    logprobs, old, advantages, mask = _ppo_case()
    out = ppo_clip(logprobs, old, advantages, mask, clip_low=0.2, clip_high=0.28)
    # per token: A=+1: -1.1, -clip(1.5)=-1.28 | -0.5 (below band, A>0: unclipped), -1.25
    # A=-2: ratio 0.5 -> max(1.0, 1.6) = 1.6 (clipped), ratio 1.5 -> max(3.0, 2.56) = 3.0 | 1.8
    assert out.loss.item() == pytest.approx(2.27 / 7)
    assert out.metrics["clip_fraction"] == pytest.approx(2 / 7)
    assert out.metrics["clip_fraction_low"] == pytest.approx(1 / 7)
    assert out.metrics["clip_fraction_high"] == pytest.approx(1 / 7)
    assert out.metrics["ratio_mean"] == pytest.approx(7.25 / 7)
    assert out.metrics["ratio_max"] == pytest.approx(1.5)
    assert out.metrics["approx_kl"] == pytest.approx(0.0874673, abs=1e-6)
    assert all(isinstance(v, float) for v in out.metrics.values())


def test_ppo_clip_gradient_is_zero_on_clipped_and_masked_tokens() -> None:
    logprobs, old, advantages, mask = _ppo_case()
    ppo_clip(logprobs, old, advantages, mask, clip_low=0.2, clip_high=0.28).loss.backward()
    grad = logprobs.grad
    assert grad is not None and torch.isfinite(grad).all()
    # d loss / d logp = -A * ratio / 7 where the unclipped term is active, else 0
    expected = torch.tensor([[-1.1, 0.0], [-0.5, -1.25], [0.0, 3.0], [1.8, 0.0]], dtype=torch.float64) / 7
    torch.testing.assert_close(grad, expected)


def test_ppo_clip_per_token_advantages_and_masked_garbage() -> None:
    logprobs, old, _, mask = _ppo_case()
    old = old.clone()
    old[3, 1] = -1e4
    adv_tok = torch.tensor([[1.0, 1.0], [1.0, 1.0], [-2.0, -2.0], [-2.0, HUGE]], dtype=torch.float64)
    out = ppo_clip(logprobs, old, adv_tok, mask, clip_low=0.2, clip_high=0.28)
    assert out.loss.item() == pytest.approx(2.27 / 7)
    per_row = ppo_clip(
        logprobs, old, adv_tok, mask, clip_low=0.2, clip_high=0.28, aggregation="seq-mean-token-sum"
    )
    assert per_row.loss.item() == pytest.approx(2.27 / 4)


def test_ppo_dual_clip() -> None:
    ratios = torch.tensor([[5.0, 5.0, 2.0]], dtype=torch.float64)
    logprobs = ratios.log().requires_grad_()
    adv = torch.tensor([[-1.0, 1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    out = ppo_clip(logprobs, torch.zeros_like(ratios), adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    # A<0, ratio 5: loss 5 capped at 3; A>0, ratio 5: clipped to -1.28; A<0, ratio 2: 2 < 3, kept
    assert out.loss.item() == pytest.approx((3.0 - 1.28 + 2.0) / 3)
    assert out.metrics["clip_fraction_high"] == pytest.approx(2 / 3)
    out.loss.backward()
    assert logprobs.grad is not None
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, 0.0, 2.0 / 3]], dtype=torch.float64))
    without = ppo_clip(logprobs, torch.zeros_like(ratios), adv, mask, clip_low=0.2, clip_high=0.28)
    assert without.loss.item() == pytest.approx((5.0 - 1.28 + 2.0) / 3)
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_clip(logprobs, torch.zeros_like(ratios), adv, mask, dual_clip=1.0)


def test_gspo_value_gradient_and_metrics() -> None:
    log_ratio = torch.tensor(
        [[0.0004, 0.0008, 0.0], [0.0001, -0.0002, 0.0004], [-0.001, 0.0, 0.0]], dtype=torch.float64
    )
    mask = torch.tensor([[T_, T_, F_], [T_, T_, T_], [T_, F_, F_]])
    old = torch.full_like(log_ratio, -2.0)
    old[0, 2] = -1e4  # masked garbage
    logprobs = (old + log_ratio).requires_grad_()
    advantages = torch.tensor([1.0, -1.0, -1.0], dtype=torch.float64)
    out = gspo(logprobs, old, advantages, mask, clip_low=3e-4, clip_high=4e-4)
    # s = exp(0.0006) -> clipped to 1.0004 (A>0); exp(0.0001) inside; exp(-0.001) -> clipped to 0.9997 (A<0)
    assert out.loss.item() == pytest.approx(0.333133335, abs=1e-9)
    assert out.metrics["clip_fraction"] == pytest.approx(3 / 6)
    assert out.metrics["clip_fraction_low"] == pytest.approx(1 / 6)
    assert out.metrics["clip_fraction_high"] == pytest.approx(2 / 6)
    assert out.metrics["ratio_max"] == pytest.approx(1.0006002, abs=1e-6)
    out.loss.backward()
    # only the unclipped row has gradient: -A * s / (3 tokens) / (3 rows) = 1.0001 / 9 per token
    expected = torch.zeros(3, 3, dtype=torch.float64)
    expected[1] = 0.1111222228
    assert logprobs.grad is not None
    torch.testing.assert_close(logprobs.grad, expected)


def test_gspo_matches_sequence_form_with_normalizer() -> None:
    g = torch.Generator().manual_seed(3)
    logprobs = (torch.randn(4, 5, generator=g, dtype=torch.float64) * 1e-3).requires_grad_()
    old = torch.zeros(4, 5, dtype=torch.float64)
    mask = torch.tensor([[T_] * 5, [T_, T_, F_, F_, F_], [F_] * 5, [T_, T_, T_, T_, F_]])
    adv = torch.tensor([0.5, -1.0, 2.0, 1.5], dtype=torch.float64)
    out = gspo(logprobs, old, adv, mask, clip_low=0.05, clip_high=0.05, normalizer=8.0)
    (grad,) = torch.autograd.grad(out.loss, logprobs)
    # sequence form written out directly; all ratios are inside the wide band; the empty row counts 0
    n = mask.sum(-1).clamp_min(1)
    s = torch.exp((logprobs * mask).sum(-1) / n)
    seq = -(s * adv * mask.any(-1)).sum() / 8.0
    (seq_grad,) = torch.autograd.grad(seq, logprobs)
    torch.testing.assert_close(out.loss, seq)
    torch.testing.assert_close(grad, seq_grad)


# ---------------------------------------------------------------------------------------------------------
# off-policy corrections (asynchronous training)


def test_importance_weights_truncate_and_report():
    from meshrl.algorithms.losses import importance_weights

    target = torch.tensor([[0.0, 0.0, 1.0, 9.0]])
    behaviour = torch.tensor([[0.0, math.log(2.0), 0.0, 0.0]])
    mask = torch.tensor([[True, True, True, False]])
    w, stats = importance_weights(target, behaviour, mask, cap=2.0)
    assert w[0].tolist() == pytest.approx([1.0, 0.5, 2.0, 0.0])  # e^1 = 2.718 truncated to 2; masked -> 0
    assert stats["is_weight_mean"] == pytest.approx((1.0 + 0.5 + math.e) / 3)
    assert stats["is_weight_max"] == pytest.approx(math.e)
    assert stats["is_truncated_fraction"] == pytest.approx(1 / 3)


def test_decoupled_ppo_weights_the_clipped_loss_by_behaviour_to_proximal():
    from meshrl.algorithms.losses import decoupled_ppo

    # token 0: ratio 1.1 (inside), weight 0.5; token 1: ratio 1.5 (clipped at 1.2), weight 2 (cap 3)
    prox = torch.tensor([[0.0, 0.0]])
    logp = torch.tensor([[math.log(1.1), math.log(1.5)]], requires_grad=True)
    behav = torch.tensor([[math.log(2.0), -math.log(2.0)]])
    out = decoupled_ppo(logp, prox, behav, torch.tensor([1.0]), torch.ones(1, 2, dtype=torch.bool), cap=3.0)
    assert out.loss.item() == pytest.approx(-(0.5 * 1.1 + 2.0 * 1.2) / 2)
    out.loss.backward()
    assert logp.grad is not None
    assert logp.grad[0].tolist() == pytest.approx([-0.5 * 1.1 / 2, 0.0])  # clipped token: no gradient
    assert out.metrics["clip_fraction"] == pytest.approx(0.5)
    assert out.metrics["is_weight_mean"] == pytest.approx(1.25)


def test_decoupled_ppo_equals_ppo_when_behaviour_is_proximal():
    from meshrl.algorithms.losses import decoupled_ppo, ppo_clip

    g = torch.Generator().manual_seed(0)
    logp, old = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    adv, mask = torch.randn(3, generator=g), torch.rand(3, 5, generator=g) > 0.3
    a = decoupled_ppo(logp, old, old, adv, mask, cap=2.0).loss
    b = ppo_clip(logp, old, adv, mask).loss
    assert a.item() == pytest.approx(b.item())


def test_tis_is_truncated_reinforce():
    from meshrl.algorithms.losses import tis

    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    behav = torch.tensor([[-1.0, -3.0]])  # weights 1 and e -> truncated to 2
    out = tis(logp, behav, torch.tensor([2.0]), torch.ones(1, 2, dtype=torch.bool), cap=2.0)
    assert out.loss.item() == pytest.approx(-(1.0 * 2.0 * -1.0 + 2.0 * 2.0 * -2.0) / 2)
    out.loss.backward()
    assert logp.grad is not None
    assert logp.grad[0].tolist() == pytest.approx([-1.0 * 2.0 / 2, -2.0 * 2.0 / 2])
    assert out.metrics["is_truncated_fraction"] == pytest.approx(0.5)


def test_value_loss_clips_both_sides_and_ignores_masked_tokens():
    from meshrl.algorithms.losses import value_loss

    old = torch.tensor([[0.0, 0.0, 0.0, 5.0]])
    new = torch.tensor([[0.5, -0.5, 0.1, 99.0]], requires_grad=True)
    ret = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True, False]])
    loss, metrics = value_loss(new, old, ret, mask, clip=0.2)
    # token 0: unclipped (0.5-1)^2=0.25, clipped (0.2-1)^2=0.64 -> 0.64 (clipping would help: it is taken)
    # token 1: unclipped 0.25, clipped (-0.2)^2=0.04 -> 0.25; token 2: inside the band, 0.01 both ways
    torch.testing.assert_close(loss, torch.tensor(0.5 * (0.64 + 0.25 + 0.01) / 3))
    assert metrics["value_clip_fraction"] == pytest.approx(1 / 3)
    loss.backward()
    assert new.grad is not None
    # the clipped term of token 0 does not depend on the new value; masked token 3 gets nothing
    assert new.grad[0, 0] == 0 and new.grad[0, 3] == 0 and new.grad[0, 1] != 0
    plain, _ = value_loss(new, old, ret, mask, clip=None)
    torch.testing.assert_close(plain, torch.tensor(0.5 * (0.25 + 0.25 + 0.01) / 3))


def test_value_loss_explained_variance():
    from meshrl.algorithms.losses import value_loss

    ret = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    _, perfect = value_loss(ret.clone(), ret.clone(), ret, mask, clip=None)
    _, constant = value_loss(torch.full((1, 4), 2.5), ret, ret, mask, clip=None)
    assert perfect["explained_variance"] == pytest.approx(1.0)
    assert constant["explained_variance"] == pytest.approx(0.0)


def test_adaptive_kl_moves_towards_the_target_by_at_most_twenty_percent():
    from meshrl.algorithms.losses import AdaptiveKL

    ctl = AdaptiveKL(0.1, target=1.0, horizon=100)
    assert ctl.update(1.5, 10) == pytest.approx(0.1 * (1 + 0.2 * 0.1))  # error 0.5 clipped to 0.2
    ctl = AdaptiveKL(0.1, target=1.0, horizon=100)
    assert ctl.update(0.9, 50) == pytest.approx(0.1 * (1 - 0.1 * 0.5))
    fixed = AdaptiveKL(0.1, target=None)
    assert fixed.update(10.0, 1000) == 0.1
