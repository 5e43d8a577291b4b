"""The one renderer of every agent: whole prompts, a conversation's next prompt on the tokens generated,
the tool list and calls for templates without a tools section, and reasoning templates (the tiny
tokenizer with Qwen3's behaviour: earlier reasoning dropped once a user query follows)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from meshrl.envs import Environment, Limits, Message, State, Step, Turn
from meshrl.envs.episode import advance, start
from meshrl.envs.parsers import HermesParser, PlainParser
from meshrl.envs.render import Renderer
from meshrl.schema import LOGPROBS, LOSS_MASK, PROMPT, RESPONSE, SEGMENTS, TOKEN_VERSIONS


def ids(tok: Any, text: str) -> list[int]:
    return list(tok(text)["input_ids"])


def test_the_next_prompt_is_the_tokens_generated_then_the_reply(tok: Any) -> None:
    chat = Renderer(tok, PlainParser([]), tool_role="user")
    history = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}]
    prompt = chat.prompt(history[:1])
    assert tok.decode(prompt) == "<|user|>1+2=<|assistant|>"
    generated = [*ids(tok, "3"), tok.eos_token_id]
    new = [{"role": "user", "content": "and 4+5="}]
    assert chat.extend(prompt + generated, history, new, None) == [
        *prompt,
        *generated,
        *ids(tok, "<|user|>and 4+5=<|assistant|>"),
    ]
    # a turn cut before its stop token is closed with it (masked: it is not the model's)
    cut = ids(tok, "33")
    assert chat.extend(prompt + cut, history, new, None) == [
        *prompt,
        *cut,
        tok.eos_token_id,
        *ids(tok, "<|user|>and 4+5=<|assistant|>"),
    ]
    # only replies extend a conversation: anything else is rendered whole
    assert chat.extend(prompt + generated, history, [{"role": "assistant", "content": "x"}], None) is None
    assert not chat.rewrites


class Chars:
    """A tokenizer whose ids are characters' code points and whose template writes the roles out (the tiny
    vocabulary has no '<', '{' or '"' to show a Hermes block with)."""

    eos_token_id = 0
    chat_template = "no tool section"

    def apply_chat_template(
        self, messages: list[Message], add_generation_prompt: bool, tokenize: bool
    ) -> Any:
        text = "".join(
            f"[{m['role']}]{m['content']}" + ("\0" if m["role"] == "assistant" else "") for m in messages
        )
        text += "[assistant]" if add_generation_prompt else ""
        return [ord(c) for c in text] if tokenize else text

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(map(chr, ids))


TOOL = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object", "properties": {}}}}


def test_a_template_without_tools_gets_the_format_s_text() -> None:
    text = Chars().decode
    hermes = Renderer(Chars(), HermesParser())
    messages = [
        {"role": "user", "content": "1+2"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "calc", "arguments": '{"x": "1+2"}'}}],
        },
        {"role": "tool", "content": "3"},
    ]
    rendered = text(hermes.prompt(messages, [TOOL]))
    assert (
        rendered.startswith("[system]# Tools")
        and '{"type": "function", "function": {"name": "calc"' in rendered
    )
    assert '[assistant]<tool_call>\n{"name": "calc", "arguments": {"x": "1+2"}}\n</tool_call>\0' in rendered
    assert rendered.endswith("[tool]<tool_response>\n3\n</tool_response>[assistant]")
    plain = text(Renderer(Chars(), PlainParser(["calc"]), tool_role="user").prompt(messages, [TOOL]))
    assert (
        plain == "[user]1+2[assistant]calc(1+2)\0[user]3[assistant]"
    )  # no tool list: the model learned them


def test_a_reasoning_template_is_found_out(tok: Any, thinking: Any) -> None:
    assert Renderer(thinking, PlainParser([])).rewrites
    assert not Renderer(tok, PlainParser([]), tool_role="user").rewrites


class Talk(Environment):
    """A tool result after the first turn, a user's question after the second, done after the third."""

    async def reset(self, row: dict[str, Any]) -> tuple[list[Message], State]:
        return [{"role": "user", "content": "q"}], {"turn": 0}

    async def step(self, state: State, turn: Turn) -> Step:
        state["turn"] += 1
        if state["turn"] == 1:
            return Step([{"role": "tool", "content": "r"}])
        return Step([{"role": "user", "content": "again"}], done=state["turn"] == 3)

    async def reward(self, state: State, final: Turn | None, transcript: list[Message]) -> float:
        return 1.0


