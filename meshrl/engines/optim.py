"""The training engines' learning-rate schedule: warm-up, then constant, linear decay to 0 at the last
step, or cosine (the settings are `OptimConfig`, meshrl/engines/settings.py)."""

from __future__ import annotations

import math

from meshrl.engines.settings import OptimConfig


def lr_factor(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Multiplier of the base learning rate at optimizer step `step` (0-based) of `total_steps`."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    if cfg.schedule == "linear":
        return max(0.0, 1.0 - progress)
    if cfg.schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0
