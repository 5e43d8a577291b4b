"""The OpenAI side of the endpoint, without sockets: requests parsed and checked, generated tokens
turned back into answers (rendering messages to tokens: meshrl/roles/endpoint/templates.py).

Two request shapes arrive. `/v1/chat/completions` (OpenAI's): messages and tools, rendered with the
model's chat template; the answer's text is parsed for tool calls with the run's parser.
`/inference/v1/generate` (vLLM's token-in/token-out route, which verifiers' training client renders for
itself): token ids in, token ids and log-probs out.

Every problem with a request is an `ApiError`: an HTTP status and an OpenAI-style error body.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from meshrl.envs.parsers import Parser

CHAT_FIELDS = {
    "model", "messages", "tools", "tool_choice", "temperature", "top_p", "max_tokens",
    "max_completion_tokens", "stop", "seed", "n", "stream", "stream_options", "logprobs", "top_logprobs",
    "user", "parallel_tool_calls", "session_id", "metadata", "store",
}  # fmt: skip
"""Fields of a chat request the endpoint reads; any other is refused by name (not silently ignored)."""
GENERATE_FIELDS = {
    "model",
    "token_ids",
    "sampling_params",
    "cache_salt",
    "priority",
    "request_id",
    "session_id",
}
SAMPLING_FIELDS = {
    "temperature", "top_p", "max_tokens", "seed", "stop", "stop_token_ids", "logprobs",
    "skip_special_tokens", "n", "top_k", "min_tokens", "repetition_penalty", "include_stop_str_in_output",
    "routed_experts_prompt_start",  # verifiers' client, continuing a turn: nothing to route here
}  # fmt: skip


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, *, param: str | None = None, kind: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or {401: "authentication_error", 404: "not_found_error"}.get(
            status, "invalid_request_error"
        )

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


@dataclass
class Call:
    """One model call, parsed: what to render or the ids themselves, and how to sample."""

    model: str
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    token_ids: list[int] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    """temperature, top_p, max_tokens, seed: as asked (the run's settings fill what is missing)."""
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    tool_choice: str = "auto"
    stream: bool = False
    usage_in_stream: bool = False
    logprobs: bool = False
    session: str | None = None


def _number(body: dict[str, Any], name: str, low: float, high: float) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or not low <= v <= high:
        raise ApiError(400, f"{name} must be a number in [{low:g}, {high:g}], got {v!r}", param=name)
    return float(v)


def _count(body: dict[str, Any], name: str) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ApiError(400, f"{name} must be an integer >= 1, got {v!r}", param=name)
    return v


def _unknown(body: dict[str, Any], known: set[str], where: str) -> None:
    extra = sorted(set(body) - known)
    if extra:
        raise ApiError(400, f"unsupported field(s) in {where}: {', '.join(extra)}", param=extra[0])


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, high in (("temperature", 2.0), ("top_p", 1.0)):
        v = _number(body, name, 0.0, high)
        if v is not None:
            out[name] = v
    if (t := _count(body, "max_tokens")) is not None:
        out["max_tokens"] = t
    seed = body.get("seed")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ApiError(400, f"seed must be an integer, got {seed!r}", param="seed")
        out["seed"] = seed
    if body.get("n", 1) != 1:
        raise ApiError(
            400, "n must be 1 (ask again for more completions: each call is one sample)", param="n"
        )
    return out


def parse_chat(body: Any) -> Call:
    """A `/v1/chat/completions` body, checked."""
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    _unknown(body, CHAT_FIELDS, "a chat completion request")
    model = body.get("model")
    if not isinstance(model, str):
        raise ApiError(400, "model is required (a string)", param="model")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", param="messages")
    clean = [_message(m, i) for i, m in enumerate(messages)]
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(
            isinstance(t, dict)
            and t.get("type") == "function"
            and isinstance(t.get("function", {}).get("name"), str)
            for t in tools
        ):
            raise ApiError(
                400, 'tools must be a list of {"type": "function", "function": {"name": ...}}', param="tools"
            )
        tools = tools or None
    choice = body.get("tool_choice", "auto")
    if choice not in ("auto", "none"):
        raise ApiError(
            400, f"tool_choice {choice!r} is not supported (use 'auto' or 'none')", param="tool_choice"
        )
    body = dict(body)
    if body.get("max_completion_tokens") is not None:
        body["max_tokens"] = body["max_completion_tokens"]
    if body.get("top_logprobs"):
        raise ApiError(
            400, "top_logprobs is not supported (logprobs=true gives each token's own)", param="top_logprobs"
        )
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
        raise ApiError(400, "stop must be a string or a list of up to 4 non-empty strings", param="stop")
    options = body.get("stream_options") or {}
    session = body.get("session_id", body.get("user"))
    return Call(
        model=model, messages=clean, tools=tools, sampling=_sampling(body), stop=stop,
        tool_choice=choice, stream=bool(body.get("stream")), usage_in_stream=bool(options.get("include_usage")),
        logprobs=bool(body.get("logprobs")), session=session if isinstance(session, str) else None,
    )  # fmt: skip


def parse_generate(body: Any, vocab: int) -> Call:
    """A `/inference/v1/generate` body (token ids in), checked."""
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    _unknown(body, GENERATE_FIELDS, "a generate request")
    model = body.get("model")
    if not isinstance(model, str):
        raise ApiError(400, "model is required (a string)", param="model")
    ids = body.get("token_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
        raise ApiError(
            400, f"token_ids must be a non-empty list of token ids below {vocab}", param="token_ids"
        )
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise ApiError(400, "sampling_params must be an object", param="sampling_params")
    _unknown(params, SAMPLING_FIELDS, "sampling_params")
    stop = params.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    stop_ids = params.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) for t in stop_ids):
        raise ApiError(400, "stop_token_ids must be a list of token ids", param="stop_token_ids")
    session = body.get("session_id")
    return Call(
        model=model, token_ids=ids, sampling=_sampling(params), stop=list(stop), stop_token_ids=stop_ids,
        logprobs=True, session=session if isinstance(session, str) else None,
    )  # fmt: skip


