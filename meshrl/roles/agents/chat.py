"""The OpenAI side of the endpoint, without sockets: request bodies decoded into typed structs (msgspec:
a wrong type, a value out of range or an unknown field is refused naming its path), and generated
tokens turned back into answers (rendering messages to tokens: meshrl/envs/render.py).

Two request shapes arrive. `/v1/chat/completions` (OpenAI's): messages and tools, rendered with the
model's chat template; the answer's text is parsed for tool calls in the run's format.
`/inference/v1/generate` (vLLM's token-in/token-out route, which verifiers' training client renders for
itself): token ids in, token ids and log-probs out.

Every problem with a request is an `ApiError`: an HTTP status and an OpenAI-style error body.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec

from meshrl.envs.parsers import Parser, arguments

Unit = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
Count = Annotated[int, msgspec.Meta(ge=1)]


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, *, param: str | None = None, kind: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        errors = {401: "authentication_error", 404: "not_found_error"}
        self.kind = kind or errors.get(status, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


class Struct(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A request part: every field it has is read; any other is refused by name, not ignored."""


class Function(Struct, forbid_unknown_fields=False):
    name: str
    arguments: str | dict[str, Any] | None = None


class ToolCall(Struct, forbid_unknown_fields=False):
    function: Function
    id: str | None = None
    type: Literal["function"] = "function"


class TextPart(Struct, tag="text"):
    text: str


class ImageUrl(Struct):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(Struct, tag="image_url"):
    """A picture (a vision-language model's): a data URL (`data:image/png;base64,...`)."""

    image_url: ImageUrl


class Message(Struct, forbid_unknown_fields=False):
    """A message as sent; fields OpenAI's messages may carry that do not change the tokens (refusal,
    annotations, audio of an answer sent back) are ignored."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | ImagePart] | None = None
    tool_calls: list[ToolCall] | None = None
    name: str | None = None
    tool_call_id: str | None = None


class StreamOptions(Struct):
    include_usage: bool = False


class ChatRequest(Struct):
    model: str
    messages: Annotated[list[Message], msgspec.Meta(min_length=1)]
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none"] = "auto"
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] | None = None
    top_p: Unit | None = None
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    stop: (
        str | Annotated[list[Annotated[str, msgspec.Meta(min_length=1)]], msgspec.Meta(max_length=4)] | None
    ) = None
    seed: int | None = None
    n: Literal[1] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: Literal[0] | None = None
    user: str | None = None
    parallel_tool_calls: bool | None = None
    session_id: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None


class SamplingIn(Struct):
    """vLLM's sampling parameters, those this route honours (and three that change nothing here: it
    returns each token's log-prob and no text, and routes no experts)."""

    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] | None = None
    top_p: Unit | None = None
    max_tokens: Count | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: Literal[1] = 1
    logprobs: int | None = None
    skip_special_tokens: bool | None = None
    routed_experts_prompt_start: int | None = None


class GenerateRequest(Struct):
    model: str
    token_ids: Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(min_length=1)]
    sampling_params: SamplingIn = msgspec.field(default_factory=SamplingIn)
    cache_salt: str | None = None
    priority: int | None = None
    request_id: str | None = None
    session_id: str | None = None


HINTS = {"n": "n must be 1 (ask again for more completions: each call is one sample)",
         "tool_choice": "tool_choice must be 'auto' or 'none'",
         "top_logprobs": "top_logprobs is not supported (logprobs=true gives each token's own)"}  # fmt: skip


