"""Configuration of the environment service (multi-turn agents; meshrl/roles/env/service.py)."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from meshrl.planning.config import ServiceConfig
from meshrl.planning.wiring import Read, Write
from meshrl.schema import (
    ENV_REWARD,
    GEN_BATCH,
    GEN_S,
    LOGPROBS,
    LOSS_MASK,
    PROMPT,
    RESPONSE,
    SAMPLES,
    TASKS,
    TOKEN_VERSIONS,
    TRAJ_LOGPROBS,
    TURNS,
    VERSION,
)

if TYPE_CHECKING:
    from meshrl.envs import Limits
    from meshrl.planning.recipe import Recipe, ServiceGroup
    from meshrl.planning.wiring import Wiring

HISTORY = (LOSS_MASK, TRAJ_LOGPROBS, TOKEN_VERSIONS)
"""A turn row's record of the trajectory so far, one value per token of its PROMPT."""
TURN_READS = (PROMPT, *HISTORY, RESPONSE, LOGPROBS, VERSION, GEN_S, GEN_BATCH)
SAMPLE_WRITES = (PROMPT, RESPONSE, LOGPROBS, LOSS_MASK, TOKEN_VERSIONS, VERSION, GEN_S, GEN_BATCH, ENV_REWARD)


@dataclass(frozen=True, kw_only=True)
class EnvConfig(ServiceConfig):
    service = "meshrl.roles.env.service:EnvService"
    rejoins = True  # it keeps nothing of its own: every trajectory lives in its turn rows

    model: str
    """Local path of the policy: its tokenizer and chat template render the environment's messages."""
    environment: str
    """`package.module:Class`, a subclass of meshrl.envs.Environment, built as `Class(**environment_args)`."""
    environment_args: dict[str, Any] = field(default_factory=dict)
    """The environment's constructor arguments (a dataset split, a difficulty, a tool's endpoint), checked
    against its signature at start-up. JSON-like values: the recipe travels to every launcher."""
    parser: Literal["hermes", "plain"] = "hermes"
    """Tool-call format: "hermes" (<tool_call>{json}</tool_call>, Qwen) or "plain" (name(text))."""
    tool_role: str = "tool"
    """Role tool results are rendered as; "user" for chat templates without a tool role."""
    max_turns: int = 8
    """Model turns per trajectory; one that reaches it is truncated (scored as it is, counted)."""
    max_tokens: int = 2048
    """Token budget of a trajectory; a reply that leaves no room for a full turn truncates it."""
    step_timeout_s: float = 60.0
    """Seconds reset, step or reward may take before the trajectory fails."""
    tool_timeout_s: float = 10.0
    """Seconds one tool call may take; a slower one becomes a tool message saying so (a tool error)."""
    concurrency: int = 256
    """Trajectories one replica steps at once (asyncio); a trajectory waiting on a tool holds one of
    these, never a generation slot."""
    lease_s: float = 900.0
    """A replica that hangs gives its trajectories back after this long (one that dies: at once)."""

    def validate(self) -> Iterator[str]:
        if ":" not in self.environment:
            yield f"environment: {self.environment!r} must look like 'package.module:Class'"
        if self.max_turns < 1:
            yield "max_turns: must be >= 1"
        if self.concurrency < 1:
            yield "concurrency: must be >= 1"
        if self.step_timeout_s <= 0 or self.lease_s <= self.step_timeout_s:
            yield "step_timeout_s: must be > 0 and below lease_s"
        if self.tool_timeout_s <= 0:
            yield "tool_timeout_s: must be > 0"
        if not isinstance(self.environment_args, dict) or not all(
            isinstance(k, str) for k in self.environment_args
        ):
            yield "environment_args: must be a dict of keyword arguments (str keys)"

    def limits(self, turn_tokens: int) -> Limits:
        """The trajectory limits of this recipe, with inference's `max_new_tokens` as `turn_tokens`."""
        from meshrl.envs import Limits

        return Limits(
            max_turns=self.max_turns,
            max_tokens=self.max_tokens,
            max_new_tokens=turn_tokens,
            step_timeout_s=self.step_timeout_s,
            tool_timeout_s=self.tool_timeout_s,
        )

    def reads(self) -> tuple[Read, ...]:
        return (
            Read("tasks", TASKS, (PROMPT,), consumer="env", retains=True),
            Read("turns", TURNS, TURN_READS, consumer="env", retains=True),
        )

    def writes(self) -> tuple[Write, ...]:
        return (Write("turns", TURNS, (PROMPT, *HISTORY)), Write("samples", SAMPLES, SAMPLE_WRITES))

    def needs(self) -> dict[str, str]:
        return {"turn_tokens": "an inference group generates the turns (its max_new_tokens bounds one)"}

    def check(self, recipe: Recipe, group: ServiceGroup, wiring: Wiring) -> list[str]:
        from meshrl.envs import Environment

        problems = []
        turn = wiring.inputs.get("turn_tokens")
        if turn is not None and turn >= self.max_tokens:
            problems.append(
                f"max_tokens: {self.max_tokens} leaves no room for one turn of {turn} (inference.max_new_tokens)"
            )
        module, _, name = self.environment.partition(":")
        try:
            cls = getattr(importlib.import_module(module), name, None)
        except ImportError as e:
            return [*problems, f"environment: cannot import {module!r}: {e}"]
        if not (isinstance(cls, type) and issubclass(cls, Environment)):
            return [
                *problems,
                f"environment: {self.environment!r} is not a subclass of meshrl.envs.Environment",
            ]
        try:
            inspect.signature(cls).bind(**self.environment_args)
        except TypeError as e:
            problems.append(f"environment_args: {name} cannot take {self.environment_args}: {e}")
        try:
            inspect.signature(cls.reward).bind(None, {}, None, [])
        except TypeError:
            problems.append(
                f"environment: {name}.reward must take (self, state, final, transcript) (the transcript "
                "was added: `async def reward(self, state, final, transcript)`)"
            )
        return problems
