"""Configuration of the agents service: one service for every kind of agent episode (an `Environment`
subclass, an agent program, a verifiers v1 environment; meshrl/roles/agents/service.py)."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import ipaddress
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from meshrl.models.hub import missing
from meshrl.models.vision import is_vision
from meshrl.planning.config import ServiceConfig
from meshrl.planning.wiring import Read, Write
from meshrl.schema import (
    CALLS,
    GENERATED,
    IMAGE_MASK,
    IMAGES,
    PICTURES,
    PROMPT,
    SAMPLES,
    TASKS,
    TRAJECTORY_SO_FAR,
    TRAJECTORY_WRITES,
)

if TYPE_CHECKING:
    from meshrl.envs import Limits
    from meshrl.planning.recipe import RunSettings, ServiceGroup
    from meshrl.planning.wiring import Wiring


@dataclass(frozen=True, kw_only=True)
class AgentsConfig(ServiceConfig):
    service = "meshrl.roles.agents.service:AgentsService"
    rejoins = (
        True  # an environment's trajectories live in their call rows; a program runs again from its start
    )

    model: str
    """Local path of the policy: its tokenizer and chat template render every agent's messages."""
    environment: str | None = None
    """`package.module:Class`, a subclass of meshrl.envs.Environment, built as `Class(**args)`."""
    program: str | None = None
    """`package.module:function`, an agent program (meshrl/envs/programs.py), called as
    `function(run, **args)`; it calls the model through the endpoint and returns the reward."""
    verifiers: str | None = None
    """A verifiers v1 taskset id: each task is one of its environment's episodes (meshrl/envs/verifiers.py),
    `args` the rest of its environment config."""
    args: dict[str, Any] = field(default_factory=dict)
    """The environment's constructor arguments, the program's keyword arguments, or the verifiers
    environment's config; checked at start-up. JSON-like values: the recipe travels to every launcher."""
    parser: Literal["hermes", "plain"] = "hermes"
    """The tool-call format: "hermes" (<tool_call>{json}</tool_call>, Qwen) or "plain" (name(text)). It
    reads calls from the model's text and, for a chat template without a tools section, writes the tool
    list into the system prompt (Hermes), and calls and results as text (meshrl/envs/render.py)."""
    tool_role: str = "tool"
    """Role tool results are rendered as; "user" for chat templates without a tool role."""
    keep_reasoning: bool = False
    """Keep the model's earlier reasoning in the history it sees, as generated, where the chat template
    would drop it (Qwen3-style `<think>`); by default the history is what the template renders, and a
    call after dropped reasoning starts a new segment of the trajectory."""
    max_tokens: int | None = None
    """Token budget of the sequence the model sees: an environment's reply that leaves no room for a full
    turn (inference.max_new_tokens) truncates its trajectory; a program's call whose prompt leaves none is
    refused (HTTP 400). None: the model's context (config.json's max_position_embeddings)."""
    max_turns: int = 8
    """Model turns of an environment's trajectory; one that reaches it is truncated (scored, counted)."""
    step_timeout_s: float = 60.0
    """Seconds an environment's reset, step or reward may take before its trajectory fails."""
    tool_timeout_s: float = 10.0
    """Seconds one tool call may take; a slower one becomes a tool message saying so (a tool error)."""
    timeout_s: float = 600.0
    """Seconds of a program's own time (not counting its model calls in flight, which wait for weights
    or a generation slot: call_timeout_s bounds those), after which its trajectory fails (counted)."""
    call_timeout_s: float = 600.0
    """A model call not answered within this long fails (HTTP 504 to a program)."""
    name: str | None = None
    """The model name programs ask for (`model` of a request); None: `model` as written, or its last part."""
    host: str = "127.0.0.1"
    """Where the endpoint listens for programs' own clients. On loopback it is open; on any other address a
    request needs the run's secret as a bearer token (the OpenAI SDK's api_key)."""
    concurrency: int = 256
    """Trajectories one replica plays at once (asyncio; plain-function programs on threads)."""
    lease_s: float = 1800.0
    """A replica that hangs gives its tasks and answers back after this long (one that dies: at once)."""

    def validate(self) -> Iterator[str]:
        kinds = [k for k in ("environment", "program", "verifiers") if getattr(self, k)]
        if len(kinds) != 1:
            yield "environment, program, verifiers: set exactly one (the kind of agent these episodes are)"
        for k in ("environment", "program"):
            if getattr(self, k) and ":" not in str(getattr(self, k)):
                yield f"{k}: {getattr(self, k)!r} must look like 'package.module:name'"
        if not isinstance(self.args, dict) or not all(isinstance(k, str) for k in self.args):
            yield "args: must be a dict of keyword arguments (str keys)"
        for name in ("max_turns", "concurrency"):
            if getattr(self, name) < 1:
                yield f"{name}: must be >= 1"
        for name in ("step_timeout_s", "tool_timeout_s", "timeout_s", "call_timeout_s"):
            if not 0 < getattr(self, name) < self.lease_s:
                yield f"{name}: must be > 0 and below lease_s ({self.lease_s:g})"
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            yield f"host: {self.host!r} is not an IP address (127.0.0.1 for this host only, 0.0.0.0 for all)"

    @property
    def kind(self) -> Literal["environment", "program", "verifiers"]:
        return "environment" if self.environment else "program" if self.program else "verifiers"

    @property
    def names(self) -> tuple[str, ...]:
        """The model names a request may give."""
        return (self.name,) if self.name else (self.model, Path(self.model).name)

    def budget(self) -> int:
        """The token budget of a sequence: max_tokens, or the model's context (read without transformers)."""
        if self.max_tokens is not None:
            return self.max_tokens
        path = Path(self.model) / "config.json"
        value = json.loads(path.read_text()).get("max_position_embeddings") if path.exists() else None
        return int(value) if isinstance(value, int) else 4096

    def limits(self, turn_tokens: int) -> Limits:
        """The trajectory limits of this recipe, with inference's `max_new_tokens` as `turn_tokens`."""
        from meshrl.envs import Limits

        return Limits(max_turns=self.max_turns, max_tokens=self.budget(), max_new_tokens=turn_tokens,
                      step_timeout_s=self.step_timeout_s, tool_timeout_s=self.tool_timeout_s)  # fmt: skip

    def imports(self) -> tuple[str, ...]:
        if self.kind == "environment":
            return (*super().imports(), "meshrl.roles.agents.environments", str(self.environment).partition(":")[0])  # fmt: skip
        user = str(self.program).partition(":")[0] if self.program else "meshrl.envs.verifiers"
        return (*super().imports(), "meshrl.roles.agents.programs", "openai", "starlette", "uvicorn", user)  # fmt: skip

    def reads(self) -> tuple[Read, ...]:
        # an environment's call rows carry its trajectory so far: any replica takes their answers (and its
        # acknowledgement deletes them); a program's calls are answered to the replica running it
        # (addressed; it deletes them itself)
        env = self.kind == "environment"
        answers = (PROMPT, *GENERATED, *(TRAJECTORY_SO_FAR if env else ()))
        return (
            Read("tasks", TASKS, (PROMPT,), retains=True),
            Read("answers", CALLS, answers, retains=env, addressed=not env),
        )

    def writes(self) -> tuple[Write, ...]:
        so_far = TRAJECTORY_SO_FAR if self.kind == "environment" else ()
        images = (IMAGES, IMAGE_MASK, PICTURES) if Path(self.model).exists() and is_vision(self.model) else ()
        return (
            Write("calls", CALLS, (PROMPT, *so_far, *images)),
            Write("samples", SAMPLES, (*TRAJECTORY_WRITES, *images)),
        )

    def needs(self) -> dict[str, str]:
        return {"turn_tokens": "an inference group generates the calls (its max_new_tokens bounds one)"}

    def check(self, run: RunSettings, group: ServiceGroup, wiring: Wiring) -> list[str]:
        if not Path(self.model).exists():
            return [missing(self.model)]
        turn = int(wiring.inputs.get("turn_tokens") or 0)
        if turn >= self.budget():
            return [f"max_tokens: a budget of {self.budget()} tokens leaves no room for a prompt beside a "
                    f"turn of {turn} (inference.max_new_tokens)"]  # fmt: skip
        if self.kind == "environment":
            return environment_problems(str(self.environment), self.args)
        absent = [m for m in ("starlette", "uvicorn", "openai") if importlib.util.find_spec(m) is None]
        if absent:
            return [f"agent programs need {' and '.join(absent)}: pip install 'meshrl[agents]'"]
        if self.kind == "verifiers" and importlib.util.find_spec("verifiers") is None:
            return ["verifiers: verifiers environments need verifiers 0.4.0: pip install 'meshrl[verifiers]'"]
        if self.kind == "verifiers":
            return []
        return program_problems(str(self.program), self.args)


