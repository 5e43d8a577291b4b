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


async def chat_judge(prompts: list, completions: list, **columns: list) -> list[float]:
    """TRL's signature, async: conversational prompts and completions, the other columns by name."""
    assert all(p[-1]["role"] == "user" for p in prompts) and all(
        c[0]["role"] == "assistant" for c in completions
    )
    return [float(c[0]["content"].startswith(a)) for c, a in zip(completions, columns["answer"], strict=True)]


def odd_only(prompt: list, completion: list, row: dict) -> float | None:
    """Per sample: not applicable (None) to rows with an even answer."""
    return None if int(row["answer"]) % 2 == 0 else float(completion[0]["content"][:1].isdigit())
