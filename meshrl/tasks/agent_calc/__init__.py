"""Tool arithmetic: sums of three two-digit numbers, which the tiny model cannot do in its head, with a
calculator tool it can call.

A good trajectory is two turns: ``calc(12+34+56)``, the tool's reply ``102``, then the answer ``102``.
The reward is the final answer's correctness (the arithmetic task's rule: the answer's digits, then
nothing or a non-digit). The tiny model's characters have no braces, so calls use the plain-text
format (`parser="plain"`), and its chat template has no tool role, so results come back as user
messages (`tool_role="user"`).

The warm start before RL is `meshrl sft` on demonstrations (`demonstrations`, or `python -m
meshrl.tasks.agent_calc --out FILE`): trajectories as the environment renders them, the tool's result a
user message, the loss on the model's turns only. Only a share of them use the tool; the others answer
at once (the right sum, which the tiny model cannot compute in its head), so the warmed model uses the
tool on about that share of problems and RL has correct tool use to raise.
"""

from __future__ import annotations

import random
import re
from typing import Any

from meshrl.envs import Environment, Message, State, Step, Turn, tool
from meshrl.tasks.arith import correct

WARM_ROWS, TOOL_FRACTION = 9600, 0.7
"""The warm start's demonstrations: how many (one pass of 300 steps of 32), and the share that use the
tool. Measured on the tiny model (`meshrl eval recipes/agent_calc.py`, 200 held-out problems): after
one pass the model uses the tool on 0.98 of them greedy and copies its result, 0.68 right sampled at
temperature 1; 3000 rows seen 3.2 times instead leave it calling the tool but not yet copying the
result (0.08 greedy): repeated problems are memorized before the copy is learned."""

_SUM = re.compile(r"\s*-?\d+(\s*[+-]\s*\d+)*\s*")


def all_problems(n: int = 2000, seed: int = 0) -> list[dict[str, Any]]:
    """`n` rows {"prompt": "a+b+c=", "answer": str(a+b+c)} with two-digit terms, drawn with `seed`."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        terms = [rng.randint(10, 99) for _ in range(3)]
        rows.append({"prompt": "+".join(map(str, terms)) + "=", "answer": str(sum(terms))})
    return rows


def split(seed: int = 0) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, held-out): 2000 training rows and 200 others drawn with another seed (`meshrl eval`)."""
    train = all_problems(seed=seed)
    seen = {r["prompt"] for r in train}
    return train, [r for r in all_problems(400, seed=seed + 1) if r["prompt"] not in seen][:200]


@tool
def calc(expression: str) -> int:
    """Add and subtract integers exactly.

    Args:
        expression: integers joined by + and -, like 12+34-5
    """
    if not _SUM.fullmatch(expression):
        raise ValueError(f"only integers joined by + and - are allowed, got {expression!r}")
    return sum(int(t) for t in re.findall(r"[+-]?\s*\d+", expression.replace(" ", "")))


class CalcEnv(Environment):
    """The model calls `calc` as often as it likes; a turn without a call is its answer."""

    tools = (calc,)

    async def reset(self, row: dict[str, Any]) -> tuple[list[dict[str, Any]], State]:
        return [{"role": "user", "content": str(row["prompt"])}], {"answer": str(row["answer"]), "calls": 0}

    async def step(self, state: State, turn: Turn) -> Step:
        state["calls"] += len(turn.tool_calls)
        return await super().step(state, turn)

    async def reward(self, state: State, final: Turn | None, transcript: list[Message]) -> float:
        answered = final is not None and not final.tool_calls
        return float(answered and final is not None and correct(final.content, {"answer": state["answer"]}))


def demonstrations(n: int, tool_fraction: float, seed: int = 2) -> list[dict[str, Any]]:
    """`n` chat rows for `meshrl sft` on problems drawn with `seed` (the run trains on seed 0 and is
    evaluated on seed 1's): a share `tool_fraction` call the tool, read its result (a user message, as
    the environment shows it to a template without a tool role) and answer with it; the others answer
    at once."""
    rng = random.Random(seed)
    out = []
    for row in all_problems(n, seed=seed):
        messages: list[Message] = [{"role": "user", "content": row["prompt"]}]
        if rng.random() < tool_fraction:
            call = f"calc({row['prompt'].rstrip('=')})"
            messages += [{"role": "assistant", "content": call}, {"role": "user", "content": row["answer"]}]
        messages.append({"role": "assistant", "content": row["answer"]})
        out.append({"messages": messages})
    return out
