"""One trajectory's moves, as pure async functions over an environment: start it from a dataset row,
and advance it by one model turn. The environment service (meshrl/roles/env/service.py) calls these
between the data plane's turn rows; tests call them directly.

Every way an environment or a model can misbehave has one outcome here: a tool problem is a tool
message (tools.py); a step or reset that raises, times out or returns something that is not messages,
and a reward that fails, end the trajectory as failed (reward NaN: rollout counts the sample failed,
the run goes on within `max_failed_fraction`); a trajectory past its turns or its token budget ends
truncated (scored as it is, counted by the limit it ran into).

An outcome also keeps the trajectory's transcript (every message: reset's, the model's turns with
their parsed tool calls, the environment's replies), which `reward` sees, and its tool figures.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections import Counter
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from meshrl.envs import tools
from meshrl.envs.base import EnvError, Environment, Limits, Message, State, Step, Turn, check_messages
from meshrl.envs.parsers import Parser
from meshrl.envs.render import Renderer
from meshrl.envs.trajectory import Trajectory

T = TypeVar("T")

log = logging.getLogger("meshrl.env")


@dataclass
class Outcome:
    trajectory: Trajectory
    state: State
    done: bool = False
    reward: float = math.nan
    rewards: dict[str, float] = field(default_factory=dict)
    truncated: Literal["turns", "tokens"] | None = None
    """The limit the trajectory ran into, or None."""
    failed: str | None = None
    """Why the trajectory failed (its reward is NaN), or None."""
    transcript: list[Message] = field(default_factory=list)
    tool_calls: int = 0
    tool_errors: Counter[str] = field(default_factory=Counter)
    """Tool errors by kind (schema.TOOL_ERROR_KINDS)."""

    def count_tools(self, tally: Counter[str]) -> None:
        """Add one step's tally of `call_tools` (its calls, its errors by kind)."""
        self.tool_calls += tally.pop("calls", 0)
        self.tool_errors.update(tally)


async def start(env: Environment, renderer: Renderer, row: dict[str, Any]) -> Outcome:
    """Reset on `row` and render the first context; a failure ends the trajectory before any turn."""
    limits = env.limits
    try:
        messages, state = await _within(env.reset(row), limits.step_timeout_s)
        messages = check_messages(messages, f"{type(env).__name__}.reset")
        _check_state(state, "reset")
        ids = renderer.first(messages)
    except Exception as e:
        return Outcome(Trajectory.start([renderer.stop]), {}, done=True, failed=_why("reset", e, limits))
    out = Outcome(Trajectory.start(ids), state, transcript=list(messages))
    if len(ids) + limits.max_new_tokens > limits.max_tokens:
        out.truncated = "tokens"
        return await _finish(env, out, None, limits)
    return out


async def advance(
    env: Environment,
    renderer: Renderer,
    parser: Parser,
    outcome: Outcome,
    response: list[int],
    logprobs: list[float],
    version: int,
) -> Outcome:
    """Append the model's turn exactly as generated, step the environment, and append its reply (or end
    the trajectory: done, out of turns or budget (`env.limits`), or failed)."""
    limits = env.limits
    traj, state = outcome.trajectory, outcome.state
    traj.add_model(response, logprobs, version)
    text = renderer.decode(response)
    turn = Turn(text, parser.parse(text))
    outcome.transcript.append(turn.message())
    counted: Counter[str] = Counter()
    counting = tools.tally.set(counted)
    try:
        step = await _within(env.step(state, turn), limits.step_timeout_s)
        if not isinstance(step, Step):
            raise EnvError(f"{type(env).__name__}.step returned {type(step).__name__}, not a Step")
        messages = check_messages(step.messages, f"{type(env).__name__}.step")
        _check_state(state, "step")
    except Exception as e:
        outcome.done, outcome.failed = True, _why("step", e, limits)
        return outcome
    finally:
        tools.tally.reset(counting)
        outcome.count_tools(counted)
    if step.done:
        return await _finish(env, outcome, turn, limits)
    if traj.turns >= limits.max_turns:
        outcome.truncated = "turns"
        return await _finish(env, outcome, turn, limits)
    reply = renderer.reply(messages, after_stop=bool(response) and response[-1] == renderer.stop)
    if len(traj.ids) + len(reply) + limits.max_new_tokens > limits.max_tokens:
        outcome.truncated = "tokens"
        return await _finish(env, outcome, turn, limits)
    traj.add_env(reply)
    outcome.transcript.extend(messages)  # what the model sees next (a reply cut by a limit is not)
    return outcome


async def _finish(env: Environment, outcome: Outcome, final: Turn | None, limits: Limits) -> Outcome:
    """Take the reward: one number, or named ones (summed); a failure makes it NaN."""
    outcome.done = True
    try:
        value = await _within(env.reward(outcome.state, final, outcome.transcript), limits.step_timeout_s)
        named = dict(value) if isinstance(value, dict) else {"reward": value}
        named = {str(k): float(v) for k, v in named.items()}
        total = math.fsum(named.values())
        if not math.isfinite(total):
            raise EnvError(f"reward is {total}")
    except Exception as e:
        outcome.failed = _why("reward", e, limits)
        return outcome
    outcome.reward, outcome.rewards = total, named
    return outcome


def _check_state(state: Any, where: str) -> None:
    if not isinstance(state, dict):
        raise EnvError(f"{where}: the state must be a dict, got {type(state).__name__}")
    try:
        json.dumps(state)
    except (TypeError, ValueError) as e:
        raise EnvError(f"{where}: the state must be JSON-serialisable ({e})") from e


def _why(where: str, e: BaseException, limits: Limits) -> str:
    if isinstance(e, TimeoutError):
        return f"{where} timed out after {limits.step_timeout_s:g}s"
    return f"{where} raised {type(e).__name__}: {e}"


async def _within(awaitable: Awaitable[T], seconds: float) -> T:
    """`awaitable`, or TimeoutError after `seconds` (not asyncio.wait_for, which on Python 3.11 can
    swallow the cancellation of a service shutting down)."""
    async with asyncio.timeout(seconds):
        return await awaitable
