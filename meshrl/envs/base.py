"""What an environment is: plain async Python that turns a dataset row into a conversation, answers
each of the model's turns, and scores the trajectory at the end.

An environment never sees tokens. Its state is a JSON-serialisable dict, kept in the data plane with
the trajectory's current turn, so a trajectory resumes from its last written turn on any replica of
the environment service (docs/architecture.md, "Agents"). Turn limits, the token budget and the
per-step timeout are the service's (`meshrl/roles/env/config.py`), enforced around these calls.

    class Guess(Environment):
        async def reset(self, row):          # the dataset row rollout fed -> first messages, state
            return [{"role": "user", "content": "guess my number"}], {"secret": row["secret"]}

        async def step(self, state, turn):   # turn.content, turn.tool_calls: the model's reply
            ...  # compare, reply "higher"/"lower", done when right
            return Step([{"role": "user", "content": "higher"}], done=False)

        async def reward(self, state, final):  # final: the last model turn (None if there was none)
            return float(state.get("found", False))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from meshrl.envs.parsers import ToolCall
from meshrl.envs.tools import Tool, call_tools

Message = dict[str, Any]
"""A chat message: {"role": ..., "content": ...} (+ "tool_calls" on the model's turns as parsed)."""
State = dict[str, Any]
"""An environment's state: JSON-serialisable (it travels with the trajectory's turn rows)."""


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
        return {"role": "assistant", "content": self.content}


class Environment:
    """Subclass and write `reset`, `step` (unless the default tool loop of `tools` is what you want)
    and `reward`. One instance serves many trajectories at once: keep per-trajectory data in `state`."""

    tools: Sequence[Tool] = ()
    """Tools the model may call; their schemas go to the chat template. With tools, the default `step`
    runs the turn's calls (concurrently) and ends the trajectory on a turn without calls."""

    async def reset(self, row: dict[str, Any]) -> tuple[list[Message], State]:
        """The first messages (system, user) and the state for dataset row `row`."""
        raise NotImplementedError

    async def step(self, state: State, turn: Turn) -> Step:
        """Answer the model's turn: by default, its tool calls' results, or done when it made none."""
        if not turn.tool_calls:
            return Step([], done=True)
        return Step(await call_tools(self.tools, turn.tool_calls, timeout_s=self.tool_timeout_s))

    async def reward(self, state: State, final: Turn | None) -> float | dict[str, float]:
        """The trajectory's reward: one number, or several named ones (summed, each logged).
        `final` is the model's last turn (None when the trajectory was cut before one)."""
        raise NotImplementedError

    tool_timeout_s: float = 10.0
    """Seconds one tool call may take; a call that takes longer becomes a tool message saying so."""


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
