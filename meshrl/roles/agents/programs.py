"""Agent programs and verifiers episodes in the agents service (service.py): each task's program runs in
an asyncio task of its own (a plain function: on a thread) with a session of this replica's endpoint.
The endpoint's model is this replica's call rows: a call is written to `calls` addressed to this
replica, with what the caller asked for and the oldest weight version its session may use; this
replica claims the answers addressed to it, hands each to the request waiting for it and deletes the
row (an answer nobody waits for, a call of a program of a process before a restart, is deleted as it
arrives). When the program returns, its session's calls are its trajectory.
"""

from __future__ import annotations

import asyncio
import inspect
import ipaddress
import itertools
import json
import secrets
import time
from typing import TYPE_CHECKING, Any

import torch

from meshrl.dataplane import Batch
from meshrl.envs.base import reward_parts
from meshrl.envs.programs import AgentRun, load_program, skip_chat_transform
from meshrl.envs.trajectory import join
from meshrl.planning.topology import HTTP
from meshrl.roles.agents.chat import Generated
from meshrl.roles.agents.endpoint import Endpoint, Session
from meshrl.roles.agents.service import Outcome
from meshrl.runtime.service import WATCH_S
from meshrl.schema import (
    GEN_BATCH,
    GEN_S,
    LOGPROBS,
    MIN_VERSION,
    PROMPT,
    RESPONSE,
    SAMPLING,
    SESSION,
    TASK,
    TO,
    VERSION,
)

if TYPE_CHECKING:
    from meshrl.roles.agents.service import AgentsService

CALL = "call"
"""Metadata key of a program's call row: this replica's name for it, which its answer is matched by."""


