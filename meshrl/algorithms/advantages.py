"""Advantage estimators: group-relative (GRPO, Dr. GRPO, RLOO), batch-normalised (REINFORCE++) and GAE.

One place for every baseline the trainer can choose, as pure functions of rewards (and values), so each
can be checked against its paper on hand-computed numbers. Outcome-reward estimators take one scalar
reward per row (a sampled response) and return one advantage per row; the trainer broadcasts it over
the row's tokens. `gae` works per token.

Groups are given as an id per row (the prompt a response was sampled for); rows of a group need not be
contiguous. Rows marked invalid (failed or truncated samples, padding rows) get advantage 0 and do not
enter any mean or standard deviation.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _valid_mask(rewards: Tensor, valid: Tensor | None) -> Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {tuple(rewards.shape)}")
    if valid is None:
        return torch.ones_like(rewards, dtype=torch.bool)
    if valid.shape != rewards.shape:
        raise ValueError(f"valid shape {tuple(valid.shape)} != rewards shape {tuple(rewards.shape)}")
    return valid.bool()


def _float(x: Tensor) -> Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _group_stats(rewards: Tensor, groups: Tensor, valid: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Return (r, index, sum, count): float rewards zeroed on invalid rows, dense group index per row,
    and the per-group sum and count of valid rows."""
    if groups.shape != rewards.shape:
        raise ValueError(f"groups shape {tuple(groups.shape)} != rewards shape {tuple(rewards.shape)}")
    r = torch.where(valid, _float(rewards), 0.0)  # where, not multiply: NaN rewards on invalid rows
    ids, index = torch.unique(groups, return_inverse=True)
    n = ids.numel()
    total = r.new_zeros(n).index_add_(0, index, r)
    count = r.new_zeros(n).index_add_(0, index, valid.to(r.dtype))
    return r, index, total, count


