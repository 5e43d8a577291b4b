"""Agent programs: an agent's own code, trained as it is, through the run's OpenAI-compatible endpoint
(meshrl/roles/agents: the agents service runs programs and serves their calls).

A program is a function, `async def` or plain, named in the recipe as `package.module:function`:

    async def solve(run: AgentRun, **args) -> float | dict[str, float]:
        answer = await run.client.chat.completions.create(
            model=run.model, messages=[{"role": "user", "content": run.task["question"]}], tools=[...])
        ...
        return 1.0 if ... else 0.0

It gets one task (the dataset row rollout fed), calls the model as often as it likes, with whatever
tools and history handling it has, and returns the trajectory's reward (meshrl/envs/base.py
`reward_parts`: a number, or named parts, summed and each logged). Everything the model generated on
those calls is trained under that reward. A program that raises, returns no reward, or runs past its
time limit fails its trajectory (counted, never trained).

`run.client` (`openai.AsyncOpenAI`) reaches the endpoint inside the agents process, without a socket;
`run.sync_client` (`openai.OpenAI`, for plain functions, which run on a thread) and a framework's own
client (from `run.base_url` and `run.api_key`) reach it over HTTP. Every call to the session's URL is
recorded, whichever client made it.

The process that runs programs (the agents service, `meshrl eval`) leaves out the OpenAI SDK's request
transform of chat completions (`skip_chat_transform`): it walks every message of every request against
the SDK's typed schemas, to rename and reformat fields that chat requests do not have, and on a long
conversation it was most of a call's cost in the agents process. The bytes sent are the same
(tests/unit/envs/test_programs.py compares them).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any


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
    tokenizer: str = ""
    """The policy's tokenizer (a local path): for agents that render prompts themselves (the token route)."""
    min_version: int = 0
    """The oldest weight version this task's calls are generated with (the run's pacing: a call waits
    for it)."""
    transport: Any = None
    """The in-process route to the endpoint (an httpx async transport), None: real HTTP."""

    @cached_property
    def client(self) -> Any:
        """An `openai.AsyncOpenAI` bound to this session."""
        import httpx
        import openai

        http = httpx.AsyncClient(transport=self.transport, timeout=None) if self.transport else None
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, http_client=http,
                                  max_retries=0 if self.transport else 8)  # fmt: skip

    @cached_property
    def sync_client(self) -> Any:
        """An `openai.OpenAI` bound to this session, over HTTP (for programs that are plain functions,
        which run on a thread)."""
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key=self.api_key, max_retries=8)

    async def aclose(self) -> None:
        if "client" in self.__dict__:
            await self.client.close()
        if "sync_client" in self.__dict__:
            self.sync_client.close()


def skip_chat_transform() -> None:
    """Leave out the OpenAI SDK's request transform of chat completions in this process (see the module
    docstring): chat request parameters have no field it renames or reformats, so what it does to them
    is drop unset values and dump pydantic models, which `_plain` does without walking the types."""
    from openai._utils import is_given
    from openai.resources.chat.completions import completions

    def as_sent(data: Any, expected_type: Any) -> Any:
        return _plain(data, is_given)

    async def as_sent_async(data: Any, expected_type: Any) -> Any:
        return _plain(data, is_given)

    completions.maybe_transform = as_sent
    completions.async_maybe_transform = as_sent_async


def _plain(data: Any, is_given: Callable[[Any], bool]) -> Any:
    """What the transform makes of a chat request: unset fields dropped, pydantic models (an answer's
    message sent back as it came) dumped as JSON values, everything else as it is."""
    if isinstance(data, dict):
        return {k: _plain(v, is_given) for k, v in data.items() if is_given(v)}
    if isinstance(data, list | tuple):
        return [_plain(v, is_given) for v in data]
    if hasattr(data, "model_dump"):
        return data.model_dump(exclude_unset=True, mode="json")
    return data


def load_program(name: str) -> Callable[..., Any]:
    """The function `package.module:function`, with a clear error when it is not one."""
    module, _, attr = name.partition(":")
    if not module or not attr:
        raise ValueError(f"program {name!r} must look like 'package.module:function'")
    try:
        fn = getattr(importlib.import_module(module), attr, None)
    except ImportError as e:
        raise ValueError(f"program {name!r}: cannot import {module!r}: {e}") from None
    if not callable(fn) or isinstance(fn, type):
        raise ValueError(f"program {name!r}: {module} has no function {attr!r}")
    params = list(inspect.signature(fn).parameters.values())
    if not params or params[0].kind not in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
        raise ValueError(f"program {name!r} must take the AgentRun as its first argument")
    return fn
