"""Reward functions for tests/unit/test_rewards.py that run in worker processes (importable by name)."""

from __future__ import annotations

import os
import time
from typing import Any

from meshrl.rewards import in_process


@in_process
def worker_pid(prompt: Any, completion: Any, row: dict[str, Any]) -> float:
    """The id of the process it ran in."""
    return float(os.getpid())


@in_process
def hangs_on_stop(prompts: list[Any], completions: list[Any], **columns: Any) -> list[float]:
    """Batched; hangs on a completion that says "stop", else scores 1."""
    if "stop" in completions:
        time.sleep(3600)
    return [1.0] * len(completions)


@in_process
def raises(prompt: Any, completion: Any, row: dict[str, Any]) -> float:
    raise ValueError(f"cannot score {completion!r}")
