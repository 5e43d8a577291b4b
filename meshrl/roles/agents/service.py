"""The agents service: agent programs of the user's own, trained as they are (docs/architecture.md,
"Agents that are programs").

A replica claims trajectory starts from `tasks` (rollout feeds them, paced by the window like any
prompt) and runs the recipe's program on each (meshrl/envs/programs.py), many at once on asyncio. The
program calls the model through the endpoint, at a base URL naming its session (this replica, a key of
its own, and the oldest weight version its calls may use); each call is a row of `calls` that inference
generates and the endpoint answers. The answered calls come back here (the rows addressed to this
replica), and when the program returns its reward, its session's calls are joined into one sample
(meshrl/envs/sessions.py: one token sequence where each call extends the last, segments where the
agent rewrote its history) and written to `samples` with the reward as ENV_REWARD. A program that
raises or times out writes its sample with a NaN reward: rollout counts it and nothing of it trains.

Exactly once: the sample is written under the task's key before the task is acknowledged. A replica
killed mid-program loses its programs: their tasks return to the pool and run again from the start,
under new sessions (the old sessions' call rows are dropped as they arrive: nobody runs them).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import math
import secrets
import time
from collections import Counter
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

import torch

from meshrl.dataplane import AsyncClient, Batch
from meshrl.envs.programs import AgentRun, load_program, reward_parts
from meshrl.envs.sessions import Record, join, session_token
from meshrl.roles.agents.config import AgentsConfig
from meshrl.runtime.service import WATCH_S, Service
from meshrl.schema import (
    CARRIED,
    DELIVERED,
    ENV_REWARD,
    ENV_REWARDS,
    GEN_BATCH,
    GEN_S,
    LOGPROBS,
    LOSS_MASK,
    MIN_VERSION,
    MODEL_TURNS,
    PROMPT,
    RESPONSE,
    SEGMENTS,
    SEQUENCES,
    SESSION,
    TASK,
    TOKEN_VERSIONS,
    TRAJ_FAILED,
    VERSION,
)

CALL = "call"
"""Metadata key of a call row: the endpoint's name for the call (the x-meshrl-call header)."""


@dataclass
class Session:
    """The calls of one program's run, as they come back from the endpoint."""

    calls: dict[str, tuple[Batch, int]] = field(default_factory=dict)
    """By call name: the row (batch, index) of each delivered call."""
    dropped: set[str] = field(default_factory=set)
    """Calls whose answer never reached the program (their endpoint replica was killed)."""
    arrived: asyncio.Event = field(default_factory=asyncio.Event)


