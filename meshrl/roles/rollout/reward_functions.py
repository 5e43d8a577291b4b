"""Reward functions, TRL's way: several, weighted, batched or per sample, sync or async.

A recipe names them by import path with a weight, `rewards={"pkg.mod:fn": 1.0, ...}`. A function is
called in one of two ways, told apart by its signature:

- batched, TRL's `reward_funcs` signature (it takes `**kwargs`):
  `fn(prompts, completions, **columns) -> list[float | None]`, every other dataset column passed as a
  list by name, so a function written for TRL runs unchanged;
- per sample (no `**kwargs`): `fn(prompt, completion, row) -> float | None`, `row` the dataset row.

Prompts are the dataset's prompt column as it is (a string, or TRL's list of chat messages); a
completion is the decoded text, or `[{"role": "assistant", "content": text}]` when the prompt is a
list of messages (as TRL passes them).

Where they run (`Workers`): nothing but `async def` functions runs on rollout's event loop, which also
counts gates, feeds prompts and collects evaluations. A synchronous function (math-verify on a long
answer, code execution, a judge over a blocking client) runs on a thread pool of `reward_threads`, or,
when it asks with `meshrl.rewards.in_process`, in a worker process (CPU-bound Python, or code that
needs a main thread of its own). Functions of a batch run concurrently with each other, and a
per-sample function over the batch's samples: on the threads, a run of samples per thread, one call
after another (`Workers.each`: a pool job per call cost ~40 us, 100 times the arithmetic reward). Every
call has a time limit, `reward_timeout_s`; past it the call fails and its run goes on in a new job.

A value of `None` means "not applicable": it adds nothing to the sample's reward and is left out of
that function's mean (TRL's rule). An exception, a non-finite value or a call past its time limit marks
the sample failed, with the reason: it is excluded from the loss, counted, the first failure logged,
and the run stops when more than `max_failed_fraction` of samples failed. A thread stuck in a function
cannot be stopped (it goes on in the background, its result thrown away); a stuck process is ended and
its pool started afresh.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import importlib
import inspect
import itertools
import logging
import math
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from meshrl.dataplane import Batch
from meshrl.roles.rollout.config import metric_name
from meshrl.roles.rollout.reward_process import ProcessPool
from meshrl.schema import RESPONSE

log = logging.getLogger("meshrl.rollout")

Value = float | None | BaseException  # a value, not applicable, or why it failed


@dataclass(frozen=True)
class RewardFunction:
    name: str
    """The metric name: `reward/<name>` (the function's name, unique in the recipe)."""
    fn: Callable[..., Any]
    weight: float
    batched: bool
    """Takes `**kwargs`: called once per batch, TRL's way."""
    spec: str = ""
    """`module:function`: how a worker process finds it."""

    @property
    def asynchronous(self) -> bool:
        return inspect.iscoroutinefunction(self.fn)

    @property
    def in_process(self) -> bool:
        """It asked to run in a worker process (`meshrl.rewards.in_process`)."""
        return bool(getattr(self.fn, "meshrl_in_process", False))


class Workers:
    """Where the synchronous reward functions run, each call under a time limit: a thread pool, and
    worker processes for the functions that ask (`reward_process.py`)."""

    def __init__(self, threads: int = 4, timeout_s: float = 60.0) -> None:
        self.threads = concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="reward")
        self.n_threads = threads
        self.processes = ProcessPool(threads)
        self.timeout_s = timeout_s

    async def call(self, f: RewardFunction, *args: Any, **kwargs: Any) -> Any:
        """`f(*args, **kwargs)`, off the event loop unless it is async; TimeoutError past the limit."""
        try:
            async with asyncio.timeout(self.timeout_s):
                if f.asynchronous:
                    return await f.fn(*args, **kwargs)
                if f.in_process:
                    return await self.processes.call(f.spec, args, kwargs)
                loop = asyncio.get_running_loop()
                value = await loop.run_in_executor(self.threads, functools.partial(f.fn, *args, **kwargs))
                return await value if inspect.isawaitable(value) else value
        except TimeoutError:
            raise TimeoutError(f"{f.name} took longer than reward_timeout_s={self.timeout_s:g}s") from None

    async def each(self, f: RewardFunction, calls: list[tuple[Any, ...]]) -> list[Any]:
        """`f(*args)` for each of `calls` (a synchronous function, not `in_process`): the result, or the
        exception it raised. The calls are cut into a run per thread; a run's calls go one after
        another in one job. A call past the time limit fails with TimeoutError and the calls after it
        go on in a fresh job (the stuck thread's later results are thrown away)."""
        out: list[Any] = [None] * len(calls)
        size = max(1, -(-len(calls) // self.n_threads))
        runs = [range(a, min(a + size, len(calls))) for a in range(0, len(calls), size)]
        await asyncio.gather(*(self._run(f, calls, run, out) for run in runs))
        return out

    async def _run(self, f: RewardFunction, calls: list[tuple[Any, ...]], run: range, out: list[Any]) -> None:
        loop = asyncio.get_running_loop()
        while run:
            job = _Job(run)
            done = loop.run_in_executor(self.threads, job.work, f.fn, calls, out)
            while not done.done():
                at, since = job.current
                await asyncio.wait([done], timeout=max(since + self.timeout_s - time.monotonic(), 0.0))
                if (
                    not done.done()
                    and job.current == (at, since)
                    and time.monotonic() - since >= self.timeout_s
                ):
                    job.abandoned = True  # the call in progress is given up; the rest go on afresh
                    out[at] = TimeoutError(f"{f.name} took longer than reward_timeout_s={self.timeout_s:g}s")
                    break
            run = run[run.index(job.current[0]) + 1 :] if job.abandoned else range(0)
        for i in range(len(out)):  # a function that returned an awaitable: awaited here, under the limit
            if inspect.isawaitable(out[i]):
                try:
                    out[i] = await asyncio.wait_for(out[i], self.timeout_s)
                except Exception as e:
                    out[i] = e

    def close(self) -> None:
        self.threads.shutdown(wait=False, cancel_futures=True)
        self.processes.close()


class _Job:
    """A run of calls on one thread: `current`, the call it is at and since when (one tuple, so that
    the event loop reads both of one call); `abandoned`: stop before the next call, keep no more results."""

    def __init__(self, run: range) -> None:
        self.run, self.current, self.abandoned = run, (run[0], time.monotonic()), False

    def work(self, fn: Callable[..., Any], calls: list[tuple[Any, ...]], out: list[Any]) -> None:
        for i in self.run:
            if self.abandoned:
                return
            self.current = (i, time.monotonic())
            try:
                value = fn(*calls[i])
            except Exception as e:
                value = e
            if not self.abandoned:
                out[i] = value


def load(rewards: dict[str, float]) -> list[RewardFunction]:
    """The recipe's reward functions, imported (the config's check has made sure they import)."""
    out = []
    for spec, weight in rewards.items():
        module, _, name = spec.partition(":")
        fn = getattr(importlib.import_module(module), name)
        batched = any(p.kind is p.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())
        out.append(RewardFunction(metric_name(spec), fn, float(weight), batched, spec))
    return out


@dataclass
class Scored:
    """The rewards of a batch of completions."""

    total: torch.Tensor
    """Float32 per sample: the weighted sum of the functions' values (None adds nothing)."""
    valid: torch.Tensor
    """Bool per sample: no function failed on it."""
    applied: dict[str, dict[int, float]]
    """Per function, its value by sample index, for the samples it applied to (its metric is their mean)."""
    failure: str | None
    """The traceback of the first failure, None when nothing failed."""


async def score(
    functions: list[RewardFunction],
    prompts: list[Any],
    completions: list[Any],
    rows: list[dict[str, Any]],
    prompt_field: str = "prompt",
    workers: Workers | None = None,
) -> Scored:
    """Every function on every sample, the functions concurrently (on `workers`; a default pool when
    none is given)."""
    kwargs = columns(rows, prompt_field)
    own = workers is None
    workers = workers or Workers()
    try:
        outcomes = await asyncio.gather(
            *(_call(workers, f, prompts, completions, rows, kwargs) for f in functions)
        )
    finally:
        if own:
            workers.close()
    n = len(prompts)
    total, valid, failure = [0.0] * n, [True] * n, None
    applied: dict[str, dict[int, float]] = {f.name: {} for f in functions}
    for f, values in zip(functions, outcomes, strict=True):
        for i, v in enumerate(values):
            if isinstance(v, BaseException):
                valid[i] = False
                if failure is None:
                    failure = f"{f.name} on sample {i}:\n" + "".join(traceback.format_exception(v))
            elif v is not None:
                total[i] += f.weight * v
                applied[f.name][i] = v
    return Scored(
        torch.tensor(total, dtype=torch.float32), torch.tensor(valid, dtype=torch.bool), applied, failure
    )


async def _call(
    workers: Workers,
    f: RewardFunction,
    prompts: list[Any],
    completions: list[Any],
    rows: list[dict[str, Any]],
    kwargs: dict[str, list[Any]],
) -> list[Value]:
    """One function's outcome per sample; a batched call that fails, times out or returns the wrong
    shape fails every sample of the batch."""
    n = len(prompts)
    if not f.batched and not (f.asynchronous or f.in_process):
        outcomes = await workers.each(f, list(zip(prompts, completions, rows, strict=True)))
        return [v if isinstance(v, BaseException) else _checked(v) for v in outcomes]
    if not f.batched:
        calls = zip(prompts, completions, rows, strict=True)
        return list(await asyncio.gather(*(_one(workers, f, p, c, r) for p, c, r in calls)))
    try:
        values = list(await workers.call(f, prompts, completions, **kwargs))
        if len(values) != n:
            raise ValueError(f"returned {len(values)} values for {n} completions")
    except Exception as e:
        return [e] * n
    return [_checked(v) for v in values]


async def _one(
    workers: Workers, f: RewardFunction, prompt: Any, completion: Any, row: dict[str, Any]
) -> Value:
    try:
        value = await workers.call(f, prompt, completion, row)
    except Exception as e:
        return e
    return _checked(value)


def _checked(value: Any) -> Value:
    """None, a finite float, or the error saying why not."""
    if value is None:
        return None
    try:
        x = float(value)
    except (TypeError, ValueError) as e:
        return e
    return x if math.isfinite(x) else ValueError(f"reward function returned {x}")


def columns(rows: list[dict[str, Any]], prompt_field: str) -> dict[str, list[Any]]:
    """Every column of the rows but the prompt as a list by name (None where a row lacks it), as TRL
    passes them; meshrl's own bookkeeping (`_line`) left out."""
    names = dict.fromkeys(k for r in rows for k in r if not k.startswith("_") and k != prompt_field)
    return {k: [r.get(k) for r in rows] for k in names}


def completions(tokenizer: Any, batch: Batch, conversational: bool) -> list[Any]:
    """The batch's completions decoded without their stop token: text, or one assistant message."""
    responses = batch.ragged(RESPONSE)
    eos = set(tokenizer.all_special_ids) & {tokenizer.eos_token_id}
    flat, bounds = responses.values.tolist(), responses.offsets.tolist()
    answers = []
    for a, b in itertools.pairwise(bounds):
        while b > a and flat[b - 1] in eos:  # the stop token is not part of the answer
            b -= 1
        answers.append(flat[a:b])
    texts = tokenizer.batch_decode(answers, skip_special_tokens=False)
    return [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
