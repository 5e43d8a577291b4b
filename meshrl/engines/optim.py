"""The training engines' optimizer settings and learning-rate schedule (warm-up, then constant, linear
decay to 0 at the last step, or cosine)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    lr: float
    schedule: str = "constant"
    warmup_steps: int = 0
    total_steps: int = 1
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0


def lr_factor(step: int, cfg: OptimConfig) -> float:
    """Multiplier of the base learning rate at optimizer step `step` (0-based)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    span = max(1, cfg.total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    if cfg.schedule == "linear":
        return max(0.0, 1.0 - progress)
    if cfg.schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0
