"""A simulated environment for agent benchmarks: each trajectory lasts 2-8 model turns and each step
waits on a "tool" with a long-tailed latency (lognormal: median 50 ms, 99th percentile ~2 s), then
replies with a short message. No tokens are looked at; the reward is 0.

    environment="meshrl.envs.sim:SimToolEnv"      # benchmarks/agent_sim.py
    program="meshrl.envs.sim:sim_program"         # the same as an agent program (benchmarks/agent_gateway.py)
"""

from __future__ import annotations

import asyncio
import math
import random
from typing import Any

from meshrl.envs.base import Environment, Message, State, Step, Turn

MEDIAN_S = 0.05
SIGMA = math.log(2.0 / MEDIAN_S) / 2.326  # the 99th percentile at 2 s
MIN_TURNS, MAX_TURNS = 2, 8


def tool_latency(rng: random.Random) -> float:
    return rng.lognormvariate(math.log(MEDIAN_S), SIGMA)


class SimToolEnv(Environment):
    def __init__(self) -> None:
        self.rng = random.Random()

    async def reset(self, row: dict[str, Any]) -> tuple[list[dict[str, Any]], State]:
        turns = self.rng.randint(MIN_TURNS, MAX_TURNS)
        return [{"role": "user", "content": "go"}], {"left": turns}

    async def step(self, state: State, turn: Turn) -> Step:
        state["left"] -= 1
        if state["left"] <= 0:
            return Step([], done=True)
        await asyncio.sleep(tool_latency(self.rng))
        return Step([{"role": "user", "content": "ok"}])

    async def reward(self, state: State, final: Turn | None, transcript: list[Message]) -> float:
        return 0.0


async def sim_program(run: Any, record: str | None = None) -> float:
    """SimToolEnv's work as an agent program (benchmarks/agent_gateway.py): 2-8 model calls through the
    endpoint, each followed by a tool's wait and a short reply, the history sent back each time. With
    `record`, appends per call the client's time and the part of it spent waiting on the row
    (`waited_s`) to that file, one JSON line per program."""
    import json
    import time

    rng = random.Random()
    messages: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    calls = []
    for left in range(rng.randint(MIN_TURNS, MAX_TURNS), 0, -1):
        t0 = time.perf_counter()
        answer = await run.client.chat.completions.create(model=run.model, messages=messages)
        calls.append((time.perf_counter() - t0, answer.model_extra["meshrl"]["waited_s"]))
        messages.append({"role": "assistant", "content": answer.choices[0].message.content or ""})
        if left > 1:
            await asyncio.sleep(tool_latency(rng))
            messages.append({"role": "user", "content": "ok"})
    if record:
        with open(record, "a") as f:
            f.write(json.dumps(calls) + "\n")
    return 0.0