def decode(body: bytes, kind: type[Any]) -> Any:
    """`body` as a `kind` request, or an ApiError naming what is wrong and where."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        text = str(e)
        at = re.search(r"at `\$\.?([^`]*)`", text)
        param = at.group(1) if at else None
        unknown = re.search(r"unknown field `([^`]*)`", text)
        if unknown:
            param = f"{param}.{unknown.group(1)}" if param else unknown.group(1)
            text = f"unsupported field {param!r} (not silently ignored)"
        raise ApiError(400, HINTS.get(param or "", text), param=param) from None
    except msgspec.DecodeError as e:
        raise ApiError(400, f"the body is not JSON: {e}") from None


@dataclass
class Call:
    """One model call, checked: the messages to render (or the ids themselves), and how to sample."""

    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    token_ids: list[int] | None
    sampling: dict[str, Any]
    """temperature, top_p, max_tokens, seed, as asked (the run's settings fill the rest)."""
    stop: list[str]
    stop_token_ids: list[int]
    session: str | None
    tool_choice: str = "auto"
    stream: bool = False
    usage_in_stream: bool = False
    logprobs: bool = False


def chat_call(body: bytes) -> Call:
    r = decode(body, ChatRequest)
    if r.tools and not all(t.get("type") == "function" and isinstance((t.get("function") or {}).get("name"), str)
                           for t in r.tools):  # fmt: skip
        raise ApiError(
            400, 'tools must be a list of {"type": "function", "function": {"name": ...}}', param="tools"
        )
    usage = bool(r.stream_options and r.stream_options.include_usage)
    return Call(r.model, [normalized(msgspec.to_builtins(m)) for m in r.messages], r.tools or None, None,
                _sampling(r.temperature, r.top_p, r.max_completion_tokens or r.max_tokens, r.seed), _stops(r.stop), [],
                r.session_id or r.user, r.tool_choice, r.stream, usage, r.logprobs)  # fmt: skip


def generate_call(body: bytes, vocab: int) -> Call:
    r = decode(body, GenerateRequest)
    if max(r.token_ids) >= vocab:
        raise ApiError(400, f"token_ids must be token ids below {vocab}", param="token_ids")
    p = r.sampling_params
    return Call(r.model, [], None, r.token_ids, _sampling(p.temperature, p.top_p, p.max_tokens, p.seed),
                _stops(p.stop), list(p.stop_token_ids or []), r.session_id, logprobs=True)  # fmt: skip


def _sampling(
    temperature: float | None, top_p: float | None, max_tokens: int | None, seed: int | None
) -> dict[str, Any]:
    asked = {"temperature": temperature, "top_p": top_p, "max_tokens": max_tokens, "seed": seed}
    return {k: v for k, v in asked.items() if v is not None}  # fmt: skip


def _stops(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


def normalized(m: dict[str, Any]) -> dict[str, Any]:
    """A message as the template gets it and as a later call's history is compared with it: text content
    (parts, when it holds pictures: `image_url` parts, then its text), tool calls with their arguments as
    objects, "developer" as "system"."""
    content = m.get("content")
    if isinstance(content, list):
        text = "".join(p["text"] for p in content if p["type"] == "text")
        pictures = [{"type": "image_url", "image_url": {"url": p["image_url"]["url"]}}
                    for p in content if p["type"] == "image_url"]  # fmt: skip
        content = [*pictures, {"type": "text", "text": text}] if pictures else text
    out: dict[str, Any] = {
        "role": "system" if m["role"] == "developer" else m["role"],
        "content": content or "",
    }
    if m.get("tool_calls"):
        if m["role"] != "assistant":
            raise ApiError(400, "only assistant messages carry tool_calls", param="messages")
        try:
            calls = [
                (c["function"]["name"], arguments(c["function"].get("arguments"))) for c in m["tool_calls"]
            ]
        except ValueError as e:
            raise ApiError(400, f"a tool call's arguments are not JSON: {e}", param="messages") from None
        out["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]
    if m["role"] == "tool" and m.get("name"):
        out["name"] = m["name"]
    return out  # fmt: skip


# ------------------------------------------------------------------------------------------------------
# answers


@dataclass
class Generated:
    """What inference wrote for a call, cut at the caller's stop strings or ids."""

    ids: list[int]
    logprobs: list[float]
    version: tuple[int, int]
    finish: str
    """"stop" or "length" (the answer's tool calls make it "tool_calls")."""
    gen_s: float = 0.0
    """Seconds of the inference batch that generated it."""
    gen_batch: int = 0
    """That batch's id."""
    waited_s: float = 0.0
    """From writing the call's row to having its answer: what a service writing the row itself would
    wait too (the rest of a call's time is the endpoint's own: HTTP, rendering, parsing)."""


def cut(tokenizer: Any, call: Call, stop_id: int, out: Generated, max_tokens: int) -> Generated:
    """Inference's tokens up to the first stop (the tokens that complete it are kept: they were generated
    and are trained; the text after it is not shown)."""
    ids = out.ids
    out.finish = "stop" if ids and ids[-1] == stop_id else "length" if len(ids) >= max_tokens else "stop"
    for k, t in enumerate(ids):
        if t in call.stop_token_ids:
            return _first(out, k + 1)
    if call.stop:
        text = tokenizer.decode(ids, skip_special_tokens=False)
        hits = [text.find(s) + len(s) for s in call.stop if s in text]
        if hits:
            end = min(hits)
            return _first(out, next(k for k in range(1, len(ids) + 1)
                                    if len(tokenizer.decode(ids[:k], skip_special_tokens=False)) >= end))  # fmt: skip
    return out


def _first(out: Generated, k: int) -> Generated:
    out.ids, out.logprobs, out.finish = out.ids[:k], out.logprobs[:k], "stop"
    return out


def assistant_message(text: str, call: Call, parser: Parser) -> tuple[dict[str, Any], int, int]:
    """The answer as an OpenAI assistant message (text up to a stop string, tool calls parsed from it
    unless tool_choice is "none" or no tools were offered); the calls parsed and the malformed ones."""
    for s in call.stop:
        if s in text:
            text = text[: text.find(s)]
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if not call.tools or call.tool_choice == "none":
        return message, 0, 0
    parsed = parser.parse(text)
    calls = [c for c in parsed if c.error is None]
    if calls:
        for c in calls:
            text = text.replace(c.raw, "")
        message["content"] = text.strip() or None
        message["tool_calls"] = [{"id": f"call_{k}", "type": "function", "function": {
            "name": c.name, "arguments": json.dumps(c.arguments)}} for k, c in enumerate(calls)]  # fmt: skip
    return message, len(parsed), len(parsed) - len(calls)


def chat_completion(call: Call, message: dict[str, Any], out: Generated, prompt: Sequence[int],
                    extra: dict[str, Any], tokenizer: Any) -> dict[str, Any]:  # fmt: skip
    finish = "tool_calls" if message.get("tool_calls") else out.finish
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish, "token_ids": out.ids}
    if call.logprobs:
        choice["logprobs"] = {"content": [
            {"token": tokenizer.decode([t]), "logprob": lp, "bytes": None, "top_logprobs": []}
            for t, lp in zip(out.ids, out.logprobs, strict=True)
        ]}  # fmt: skip
    return {
        "id": f"chatcmpl-{extra['call']}", "object": "chat.completion", "created": int(time.time()),
        "model": call.model, "choices": [choice], "usage": _usage(prompt, out),
        "prompt_token_ids": list(prompt), "meshrl": extra,
    }  # fmt: skip


def chat_chunks(call: Call, message: dict[str, Any], out: Generated, prompt: Sequence[int],
                extra: dict[str, Any]) -> list[dict[str, Any]]:  # fmt: skip
    """The answer as server-sent chunks: the role, the text, the tool calls, the finish (the last
    carrying the token ids, log-probs and weight version; then the usage when asked for)."""
    base = {"id": f"chatcmpl-{extra['call']}", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": call.model}  # fmt: skip

    def chunk(delta: dict[str, Any], finish: str | None = None, **more: Any) -> dict[str, Any]:
        return {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **more}

    chunks = [chunk({"role": "assistant", "content": ""})]
    if message.get("content"):
        chunks.append(chunk({"content": message["content"]}))
    for k, c in enumerate(message.get("tool_calls") or []):
        chunks.append(chunk({"tool_calls": [{"index": k, **c}]}))
    finish = "tool_calls" if message.get("tool_calls") else out.finish
    chunks.append(chunk({}, finish, prompt_token_ids=list(prompt), token_ids=out.ids, meshrl=extra))
    if call.usage_in_stream:
        chunks.append({**base, "choices": [], "usage": _usage(prompt, out)})
    return chunks


def generate_response(out: Generated, prompt: Sequence[int], extra: dict[str, Any]) -> dict[str, Any]:
    """vLLM's token-in/token-out answer, as verifiers' training client reads it."""
    logprobs = [
        {"token": f"token_id:{t}", "logprob": lp} for t, lp in zip(out.ids, out.logprobs, strict=True)
    ]
    return {
        "request_id": f"gen-{extra['call']}", "prompt_token_ids": list(prompt),
        "choices": [{"index": 0, "token_ids": out.ids, "finish_reason": out.finish, "logprobs": {"content": logprobs}}],
        "usage": _usage(prompt, out), "meshrl": extra,
    }  # fmt: skip


def _usage(prompt: Sequence[int], out: Generated) -> dict[str, int]:
    n, m = len(prompt), len(out.ids)
    return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}
