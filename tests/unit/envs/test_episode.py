"""A trajectory's token layout and loss mask, built by hand through the episode functions with the tiny
model's tokenizer; and the defined outcome of every kind of misbehaving environment."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest

from meshrl.envs import Environment, Limits, Message, State, Step, Turn, tool
from meshrl.envs.episode import advance, start
from meshrl.envs.parsers import PlainParser
from meshrl.envs.render import Renderer
from meshrl.schema import LOGPROBS, LOSS_MASK, PROMPT, RESPONSE, SEGMENTS, TOKEN_VERSIONS
from meshrl.tasks.sim import wait


@tool
def calc(expression: str) -> int:
    """Evaluate a sum of integers.

    Args:
        expression: like 12+34
    """
    return sum(int(t) for t in expression.split("+"))


class Calc(Environment):
    tools = (calc,)

    async def reset(self, row: dict[str, Any]) -> tuple[list[dict[str, Any]], State]:
        return [{"role": "user", "content": row["q"]}], {"answer": row["a"]}

    async def reward(self, state: State, final: Turn | None, transcript: list[Message]) -> dict[str, float]:
        right = final is not None and final.content.strip() == str(state["answer"])
        return {"correct": float(right), "format": 0.5}


def ids(tok: Any, text: str) -> list[int]:
    return list(tok(text)["input_ids"])


SHORT = Limits(max_new_tokens=8)


def renderer(tok: Any, env: Environment) -> Renderer:
    return Renderer(tok, PlainParser([t.name for t in env.tools]), tool_role="user")


def play(env: Environment, tok: Any, turns: list[str], limits: Limits = SHORT) -> Any:
    env.limits = limits

    async def go() -> Any:
        chat = renderer(tok, env)
        out = await start(env, chat, {"q": "12+34+5=", "a": 51})
        for k, text in enumerate(turns):
            if out.done:
                break
            response = [*ids(tok, text), tok.eos_token_id]
            out = await advance(env, chat, out, response, [-0.5] * len(response), 10 + k)
        return out

    return asyncio.run(go())


def test_layout_and_loss_mask(tok: Any) -> None:
    out = play(Calc(), tok, ["calc(12+34+5)", "51"])
    assert out.done and not out.truncated and out.failed is None
    assert out.reward == 1.5 and out.rewards == {"correct": 1.0, "format": 0.5}
    eos = tok.eos_token_id
    sample = out.trajectory.sample(eos)
    prompt = ids(tok, "<|user|>12+34+5=<|assistant|>")
    turn1, reply, turn2 = (
        [*ids(tok, "calc(12+34+5)"), eos],
        ids(tok, "<|user|>51<|assistant|>"),
        [*ids(tok, "51"), eos],
    )
    assert sample[PROMPT] == prompt
    assert sample[RESPONSE] == turn1 + reply + turn2  # the model's ids exactly as given
    assert sample[LOSS_MASK] == [1] * len(turn1) + [0] * len(reply) + [1] * len(turn2)
    assert sample[LOGPROBS] == [-0.5] * len(turn1) + [0.0] * len(reply) + [-0.5] * len(turn2)
    assert sample[TOKEN_VERSIONS] == [10] * len(turn1) + [-1] * len(reply) + [11] * len(turn2)
    assert sample[SEGMENTS] == [len(prompt) + len(sample[RESPONSE])]  # one sequence
    assert out.trajectory.version_range == (10, 11)
    assert tok.decode(sample[PROMPT] + sample[RESPONSE]) == (
        "<|user|>12+34+5=<|assistant|>calc(12+34+5)<eos><|user|>51<|assistant|>51<eos>"
    )


def test_out_of_turns_and_out_of_budget_truncate(tok: Any) -> None:
    out = play(Calc(), tok, ["calc(1)"] * 5, Limits(max_turns=3, max_new_tokens=8))
    assert out.done and out.truncated == "turns" and out.turns == 3 and out.reward == 0.5
    out = play(Calc(), tok, ["calc(1)"] * 5, Limits(max_tokens=40, max_new_tokens=8))
    assert out.done and out.truncated == "tokens" and len(out.trajectory.ids) + 8 <= 40 + 8
    assert out.turns < 5


class Broken(Calc):
    def __init__(self, where: str) -> None:
        self.where = where

    async def reset(self, row: dict[str, Any]) -> tuple[list[dict[str, Any]], State]:
        if self.where == "reset":
            raise ValueError("no such row")
        if self.where == "not-messages":
            return "hello", {}  # type: ignore[return-value]
        if self.where == "state":
            return [{"role": "user", "content": "x"}], {"f": object()}
        return await super().reset(row)

    async def step(self, state: State, turn: Turn) -> Step:
        if self.where == "step":
            raise KeyError("oops")
        if self.where == "hang":
            await asyncio.sleep(10)
        return await super().step(state, turn)

    async def reward(self, state: State, final: Turn | None, transcript: list[Message]) -> dict[str, float]:
        if self.where == "reward":
            return {"r": math.inf}
        return await super().reward(state, final, transcript)


@pytest.mark.parametrize(
    ("where", "why"),
    [
        ("reset", "reset raised ValueError: no such row"),
        ("not-messages", "reset raised EnvError: Broken.reset returned str 'hello', not a list"),
        ("state", "reset raised EnvError: reset: the state must be JSON-serialisable"),
        ("step", "step raised KeyError: 'oops'"),
        ("hang", "step timed out after 0.2s"),
        ("reward", "reward raised EnvError: reward part 'r' is inf"),
    ],
)
def test_a_misbehaving_environment_fails_the_trajectory(tok: Any, where: str, why: str) -> None:
    out = play(Broken(where), tok, ["calc(1)", "2"], Limits(max_new_tokens=8, step_timeout_s=0.2))
    assert out.done and math.isnan(out.reward)
    assert out.failed is not None and out.failed.startswith(why), out.failed


def test_malformed_call_is_a_tool_message_not_a_failure(tok: Any) -> None:
    out = play(Calc(), tok, ["calc(1+(2", "3"])
    assert out.failed is None and out.reward == 0.5
    assert out.tool_calls == 1 and out.tool_errors == {"malformed": 1}
    text = tok.decode(out.trajectory.ids)
    assert "<|user|>error: unbalanced parentheses<|assistant|>" in text


def test_guess_game_lasts_as_many_turns_as_it_takes(tok: Any) -> None:
    from meshrl.tasks.guess import GuessEnv

    async def game(guesses: list[str]) -> Any:
        env = GuessEnv()
        env.limits = Limits(max_turns=8, max_new_tokens=4)
        chat = renderer(tok, env)
        out = await start(env, chat, {"prompt": "guess", "secret": 30})
        for k, g in enumerate(guesses):
            response = [*ids(tok, g), tok.eos_token_id]
            out = await advance(env, chat, out, response, [0.0] * len(response), k)
            if out.done:
                break
        return out

    short, long = asyncio.run(game(["30"])), asyncio.run(game(["10", "40", "x", "30"]))
    assert (short.turns, long.turns) == (1, 4)
    assert short.rewards["found"] == long.rewards["found"] == 1.0 and short.reward > long.reward
    text = tok.decode(long.trajectory.ids)
    assert (
        "<|user|>higher<|assistant|>40<eos><|user|>lower<|assistant|>x<eos><|user|>a number, please" in text
    )


class Seen(Calc):
    """Keeps what `reward` was given."""

    async def reward(self, state: State, final: Turn | None, transcript: list[Message]) -> dict[str, float]:
        state["transcript"] = transcript
        return await super().reward(state, final, transcript)


def test_reward_sees_the_transcript_and_tool_figures_are_kept(tok: Any) -> None:
    out = play(Seen(), tok, ["calc(12+34+5)", "calc(1+x)", "calc(1+(2", "51"])
    assert out.reward == 1.5 and out.tool_calls == 3 and out.tool_errors == {"raised": 1, "malformed": 1}
    call = {"id": "call_0", "type": "function", "function": {"name": "calc", "arguments": '{"": "12+34+5"}'}}
    transcript = out.state["transcript"]
    assert transcript[:3] == [
        {"role": "user", "content": "12+34+5="},
        {"role": "assistant", "content": "", "tool_calls": [call]},  # OpenAI's: the call is not content
        {"role": "tool", "name": "calc", "content": "51"},
    ]
    assert [m["role"] for m in transcript] == ["user", *["assistant", "tool"] * 3, "assistant"]
    assert transcript[-1] == {"role": "assistant", "content": "51"}


class SlowTool(Calc):
    tools = (wait,)


def test_the_tool_timeout_is_the_limits_one(tok: Any) -> None:
    out = play(SlowTool(), tok, ["wait(1)", "51"], Limits(max_new_tokens=8, tool_timeout_s=0.1))
    assert out.failed is None and out.tool_errors == {"timeout": 1}
    assert "<|user|>error: wait timed out after 0.1s<|assistant|>" in tok.decode(out.trajectory.ids)