def environment_problems(name: str, args: dict[str, Any]) -> list[str]:
    from meshrl.envs import Environment
    from meshrl.envs.base import MOVED

    module, _, attr = name.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr, None)
    except ImportError as e:
        return [f"environment: cannot import {module!r}: {e}"]
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        return [f"environment: {name!r} is not a subclass of meshrl.envs.Environment"]
    problems = [
        f"environment: {attr} sets {stale}, which no longer configures an environment: it is {where}"
        for stale, where in MOVED.items()
        if any(stale in vars(c) for c in cls.__mro__ if c is not Environment)
    ]
    try:
        inspect.signature(cls).bind(**args)
    except TypeError as e:
        problems.append(f"args: {attr} cannot take {args}: {e}")
    try:
        inspect.signature(cls.reward).bind(None, {}, None, [])
    except TypeError:
        problems.append(f"environment: {attr}.reward must take (self, state, final, transcript)")
    return problems


def program_problems(name: str, args: dict[str, Any]) -> list[str]:
    from meshrl.envs.programs import load_program

    try:
        fn = load_program(name)
    except ValueError as e:
        return [str(e)]
    try:
        inspect.signature(fn).bind(None, **args)
    except TypeError as e:
        return [f"args: {name} cannot take {args}: {e}"]
    return []
