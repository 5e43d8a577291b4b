"""Agent programs: an agent's own code, trained as it is, through the run's OpenAI-compatible endpoint
(meshrl/roles/endpoint; the agents service runs programs: meshrl/roles/agents/service.py).

A program is a function, `async def` or plain, named in the recipe as `package.module:function`:

    async def solve(run: AgentRun, **program_args) -> float | dict[str, float]:
        answer = await run.client.chat.completions.create(
            model=run.model, messages=[{"role": "user", "content": run.task["question"]}], tools=[...])
        ...
        return 1.0 if ... else 0.0

It gets one task (the dataset row rollout fed), calls the model as often as it likes, with whatever
tools and history handling it has, and returns the trajectory's reward (a dict: named parts, summed;
each part is logged). Everything the model generated on those calls is trained under that reward. A
program that raises, or runs past the time limit, fails its trajectory (counted, never trained).

`run.client` (`openai.AsyncOpenAI`) and `run.sync_client` (`openai.OpenAI`, for plain functions, which
run on a thread) are bound to the session: every call they make is recorded. A framework that builds
its own client takes `run.base_url` and `run.api_key`; its calls are recorded too (by the session in the
URL), though the agents service then waits `settle_s` for the last of them instead of knowing them.
"""

from __future__ import annotations

import importlib
import inspect
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

RETRIES = 8
"""Retries of a call by the session's clients (the SDK backs off 0.5 s doubling to 8 s: about 40 s in
all), enough to outlast a restart of the endpoint replica that was answering."""
CALL_HEADER = "x-meshrl-call"
"""The response header naming the row of a call (the endpoint sets it; the session's clients note it)."""


@dataclass
class AgentRun:
    """What a program gets: its task and a model to call."""

    task: dict[str, Any]
    """The dataset row."""
    model: str
    """The name to ask for (`model=` of a request)."""
    base_url: str
    """This session's OpenAI base URL (`http://host:port/s/<session>/v1`)."""
    api_key: str
    calls: list[str] = field(default_factory=list)
    """The calls answered so far, in order (by their rows' names)."""
    _waiting: list[float] = field(default_factory=lambda: [0, 0.0, 0.0])
    """Model calls of this session's clients in flight, seconds with one in flight, since when."""
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _sent(self) -> None:
        with self._lock:
            w = self._waiting
            if w[0] == 0:
                w[2] = time.monotonic()
            w[0] += 1

    def _answered(self) -> None:
        with self._lock:
            w = self._waiting
            w[0] -= 1
            if w[0] == 0:
                w[1] += time.monotonic() - w[2]

    def _note(self, response: Any) -> None:
        name = response.headers.get(CALL_HEADER)
        if name:
            self.calls.append(name)

    def own_s(self, since: float) -> float:
        """Seconds since `since` (time.monotonic) that the program spent on its own, not waiting for
        a model call of `client` or `sync_client` (calls waiting for weights or a generation slot)."""
        with self._lock:
            n, waited, start = self._waiting
            now = time.monotonic()
            return now - since - waited - (now - start if n else 0.0)

    @cached_property
    def client(self) -> Any:
        """An `openai.AsyncOpenAI` bound to this session."""
        import httpx
        import openai

        run = self

        class Timed(httpx.AsyncHTTPTransport):  # the program's clock stops while a call waits
            async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
                run._sent()
                try:
                    return await super().handle_async_request(request)
                finally:
                    run._answered()

        async def note(response: httpx.Response) -> None:
            self._note(response)

        # plain http: no TLS context (loading the CA bundle per session costs more than the call)
        http = httpx.AsyncClient(
            event_hooks={"response": [note]}, timeout=None, transport=Timed(verify=False)
        )
        return openai.AsyncOpenAI(
            base_url=self.base_url, api_key=self.api_key, http_client=http, max_retries=RETRIES
        )

    @cached_property
    def sync_client(self) -> Any:
        """An `openai.OpenAI` bound to this session (for programs that are plain functions)."""
        import httpx
        import openai

        run = self

        class Timed(httpx.HTTPTransport):
            def handle_request(self, request: httpx.Request) -> httpx.Response:
                run._sent()
                try:
                    return super().handle_request(request)
                finally:
                    run._answered()

        http = httpx.Client(
            event_hooks={"response": [self._note]}, timeout=None, transport=Timed(verify=False)
        )
        return openai.OpenAI(
            base_url=self.base_url, api_key=self.api_key, http_client=http, max_retries=RETRIES
        )

    async def aclose(self) -> None:
        if "client" in self.__dict__:
            await self.client.close()
        if "sync_client" in self.__dict__:
            self.sync_client.close()


def load_program(name: str) -> Callable[..., Any]:
    """The function `package.module:function`, with a clear error when it is not one."""
    module, _, attr = name.partition(":")
    if not module or not attr:
        raise ValueError(f"program {name!r} must look like 'package.module:function'")
    try:
        fn = getattr(importlib.import_module(module), attr, None)
    except ImportError as e:
        raise ValueError(f"program {name!r}: cannot import {module!r}: {e}") from None
    if not callable(fn):
        raise ValueError(f"program {name!r}: {module} has no function {attr!r}")
    params = list(inspect.signature(fn).parameters.values())
    if not params or params[0].kind not in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
        raise ValueError(f"program {name!r} must take the AgentRun as its first argument")
    return fn


def reward_parts(value: Any) -> dict[str, float]:
    """A program's return value as named reward parts (a number is the part "reward")."""
    if isinstance(value, bool) or value is None:
        raise TypeError(f"a program returns its reward as a number or a dict of numbers, not {value!r}")
    if isinstance(value, int | float):
        return {"reward": float(value)}
    if (
        isinstance(value, dict)
        and value
        and all(
            isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool)
            for k, v in value.items()
        )
    ):
        return {k: float(v) for k, v in value.items()}
    raise TypeError(f"a program returns its reward as a number or a dict of numbers, not {value!r}")
