"""An environment's trajectory, move by move: start it from a dataset row, advance it by one model turn.
The agents service (meshrl/roles/agents/service.py) drives these between model calls, `meshrl eval`
with its own engine, tests directly. An `Episode` is everything needed to go on, so the service keeps it
in each call row and a trajectory resumes from its last turn on whichever replica takes the answer.

Every way an environment or a model can misbehave has one outcome here: a tool problem is a tool
message (tools.py); a reset or step that raises, times out or returns something that is not messages
(or a state that is not a JSON dict), and a reward that fails the reward rule (base.reward_parts), end
the trajectory as failed (reward NaN: never trained, counted); a trajectory past its turns or its token
budget ends truncated (scored as it is, counted by the limit it ran into).
"""

from __future__ import annotations

import asyncio
import json
import math
from collections import Counter
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from meshrl.envs import tools
from meshrl.envs.base import EnvError, Environment, Message, State, Step, Turn, check_messages, reward_parts
from meshrl.envs.render import Renderer
from meshrl.envs.trajectory import Trajectory
from meshrl.models.vision import image_urls

T = TypeVar("T")


@dataclass
class Episode:
    trajectory: Trajectory
    state: State
    transcript: list[Message] = field(default_factory=list)
    """Every message so far: reset's, the model's turns with their parsed tool calls, the replies."""
    done: bool = False
    reward: float = math.nan
    rewards: dict[str, float] = field(default_factory=dict)
    truncated: Literal["turns", "tokens"] | None = None
    """The limit the trajectory ran into, or None."""
    failed: str | None = None
    """Why the trajectory failed (its reward is NaN), or None."""
    tool_calls: int = 0
    tool_errors: Counter[str] = field(default_factory=Counter)
    """Tool errors by kind (schema.TOOL_ERROR_KINDS)."""

    @property
    def turns(self) -> int:
        return self.trajectory.calls

    def state_json(self) -> dict[str, Any]:
        """What the episode is besides its tokens, as JSON-ready values (a call row's metadata)."""
        return {"state": self.state, "transcript": self.transcript, "tool_calls": self.tool_calls,
                "tool_errors": dict(self.tool_errors)}  # fmt: skip

    @classmethod
    def resume(cls, trajectory: Trajectory, saved: dict[str, Any]) -> Episode:
        """The episode a call row recorded (`state_json` and its trajectory so far)."""
        return cls(trajectory, saved["state"], saved["transcript"], tool_calls=saved["tool_calls"],
                   tool_errors=Counter(saved["tool_errors"]))  # fmt: skip


def schemas(env: Environment, renderer: Renderer) -> list[Message] | None:
    """The environment's tools as the chat template gets them (none for a template without a tools
    section when the environment describes them itself: `tools_in_prompt`)."""
    return [t.schema for t in env.tools] or None if renderer.renders_tools or env.tools_in_prompt else None


async def start(env: Environment, renderer: Renderer, row: dict[str, Any]) -> Episode:
    """Reset on `row` and render the first prompt; a failure ends the trajectory before any turn."""
    limits = env.limits
    try:
        messages, state = await _within(env.reset(row), limits.step_timeout_s)
        messages = check_messages(messages, f"{type(env).__name__}.reset")
        _check_state(state, "reset")
        ids = renderer.prompt(messages, schemas(env, renderer))
    except Exception as e:
        return Episode(Trajectory(), {}, done=True, failed=_why("reset", e, limits.step_timeout_s))
    out = Episode(Trajectory(), state, list(messages))
    out.trajectory.prompt(ids, image_urls(messages))
    if len(ids) + limits.max_new_tokens > limits.max_tokens:
        out.truncated = "tokens"
        return await _finish(env, out, None)
    return out


async def advance(
    env: Environment,
    renderer: Renderer,
    ep: Episode,
    completion: list[int],
    logprobs: list[float],
    version: int,
) -> Episode:
    """Add the model's turn exactly as generated, step the environment, and add the next prompt (or end
    the trajectory: done, out of turns or budget (`env.limits`), or failed)."""
    limits = env.limits
    ep.trajectory.answer(completion, logprobs, version)
    text = renderer.decode(completion)
    turn = Turn(text, renderer.parser.parse(text))
    ep.transcript.append(turn.message())
    counted: Counter[str] = Counter()
    counting = tools.tally.set(counted)
    try:
        step = await _within(env.step(ep.state, turn), limits.step_timeout_s)
        if not isinstance(step, Step):
            raise EnvError(f"{type(env).__name__}.step returned {type(step).__name__}, not a Step")
        messages = check_messages(step.messages, f"{type(env).__name__}.step")
        _check_state(ep.state, "step")
    except Exception as e:
        ep.done, ep.failed = True, _why("step", e, limits.step_timeout_s)
        return ep
    finally:
        tools.tally.reset(counting)
        ep.tool_calls += counted.pop("calls", 0)
        ep.tool_errors.update(counted)
    if step.done:
        return await _finish(env, ep, turn)
    if ep.turns >= limits.max_turns:
        ep.truncated = "turns"
        return await _finish(env, ep, turn)
    tools_ = schemas(env, renderer)
    ids = renderer.extend(ep.trajectory.tail, ep.transcript, messages, tools_)
    images = [*ep.trajectory.tail_images, *image_urls(messages)]
    if ids is None:
        ids = renderer.prompt([*ep.transcript, *messages], tools_)
        images = image_urls([*ep.transcript, *messages])
    if len(ids) + limits.max_new_tokens > limits.max_tokens:
        ep.truncated = "tokens"
        return await _finish(env, ep, turn)
    ep.trajectory.prompt(ids, images)
    ep.transcript.extend(messages)  # what the model sees next (a reply cut by a limit is not)
    return ep


async def _finish(env: Environment, ep: Episode, final: Turn | None) -> Episode:
    ep.done = True
    try:
        value = await _within(env.reward(ep.state, final, ep.transcript), env.limits.step_timeout_s)
        ep.rewards = reward_parts(value)
    except Exception as e:
        ep.failed = _why("reward", e, env.limits.step_timeout_s)
        return ep
    ep.reward = math.fsum(ep.rewards.values())
    return ep


def _check_state(state: Any, where: str) -> None:
    if not isinstance(state, dict):
        raise EnvError(f"{where}: the state must be a dict, got {type(state).__name__}")
    try:
        json.dumps(state)
    except (TypeError, ValueError) as e:
        raise EnvError(f"{where}: the state must be JSON-serialisable ({e})") from e


def _why(where: str, e: BaseException, timeout_s: float) -> str:
    if isinstance(e, TimeoutError):
        return f"{where} timed out after {timeout_s:g}s"
    return f"{where} raised {type(e).__name__}: {e}"


async def _within(awaitable: Awaitable[T], seconds: float) -> T:
    """`awaitable`, or TimeoutError after `seconds` (not asyncio.wait_for, which on Python 3.11 can
    swallow the cancellation of a service shutting down)."""
    async with asyncio.timeout(seconds):
        return await awaitable