class AgentsService(Service):
    def setup(self) -> None:
        cfg, ctx = self.config, self.ctx
        self.program = load_program(cfg.program)
        self.model = str(ctx.wiring.inputs["model_calls"])  # the endpoint's model name
        self.endpoints = [
            f"http://{ctx.address(p.host)}:{p.port}" for p in ctx.wiring.served_by["model_calls"]
        ]
        self.nonce = secrets.token_hex(4)  # sessions of this process only (a restart starts new ones)
        self.sessions: dict[str, Session] = {}
        self.counts: Counter[str] = Counter()
        self.parts: dict[str, float] = {}
        self.times = {"life_s": 0.0, "gen_s": 0.0}
        self.span: list[float] = []  # first start, last finish (wall clock; benchmarks/agent_gateway.py)

    @property
    def config(self) -> AgentsConfig:
        cfg = self.ctx.config
        assert isinstance(cfg, AgentsConfig)
        return cfg

    def run(self) -> None:
        asyncio.run(self.serve())

    async def serve(self) -> None:
        client = await AsyncClient.connect(self.ctx.controller, secret=self.ctx.secret, name=self.ctx.name)
        self.slots = asyncio.Semaphore(self.config.concurrency)
        self.running: set[asyncio.Task[None]] = set()
        self.failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        jobs = [asyncio.create_task(self.take_tasks(client)), asyncio.create_task(self.take_calls(client))]
        run_over = asyncio.create_task(self.watch_run(client))
        self.phase("waiting for tasks")
        try:
            done, _ = await asyncio.wait([*jobs, run_over, self.failed], return_when="FIRST_COMPLETED")
            for t in done:
                t.result()
        finally:
            for t in [*jobs, run_over, *self.running]:
                t.cancel()
            await asyncio.gather(*jobs, run_over, *self.running, return_exceptions=True)
            if self.failed.done() and not self.failed.cancelled():
                self.failed.exception()
            with contextlib.suppress(Exception):
                await client.close()

    async def take_tasks(self, client: AsyncClient) -> None:
        """Claim as many tasks as there are free slots; run each in a task of its own."""
        c = self.ctx.wiring.claim("tasks")
        while True:
            await self.slots.acquire()
            n = 1
            while n < 64 and not self.slots.locked():
                await self.slots.acquire()
                n += 1
            try:
                batch = await client.claim(c.partition, c.consumer, list(c.columns), n, timeout=WATCH_S,
                                           lease=self.config.lease_s)  # fmt: skip
            except BaseException:
                for _ in range(n):
                    self.slots.release()
                raise
            for _ in range(n - len(batch)):
                self.slots.release()
            for i in range(len(batch)):
                task = asyncio.create_task(self.guarded(client, batch, i))
                self.running.add(task)
                task.add_done_callback(self.running.discard)

    async def take_calls(self, client: AsyncClient) -> None:
        """The answered calls addressed to this replica, to their sessions; calls of sessions this process
        does not run (its predecessor's) are dropped at once."""
        c = self.ctx.wiring.claim("calls")
        me = self.ctx.replica.name
        while True:
            batch = await client.claim(c.partition, c.consumer_of(me), list(c.columns), 256, timeout=WATCH_S,
                                       lease=self.config.lease_s, address=c.address_of(me))  # fmt: skip
            if not batch:
                continue
            names, sessions = batch.meta_of(CALL), batch.meta_of(SESSION)
            delivered = batch.tensor(DELIVERED).tolist()
            orphans = []
            for i, (name, key) in enumerate(zip(names, sessions, strict=True)):
                session = self.sessions.get(str(key))
                if session is None:
                    orphans.append(i)
                    continue
                if delivered[i]:
                    session.calls[str(name)] = (batch, i)
                else:
                    session.dropped.add(str(name))
                    orphans.append(i)
                session.arrived.set()
            if orphans:
                self.counts["calls_dropped"] += len(orphans)
                await self.forget(client, batch, orphans)

    async def forget(self, client: AsyncClient, batch: Batch, rows: list[int]) -> None:
        ids = batch.ids[rows]
        await client.ack(batch, ids)
        await client.delete(batch.partition, ids)

    async def guarded(self, client: AsyncClient, batch: Batch, i: int) -> None:
        """Run task `i`, write its sample, then acknowledge the task. Anything failing here that is not
        the program's (the data plane, a bug) stops the service; its tasks return to the pool."""
        try:
            await self.trajectory(client, batch, i)
            await client.ack(batch, batch.ids[[i]])
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            self.log.exception("task %d failed", int(batch.ids[i]))
            if not self.failed.done():
                self.failed.set_exception(e)
        finally:
            self.slots.release()
            self.ctx.health.info.update(self.counts, active=len(self.running))
            self.phase(f"{len(self.running)} programs running ({self.counts['finished']} finished)")

    async def trajectory(self, client: AsyncClient, batch: Batch, i: int) -> None:
        cfg = self.config
        row = (batch.meta or [{}])[i] or {}
        traj = int(batch.ids[i])
        need = int(row.get(MIN_VERSION) or 0)
        key = session_token(self.ctx.replica.name, f"{self.nonce}.{traj}", need)
        session = self.sessions[key] = Session()
        base = self.endpoints[traj % len(self.endpoints)]
        run = AgentRun(
            task=json.loads(str(row.get(TASK) or "{}")),
            model=self.model,
            base_url=f"{base}/s/{key}/v1",
            api_key=self.ctx.secret or "meshrl",
        )
        t0 = time.time()
        self.span = self.span or [t0, t0]
        self.counts["started"] += 1
        failure: tuple[str, str] | None = None
        parts: dict[str, float] = {}
        try:
            if inspect.iscoroutinefunction(self.program):
                running = self.program(run, **cfg.program_args)
            else:
                running = asyncio.to_thread(self.program, run, **cfg.program_args)
            value = await _within_own_time(run, running, cfg.timeout_s)
        except TimeoutError:
            failure = ("timeout", f"timed out after {cfg.timeout_s:g}s (agents.timeout_s)")
        except Exception as e:  # the program's own failure: this trajectory fails, the run goes on
            failure = ("raised", f"{type(e).__name__}: {e}")
        else:
            try:
                parts = reward_parts(value)
            except TypeError as e:
                failure = ("bad_reward", str(e))
        finally:
            await run.aclose()
        try:
            records = await self.collect(session, run.calls)
            await self.finish(client, row, traj, records, parts, failure, time.time() - t0)
        finally:
            del self.sessions[key]
            rows = [(b, k) for b, k in session.calls.values()]
            for b in {id(b): b for b, _ in rows}.values():
                await self.forget(client, b, [k for bb, k in rows if bb is b])

    async def collect(self, session: Session, names: list[str]) -> list[tuple[Batch, int]]:
        """The session's delivered calls, in the order they were answered: those the program's clients
        noted, once all have arrived; else (a client of the program's own) what arrived by settle_s."""
        if not names:
            await asyncio.sleep(self.config.settle_s)
            return sorted(session.calls.values(), key=lambda r: int(r[0].ids[r[1]]))
        deadline = time.monotonic() + max(60.0, self.config.settle_s)
        while True:
            missing = [n for n in names if n not in session.calls and n not in session.dropped]
            if not missing:
                return [session.calls[n] for n in names if n in session.calls]
            session.arrived.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                self.log.warning("%d of a session's calls never came back: left out", len(missing))
                return [session.calls[n] for n in names if n in session.calls]
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(session.arrived.wait(), left)

    async def finish(
        self,
        client: AsyncClient,
        row: dict[str, Any],
        traj: int,
        calls: list[tuple[Batch, int]],
        parts: dict[str, float],
        failure: tuple[str, str] | None,
        life_s: float,
    ) -> None:
        """The trajectory's sample into `samples` (reward NaN when the program failed or made no call)."""
        if failure is None and not calls:
            failure = ("no_call", "the program made no model call")
        records = [
            Record(
                prompt=b.ragged(PROMPT)[k].tolist(),
                completion=b.ragged(RESPONSE)[k].tolist(),
                logprobs=b.ragged(LOGPROBS)[k].tolist(),
                version=int(b.tensor(VERSION)[k][0]),
            )
            for b, k in calls
        ]
        need = int(row.get(MIN_VERSION) or 0)
        if records:
            joined = join(records)
        else:  # nothing generated: one masked token carries the failed trajectory's row
            from meshrl.envs.sessions import Joined

            joined = Joined(prompt=[0], segments=[1])
            joined.add([0], trained=False)
        first, last = joined.version_range
        gen_s = sum(float(b.tensor(GEN_S)[k]) for b, k in calls)
        reward = math.nan if failure is not None else sum(parts.values())
        columns: dict[str, Any] = {
            PROMPT: [torch.tensor(joined.prompt, dtype=torch.int64)],
            RESPONSE: [torch.tensor(joined.response, dtype=torch.int64)],
            LOGPROBS: [torch.tensor(joined.logprobs, dtype=torch.float32)],
            LOSS_MASK: [torch.tensor(joined.loss_mask, dtype=torch.int8)],
            TOKEN_VERSIONS: [torch.tensor(joined.versions, dtype=torch.int64)],
            SEGMENTS: [torch.tensor(joined.segments, dtype=torch.int64)],
            VERSION: torch.tensor([[max(first, need), max(last, need)]], dtype=torch.int64),
            GEN_S: torch.tensor([gen_s], dtype=torch.float32),
            GEN_BATCH: torch.tensor([int(calls[-1][0].tensor(GEN_BATCH)[calls[-1][1]]) if calls else 0]),
            ENV_REWARD: torch.tensor([reward], dtype=torch.float32),
        }
        meta = {**{k: row.get(k) for k in CARRIED}, MODEL_TURNS: len(records), SEQUENCES: len(joined.segments),
                TRAJ_FAILED: failure is not None, ENV_REWARDS: json.dumps(parts)}  # fmt: skip
        self.count(traj, len(records), joined.splits, parts, failure, life_s, gen_s)
        await client.put(self.ctx.wiring.partition("samples"), columns, meta=[meta], timeout=3600,
                         key=f"traj/{traj}")  # fmt: skip

    def count(
        self,
        traj: int,
        calls: int,
        splits: int,
        parts: dict[str, float],
        failure: tuple[str, str] | None,
        life_s: float,
        gen_s: float,
    ) -> None:
        c = self.counts
        c["finished"] += 1
        self.span[1] = time.time()
        c["calls"] += calls
        c["splits"] += splits
        self.times["life_s"] += life_s
        self.times["gen_s"] += gen_s
        if failure is not None:
            kind, reason = failure
            c["failed"] += 1
            c[f"failed_{kind}"] += 1
            if c[f"failed_{kind}"] <= 3 or c["failed"] % 100 == 0:
                self.log.warning("trajectory %d failed (%d so far): %s", traj, c["failed"], reason)
        for name, value in parts.items():
            self.parts[name] = self.parts.get(name, 0.0) + value
        if c["finished"] % 50 == 0:
            done = c["finished"] - c["failed"]
            means = {k: round(v / max(done, 1), 4) for k, v in self.parts.items()}
            self.log.info("trajectories: %s; mean rewards %s", dict(c), means)
            self.ctx.health.info["rewards"] = means

    def close(self) -> None:
        if getattr(self, "span", None):
            self.log.info(
                "agents: %s; %.3f s from the first start to the last finish; trajectories' time: %.3f s "
                "alive, %.3f s generating", dict(self.counts), self.span[1] - self.span[0], *self.times.values(),
            )  # fmt: skip
        super().close()


async def _within_own_time(run: AgentRun, program: Awaitable[Any], limit_s: float) -> Any:
    """The program's result, or TimeoutError once it has spent `limit_s` seconds of its own: time its
    session's clients wait for a model call (parked for the weights it needs, queued for generation)
    is not counted; the endpoint's call_timeout_s bounds that."""
    task = asyncio.ensure_future(program)
    since = time.monotonic()
    try:
        while (left := limit_s - run.own_s(since)) > 0:
            done, _ = await asyncio.wait({task}, timeout=left)
            if done:
                return task.result()
        raise TimeoutError
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
