"""Guess the number: a multi-turn game with feedback and no tools, so trajectories differ in length.

The secret is 1..`HIGH`; each model turn is a guess, the environment answers "higher" or "lower"
until the guess is right or the turns run out. Reward: 1 when found, less the later it is found.
"""

from __future__ import annotations

import random
import re
from typing import Any

from meshrl.envs import Environment, Message, State, Step, Turn

HIGH = 50


def split(seed: int = 0) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    rng = random.Random(seed)
    rows = [
        {"prompt": f"guess a number from 1 to {HIGH}", "secret": rng.randint(1, HIGH)} for _ in range(500)
    ]
    return rows, []


class GuessEnv(Environment):
    async def reset(self, row: dict[str, Any]) -> tuple[list[dict[str, Any]], State]:
        return [{"role": "user", "content": str(row["prompt"])}], {
            "secret": int(row["secret"]),
            "found": 0,
            "turns": 0,
        }

    async def step(self, state: State, turn: Turn) -> Step:
        state["turns"] += 1
        m = re.search(r"\d+", turn.content)
        if m is None:
            return Step([{"role": "user", "content": "a number, please"}])
        guess = int(m.group())
        if guess == state["secret"]:
            state["found"] = state["turns"]
            return Step([], done=True)
        return Step([{"role": "user", "content": "higher" if guess < state["secret"] else "lower"}])

    async def reward(self, state: State, final: Turn | None, transcript: list[Message]) -> dict[str, float]:
        found, most = state["found"], self.limits.max_turns  # the recipe's agents.max_turns
        return {
            "found": float(found > 0),
            "speed": 0.1 * (most - found) / most if found else 0.0,
        }
