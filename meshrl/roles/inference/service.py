"""The inference service: turn prompt rows into completions with the weights each row asks for.

Two claims are kept in flight on one asyncio client, as its wiring says (meshrl/planning/wiring.py):
prompts to complete ("generate": rollout's samples, or agents' turns where an environment writes them)
and held-out prompts ("evaluate"); replicas share the work under one consumer name. Training rows go
first; an evaluation's rows are claimed together and generated in one call with the version they
evaluate (new weights wait for it), so in lock-step an evaluation runs while the trainer trains. Every prompt row
carries `min_version` in its metadata, the oldest weight version it may be generated with: this is where
the rollout's pacing window is enforced. Rows whose version has not been published yet stay claimed
(their lease renewed); when it arrives, one batch of them is generated and the rest go back to the pool
for the other replicas; the others are generated at once. Rows are acknowledged as they are done.

New weights arrive on a thread of their own (`receive.py`, with the two interrupt modes). Every
completion records the versions of its first and last tokens. A replica restarted on its own, or new
(`meshrl scale`), joins: the prompts a predecessor had claimed came back when its connection closed, it
asks the trainer for the current weights and claims nothing until they arrive, and rows a predecessor
wrote but had not acknowledged keep their first completion.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from meshrl.dataplane import AsyncClient, Batch, Ragged
from meshrl.dataplane.missing import put_missing_async
from meshrl.engines.base import FINISH_INTERRUPTED, InferenceEngine, SamplingParams
from meshrl.models import vision
from meshrl.roles.inference.config import InferenceConfig
from meshrl.roles.inference.engine import Completions, Want, build_engine, row_seed
from meshrl.roles.inference.receive import Receiver
from meshrl.runtime import hybrid
from meshrl.runtime.service import WATCH_S, Service
from meshrl.runtime.weights import WeightGroup
from meshrl.schema import (
    EVAL_VERSION,
    GEN_BATCH,
    GEN_S,
    GREEDY,
    GROUP,
    LOGPROBS,
    MEMBER,
    MIN_VERSION,
    PROMPT,
    PROMPT_ID,
    RESPONSE,
    SAMPLING,
    TURN,
    VERSION,
)

LEASE_S = 300.0  # a replica that dies gives its claimed prompts back after this long
PORTS = ("generate", "evaluate")  # the claims kept in flight: training rows first
EVALUATION_ROWS = 65536
"""An evaluation claim takes every row of a version at once: they are generated in one call, under the
engine lock, so new weights cannot land in the middle of an evaluation (meshrl/roles/inference/receive.py)."""


@dataclass
class Waiting:
    """Rows of a claim that need a newer weight version than this replica has."""

    port: str
    batch: Batch
    rows: list[int]
    renewed: float = field(default_factory=time.monotonic)


class InferenceService(Service):
    def setup(self) -> None:
        cfg, ctx = self.config, self.ctx
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        link = ctx.wiring.weights
        assert link is not None, "the planner links every inference group to its trainer"
        # the trainer in this very process (a hybrid ring) lends its model: its weights are live here
        self.trainer = hybrid.peer(link.source)
        self.engine: InferenceEngine = build_engine(
            cfg, device=str(ctx.device), seed=ctx.run.seed, replica=ctx.replica.index,
            work_dir=str(ctx.run_dir / "vllm" / ctx.name),
            model=None if self.trainer is None else self.trainer.engine.model, adapters=link.adapters,
        )  # fmt: skip
        self.batches = self.generated = self.aborted = 0
        ctx.health.info.update(batches=0, generated=0)  # a joining replica has joined at its first row
        self.busy_s = 0.0  # generating, from the first batch's start to the last's end (logged at close)
        self.span: tuple[float, float] | None = None
        self.intervals: list[tuple[float, float]] = []  # each batch's (start, end), wall clock
        self.waiting: list[Waiting] = []
        self.loop: asyncio.AbstractEventLoop | None = None
        self.new_version: asyncio.Event | None = None
        self.receiver = Receiver(self.engine, continuing=cfg.interrupt == "continue", announce=self.announce)
        if self.trainer is None:  # the group meets at the trainer's endpoint; its members in rank order
            source, members = link.endpoint, link.members
            assert source is not None, "the planner places every weight group"
            self.receiver.start(
                WeightGroup(
                    ctx.address(source.host), source.port, 1 + members.index(ctx.replica.name),
                    1 + len(members), device=str(ctx.device), member=self.engine.weight_member(),
                    name=ctx.replica.name,
                )
            )  # fmt: skip

    @property
    def config(self) -> InferenceConfig:
        cfg = self.ctx.config
        assert isinstance(cfg, InferenceConfig)
        return cfg

    def run(self) -> None:
        asyncio.run(self.serve())

    async def serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.new_version = asyncio.Event()
        self.leaving = asyncio.Event()
        preempted = self.take_turns()
        if self.engine.version < 0:  # joining a running run: hold the current version before any row
            self.phase("waiting for the current weights")
            await self.loop.run_in_executor(None, self.receiver.wait_newer, -1)
        client = await AsyncClient.connect(self.ctx.controller, secret=self.ctx.secret, name=self.ctx.name)
        pending = {port: asyncio.create_task(self.claim(client, port)) for port in PORTS}
        run_over = asyncio.create_task(self.watch_run(client))
        version_task: asyncio.Task[Any] = asyncio.create_task(self.new_version.wait())
        preempt_task: asyncio.Task[Any] = asyncio.create_task(preempted.wait())
        leave_task = asyncio.create_task(self.leaving.wait())
        try:
            while not run_over.done():
                await asyncio.wait(
                    [*pending.values(), version_task, run_over, preempt_task, leave_task],
                    return_when="FIRST_COMPLETED",
                )
                if leave_task.done():  # drained: what it generated is in; what it holds goes back
                    for work in self.waiting:
                        await client.release(work.batch)
                    return
                if preempt_task.done():
                    preempted.clear()
                    preempt_task = asyncio.create_task(preempted.wait())
                self.safe_point()
                if self.receiver.error is not None:
                    raise RuntimeError("weight receiver failed") from self.receiver.error
                if version_task.done():
                    self.new_version.clear()
                    version_task = asyncio.create_task(self.new_version.wait())
                await self.serve_waiting(client)
                self.idle_phase()
                for port, task in list(pending.items()):
                    if task.done():
                        batch = task.result()
                        if batch:
                            await self.serve_rows(client, Waiting(port, batch, list(range(len(batch)))))
                        pending[port] = asyncio.create_task(self.claim(client, port))
            run_over.result()  # a failure elsewhere in the run
        finally:
            for task in [*pending.values(), version_task, run_over, preempt_task, leave_task]:
                task.cancel()
            for task in [*pending.values(), version_task, run_over, preempt_task, leave_task]:
                with contextlib.suppress(BaseException):
                    await task
            await client.close()

    def take_turns(self) -> asyncio.Event:
        """A FALLBACK member of a colocation ring holds the devices whenever nobody else asks: set when
        another member asks for them (`preempted`)."""
        preempted, loop = asyncio.Event(), self.loop
        self.acquiring: asyncio.Future[float] | None = None
        if self.ring is not None and loop is not None:

            def on_preempt() -> None:
                if not loop.is_closed():
                    loop.call_soon_threadsafe(preempted.set)

            self.ring.on_preempt = on_preempt
            self.acquiring = self.ring.acquire_async(loop)
        return preempted

    async def claim(self, client: AsyncClient, port: str) -> Batch:
        c = self.ctx.wiring.claim(port)
        n = EVALUATION_ROWS if port == "evaluate" else self.config.max_batch
        return await client.claim(c.partition, c.consumer, list(c.columns), n, timeout=WATCH_S, lease=LEASE_S)

    async def serve_rows(self, client: AsyncClient, work: Waiting) -> None:
        """Generate the rows the current version may serve; park the others."""
        needs = work.batch.meta_of(MIN_VERSION, 0)
        version = self.engine.version
        ready = [i for i in work.rows if int(needs[i] or 0) <= version]
        later = [i for i in work.rows if int(needs[i] or 0) > version]
        if ready:
            await self.hold_devices()
            what = "evaluation" if work.port == "evaluate" else "prompt"
            self.phase(f"generating {len(ready)} {what} rows with version {version}")
            t0 = time.perf_counter()
            columns = self.generate(work.batch, ready, evaluation=work.port == "evaluate")
            if work.port == "evaluate":
                elapsed = time.perf_counter() - t0
                self.log.info("%d evaluation rows with version %d in %.1f s", len(ready), version, elapsed)
            self.safe_point()
            ids = work.batch.ids[ready]
            await put_missing_async(client, work.batch.partition, columns, ids)
            await client.ack(work.batch, None if not later and len(ready) == len(work.batch) else ids)
        if later:
            work.rows = later
            self.waiting.append(work)

    async def serve_waiting(self, client: AsyncClient) -> None:
        """Generate the parked rows the current version may serve, one batch of training rows at most;
        the rest go back to the pool, to idle replicas (else this one would generate them alone)."""
        waiting, self.waiting = self.waiting, []
        budget = self.config.max_batch
        for work in waiting:
            needs = work.batch.meta_of(MIN_VERSION, 0)
            ready = sum(int(needs[i] or 0) <= self.engine.version for i in work.rows)
            if work.port == "generate" and ready and budget <= 0:
                await client.release(work.batch)
                continue
            budget -= ready if work.port == "generate" else 0
            await self.serve_rows(client, work)
        for work in self.waiting:  # still waiting: keep the rows ours
            if (now := time.monotonic()) - work.renewed > LEASE_S / 3:
                await client.renew(work.batch, LEASE_S)
                work.renewed = now

    def idle_phase(self) -> None:
        waiting = sum(len(w.rows) for w in self.waiting)
        if waiting:
            need = min(int(w.batch.meta_of(MIN_VERSION, 0)[i] or 0) for w in self.waiting for i in w.rows)
            self.phase(f"{waiting} rows wait for version {need} (it has {self.engine.version})")
        else:
            self.phase("waiting for prompts")

    def leave(self) -> None:
        """SIGUSR2 (drained): the batch being generated finishes and is written, then the service ends."""
        if self.loop is None:
            raise SystemExit(0)
        self.loop.call_soon_threadsafe(self.leaving.set)

    def local_publish(self, version: int) -> None:
        """Called by the trainer of this process (hybrid ring): its model, which this engine generates
        with, now holds `version`."""
        self.receiver.set_version(version)

    def announce(self, version: int) -> None:
        """A new weight version is in the engine (or receiving failed): wake the rows waiting for it."""
        self.ctx.health.info["version"] = version
        if self.loop is not None and self.new_version is not None:
            self.loop.call_soon_threadsafe(self.new_version.set)

    async def hold_devices(self) -> None:
        """In a colocation ring: wait until this replica holds the ring's devices."""
        if self.ring is None or self.ring.holding:
            return
        if self.acquiring is None and self.loop is not None:
            self.acquiring = self.ring.acquire_async(self.loop)
        assert self.acquiring is not None
        await self.acquiring
        self.acquiring = None

    def safe_point(self) -> None:
        """Between batches: if an ON_DEMAND ring member asked for the devices, offload and pass them on,
        then ask again at once (the next grant comes when nobody else is waiting)."""
        if self.ring is not None and self.loop is not None and self.ring.yield_if_preempted():
            self.acquiring = self.ring.acquire_async(self.loop)

    def close(self) -> None:
        if getattr(self, "span", None) is not None:
            assert self.span is not None
            self.log.info(
                "generated %d rows in %d batches: %.3f s busy over %.3f s from the first batch to the last end",
                self.generated, self.batches, self.busy_s, self.span[1] - self.span[0],
            )  # fmt: skip
            # when each batch ran (benchmarks/agent_sim.py: how busy the replicas were, and when)
            path = self.ctx.run_dir / "logs" / f"{self.ctx.name}.batches.json"
            path.write_text(json.dumps([[round(a, 4), round(b, 4)] for a, b in self.intervals]))
        if hasattr(self, "engine"):
            self.engine.close()
        super().close()

    def offload(self) -> None:
        with self.receiver.lock:
            self.engine.offload(str(self.ctx.run_dir / "offload" / f"{self.ctx.name}.bin"))

    def restore(self) -> None:
        with self.receiver.lock:
            self.engine.restore()

    # ---------------------------------------------------------------------------------------------------
    # generation

    def row_seeds(self, batch: Batch, rows: list[int]) -> list[int]:
        """A sampling seed per row from the row's identity (rollout's group sequence and member, or the
        evaluation's version, prompt and member; an agent's call: the seed it asked for, else its row),
        not from this process's history or batch: a resumed run, or a row that lands in another batch,
        samples the same tokens."""
        seeds = []
        groups, members = batch.meta_of(GROUP), batch.meta_of(MEMBER, 0)
        versions, prompts, turns = (
            batch.meta_of(EVAL_VERSION, 0),
            batch.meta_of(PROMPT_ID, 0),
            batch.meta_of(TURN, 0),
        )
        asked = [json.loads(a) if a else None for a in batch.meta_of(SAMPLING)]
        for i in rows:
            if (a := asked[i]) is not None:  # an agent's call: its own seed, or one of its row's
                seed = a.get("seed")
                key = (2, int(seed), 0) if seed is not None else (3, int(batch.ids[i]), 0)
            elif groups[i] is None:  # evaluation rows
                key = (1, int(versions[i] or 0), int(prompts[i] or 0))
            else:  # a trajectory's turns differ by their number
                key = (0, int(groups[i]), int(turns[i] or 0))
            seeds.append(row_seed(self.ctx.run.seed, key, int(members[i] or 0)))
        return seeds

    def generate(self, batch: Batch, rows: list[int], *, evaluation: bool) -> dict[str, Any]:
        """Completions for `rows` of `batch`: rows interrupted by a weight update are continued on the
        new weights and record both versions; a batch preempted in a ring starts again once the devices
        are back."""
        prompts = [batch.ragged(PROMPT)[i].tolist() for i in rows]
        images = vision.from_batch(batch, rows)
        wants = self.sampling(batch, rows, evaluation)
        seeds = self.row_seeds(batch, rows)
        out = Completions.empty(len(rows))
        interrupt = self.interruption(evaluation)
        todo = list(range(len(rows)))
        t0 = time.perf_counter()
        while todo:
            with self.receiver.lock:
                version = self.engine.version
                for same, params in self.buckets(todo, wants, out, seeds[0]):
                    done = self.engine.generate(
                        [prompts[i] + out.tokens[i] for i in same], params, interrupt=interrupt,
                        seeds=[(seeds[i] * 4099 + len(out.tokens[i])) % 2**63 for i in same],
                        images=None if images is None else [images[i] for i in same],
                    )  # fmt: skip
                    for i, c in zip(same, done, strict=True):
                        out.first[i] = version if out.first[i] < 0 else out.first[i]
                        out.last[i] = version
                        out.tokens[i] += c.tokens
                        out.logprobs[i] += c.logprobs
                        if c.finish_reason != FINISH_INTERRUPTED or len(out.tokens[i]) >= wants[i].max_tokens:
                            todo.remove(i)
            if todo and self.preempted():
                self.start_again(out, todo)
            elif todo:  # interrupted by an update: continue on the new weights
                self.receiver.wait_newer(version)
        return self.columns(out, time.perf_counter() - t0)

    def interruption(self, evaluation: bool) -> Callable[[], bool] | None:
        """What stops a batch at its next token: new weights under interrupt="continue" (never an
        evaluation: it measures one version), a ring member asking for the devices under preempt="abort"."""
        checks = []
        if self.config.interrupt == "continue" and not evaluation:
            checks.append(self.receiver.update_pending.is_set)
        if self.ring is not None and self.config.preempt == "abort":
            checks.append(self.ring.preempt.is_set)
        return (lambda: any(c() for c in checks)) if checks else None

    def sampling(self, batch: Batch, rows: list[int], evaluation: bool) -> list[Want]:
        """What each row is generated with: the run's settings (greedy for a greedy evaluation row), or
        what an agent's call asked for (its SAMPLING metadata; max_tokens capped at max_new_tokens)."""
        cfg, temperature = self.config, self.ctx.run.temperature
        greedy, asked = batch.meta_of(GREEDY, False), batch.meta_of(SAMPLING)
        wants = []
        for i in rows:
            a = json.loads(asked[i]) if asked[i] else {}
            wants.append(
                Want(
                    0.0 if greedy[i] and evaluation else float(a.get("temperature", temperature)),
                    float(a.get("top_p", cfg.top_p)),
                    min(int(a.get("max_tokens") or cfg.max_new_tokens), cfg.max_new_tokens),
                )
            )
        return wants

    def buckets(
        self, todo: list[int], wants: list[Want], out: Completions, seed: int
    ) -> Iterator[tuple[list[int], SamplingParams]]:
        """The rows to generate together and their parameters: by what they want and by the tokens each
        has left (a continued row has fewer), at most max_batch at a time (an evaluation claims all its
        rows at once)."""
        cfg = self.config
        keys = {
            i: (wants[i].temperature, wants[i].top_p, wants[i].max_tokens - len(out.tokens[i])) for i in todo
        }
        for key in sorted(set(keys.values()), key=lambda k: (k[0] == 0.0, *k)):  # sampled rows first
            same = [i for i in todo if keys[i] == key]
            temperature, top_p, left = key
            params = SamplingParams(
                temperature=temperature, top_k=cfg.top_k, top_p=top_p, max_new_tokens=left, seed=seed
            )
            for start in range(0, len(same), cfg.max_batch):
                yield same[start : start + cfg.max_batch], params

    def preempted(self) -> bool:
        return self.ring is not None and self.ring.preempt.is_set() and self.config.preempt == "abort"

    def start_again(self, out: Completions, todo: list[int]) -> None:
        """Preempted mid-batch: the partial completions go, the devices go to the member that asked, and
        the rows start again once they are back."""
        assert self.ring is not None
        out.drop(todo)
        self.aborted += len(todo)
        self.ctx.health.info["aborted"] = self.aborted
        self.log.info(
            "preempted mid-batch: %d rows dropped, regenerated once the devices are back", len(todo)
        )
        self.ring.yield_if_preempted()
        self.ring.acquire()

    def columns(self, out: Completions, gen_s: float) -> dict[str, Any]:
        """The batch's columns (ragged ones built flat: one tensor each, not one per row); the counts."""
        t_end = time.perf_counter()
        if len(self.intervals) < 200_000:  # bounded: a long run keeps its first 200k batches
            self.intervals.append((time.time() - gen_s, time.time()))
        self.busy_s += gen_s
        self.span = (t_end - gen_s if self.span is None else self.span[0], t_end)
        self.batches += 1
        n = len(out.tokens)
        self.generated += n
        self.ctx.health.info.update(batches=self.batches, generated=self.generated)
        lengths = [len(t) for t in out.tokens]
        return {
            RESPONSE: Ragged(
                torch.tensor(list(itertools.chain.from_iterable(out.tokens)), dtype=torch.int64), lengths
            ),
            LOGPROBS: Ragged(
                torch.tensor(list(itertools.chain.from_iterable(out.logprobs)), dtype=torch.float32), lengths
            ),
            VERSION: torch.tensor(list(zip(out.first, out.last, strict=True)), dtype=torch.int64).view(n, 2),
            GEN_S: torch.full((n,), gen_s, dtype=torch.float32),
            GEN_BATCH: torch.full(
                (n,), self.ctx.replica.index * 1_000_000_000 + self.batches, dtype=torch.int64
            ),
        }