def played(tok: Any, keep_reasoning: bool) -> tuple[Any, list[list[int]]]:
    env = Talk()
    env.limits = Limits(max_turns=5, max_tokens=120, max_new_tokens=10)
    chat = Renderer(tok, PlainParser([]), keep_reasoning=keep_reasoning)
    turns = [[*ids(tok, "<think>ab</think>c"), tok.eos_token_id], [*ids(tok, "<think>d</think>e"), tok.eos_token_id],
             [*ids(tok, "f"), tok.eos_token_id]]  # fmt: skip

    async def go() -> Any:
        ep = await start(env, chat, {})
        for k, t in enumerate(turns):
            ep = await advance(env, chat, ep, t, [-0.1 * (k + 1)] * len(t), k)
        return ep

    return asyncio.run(go()), turns


def test_reasoning_dropped_by_the_template_starts_a_segment_where_it_must(thinking: Any) -> None:
    """After the tool result the history is as generated (one sequence); after the user's question the
    template drops the earlier turns' reasoning, so the next prompt is its rendering: a new segment. Every
    model token is trained exactly as generated, with its log-prob and version."""
    ep, turns = played(thinking, keep_reasoning=False)
    t = ep.trajectory
    assert ep.done and ep.reward == 1.0 and t.calls == 3 and t.splits == 1
    sample = t.sample(thinking.eos_token_id)
    first, second = t.segments
    everything = sample[PROMPT] + sample[RESPONSE]
    assert thinking.decode(everything[:first]) == (
        "<|user|>q<|assistant|><think>ab</think>c<eos><|user|>r<|assistant|><think>d</think>e<eos>"
    )
    assert thinking.decode(everything[first:]) == (
        "<|user|>q<|assistant|>c<eos><|user|>r<|assistant|>e<eos><|user|>again<|assistant|>f<eos>"
    )
    response = sample[RESPONSE]
    trained = [tok for tok, m in zip(response, sample[LOSS_MASK], strict=True) if m]
    assert trained == [x for turn in turns for x in turn]
    assert [lp for lp, m in zip(sample[LOGPROBS], sample[LOSS_MASK], strict=True) if m] == pytest.approx(
        [-0.1 * (k + 1) for k, turn in enumerate(turns) for _ in turn]
    )
    assert sorted({v for v, m in zip(sample[TOKEN_VERSIONS], sample[LOSS_MASK], strict=True) if m}) == [
        0,
        1,
        2,
    ]
    assert sample[SEGMENTS] == [first, second] and first + second == len(sample[PROMPT]) + len(response)


def test_keep_reasoning_keeps_the_tokens_as_generated(thinking: Any) -> None:
    ep, turns = played(thinking, keep_reasoning=True)
    t = ep.trajectory
    assert t.splits == 0 and len(t.segments) == 1
    assert thinking.decode(t.ids) == (
        "<|user|>q<|assistant|><think>ab</think>c<eos><|user|>r<|assistant|><think>d</think>e<eos>"
        "<|user|>again<|assistant|>f<eos>"
    )
    assert [x for x, m in zip(t.ids[t.prompt_len :], t.mask, strict=True) if m] == [
        x for turn in turns for x in turn
    ]


def test_an_environment_that_describes_its_tools_itself_gets_no_tool_list() -> None:
    from meshrl.envs import tool

    @tool
    def calc(expression: str) -> int:
        """Add.

        Args:
            expression: a sum
        """
        return 0

    class Described(Environment):
        tools = (calc,)
        tools_in_prompt = False

        async def reset(self, row: dict[str, Any]) -> tuple[list[Message], State]:
            return [{"role": "system", "content": "call calc"}, {"role": "user", "content": "1+2"}], {}

    listed = type("Listed", (Described,), {"tools_in_prompt": True})
    texts = []
    for env in (Described(), listed()):
        env.limits = Limits(max_tokens=4096)
        ep = asyncio.run(start(env, Renderer(Chars(), HermesParser()), {}))
        texts.append(Chars().decode(ep.trajectory.ids))
    assert texts[0] == "[system]call calc[user]1+2[assistant]"
    assert texts[1].startswith("[system]call calc\n\n# Tools") and '"name": "calc"' in texts[1]
