"""Reward functions for tests, importable by the rollout service as tests.integration.ppo.rewards:NAME."""

from __future__ import annotations

from typing import Any


def even_first_digit(prompt: str, completion: str, row: dict[str, Any]) -> float:
    """1 when the completion starts with an even digit: a signal a critic can read off the tokens."""
    return 1.0 if completion[:1] in "02468" and completion[:1] != "" else 0.0