def normalized(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message as the endpoint answered it, the way it will compare with the same message
    sent back in a later call's history."""
    return _message(message, 0)


def _message(m: Any, i: int) -> dict[str, Any]:
    """A message as the template gets it: text content, tool calls with their arguments as objects."""
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
        raise ApiError(
            400, f"{where} must be an object whose role is system, user, assistant or tool", param=where
        )
    content = m.get("content")
    if isinstance(content, list):  # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            raise ApiError(400, f"{where}: only text content parts are supported", param=where)
        content = "".join(str(p.get("text", "")) for p in content)
    if content is not None and not isinstance(content, str):
        raise ApiError(400, f"{where}.content must be a string or a list of text parts", param=where)
    out: dict[str, Any] = {
        "role": "system" if m["role"] == "developer" else m["role"],
        "content": content or "",
    }
    calls = m.get("tool_calls")
    if calls:
        if m["role"] != "assistant" or not isinstance(calls, list):
            raise ApiError(400, f"{where}: only assistant messages carry tool_calls (a list)", param=where)
        out["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{k}]") for k, c in enumerate(calls)]
    if m["role"] == "tool" and isinstance(m.get("name"), str):
        out["name"] = m["name"]
    return out


def _tool_call(c: Any, where: str) -> dict[str, Any]:
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ApiError(
            400, f"{where} must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}", param=where
        )
    args = fn.get("arguments") or {}
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            raise ApiError(400, f"{where}.function.arguments is not JSON", param=where) from None
    return {"type": "function", "function": {"name": fn["name"], "arguments": args}}


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
    waited_s: float = 0.0
    """From writing the call's row to having its answer: what a service writing the row itself would
    wait too (the rest of a call's time is the endpoint's own: HTTP, rendering, parsing)."""


def cut(
    tokenizer: Any,
    call: Call,
    stop_id: int,
    max_tokens: int,
    ids: list[int],
    logprobs: list[float],
    version: tuple[int, int],
) -> Generated:
    """Inference's tokens, up to the first stop (the tokens that complete it are kept: they were
    generated and are trained; the text after it is not shown)."""
    finish = "stop" if ids and ids[-1] == stop_id else "length" if len(ids) >= max_tokens else "stop"
    for k, t in enumerate(ids):
        if t in call.stop_token_ids:
            return Generated(ids[: k + 1], logprobs[: k + 1], version, "stop")
    if call.stop:
        text = tokenizer.decode(ids, skip_special_tokens=False)
        hits = [text.find(s) + len(s) for s in call.stop if s in text]
        if hits:
            end = min(hits)
            k = next(
                k
                for k in range(1, len(ids) + 1)
                if len(tokenizer.decode(ids[:k], skip_special_tokens=False)) >= end
            )
            return Generated(ids[:k], logprobs[:k], version, "stop")
    return Generated(ids, logprobs, version, finish)


def assistant_message(
    tokenizer: Any, call: Call, parser: Parser | None, out: Generated, stop_id: int
) -> dict[str, Any]:
    """The answer as an OpenAI assistant message: text (up to a stop string), and the tool calls parsed
    from it (unless tool_choice is "none" or no tools were offered)."""
    ids = out.ids[:-1] if out.ids and out.ids[-1] == stop_id else out.ids
    text = str(tokenizer.decode(ids, skip_special_tokens=False))
    for s in call.stop:
        if s in text:
            text = text[: text.find(s)]
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if parser is None or not call.tools or call.tool_choice == "none":
        return message
    calls = [c for c in parser.parse(text) if c.error is None]
    if calls:
        for c in calls:
            text = text.replace(c.raw, "")
        message["content"] = text.strip() or None
        message["tool_calls"] = [
            {
                "id": f"call_{k}",
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
            }
            for k, c in enumerate(calls)
        ]
    return message


def chat_completion(
    call: Call,
    message: dict[str, Any],
    out: Generated,
    prompt: Sequence[int],
    extra: dict[str, Any],
    tokenizer: Any,
) -> dict[str, Any]:
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


def chat_chunks(
    call: Call, message: dict[str, Any], out: Generated, prompt: Sequence[int], extra: dict[str, Any]
) -> list[dict[str, Any]]:
    """The answer as server-sent chunks: the role, the text, the tool calls, the finish (the last
    carrying the token ids, log-probs and weight version; then the usage when asked for)."""
    base = {
        "id": f"chatcmpl-{extra['call']}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": call.model,
    }

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


def generate_response(
    call: Call, out: Generated, prompt: Sequence[int], extra: dict[str, Any]
) -> dict[str, Any]:
    """vLLM's token-in/token-out answer, as verifiers' training client reads it."""
    return {
        "request_id": f"gen-{extra['call']}", "prompt_token_ids": list(prompt),
        "choices": [{
            "index": 0, "token_ids": out.ids, "finish_reason": out.finish,
            "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": lp} for t, lp in zip(out.ids, out.logprobs, strict=True)]},
        }],
        "usage": _usage(prompt, out), "meshrl": extra,
    }  # fmt: skip


def _usage(prompt: Sequence[int], out: Generated) -> dict[str, int]:
    return {
        "prompt_tokens": len(prompt),
        "completion_tokens": len(out.ids),
        "total_tokens": len(prompt) + len(out.ids),
    }
