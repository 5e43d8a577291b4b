"""What an environment is: plain async Python that turns a dataset row into a conversation, answers
each of the model's turns, and scores the trajectory at the end.

An environment never sees tokens. Its state is a JSON-serialisable dict, kept in the data plane with
the trajectory's current turn, so a trajectory resumes from its last written turn on any replica of
the environment service (docs/architecture.md, "Agents"). The limits (turns, tokens, timeouts) are
the recipe's (`EnvConfig`, meshrl/roles/env/config.py), enforced around these calls and readable here
as `self.limits`; the recipe's `environment_args` are the class's constructor arguments.

    class Guess(Environment):
        async def reset(self, row):          # the dataset row rollout fed -> first messages, state
            return [{"role": "user", "content": "guess my number"}], {"secret": row["secret"]}

        async def step(self, state, turn):   # turn.content, turn.tool_calls: the model's reply
            ...  # compare, reply "higher"/"lower", done when right
            return Step([{"role": "user", "content": "higher"}], done=False)

        async def reward(self, state, final, transcript):  # final: the last model turn (None if
            return float(state.get("found", False))      # none); transcript: every message so far
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from meshrl.envs.parsers import ToolCall
from meshrl.envs.tools import Tool, call_tools

Message = dict[str, Any]
"""A chat message: {"role": ..., "content": ...} (+ "tool_calls" on the model's turns as parsed)."""
State = dict[str, Any]
"""An environment's state: JSON-serialisable (it travels with the trajectory's turn rows)."""


@dataclass(frozen=True)
class Limits:
    """How far a trajectory may go: the recipe's (`EnvConfig.limits`), one copy for the service and the
    environment (`Environment.limits`)."""

    max_turns: int = 8
    """Model turns per trajectory; the trajectory is truncated after the last."""
    max_tokens: int = 1024
    """Token budget of a whole trajectory (prompt, turns, replies): a reply that would leave no room
    for another full turn of `max_new_tokens` truncates it instead."""
    max_new_tokens: int = 64
    """Inference's limit per turn (the inference group's `max_new_tokens`)."""
    step_timeout_s: float = 60.0
    """Seconds `reset`, `step` or `reward` may take."""
    tool_timeout_s: float = 10.0
    """Seconds one tool call may take; a call that takes longer becomes a tool message saying so."""


class EnvError(RuntimeError):
    """An environment broke its contract (returned something that is not messages, a state that is not
    JSON): the trajectory is counted failed, the run goes on."""


@dataclass
class Step:
    """The environment's answer to one model turn."""

    messages: list[Message]
    """Its reply (tool results, feedback), rendered with the chat template and appended as tokens."""
    done: bool = False
    """The trajectory is over: no reply is rendered, the reward is taken."""


@dataclass
class Turn:
    """The model's turn as the environment sees it: the decoded text and the tool calls parsed from it."""

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)

    def message(self) -> Message:
        """The turn as a chat message, its parsed calls in the OpenAI shape (a malformed call: as
        parsed, its `arguments` best effort)."""
        out: Message = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": f"call_{i}", "type": "function",
                 "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                for i, c in enumerate(self.tool_calls)
            ]  # fmt: skip
        return out


class Environment:
    """Subclass and write `reset`, `step` (unless the default tool loop of `tools` is what you want)
    and `reward`. One instance serves many trajectories at once: keep per-trajectory data in `state`."""

    tools: Sequence[Tool] = ()
    """Tools the model may call; their schemas go to the chat template. With tools, the default `step`
    runs the turn's calls (concurrently) and ends the trajectory on a turn without calls."""

    limits: Limits = Limits()
    """The recipe's limits, set by the service before the first trajectory (read them, don't keep a
    copy: `self.limits.max_turns`)."""

    async def reset(self, row: dict[str, Any]) -> tuple[list[Message], State]:
        """The first messages (system, user) and the state for dataset row `row`."""
        raise NotImplementedError

    async def step(self, state: State, turn: Turn) -> Step:
        """Answer the model's turn: by default, its tool calls' results, or done when it made none."""
        if not turn.tool_calls:
            return Step([], done=True)
        return Step(await call_tools(self.tools, turn.tool_calls, timeout_s=self.limits.tool_timeout_s))

    async def reward(
        self, state: State, final: Turn | None, transcript: list[Message]
    ) -> float | dict[str, float]:
        """The trajectory's reward: one number, or several named ones (summed, each logged as
        `reward/env_<name>`). `final` is the model's last turn (None when the trajectory was cut
        before one); `transcript` every message so far (reset's, the model's with their parsed
        `tool_calls`, the environment's replies), as an OpenAI-style conversation."""
        raise NotImplementedError


def check_messages(value: Any, where: str) -> list[Message]:
    """`value` if it is a list of messages, else a clear `EnvError` naming `where`."""
    if not isinstance(value, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in value
    ):
        raise EnvError(
            f"{where} returned {type(value).__name__} {str(value)[:120]!r}, not a list of "
            '{"role": str, "content": str} messages'
        )
    return value
