"""Reward functions for tests of the rollout's failure handling."""

from __future__ import annotations

from meshrl.tasks.arith import reward


def flaky(prompt: str, completion: str, row: dict) -> float:
    """Raises on every prompt with a 7 in it, scores the rest like the arithmetic task."""
    if "7" in prompt:
        raise ValueError(f"cannot score {prompt!r}")
    return reward(prompt, completion, row)


def broken(prompt: str, completion: str, row: dict) -> float:
    raise RuntimeError("this reward function always fails")
