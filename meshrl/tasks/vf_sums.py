"""The demo's sums as a verifiers v1 taskset, with a harness of its own: what recipes/agent_verifiers.py
trains through verifiers, offline (meshrl/envs/verifiers.py runs each task as one episode).

Its taskset id is `meshrl-vf-sums`. v1 imports a taskset id as a top-level module (`-` read as `_`,
tried first under `verifiers.v1.tasksets`), never as a dotted path, so the meshrl distribution ships
the top-level package `meshrl_vf_sums`, which exports this module's taskset and harness.

The tasks: the 100 single-digit sums `a+b=` of meshrl/tasks/arith (the demo's warm start can do
some), then `two_digit` sums of two numbers in 10..99 drawn with `seed` (which it cannot do). The
reward, `correct`, is the demo's rule (meshrl.tasks.arith.correct) applied to the model's reply.

The harness needs no network, no sandbox and nothing installed: it makes the episode's one model call
in-process, through the episode's interception endpoint (v1 allows a harness to run its loop
in-process, as long as every model call goes through the interception). A program launched in the
runtime would work offline too (the subprocess runtime runs the host's interpreter), but starting a
Python with openai imported costs over a second of CPU per episode, far more than the episode itself.
Run it with the subprocess runtime: `{"agent": {"runtime": {"type": "subprocess"}}}` (verifiers'
default runtime is a remote Prime sandbox).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import verifiers.v1 as vf
from verifiers.v1.runtimes import ProgramResult

from meshrl.tasks import arith

__all__ = ["SumsHarness", "SumsTaskset"]

CONNECT_S = 300.0
"""How long the harness's call may take to connect to the interception server: it shares an event loop
with every other episode of the agents service, which a busy machine can stall for seconds (the
OpenAI SDK's default of 5 s then fails episodes that did nothing wrong)."""


def problems(two_digit: int = 0, seed: int = 0) -> list[dict[str, str]]:
    """The rows `{"prompt", "answer"}`: the 100 single-digit sums in meshrl/tasks/arith's order, then
    `two_digit` sums of two numbers in 10..99 drawn with `seed`."""
    rng = random.Random(seed)
    pairs = [(rng.randint(10, 99), rng.randint(10, 99)) for _ in range(two_digit)]
    more = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in pairs]
    return [{"prompt": r["prompt"], "answer": r["answer"]} for r in arith.all_problems()] + more


class SumsData(vf.TaskData):
    answer: str = ""
    """The sum's digits."""


class SumsTask(vf.Task[SumsData]):
    @vf.reward
    async def correct(self, task: SumsData, trace: vf.Trace) -> float:
        """1.0 when the reply starts with the sum's digits and the digits stop there (arith.correct)."""
        replies = trace.assistant_messages
        text = (replies[-1].content or "") if replies else ""
        return 1.0 if arith.correct(text, {"answer": task.answer}) else 0.0


class SumsConfig(vf.TasksetConfig):
    two_digit: int = 0
    """Two-digit sums added after the 100 single-digit ones (none by default)."""
    seed: int = 0
    """Draws the two-digit sums."""


class SumsTaskset(vf.Taskset[SumsTask, SumsConfig]):
    def load(self) -> Iterator[SumsTask]:
        if self.config.two_digit < 0:
            raise ValueError(f"two_digit: must be >= 0, got {self.config.two_digit}")
        for row in problems(self.config.two_digit, self.config.seed):
            yield SumsTask(SumsData(prompt=row["prompt"], answer=row["answer"]), self.config.task)


class SumsHarness(vf.Harness[vf.HarnessConfig]):
    """One chat call with the task's prompt, made in-process through the interception. Its sampling is
    the episode's (meshrl's `sampling` program argument, else the run's): verifiers' training client
    ignores what the request asks for."""

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
        import httpx
        import openai

        timeout = httpx.Timeout(None, connect=CONNECT_S)
        # no retries: a retried call would be a second model call of the episode, trained with it
        async with openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0, timeout=timeout) as c:
            await c.chat.completions.create(
                model=ctx.model, messages=[{"role": "user", "content": data.prompt_text}]
            )
        return ProgramResult(exit_code=0, stdout="", stderr="")
