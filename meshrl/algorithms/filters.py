"""Batch filters from DAPO: keep only prompt groups that carry a learning signal, and penalise overlong
responses smoothly instead of cutting them off.

Both are pure functions of per-row tensors so that the rollout side can apply them before rows reach
the trainer (dynamic sampling keeps drawing prompts until enough groups pass `groups_with_signal`).
Source: Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale".
"""

from __future__ import annotations

import torch
from torch import Tensor


def groups_with_signal(rewards: Tensor, groups: Tensor, valid: Tensor | None = None) -> Tensor:
    """Rows whose group's valid rewards are not all equal: DAPO's dynamic sampling (Yu et al. 2025).

    A group whose responses all score the same gets zero group-relative advantage and so no gradient;
    DAPO drops such groups. rewards [B] float, groups [B] int64 group id per row (any order), valid [B]
    bool or None (all valid). Returns [B] bool: for every row (invalid ones included) whether its group
    has at least two distinct valid rewards; combine with `valid` to drop the invalid rows themselves.
    Invalid rows' rewards are ignored (they may be nan).
    """
    if rewards.dim() != 1 or groups.shape != rewards.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and groups {tuple(groups.shape)} must be [B]")
    ok = torch.ones_like(rewards, dtype=torch.bool) if valid is None else valid.bool()
    ids, index = torch.unique(groups, return_inverse=True)
    r = rewards.float() if not rewards.is_floating_point() else rewards
    inf = torch.full((ids.numel(),), torch.inf, dtype=r.dtype, device=r.device)
    lo = inf.scatter_reduce(0, index, torch.where(ok, r, torch.inf), reduce="amin")
    hi = (-inf).scatter_reduce(0, index, torch.where(ok, r, -torch.inf), reduce="amax")
    return (hi > lo)[index]


def overlong_penalty(lengths: Tensor, *, max_len: int, buffer: int, penalty: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025), a reward term for each response length.

    0 while length <= max_len - buffer, then linear down to -penalty at length == max_len, and -penalty
    beyond. lengths [B] int or float -> [B] float32 (or lengths' float dtype). buffer 0 means a hard
    step: -penalty for length > max_len only.
    """
    if not 0 <= buffer <= max_len:
        raise ValueError(f"need 0 <= buffer <= max_len, got buffer={buffer}, max_len={max_len}")
    x = lengths.to(torch.promote_types(lengths.dtype, torch.float32))
    if buffer == 0:
        frac = (x > max_len).to(x.dtype)
    else:
        frac = ((x - (max_len - buffer)) / buffer).clamp(0.0, 1.0)
    return -penalty * frac