def grpo(
    rewards: Tensor,
    groups: Tensor,
    valid: Tensor | None = None,
    *,
    scale: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """Group-relative advantage: (r - group mean) / (group std + eps).

    GRPO, Shao et al. 2024, "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language
    Models". With `scale=False` the division by the std is dropped, as proposed by Dr. GRPO, Liu et al.
    2025, "Understanding R1-Zero-Like Training: A Critical Perspective" (the std term up-weights groups
    whose rewards barely differ).

    rewards [B] float, groups [B] int64 group id per row (any order), valid [B] bool or None (all valid).
    The mean and the population std (unbiased=False) are taken over the valid rows of each group.
    Returns [B] in the rewards' float dtype (at least float32); 0 for invalid rows and for groups with
    fewer than two valid rows.
    """
    ok = _valid_mask(rewards, valid)
    r, index, total, count = _group_stats(rewards, groups, ok)
    n = count.clamp_min(1.0)
    dev = torch.where(ok, r - (total / n)[index], 0.0)
    keep = ok & (count[index] >= 2)
    if scale:
        var = r.new_zeros(count.shape).index_add_(0, index, dev * dev) / n
        dev = dev / (var.sqrt()[index] + eps)
    return torch.where(keep, dev, 0.0)


def dr_grpo(rewards: Tensor, groups: Tensor, valid: Tensor | None = None) -> Tensor:
    """Dr. GRPO advantage r - group mean, without the std division (Liu et al. 2025, "Understanding
    R1-Zero-Like Training: A Critical Perspective"). The paper's other change, dropping per-sequence
    length normalisation, is a loss aggregation choice: use "seq-mean-token-sum" with a constant
    normalizer, or "token-mean", in `losses.aggregate`.

    rewards [B], groups [B] int64, valid [B] bool or None. Returns [B].
    """
    return grpo(rewards, groups, valid, scale=False)


def rloo(rewards: Tensor, groups: Tensor, valid: Tensor | None = None) -> Tensor:
    """REINFORCE leave-one-out: r_i minus the mean reward of the other valid rows of its group.

    Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from
    Human Feedback in LLMs". rewards [B], groups [B] int64, valid [B] bool or None. Returns [B]; 0 for
    invalid rows and for groups with a single valid row (no other row to form a baseline).
    """
    ok = _valid_mask(rewards, valid)
    r, index, total, count = _group_stats(rewards, groups, ok)
    others = count[index] - 1.0
    baseline = (total[index] - r) / others.clamp_min(1.0)
    return torch.where(ok & (others >= 1), r - baseline, 0.0)


def reinforce_pp(rewards: Tensor, valid: Tensor | None = None, *, eps: float = 1e-6) -> Tensor:
    """REINFORCE++ advantage: rewards normalised by the mean and std of the whole batch.

    Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models" (global
    advantage normalisation instead of a per-prompt baseline). rewards [B], valid [B] bool or None.
    Mean and population std (unbiased=False) over valid rows. Returns [B]; 0 for invalid rows.
    """
    ok = _valid_mask(rewards, valid)
    r = torch.where(ok, _float(rewards), 0.0)
    n = ok.sum().clamp_min(1).to(r.dtype)
    mean = r.sum() / n
    dev = torch.where(ok, r - mean, 0.0)
    std = ((dev * dev).sum() / n).sqrt()
    return torch.where(ok, dev / (std + eps), 0.0)


def gae(rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation, computed by a reverse scan over tokens for all rows at once.

    Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage Estimation":
    delta_t = r_t + gamma * V_{t+1} - V_t, A_t = delta_t + gamma * lam * A_{t+1}, returns = A + V.

    rewards, values [B, T] float; mask [B, T] bool, True on response tokens (rows may be right-padded to
    different lengths). The value after a row's last valid token is 0 (the episode ended; no bootstrap).
    Positions where mask is False are skipped: the scan carries V_{t+1} and A_{t+1} across them, so a
    row with gaps (e.g. environment tokens in a multi-turn response) is treated as its valid tokens
    back to back. Rewards and values at masked positions are ignored.
    Returns (advantages, returns), both [B, T] float, 0 where mask is False.
    """
    if not (rewards.shape == values.shape == mask.shape) or rewards.dim() != 2:
        raise ValueError(
            f"rewards {tuple(rewards.shape)}, values {tuple(values.shape)} and mask {tuple(mask.shape)} "
            "must all be [B, T]"
        )
    dtype = torch.promote_types(torch.promote_types(rewards.dtype, values.dtype), torch.float32)
    m = mask.bool()
    r = torch.where(m, rewards.to(dtype), 0.0)
    v = torch.where(m, values.to(dtype), 0.0)
    adv = torch.zeros_like(r)
    next_value = r.new_zeros(r.shape[0])
    next_adv = r.new_zeros(r.shape[0])
    for t in range(r.shape[1] - 1, -1, -1):
        delta = r[:, t] + gamma * next_value - v[:, t]
        a = delta + gamma * lam * next_adv
        mt = m[:, t]
        adv[:, t] = torch.where(mt, a, 0.0)
        next_adv = torch.where(mt, a, next_adv)
        next_value = torch.where(mt, v[:, t], next_value)
    returns = torch.where(m, adv + v, 0.0)
    return adv, returns


def whiten(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """Normalise x to zero mean and unit std over the positions where mask is True.

    The per-token advantage normalisation commonly applied to GAE advantages in PPO (Schulman et al.
    2017, "Proximal Policy Optimization Algorithms", and its RLHF implementations). x and mask of the
    same shape (e.g. [B, T]); population std (unbiased=False). Returns x's shape, 0 where mask is False.
    """
    if x.shape != mask.shape:
        raise ValueError(f"x shape {tuple(x.shape)} != mask shape {tuple(mask.shape)}")
    m = mask.bool()
    y = torch.where(m, _float(x), 0.0)
    n = m.sum().clamp_min(1).to(y.dtype)
    dev = torch.where(m, y - y.sum() / n, 0.0)
    std = ((dev * dev).sum() / n).sqrt()
    return dev / (std + eps)


def token_rewards(rewards: Tensor, mask: Tensor, kl_penalty: Tensor | None = None) -> Tensor:
    """Per-token rewards for GAE: the outcome reward on each row's last response token, minus a per-token
    KL penalty (coef * KL(behaviour || reference), already scaled) on every token, as in RLHF's PPO
    (Ouyang et al. 2022, "Training language models to follow instructions with human feedback").

    rewards [B], mask [B, T] bool (right-padded response tokens), kl_penalty [B, T] or None.
    Returns [B, T] float, 0 where mask is False. A row with no response token gets nothing.
    """
    m = mask.bool()
    out = torch.zeros(m.shape, dtype=torch.float32)
    if kl_penalty is not None:
        out = torch.where(m, -kl_penalty.float(), 0.0)
    lengths = m.sum(1)
    has = lengths > 0
    last = (torch.arange(m.shape[1]).expand_as(m) * m).argmax(1)
    rows = torch.arange(m.shape[0])[has]
    out[rows, last[has]] += _float(rewards)[has]
    return out
