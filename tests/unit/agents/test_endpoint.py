"""The endpoint without a run: the `openai` client against the routes served in-process, over a model
that answers from a script (the edge the data plane and inference stand behind in a run). Requests are
checked (every problem an OpenAI-style 4xx naming its field), a session's calls join when the program
sends back its history and split where it did not or the chat template drops earlier reasoning, and
answers are cut at stop strings and parsed for tool calls."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from meshrl.envs.parsers import HermesParser, PlainParser
from meshrl.envs.render import Renderer
from meshrl.envs.trajectory import join
from meshrl.roles.agents import chat
from meshrl.roles.agents.chat import ApiError, Generated
from meshrl.roles.agents.endpoint import Endpoint, Session


class Scripted:
    """A model that answers each call with the next text of a script (its ids, then EOS)."""

    def __init__(self, tok: Any, answers: list[str], wait_s: float = 0.0) -> None:
        self.tok, self.answers, self.wait_s = tok, iter(answers), wait_s
        self.prompts: list[list[int]] = []

    async def complete(
        self, ids: list[int], sampling: dict[str, Any], session: Session, images: list[str]
    ) -> Generated:
        self.prompts.append(ids)
        await asyncio.sleep(self.wait_s)
        out = [*self.tok(next(self.answers), add_special_tokens=False)["input_ids"], self.tok.eos_token_id]
        out = out[: sampling["max_tokens"]]
        return Generated(out, [-0.5] * len(out), (3, 3), "", gen_s=0.01, gen_batch=7)


def served(tok: Any, answers: list[str], *, parser: Any = None, keep_reasoning: bool = False,
           wait_s: float = 0.0, budget: int = 128, max_new: int = 16) -> tuple[Endpoint, Scripted]:  # fmt: skip
    """The endpoint over a scripted model; tool results as user turns unless the template knows the role."""
    model = Scripted(tok, answers, wait_s)
    role = "tool" if "'tool'" in str(tok.chat_template) else "user"
    renderer = Renderer(tok, parser or PlainParser([]), tool_role=role, keep_reasoning=keep_reasoning)
    return Endpoint(
        renderer, model, names=("policy",), budget=budget, max_new=max_new, call_timeout_s=5.0
    ), model


def client(endpoint: Endpoint, session: str = "s") -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=endpoint.app()))
    return openai.AsyncOpenAI(
        base_url=f"http://test/s/{session}/v1", api_key="k", http_client=http, max_retries=0
    )


def run(coroutine: Any) -> Any:
    return asyncio.run(coroutine)


def test_a_session_that_sends_back_its_history_joins_the_tokens_generated(tok: Any) -> None:
    endpoint, model = served(tok, ["3", "4", "5"])
    session = endpoint.sessions["s"] = Session("s")

    async def program() -> None:
        c = client(endpoint)
        messages = [{"role": "user", "content": "1+2="}]
        a = await c.chat.completions.create(model="policy", messages=messages)
        messages += [
            {"role": "assistant", "content": a.choices[0].message.content},
            {"role": "user", "content": "2+2="},
        ]
        b = await c.chat.completions.create(model="policy", messages=messages)
        assert (
            b.model_extra["prompt_token_ids"][: len(model.prompts[0]) + 2]
            == model.prompts[0] + a.choices[0].model_extra["token_ids"]
        )
        messages[1] = {"role": "assistant", "content": "three"}  # an edited history: rendered whole
        await c.chat.completions.create(model="policy", messages=messages)

    run(program())
    assert [tok.decode(p) for p in model.prompts] == [
        "<|user|>1+2=<|assistant|>",
        "<|user|>1+2=<|assistant|>3<eos><|user|>2+2=<|assistant|>",
        "<|user|>1+2=<|assistant|>three<eos><|user|>2+2=<|assistant|>",
    ]
    assert endpoint.counts["joined"] == 1 and endpoint.counts["rendered"] == 2
    t = join(session.calls)
    assert t.calls == 3 and t.splits == 1 and len(t.segments) == 2
    assert session.gen_s == pytest.approx(0.03) and session.gen_batch == 7


@pytest.mark.parametrize(("keep", "splits"), [(False, 1), (True, 0)], ids=["template", "keep_reasoning"])
def test_reasoning_dropped_by_the_template_splits_a_program_s_session_where_it_must(
    thinking: Any, keep: bool, splits: int
) -> None:
    """The answers think; sent back after a tool result the history is as generated (joined), after the
    user's next question the template drops the reasoning: that call starts a segment; with
    keep_reasoning it joins. Every answer is recorded exactly as generated."""
    endpoint, model = served(thinking, ["<think>ab</think>c", "<think>d</think>e", "f"], keep_reasoning=keep)
    session = endpoint.sessions["s"] = Session("s")
    replies = [{"role": "tool", "content": "r", "tool_call_id": "1"}, {"role": "user", "content": "again"}]

    async def program() -> None:
        c = client(endpoint)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "q"}]
        for k in range(3):
            a = await c.chat.completions.create(model="policy", messages=messages)
            if k < 2:
                messages += [{"role": "assistant", "content": a.choices[0].message.content}, replies[k]]

    run(program())
    t = join(session.calls)
    assert (t.calls, t.splits) == (3, splits)
    assert [thinking.decode(c.completion) for c in session.calls] == [
        "<think>ab</think>c<eos>", "<think>d</think>e<eos>", "f<eos>"
    ]  # fmt: skip
    last = thinking.decode(model.prompts[-1])
    assert ("<think>" in last) == keep, last  # the model sees its earlier reasoning only when it is kept


def test_tool_calls_are_parsed_and_counted(tok: Any) -> None:
    class Chars:  # ids are code points: the tiny vocabulary has no braces or angle brackets
        eos_token_id = 0
        chat_template = ""

        def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
            return {"input_ids": [ord(c) for c in text]}

        def apply_chat_template(self, messages: Any, add_generation_prompt: bool, tokenize: bool) -> Any:
            text = "".join(f"[{m['role']}]{m['content']}" for m in messages) + (
                "[assistant]" if add_generation_prompt else ""
            )
            return [ord(c) for c in text] if tokenize else text

        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            return "".join(map(chr, ids))

        def __len__(self) -> int:
            return 0x110000

    call = '<tool_call>{"name": "calc", "arguments": {"x": 1}}</tool_call>'
    endpoint, _ = served(
        Chars(),
        [f"sure {call}", "<tool_call>{oops</tool_call>"],
        parser=HermesParser(),
        budget=4096,
        max_new=100,
    )
    session = endpoint.sessions["s"] = Session("s")
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]

    async def program() -> Any:
        c = client(endpoint)
        a = await c.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "x"}], tools=tools
        )
        b = await c.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "y"}], tools=tools
        )
        return a, b

    a, b = run(program())
    assert a.choices[0].finish_reason == "tool_calls" and a.choices[0].message.content == "sure"
    assert a.choices[0].message.tool_calls[0].function.name == "calc"
    assert json.loads(a.choices[0].message.tool_calls[0].function.arguments) == {"x": 1}
    assert b.choices[0].message.tool_calls is None  # a malformed call is text, and counted
    assert (session.tool_calls, session.malformed) == (2, 1)


def test_answers_are_cut_at_stop_strings(tok: Any) -> None:
    endpoint, _ = served(tok, ["ab:cd", "abc"])

    async def program() -> Any:
        c = client(endpoint)
        a = await c.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "x"}], stop=[":"], logprobs=True
        )
        b = await c.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "x"}], max_tokens=2
        )
        return a, b

    a, b = run(program())
    assert (
        a.choices[0].message.content == "ab"
        and a.choices[0].model_extra["token_ids"] == tok("ab:")["input_ids"]
    )
    assert len(a.choices[0].logprobs.content) == 3 and a.choices[0].finish_reason == "stop"
    assert b.choices[0].finish_reason == "length" and b.usage.completion_tokens == 2


def test_a_program_s_own_time_leaves_out_its_calls_in_flight(tok: Any) -> None:
    endpoint, _ = served(tok, ["1", "2"], wait_s=0.3)
    session = endpoint.sessions["s"] = Session("s")

    async def program() -> float:
        import time

        since = time.monotonic()
        c = client(endpoint)
        await asyncio.gather(
            *(
                c.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
                for _ in range(2)
            )
        )
        await asyncio.sleep(0.1)
        return session.own_s(since)

    assert 0.05 < run(program()) < 0.25  # the 0.3 s the two calls were in flight (together) is not counted


BAD = [
    (b"{not json", None, "not JSON"),
    (b"[]", None, "Expected `object`"),
    (b'{"messages": [{"role": "user", "content": "x"}]}', None, "missing required field `model`"),
    (b'{"model": "policy", "messages": []}', "messages", "length >= 1"),
    (
        b'{"model": "policy", "messages": [{"role": "robot", "content": "x"}]}',
        "messages[0].role",
        "Invalid enum value 'robot'",
    ),
    (b'{"model": "policy", "messages": [{"role": "user", "content": "x"}], "n": 2}', "n", "n must be 1"),
    (
        b'{"model": "policy", "messages": [{"role": "user", "content": "x"}], "temperature": 9}',
        "temperature",
        "<= 2.0",
    ),
    (
        b'{"model": "policy", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}',
        "max_tokens",
        ">= 1",
    ),
    (
        b'{"model": "policy", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}',
        "tool_choice",
        "'auto' or 'none'",
    ),
    (
        b'{"model": "policy", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web"}]}',
        "tools",
        "tools must be a list",
    ),
    (
        b'{"model": "policy", "messages": [{"role": "user", "content": "x"}], "frequency_penalty": 1}',
        "frequency_penalty",
        "unsupported field",
    ),
    (
        b'{"model": "policy", "messages": [{"role": "user", "content": "x"}], "stop": ["a", "b", "c", "d", "e"]}',
        "stop",
        "length <= 4",
    ),
    (
        b'{"model": "policy", "messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}',
        "messages[0].content[0].type",
        "Invalid value",
    ),
]


@pytest.mark.parametrize(("body", "param", "message"), BAD)
def test_bad_chat_requests_are_4xx_naming_the_field(body: bytes, param: str | None, message: str) -> None:
    with pytest.raises(ApiError) as e:
        chat.chat_call(body)
    assert e.value.status == 400 and e.value.param == param and message in e.value.message, e.value.message
    assert e.value.body()["error"]["type"] == "invalid_request_error"


def test_generate_requests(tok: Any) -> None:
    call = chat.generate_call(
        b'{"model": "m", "token_ids": [1, 2], "sampling_params": {"max_tokens": 3, "stop_token_ids": [5]}}',
        10,
    )
    assert call.token_ids == [1, 2] and call.sampling == {"max_tokens": 3} and call.stop_token_ids == [5]
    for body, param in (
        (b'{"model": "m", "token_ids": [1, 99]}', "token_ids"),
        (b'{"model": "m", "token_ids": [1], "sampling_params": {"beam": 2}}', "sampling_params.beam"),
    ):
        with pytest.raises(ApiError) as e:
            chat.generate_call(body, 10)
        assert e.value.param == param


def test_the_sdk_gets_openai_style_errors_and_nothing_is_asked_of_the_model(tok: Any) -> None:
    endpoint, model = served(tok, [])

    async def program() -> Iterator[type[Exception]]:
        c = client(endpoint)
        hi = [{"role": "user", "content": "hi"}]
        for kwargs, error in (({"model": "gpt-4"}, openai.NotFoundError), ({"n": 2}, openai.BadRequestError),
                              ({"messages": [{"role": "user", "content": "1" * 200}]}, openai.BadRequestError)):  # fmt: skip
            with pytest.raises(error):
                await c.chat.completions.create(**{"model": "policy", "messages": hi, **kwargs})
        return iter(())

    run(program())
    assert model.prompts == [] and endpoint.counts["http_404"] == 1 and endpoint.counts["http_400"] == 2
    assert any("at most" in e for e in endpoint.errors)


def test_an_idle_connection_outlives_a_client_s_own_keep_alive(tok: Any) -> None:
    """A client may reuse its idle connection until its own keep-alive ends (httpx: 5 s): the server must
    not close it first. At uvicorn's default (5 s) it did, and a call sent as it closed failed with a
    connection error (19 of 5120 verifiers episodes in a run). One connection, two requests 6 s apart."""
    import socket

    endpoint, _ = served(tok, ["1", "2"])
    body = json.dumps({"model": "policy", "messages": [{"role": "user", "content": "hi"}]}).encode()
    request = (b"POST /s/a/v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
               b"content-length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip

    async def main() -> list[bytes]:
        ready = asyncio.Event()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        serving = asyncio.ensure_future(endpoint.serve("127.0.0.1", port, ready))
        await ready.wait()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            statuses = []
            for pause in (0.0, 6.0):
                await asyncio.sleep(pause)
                writer.write(request)
                await writer.drain()
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
                length = int(
                    next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(
                        b":"
                    )[1]
                )
                await reader.readexactly(length)
                statuses.append(head.split(b"\r\n")[0])
            writer.close()
            return statuses
        finally:
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)

    assert run(main()) == [b"HTTP/1.1 200 OK"] * 2