class Programs:
    def __init__(self, service: AgentsService) -> None:
        import httpx

        cfg = self.config = service.config
        self.service, self.renderer = service, service.renderer_for([])
        if cfg.kind == "program":
            self.program, self.args = load_program(str(cfg.program)), dict(cfg.args)
        else:
            from meshrl.envs.verifiers import run_episode

            self.program, self.args = (
                run_episode,
                {"environment": cfg.verifiers, "environment_args": cfg.args},
            )
        skip_chat_transform()
        self.nonce = secrets.token_hex(
            4
        )  # sessions and calls of this process only (a restart starts new ones)
        self.numbers = itertools.count()
        self.waiting: dict[str, asyncio.Future[tuple[Batch, int]]] = {}
        secret = None if ipaddress.ip_address(cfg.host).is_loopback else service.ctx.secret
        self.endpoint = Endpoint(self.renderer, self, names=cfg.names, budget=cfg.budget(), max_new=service.turn_tokens,
                                 call_timeout_s=cfg.call_timeout_s, secret=secret)  # fmt: skip
        self.transport = httpx.ASGITransport(app=self.endpoint.app())
        host = service.ctx.address(service.ctx.process.host) if cfg.host == "0.0.0.0" else cfg.host
        self.url = f"http://{host}:{service.ctx.process.ports[HTTP]}"

    def jobs(self) -> list[Any]:
        return [self.answers(), self.http()]

    def report(self) -> str:
        counts, errors = dict(self.endpoint.counts), list(self.endpoint.errors)
        self.endpoint.errors.clear()
        return f"; calls {counts}" + (f"; failed requests: {errors}" if errors else "")

    async def http(self) -> None:
        """The endpoint over HTTP, for programs' own clients."""
        self.service.log.info("serving %s/v1 (model %s)", self.url, self.config.names[0])
        await self.endpoint.serve(self.config.host, self.service.ctx.process.ports[HTTP])

    async def begin(self, batch: Batch, i: int) -> None:
        """Run the task's program, then write its trajectory (reward NaN when it failed or made no call)."""
        s, cfg = self.service, self.config
        row = (batch.meta or [{}])[i] or {}
        traj = int(batch.ids[i])
        session = self.endpoint.sessions[f"{self.nonce}.{traj}"] = Session(
            f"{self.nonce}.{traj}", int(row.get(MIN_VERSION) or 0)
        )
        run = AgentRun(task=json.loads(str(row.get(TASK) or "{}")), model=cfg.names[0],
                       base_url=f"{self.url}/s/{session.key}/v1", api_key=s.ctx.secret or "meshrl",
                       tokenizer=cfg.model, min_version=session.min_version, transport=self.transport)  # fmt: skip
        started, since = time.time(), time.monotonic()
        try:
            value, failed = await self.play(run, session)
        finally:
            await run.aclose()
            del self.endpoint.sessions[session.key]
        rewards: dict[str, float] = {}
        if failed is None:
            try:
                rewards = reward_parts(value)
            except Exception as e:
                failed = ("bad_reward", str(e))
        if failed is None and not session.calls:
            failed = ("no_call", "the program made no model call")
        malformed = {"malformed": session.malformed} if session.malformed else {}
        out = Outcome(join(session.calls), rewards, failed, None, session.tool_calls, malformed,  # type: ignore[arg-type]
                      started, session.gen_s, session.gen_batch, session.own_s(since))  # fmt: skip
        await s.finish(row, traj, out)

    async def play(self, run: AgentRun, session: Session) -> tuple[Any, tuple[str, str] | None]:
        """The program's return value, or why it failed: it raised, or it spent `timeout_s` of its own
        time (its calls in flight are not its time: they wait for weights or a generation slot)."""
        limit = self.config.timeout_s
        if inspect.iscoroutinefunction(self.program):
            task = asyncio.ensure_future(self.program(run, **self.args))
        else:
            task = asyncio.ensure_future(asyncio.to_thread(self.program, run, **self.args))
        since = time.monotonic()
        try:
            while (left := limit - session.own_s(since)) > 0:
                done, _ = await asyncio.wait({task}, timeout=left)
                if done:
                    return task.result(), None
            return None, ("timeout", f"timed out after {limit:g}s (agents.timeout_s)")
        except Exception as e:  # the program's own failure: this trajectory fails, the run goes on
            return None, ("raised", f"{type(e).__name__}: {e}")
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def complete(
        self, ids: list[int], sampling: dict[str, Any], session: Session, images: list[str]
    ) -> Generated:
        """The endpoint's model: the call as a row addressed to this replica, and its answer."""
        s = self.service
        if sampling.get("temperature", s.ctx.run.temperature) != s.ctx.run.temperature and session.key:
            s.counts["off_temperature"] += 1  # the trainer scores every token at the run's temperature
            if s.counts["off_temperature"] == 1:
                s.log.warning("a program asks for temperature %g, the run samples at %g: those samples are off "
                              "the trained policy (importance-weighted, often clipped); leave the temperature "
                              "to the run", sampling["temperature"], s.ctx.run.temperature)  # fmt: skip
        name = f"{self.nonce}.{next(self.numbers)}"
        answer = self.waiting[name] = asyncio.get_running_loop().create_future()
        meta: dict[str, Any] = {CALL: name, SESSION: session.key or None, MIN_VERSION: session.min_version, TO: s.ctx.replica.name,
                SAMPLING: json.dumps(sampling)}  # fmt: skip
        t0 = time.perf_counter()
        try:
            columns = {PROMPT: [torch.tensor(ids, dtype=torch.int64)], **s.image_columns(images)}
            await s.client.put(s.ctx.wiring.partition("calls"), columns, meta=[meta], timeout=60)
            batch, i = await answer
        finally:
            self.waiting.pop(name, None)
        first, last = (int(v) for v in batch.tensor(VERSION)[i].tolist())
        out = Generated(batch.ragged(RESPONSE)[i].tolist(), batch.ragged(LOGPROBS)[i].tolist(), (first, last), "",
                        float(batch.tensor(GEN_S)[i]), int(batch.tensor(GEN_BATCH)[i]), time.perf_counter() - t0)  # fmt: skip
        s.done(batch, i, delete=True)
        return out

    async def answers(self) -> None:
        """The answers addressed to this replica, each to the call waiting for it; an answer nobody waits
        for (a call of a program this process does not run) is deleted at once."""
        s = self.service
        c = s.ctx.wiring.claim("answers")
        me = s.ctx.replica.name
        while True:
            batch = await s.client.claim(c.partition, c.consumer_of(me), list(c.columns), 256, timeout=WATCH_S,
                                         lease=s.config.lease_s, address=c.address_of(me))  # fmt: skip
            for i, name in enumerate(batch.meta_of(CALL)):
                waiting = self.waiting.get(name)
                if waiting is not None and not waiting.done():
                    waiting.set_result((batch, i))
                else:
                    s.counts["calls_dropped"] += 1
                    s.done(batch, i, delete=True)
