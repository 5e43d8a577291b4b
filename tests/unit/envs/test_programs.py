"""What the process running agent programs changes in the OpenAI SDK: its chat completions' request
transform is left out (meshrl.envs.programs.skip_chat_transform), and the bytes a request sends are
the same as with it, for every kind of chat request a program makes."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
from openai.types.chat import ChatCompletion, ChatCompletionMessage

from meshrl.envs.programs import skip_chat_transform

ANSWER = ChatCompletion.model_validate({
    "id": "c", "object": "chat.completion", "created": 0, "model": "m",
    "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": None,
        "tool_calls": [{"id": "call_0", "type": "function", "function": {"name": "calc", "arguments": '{"x": 1}'}}]}}],
})  # fmt: skip
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "d",
            "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
        },
    }
]
REQUESTS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "hi"}]},
    {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "a"}]}],
     "temperature": 0.5, "top_p": 0.9, "max_tokens": 7, "seed": 3, "stop": ["\n", "x"], "user": "u"},
    {"messages": [{"role": "user", "content": "1+1"}, ANSWER.choices[0].message,  # an answer sent back as it came
                  {"role": "tool", "tool_call_id": "call_0", "content": "2"}], "tools": TOOLS, "tool_choice": "auto"},
    {"messages": [{"role": "user", "content": "x"}], "stream": True, "stream_options": {"include_usage": True}},
    {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}, "metadata": {"k": "v"},
     "logprobs": True, "parallel_tool_calls": False, "extra_body": {"session_id": "s1"}},
    {"messages": [ChatCompletionMessage(role="assistant", content="earlier"), {"role": "user", "content": "go on"}]},
]  # fmt: skip


def sent() -> list[bytes]:
    """The request bodies the SDK sends for REQUESTS."""
    bodies: list[bytes] = []

    def answer(request: httpx.Request) -> httpx.Response:
        bodies.append(request.content)
        if json.loads(request.content).get("stream"):
            return httpx.Response(
                200, content=b"data: [DONE]\n\n", headers={"content-type": "text/event-stream"}
            )
        return httpx.Response(200, json=ANSWER.model_dump())

    client = openai.OpenAI(
        base_url="http://x/v1", api_key="k", http_client=httpx.Client(transport=httpx.MockTransport(answer))
    )
    for r in REQUESTS:
        out = client.chat.completions.create(model="m", **r)
        if r.get("stream"):
            list(out)
    return bodies


def test_requests_send_the_same_bytes_without_the_sdk_transform() -> None:
    before = sent()
    skip_chat_transform()
    after = sent()
    assert len(before) == len(REQUESTS)
    for b, a in zip(before, after, strict=True):
        assert a == b, (json.loads(b), json.loads(a))
