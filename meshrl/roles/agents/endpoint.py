"""The endpoint: OpenAI-compatible routes over a model that answers calls, and the sessions of agent
programs (docs/architecture.md, "Programs and verifiers episodes").

    POST /v1/chat/completions        OpenAI's chat API (tools, streaming, stop, seed, ...)
    POST /inference/v1/generate      vLLM's token-in/token-out route (verifiers' training client)
    GET  /v1/models                  the served model, with its max_model_len

also under `/s/<session>/...`, a program's base URL. The model is the agents service's call rows
(programs.py), or `meshrl eval`'s engine. A session's calls join into one token sequence whenever the
program sends back the history it was given (`Renderer.extend`); each call of a session the service
runs is recorded in it, with the tool calls its answer holds and the time it was in flight (the
program's own time is the rest). A call of no such session is answered and forgotten. No line is logged
per request: the counts are (`Endpoint.counts`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from meshrl.envs.render import Renderer
from meshrl.envs.trajectory import Call as Record
from meshrl.models import vision
from meshrl.roles.agents import chat
from meshrl.roles.agents.chat import ApiError, Call, Generated

KEEP_ALIVE_S = 600
"""How long an idle HTTP connection is kept open (see Endpoint.serve)."""


@dataclass
class Session:
    key: str
    min_version: int = 0
    """The oldest weight version its calls may be generated with (the run's pacing)."""
    calls: list[Record] = field(default_factory=list)
    gen_s: float = 0.0
    gen_batch: int = 0
    tool_calls: int = 0
    malformed: int = 0
    last: tuple[list[dict[str, Any]], list[dict[str, Any]] | None, list[int], dict[str, Any]] | None = None
    """The last call's messages, tools, prompt and completion ids, and the answer as it will come back."""
    busy: int = 0
    """Calls in flight; `waited`: seconds with one in flight, up to the last that ended."""
    waited: float = 0.0
    busy_since: float = 0.0

    def own_s(self, since: float) -> float:
        """Seconds since `since` (time.monotonic) with no call of this session in flight."""
        now = time.monotonic()
        return now - since - self.waited - (now - self.busy_since if self.busy else 0.0)

    def record(
        self,
        prompt: list[int],
        out: Generated,
        parsed: int = 0,
        malformed: int = 0,
        images: Sequence[str] = (),
    ) -> None:
        self.calls.append(Record(prompt, out.ids, out.logprobs, out.version[0], tuple(images)))
        self.gen_s, self.gen_batch = self.gen_s + out.gen_s, out.gen_batch
        self.tool_calls, self.malformed = self.tool_calls + parsed, self.malformed + malformed


class Model(Protocol):
    async def complete(
        self, ids: list[int], sampling: dict[str, Any], session: Session, images: list[str]
    ) -> Generated:
        """Inference's answer to the prompt `ids` (holding the pictures `images`, data URLs) sampled as
        asked (temperature, top_p, max_tokens, seed)."""
        ...


class Endpoint:
    def __init__(self, renderer: Renderer, model: Model, *, names: tuple[str, ...], budget: int, max_new: int,
                 call_timeout_s: float, secret: str | None = None) -> None:  # fmt: skip
        """`budget`: the longest sequence (prompt and answer); `max_new`: the longest answer; `secret`:
        required as the bearer token (None: open, on loopback)."""
        self.renderer, self.model, self.names = renderer, model, names
        self.budget, self.max_new, self.call_timeout_s, self.secret = budget, max_new, call_timeout_s, secret
        self.sessions: dict[str, Session] = {}
        """The sessions of the programs the service runs, by key."""
        self.counts: Counter[str] = Counter()
        self.errors: list[str] = []
        """Why requests failed, the first ones since the service last logged them (and emptied this)."""
        self.numbers = itertools.count()

    def app(self) -> Any:
        """The routes as an ASGI app (a bare router: `guard` answers every error, no middleware needed)."""
        from starlette.routing import Route, Router

        handlers = {"/v1/models": (self.models, "GET"), "/v1/chat/completions": (self.chat, "POST"),
                    "/inference/v1/generate": (self.generate, "POST")}  # fmt: skip
        return Router([Route(f"{prefix}{path}", self.guard(fn), methods=[method])
                       for prefix in ("", "/s/{session}") for path, (fn, method) in handlers.items()])  # fmt: skip

    def guard(self, handler: Callable[[Any], Awaitable[Any]]) -> Callable[[Any], Awaitable[Any]]:
        """The handler behind the secret, with every ApiError as an OpenAI error body and any other
        failure as a 500 with its reason (both counted, the first reasons kept for the log)."""
        from starlette.responses import JSONResponse

        async def endpoint(request: Any) -> Any:
            self.counts["requests"] += 1
            try:
                if self.secret and request.headers.get("authorization") != f"Bearer {self.secret}":
                    raise ApiError(401, "a bearer token is required: the run's secret (the SDK's api_key)")
                return await handler(request)
            except Exception as e:  # not an ApiError: a bug of ours
                error = (
                    e
                    if isinstance(e, ApiError)
                    else ApiError(500, f"{type(e).__name__}: {e}", kind="server_error")
                )
                self.counts[f"http_{error.status}"] += 1
                if len(self.errors) < 20:
                    self.errors.append(f"{request.method} {request.url.path}: {error.status} {error.message}")
                return JSONResponse(error.body(), status_code=error.status)

        return endpoint

    async def serve(self, host: str, port: int, ready: asyncio.Event | None = None) -> None:
        """Serve the routes over HTTP until cancelled (uvicorn, without its signal handlers: the process's
        own shut it down; its log quiet: failures are counted here); `ready` is set once it listens. An
        idle connection stays open longer than a client keeps one (httpx: 5 s): at uvicorn's 5 s the
        server closed connections a client was reusing after a pause, and the call failed."""
        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Any:
                yield

        server = Server(uvicorn.Config(self.app(), host=host, port=port, log_level="critical", access_log=False,
                                       lifespan="off", timeout_keep_alive=KEEP_ALIVE_S))  # fmt: skip
        serving = asyncio.ensure_future(server.serve())
        try:
            while ready is not None and not server.started and not serving.done():
                await asyncio.sleep(0.01)
            if ready is not None:
                ready.set()
            await serving
        finally:
            server.should_exit = True
            await asyncio.gather(serving, return_exceptions=True)

    async def models(self, request: Any) -> Any:
        card = {"object": "model", "owned_by": "meshrl", "max_model_len": self.budget}
        return _json({"object": "list", "data": [{"id": n, **card} for n in self.names]})

    async def chat(self, request: Any) -> Any:
        call = chat.chat_call(await request.body())
        session = self.session(request, call)
        ids = self.prompt(session, call)
        images = vision.image_urls(call.messages)
        out = await self.complete(ids, call, session, images)
        parser = self.renderer.parser.knowing([t["function"]["name"] for t in call.tools or []])
        message, parsed, malformed = chat.assistant_message(self.renderer.decode(out.ids), call, parser)
        session.last = (call.messages, call.tools, ids + out.ids, chat.normalized(message))
        session.record(ids, out, parsed, malformed, images)
        extra = self.extra(session, out)
        if call.stream:
            return _stream(chat.chat_chunks(call, message, out, ids, extra))
        return _json(chat.chat_completion(call, message, out, ids, extra, self.renderer.tokenizer))

    async def generate(self, request: Any) -> Any:
        call = chat.generate_call(await request.body(), len(self.renderer.tokenizer))
        session = self.session(request, call)
        assert call.token_ids is not None
        out = await self.complete(call.token_ids, call, session, [])
        session.record(call.token_ids, out)
        return _json(chat.generate_response(out, call.token_ids, self.extra(session, out)))

    def session(self, request: Any, call: Call) -> Session:
        """The session the call names (in its URL, an X-Session-ID header or its body), if the service runs
        it; else one of its own, forgotten after the call."""
        if call.model not in self.names:
            raise ApiError(
                404, f"model {call.model!r} is not served here (served: {self.names[0]!r})", param="model"
            )
        key = request.path_params.get("session") or request.headers.get("x-session-id") or call.session
        return self.sessions.get(key or "") or Session("")

    def prompt(self, session: Session, call: Call) -> list[int]:
        """The call's prompt: joined to the session's last call when it sends back that history, else
        rendered whole."""
        msgs, ids = call.messages, None
        if session.last is not None and call.tools == session.last[1]:
            last, _, tokens, reply = session.last
            n = len(last)
            if len(msgs) >= n + 2 and msgs[:n] == last and _same_reply(msgs[n], reply):
                ids = self.renderer.extend(tokens, msgs[: n + 1], msgs[n + 1 :], call.tools)
        self.counts["joined" if ids is not None else "rendered"] += 1
        if self.renderer.processor is None and vision.image_urls(msgs):
            raise ApiError(
                400, "this model is not a vision-language one: it takes no image parts", param="messages"
            )
        try:
            return ids if ids is not None else self.renderer.prompt(msgs, call.tools)
        except ValueError as e:  # a picture that does not decode, or over the size limit
            raise ApiError(400, str(e), param="messages") from None
        except Exception as e:  # the chat template refused the messages
            raise ApiError(400, f"the chat template cannot render these messages: {e}") from None

    async def complete(self, ids: list[int], call: Call, session: Session, images: list[str]) -> Generated:
        """Inference's answer, cut at the caller's stops; the session's clock stops while it waits."""
        max_new = min(call.sampling.get("max_tokens", self.max_new), self.max_new)
        if len(ids) + max_new > self.budget:
            raise ApiError(400, f"the prompt is {len(ids)} tokens; with an answer of {max_new} this endpoint takes "
                                f"at most {self.budget - max_new} (agents.max_tokens, or the model's context)",
                           param="messages")  # fmt: skip
        session.busy_since = time.monotonic() if session.busy == 0 else session.busy_since
        session.busy += 1
        try:
            async with asyncio.timeout(self.call_timeout_s):
                out = await self.model.complete(
                    ids, {**call.sampling, "max_tokens": max_new}, session, images
                )
        except TimeoutError:
            raise ApiError(
                504, f"no answer within {self.call_timeout_s:g}s (agents.call_timeout_s)", kind="timeout"
            ) from None
        finally:
            session.busy -= 1
            session.waited += time.monotonic() - session.busy_since if session.busy == 0 else 0.0
        self.counts["answered"] += 1
        return chat.cut(self.renderer.tokenizer, call, self.renderer.stop, out, max_new)

    def extra(self, session: Session, out: Generated) -> dict[str, Any]:
        """The extra fields of an answer: what a trainer needs of the call."""
        return {"call": f"{session.key or 'call'}.{next(self.numbers)}", "session": session.key or None,
                "weight_version": list(out.version), "completion_logprobs": out.logprobs,
                "waited_s": round(out.waited_s, 6)}  # fmt: skip


def _same_reply(sent: dict[str, Any], answered: dict[str, Any]) -> bool:
    """Whether the program sent back the answer it was given (text and tool calls)."""

    def calls(m: dict[str, Any]) -> list[tuple[str, Any]]:
        return [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls") or []]

    text = (sent.get("content") or "").strip() == (answered.get("content") or "").strip()
    return sent.get("role") == "assistant" and text and calls(sent) == calls(answered)


def _json(body: dict[str, Any]) -> Any:
    from starlette.responses import Response

    return Response(msgspec.json.encode(body), media_type="application/json")


def _stream(chunks: list[dict[str, Any]]) -> Any:
    from starlette.responses import StreamingResponse

    async def events() -> AsyncIterator[bytes]:
        for c in chunks:
            yield b"data: " + msgspec.json.encode(c) + b"\n\n"
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")
