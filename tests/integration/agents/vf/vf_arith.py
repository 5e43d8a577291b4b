"""A verifiers v1 taskset for the tests (tests/integration/agents/test_verifiers.py): the arithmetic rows
asked once, answered through the episode's interception by a harness running in-process (no sandbox, no
program to install), rewarded by the exact answer.

v1 imports a taskset by its id as a top-level module, so this file's directory is put on PYTHONPATH and
the taskset's id is `vf_arith`. It exports its `Harness` too: that makes it the taskset's default.
`record` (a path, in the task config) appends what each episode's trace holds of its tokens: the ids
and log-probs verifiers' training client received.
"""

from __future__ import annotations

import fcntl
import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import verifiers.v1 as vf
from verifiers.v1.runtimes import ProgramResult

__all__ = ["ArithHarness", "ArithTaskset"]


class ArithData(vf.TaskData):
    answer: str = ""


class ArithTaskConfig(vf.TaskConfig):
    record: str = ""
    """A file that gets one JSON line per scored trace (its branches' tokens); "" keeps nothing."""


class ArithTask(vf.Task[ArithData, vf.State, ArithTaskConfig]):
    @vf.reward
    async def correct(self, task: ArithData, trace: vf.Trace) -> float:
        if self.config.record:
            _append(self.config.record, _tokens(task, trace))
        return 1.0 if trace.last_reply.strip() == task.answer else 0.0


class ArithTasksetConfig(vf.TasksetConfig):
    task: ArithTaskConfig = ArithTaskConfig()


class ArithTaskset(vf.Taskset[ArithTask, ArithTasksetConfig]):
    def load(self) -> Iterator[ArithTask]:  # meshrl feeds its own rows; this is for a plain eval
        for a, b in [(1, 2), (3, 4), (5, 6)]:
            yield ArithTask(ArithData(prompt=f"{a}+{b}=", answer=str(a + b)), self.config.task)


class ArithHarness(vf.Harness[vf.HarnessConfig]):
    """One chat call with the task's prompt, made here rather than by a program in the runtime (v1
    allows it: only the model calls must go through the interception). Its length is the endpoint's:
    verifiers' training client samples with the episode's settings, not the request's."""

    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(
        self,
        ctx: vf.ModelContext,
        trace: vf.Trace,
        runtime: vf.Runtime,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: vf.TaskData,
        **kwargs: Any,
    ) -> ProgramResult:
        timeout = httpx.Timeout(None, connect=300.0)  # the SDK's 5 s connect fails episodes on a busy machine
        async with openai.AsyncOpenAI(
            base_url=endpoint, api_key=secret, max_retries=0, timeout=timeout
        ) as client:
            await client.chat.completions.create(
                model=ctx.model,
                messages=[{"role": "user", "content": data.prompt_text}],
            )
        return ProgramResult(exit_code=0, stdout="", stderr="")


def _tokens(task: ArithData, trace: vf.Trace) -> dict[str, Any]:
    branches = []
    for b in trace.branches:
        mask, logprobs = b.sampled_mask, b.logprobs
        branches.append({
            "token_ids": b.token_ids, "sampled": mask,
            "logprobs": [lp for lp, m in zip(logprobs, mask, strict=True) if m],
        })  # fmt: skip
    return {"prompt": task.prompt, "branches": branches}


def _append(path: str, row: dict[str, Any]) -> None:
    with open(path, "a") as f:  # episodes score concurrently, in several processes at most
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(json.dumps(row) + "\n")
