"""Agent programs the endpoint tests run (imported by the agents service from the test tree)."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any

import openai

from meshrl.envs.programs import AgentRun
from meshrl.tasks.arith import reward
from meshrl.tasks.arith.agent import solve


async def hold(run: AgentRun, release: str, **kwargs: Any) -> dict[str, Any]:
    """`solve`, once the file `release` exists (the test talks to the endpoint alone until then)."""
    while not Path(release).exists():
        await asyncio.sleep(0.05)
    return await solve(run, **kwargs)


def plain(run: AgentRun) -> float:
    """A plain function (run on a thread) with the session's synchronous client."""
    answer = run.sync_client.chat.completions.create(
        model=run.model, messages=[{"role": "user", "content": run.task["prompt"]}], max_tokens=4
    )
    return reward(run.task["prompt"], answer.choices[0].message.content or "", run.task)


async def own_client(run: AgentRun) -> float:
    """A client the program builds itself from the session's base URL (as a framework would)."""
    client = openai.AsyncOpenAI(base_url=run.base_url, api_key=run.api_key)
    try:
        answer = await client.chat.completions.create(
            model=run.model, messages=[{"role": "user", "content": run.task["prompt"]}], max_tokens=4
        )
    finally:
        await client.close()
    return reward(run.task["prompt"], answer.choices[0].message.content or "", run.task)


_runs = itertools.count()


async def flaky(run: AgentRun) -> Any:
    """Three runs in ten fail, after a model call: one raises, one hangs, one returns junk."""
    n = next(_runs) % 10
    answer = await solve(run)
    if n == 0:
        raise RuntimeError(f"the agent broke on {run.task['prompt']}")
    if n == 1:
        await asyncio.sleep(3600)
    return "not a reward" if n == 2 else answer


async def fails_ahead(run: AgentRun) -> Any:
    """`solve` two seconds late on the first step's tasks; every later task fails at once, before the
    weights it was fed for exist (its calls may use no version older than 1)."""
    if run.min_version >= 1:
        raise RuntimeError("failing at once, ahead of the weights")
    await asyncio.sleep(2)
    return await solve(run)
