"""A simulated environment for agent benchmarks: each trajectory lasts 2-8 model turns and each step
calls a "tool" (`wait`, through `call_tools`, as the default step runs a model's calls) with a
long-tailed latency (lognormal: median 50 ms, 99th percentile ~2 s) under the recipe's tool timeout
(`TOOL_TIMEOUT_S` in recipes/agent_sim.py: the 0.6% of calls past 2.5 s time out, as a real tool's
would), then replies with its short message. No tokens are looked at; the reward is 0.

    environment="meshrl.tasks.sim:SimToolEnv"      # benchmarks/agent_sim.py
    program="meshrl.tasks.sim:sim_program"         # the same as an agent program (benchmarks/agent_gateway.py)
"""

from __future__ import annotations

import asyncio
import math
import random
from typing import Any

from meshrl.envs.base import Environment, Message, State, Step, Turn
from meshrl.envs.parsers import ToolCall
from meshrl.envs.tools import call_tools, tool

MEDIAN_S = 0.05
SIGMA = math.log(2.0 / MEDIAN_S) / 2.326  # the 99th percentile at 2 s
MIN_TURNS, MAX_TURNS = 2, 8
TOOL_TIMEOUT_S = 2.5
"""The simulated tool's timeout (a little past its 99th percentile): agents.tool_timeout_s in
recipes/agent_sim.py, and what an agent program's or the barrier baseline's tool call waits at most."""


def tool_latency(rng: random.Random) -> float:
    return rng.lognormvariate(math.log(MEDIAN_S), SIGMA)


@tool
async def wait(seconds: float) -> str:
    """Wait, as a slow tool does.

    Args:
        seconds: how long
    """
    await asyncio.sleep(seconds)
    return "ok"


class SimToolEnv(Environment):
    tools = (wait,)

    def __init__(self) -> None:
        self.rng = random.Random()

    async def reset(self, row: dict[str, Any]) -> tuple[list[dict[str, Any]], State]:
        turns = self.rng.randint(MIN_TURNS, MAX_TURNS)
        return [{"role": "user", "content": "go"}], {"left": turns}

    async def step(self, state: State, turn: Turn) -> Step:
        state["left"] -= 1
        if state["left"] <= 0:
            return Step([], done=True)
        call = ToolCall("wait", {"seconds": tool_latency(self.rng)})
        return Step(await call_tools(self.tools, [call], timeout_s=self.limits.tool_timeout_s))

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
            await asyncio.sleep(min(tool_latency(rng), TOOL_TIMEOUT_S))
            messages.append({"role": "user", "content": "ok"})
    if record:
        with open(record, "a") as f:
            f.write(json.dumps(calls) + "\n")
    return 0.0
