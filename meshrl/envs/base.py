"""What an environment is: plain async Python that turns a dataset row into a conversation, answers
each of the model's turns, and scores the trajectory at the end.

An environment never sees tokens. Its state is a JSON-serialisable dict, kept in the data plane with
the trajectory's current turn, so a trajectory resumes from its last written turn on any replica of
the agents service (docs/architecture.md, "Agents"). The limits (turns, tokens, timeouts) are the
recipe's (`AgentsConfig`, meshrl/roles/agents/config.py), enforced around these calls and readable here
as `self.limits`; the recipe's `args` are the class's constructor arguments.

    class Guess(Environment):
        async def reset(self, row):          # the dataset row rollout fed -> first messages, state
            return [{"role": "user", "content": "guess my number"}], {"secret": row["secret"]}

        async def step(self, state, turn):   # turn.text, turn.content, turn.tool_calls: the model's reply
            ...  # compare, reply "higher"/"lower", done when right
            return Step([{"role": "user", "content": "higher"}], done=False)

        async def reward(self, state, final, transcript):  # final: the last model turn (None if
            return float(state.get("found", False))      # none); transcript: every message so far
"""

from __future__ import annotations

import json
import math
import numbers
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
    """How far a trajectory may go: the recipe's (`AgentsConfig.limits`), one copy for the service and
    the environment (`Environment.limits`)."""

    max_turns: int = 8
    """Model turns per trajectory; the trajectory is truncated after the last."""
    max_tokens: int = 1024
    """Token budget of the sequence the model sees (prompt, turns, replies; a segment, where a reasoning
    template starts one): a reply that would leave no room for another full turn of `max_new_tokens`
    truncates the trajectory instead."""
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

    text: str
    """Everything the model wrote (without its stop token)."""
    tool_calls: list[ToolCall] = field(default_factory=list)

    @property
    def content(self) -> str:
        """The text outside the tool calls (an OpenAI message's `content`)."""
        text = self.text
        for c in self.tool_calls:
            text = text.replace(c.raw, "")
        return text.strip() if self.tool_calls else text

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


MOVED = {
    name: f"the recipe's agents.{name} (read it here as self.limits.{name})"
    for name in ("max_turns", "max_tokens", "step_timeout_s", "tool_timeout_s")
}
"""Class attributes that once configured an environment and now are the recipe's limits: a class that
still sets one is refused at start-up (meshrl/roles/agents/config.py), rather than silently ignored."""


class Environment:
    """Subclass and write `reset`, `step` (unless the default tool loop of `tools` is what you want)
    and `reward`. One instance serves many trajectories at once: keep per-trajectory data in `state`."""

    tools: Sequence[Tool] = ()
    """Tools the model may call; their schemas go to the chat template. With tools, the default `step`
    runs the turn's calls (concurrently) and ends the trajectory on a turn without calls."""

    tools_in_prompt: bool = True
    """For a chat template without a tools section: write the tool list into the system prompt (the
    recipe's format: the Hermes block). False when `reset`'s messages describe the tools themselves (a
    small model's short prompt: the list is trained on, as context, every step)."""

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
        """The trajectory's reward (`reward_parts` says what counts as one). `final` is the model's last
        turn (None when the trajectory was cut before one); `transcript` every message so far (reset's,
        the model's with their parsed `tool_calls`, the environment's replies), as an OpenAI-style
        conversation."""
        raise NotImplementedError


def reward_parts(value: Any) -> dict[str, float]:
    """The one reward rule, for environments, agent programs and verifiers episodes alike: a reward is a
    number (a bool counts as 0 or 1; numpy and torch scalars too), the part named "reward"; or a
    non-empty dict of named numbers, summed into the trajectory's reward, each part logged as
    `reward/env_<name>`. Anything else (None, text, a list, an empty dict) and any part that is NaN or
    infinite raise `EnvError` saying which: the trajectory fails (reward NaN: never trained, counted)."""
    parts = value if isinstance(value, dict) else {"reward": value}
    if not parts:
        raise EnvError("the reward is an empty dict: name at least one part")
    out = {}
    for name, v in parts.items():
        if not isinstance(name, str) or not _number(v):
            shown = value if len(repr(value)) < 120 else f"{repr(value)[:117]}..."
            raise EnvError(f"the reward must be a number or a dict of named numbers, not {shown!r}")
        out[name] = float(v)
        if not math.isfinite(out[name]):
            raise EnvError(f"reward part {name!r} is {out[name]}")
    return out


def _number(v: Any) -> bool:
    if isinstance(v, numbers.Real):
        return True
    return type(v).__name__ == "Tensor" and getattr(v, "ndim", None) == 0 and not v.is_complex()


def check_messages(value: Any, where: str) -> list[Message]:
    """`value` if it is a list of messages, else a clear `EnvError` naming `where`. A message's content is
    text, or a list of parts (`{"type": "text", "text": ...}`, and for a vision-language model image parts:
    an OpenAI `image_url` with a data URL, or `{"type": "image", "image": <PIL image, path or bytes>}`),
    whose images come back as data URLs (a trajectory's messages travel as JSON)."""
    if not isinstance(value, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and _content(m.get("content")) for m in value
    ):
        raise EnvError(
            f"{where} returned {type(value).__name__} {str(value)[:120]!r}, not a list of "
            '{"role": str, "content": str or a list of parts} messages'
        )
    if all(isinstance(m["content"], str) for m in value):
        return value
    from meshrl.models.vision import with_urls

    try:
        return with_urls(value, where)
    except ValueError as e:
        raise EnvError(str(e)) from None


def _content(content: Any) -> bool:
    return isinstance(content, str) or (
        isinstance(content, list)
        and all(isinstance(p, dict) and isinstance(p.get("type"), str) for p in content)
    )
