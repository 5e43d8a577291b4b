"""The endpoint without sockets: requests checked (every problem an OpenAI-style 4xx), messages rendered
so a session's calls join, answers cut at stop strings and parsed for tool calls."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshrl.envs.parsers import build_parser
from meshrl.models.tiny import build_tokenizer
from meshrl.roles.endpoint import chat
from meshrl.roles.endpoint.chat import ApiError, Generated
from meshrl.roles.endpoint.templates import Templates, Turn

TOOL = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}
TOOLS_TEMPLATE = (  # a template that renders tools itself (as Qwen's and SmolLM3's do)
    "{% if tools %}tools:{% for t in tools %}{{ t['function']['name'] }},{% endfor %} {% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}"
    "{% elif m['role'] == 'tool' %}<|user|>r:{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}c:{{ c['function']['name'] }}{% endfor %}<eos>"
    "{% else %}{{ m['content'] }} {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


class Chars:
    """A tokenizer whose ids are characters' code points (the tiny vocabulary has no '<', '{' or '"')."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(map(chr, ids))


def error_of(fn, *args) -> ApiError:
    with pytest.raises(ApiError) as e:
        fn(*args)
    assert 400 <= e.value.status < 500
    body = e.value.body()["error"]
    assert body["message"] and body["type"]
    return e.value


def test_a_chat_request_is_parsed() -> None:
    call = chat.parse_chat({
        "model": "policy", "messages": [{"role": "user", "content": [{"type": "text", "text": "1+2="}]}],
        "tools": [TOOL], "temperature": 0.5, "max_completion_tokens": 7, "seed": 3, "stop": "\n",
        "stream": True, "stream_options": {"include_usage": True}, "session_id": "s1",
    })  # fmt: skip
    assert call.messages == [{"role": "user", "content": "1+2="}]
    assert call.sampling == {"temperature": 0.5, "max_tokens": 7, "seed": 3}
    assert call.stop == ["\n"] and call.stream and call.usage_in_stream and call.session == "s1"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ([], None),
        ({"messages": [{"role": "user", "content": "x"}]}, "model"),
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "messages[0]"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 9}, "temperature"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web"}]}, "tools"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "frequency_penalty": 1}, "frequency_penalty"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 5}, "stop"),
    ],
)  # fmt: skip
def test_bad_chat_requests_are_4xx_naming_the_field(body, param) -> None:
    assert error_of(chat.parse_chat, body).param == param


def test_generate_requests() -> None:
    call = chat.parse_generate(
        {"model": "m", "token_ids": [1, 2], "sampling_params": {"max_tokens": 3, "stop_token_ids": [5]}}, 10
    )
    assert call.token_ids == [1, 2] and call.sampling == {"max_tokens": 3} and call.stop_token_ids == [5]
    assert error_of(chat.parse_generate, {"model": "m", "token_ids": [1, 99]}, 10).param == "token_ids"
    assert error_of(chat.parse_generate, {"model": "m", "token_ids": [1], "sampling_params": {"beam": 2}}, 10)


def test_a_session_that_sends_back_its_history_joins_the_tokens_generated(tok) -> None:
    t = Templates(tok, tool_role="user")
    first = [{"role": "user", "content": "1+2="}]
    prompt = t.prompt(first, None)
    generated = tok("3", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    reply = {"role": "assistant", "content": "3"}
    last = Turn(first, None, prompt + generated, reply)
    nxt = [*first, reply, {"role": "user", "content": "2+2="}]
    ids = t.bridge(last, nxt, None)
    assert ids is not None and ids[: len(last.ids)] == last.ids
    assert ids == t.prompt(nxt, None)  # here the template renders the same; the tokens generated are kept
    edited = [*first, {"role": "assistant", "content": "4"}, {"role": "user", "content": "2+2="}]
    assert t.bridge(last, edited, None) is None  # the agent changed the answer: rendered afresh
    assert t.bridge(last, [{"role": "user", "content": "2+2="}], None) is None  # truncated history


def test_tools_go_to_the_template_or_into_the_system_prompt(tok) -> None:
    plain = Templates(tok, tool_role="user")
    assert not plain.renders_tools
    text = tok.decode(plain.prompt([{"role": "user", "content": "x"}], [TOOL]))
    # the Hermes block, in a system message (the tiny vocabulary spells only lower case and digits)
    assert "may call one or more functions" in text and "calc" in text
    tok2 = build_tokenizer()
    tok2.chat_template = TOOLS_TEMPLATE
    own = Templates(tok2)
    assert own.renders_tools
    text = tok2.decode(own.prompt([{"role": "user", "content": "x"}], [TOOL]))
    assert text.startswith("tools:calc,") and "may call" not in text


def test_answers_are_cut_at_stop_strings_and_parsed_for_tool_calls(tok) -> None:
    ids = tok("ab:cd", add_special_tokens=False)["input_ids"]
    call = chat.parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": [":"]})
    out = chat.cut(tok, call, tok.eos_token_id, 16, ids, [-1.0] * len(ids), (0, 0))
    assert tok.decode(out.ids) == "ab:" and out.finish == "stop" and len(out.logprobs) == 3
    full = chat.cut(tok, call, tok.eos_token_id, len(ids), ids[:2], [-1.0, -1.0], (0, 0))
    assert full.finish == "stop"  # ended before the limit
    call = chat.parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [TOOL]})
    text = 'sure <tool_call>{"name": "calc", "arguments": {"x": 1}}</tool_call>'
    out = Generated([ord(c) for c in text], [0.0] * len(text), (1, 1), "stop")
    message = chat.assistant_message(Chars(), call, build_parser("hermes", ["calc"]), out, 0)
    assert message["content"] == "sure"
    assert message["tool_calls"][0]["function"] == {"name": "calc", "arguments": json.dumps({"x": 1})}
    body = chat.chat_completion(call, message, out, [1, 2], {"call": "c0"}, Chars())
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert body["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": len(out.ids),
        "total_tokens": 2 + len(out.ids),
    }


def test_agent_recipes_that_cannot_work_fail_at_start_up(tiny_model) -> None:
    from meshrl.planning import prepare
    from meshrl.planning.config import RecipeError

    recipe = str(Path(__file__).resolve().parents[2] / "recipes" / "agent_program.py")
    prepare(recipe, [f"*.model={tiny_model}"])  # plans as shipped
    with pytest.raises(RecipeError) as e:
        prepare(recipe, [f"*.model={tiny_model}", "inference.max_new_tokens=200", "agents.program=nope",
                         'agents.program_args={"turns": 2, "colour": "red"}', "rollout.rewards={}"])  # fmt: skip
    text = str(e.value)
    assert "leaves no room for a prompt beside a full answer of 200 tokens" in text  # 128 positions
    assert "must look like 'package.module:function'" in text
    with pytest.raises(RecipeError, match="cannot take"):
        prepare(recipe, [f"*.model={tiny_model}", 'agents.program_args={"colour": "red"}'])
