"""The inference service: turn prompt rows into completions with the weights each row asks for.

Two claims are kept in flight on one asyncio client, training prompts (`samples`) and held-out prompts
(`eval`); replicas share the work under the consumer name "inference". Every prompt row carries
`min_version` in its metadata, the oldest weight version it may be generated with: this is where the
rollout's pacing window is enforced. Rows whose version has not been published yet stay claimed (their
lease renewed) and are generated the moment it arrives; the others are generated at once. Rows are
acknowledged as they are done, so part of a claim can finish before the rest.

New weights arrive on a thread that waits for the weight group's announcements (see `receive_weights`
for the two interrupt modes). Every completion records the versions of its first and last tokens.

A replica restarted on its own (restart policy on-failure) re-joins: the prompts its predecessor had
claimed came back when its connection closed, it asks the trainer for the current weights and serves
nothing until they arrive, and rows its predecessor wrote but had not acknowledged keep their first
completion.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from meshrl.dataplane import AsyncClient, Batch, Ragged
from meshrl.engines.base import FINISH_INTERRUPTED, InferenceEngine, SamplingParams
from meshrl.roles.env.config import has_env
from meshrl.roles.inference.config import InferenceConfig
from meshrl.roles.scorer import put_missing_async
from meshrl.roles.trainer.config import TrainerConfig
from meshrl.runtime import hybrid
from meshrl.runtime.service import WATCH_S, Service
from meshrl.runtime.weights import GroupBroken, WeightGroup, one_thread
from meshrl.schema import (
    EVAL,
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
    SAMPLES,
    TURN,
    TURNS,
    VERSION,
)

LEASE_S = 300.0  # a replica that dies gives its claimed prompts back after this long


@dataclass
class Waiting:
    """Rows of a claim that need a newer weight version than this replica has."""

    kind: str
    batch: Batch
    rows: list[int]
    renewed: float = field(default_factory=time.monotonic)


class InferenceService(Service):
    def setup(self) -> None:
        cfg = self.config
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        # the trainer in this very process (a hybrid ring) lends its model: its weights are live here
        self.trainer = hybrid.peer(cfg.trainer)
        self.engine = self.build_engine()
        self.batches = 0
        self.generated = 0
        self.busy_s = 0.0  # generating, from the first batch's start to the last's end (logged at close)
        self.span: tuple[float, float] | None = None
        self.aborted = 0
        self.lock = threading.Lock()
        self.update_pending = threading.Event()
        self.version_changed = threading.Condition()
        self.receiver_error: BaseException | None = None
        self.waiting: list[Waiting] = []
        self.loop: asyncio.AbstractEventLoop | None = None
        self.new_version: asyncio.Event | None = None
        if self.trainer is None:
            trainer_cfg = self.ctx.recipe.group(cfg.trainer).config
            assert isinstance(trainer_cfg, TrainerConfig)
            members = [r for r in self.ctx.topology.replicas if r.group in trainer_cfg.inference]
            host, port = self.ctx.topology.replicas_of(cfg.trainer)[0].weights_endpoint
            self.weights = WeightGroup(
                self.ctx.address(host),
                port,
                1 + members.index(self.ctx.replica),
                1 + len(members),
                device=str(self.ctx.device),
                member=self.engine.weight_member(),
            )
            if not self.weights.formed:  # re-joining a running run: the engine's weights are not current
                self.engine.set_version(-1)
            threading.Thread(target=self.receive_weights, name="weights", daemon=True).start()

    @property
    def config(self) -> InferenceConfig:
        cfg = self.ctx.config
        assert isinstance(cfg, InferenceConfig)
        return cfg

    def build_engine(self) -> InferenceEngine:
        ctx = self.ctx
        trainer = ctx.recipe.group(self.config.trainer).config
        assert isinstance(trainer, TrainerConfig)
        return build_engine(
            self.config, device=str(ctx.device), seed=ctx.recipe.seed, replica=ctx.replica.index,
            work_dir=str(ctx.run_dir / "vllm" / ctx.name),
            model=None if self.trainer is None else self.trainer.engine.model,
            adapters=trainer.lora if trainer.publishes_adapters(ctx.recipe) else None,
        )  # fmt: skip

    def run(self) -> None:
        asyncio.run(self.serve())

    async def serve(self) -> None:
        cfg = self.config
        self.loop = asyncio.get_running_loop()
        self.new_version = asyncio.Event()
        preempted = asyncio.Event()
        self.acquiring: asyncio.Future[float] | None = None
        if self.ring is not None:  # a FALLBACK member: hold the devices whenever nobody else asks
            loop = self.loop

            def on_preempt() -> None:
                if not loop.is_closed():
                    loop.call_soon_threadsafe(preempted.set)

            self.ring.on_preempt = on_preempt
            self.acquiring = self.ring.acquire_async(loop)
        client = await AsyncClient.connect(self.ctx.controller, secret=self.ctx.secret, name=self.ctx.name)
        # agents: trajectories are generated a turn at a time, in `turns` (`samples` gets them whole)
        work = TURNS if has_env(self.ctx.recipe) else SAMPLES
        pending: dict[str, asyncio.Task[Any]] = {
            kind: asyncio.create_task(self.claim(client, kind, cfg.max_batch)) for kind in (EVAL, work)
        }
        run_over = asyncio.create_task(self.watch_run(client))
        version_task: asyncio.Task[Any] = asyncio.create_task(self.new_version.wait())
        preempt_task: asyncio.Task[Any] = asyncio.create_task(preempted.wait())
        try:
            while not run_over.done():
                await asyncio.wait(
                    [*pending.values(), version_task, run_over, preempt_task], return_when="FIRST_COMPLETED"
                )
                if preempt_task.done():
                    preempted.clear()
                    preempt_task = asyncio.create_task(preempted.wait())
                self.safe_point()
                if self.receiver_error is not None:
                    raise RuntimeError("weight receiver failed") from self.receiver_error
                if version_task.done():
                    self.new_version.clear()
                    version_task = asyncio.create_task(self.new_version.wait())
                await self.serve_waiting(client)
                for kind, task in list(pending.items()):
                    if task.done():
                        batch = task.result()
                        if batch:
                            await self.serve_rows(client, Waiting(kind, batch, list(range(len(batch)))))
                        pending[kind] = asyncio.create_task(self.claim(client, kind, cfg.max_batch))
            run_over.result()  # a failure elsewhere in the run
        finally:
            for task in [*pending.values(), version_task, run_over, preempt_task]:
                task.cancel()
            for task in [*pending.values(), version_task, run_over, preempt_task]:
                with contextlib.suppress(BaseException):
                    await task
            await client.close()

    @staticmethod
    async def claim(client: AsyncClient, kind: str, n: int) -> Batch:
        return await client.claim(kind, "inference", [PROMPT], n, timeout=WATCH_S, lease=LEASE_S)

    async def serve_rows(self, client: AsyncClient, work: Waiting) -> None:
        """Generate the rows the current version may serve; park the others."""
        needs = work.batch.meta_of(MIN_VERSION, 0)
        version = self.engine.version
        ready = [i for i in work.rows if int(needs[i] or 0) <= version]
        later = [i for i in work.rows if int(needs[i] or 0) > version]
        if ready:
            await self.hold_devices()
            columns = self.generate(work.batch, ready, eval_rows=work.kind == EVAL)
            self.safe_point()
            ids = work.batch.ids[ready]
            await put_missing_async(client, work.kind, columns, ids)
            await client.ack(work.batch, None if not later and len(ready) == len(work.batch) else ids)
        if later:
            work.rows = later
            self.waiting.append(work)

    async def serve_waiting(self, client: AsyncClient) -> None:
        waiting, self.waiting = self.waiting, []
        for work in waiting:
            await self.serve_rows(client, work)
        now = time.monotonic()
        for work in self.waiting:  # still waiting: keep the rows ours
            if now - work.renewed > LEASE_S / 3:
                await client.renew(work.batch, LEASE_S)
                work.renewed = now

    def local_publish(self, version: int) -> None:
        """Called by the trainer of this process (hybrid ring): its model, which this engine generates
        with, now holds `version`."""
        with self.lock:
            self.engine.set_version(version)
        self.announce(version)

    def announce(self, version: int) -> None:
        """A new weight version is in the engine: wake generation waiting for it."""
        with self.version_changed:
            self.version_changed.notify_all()
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
        if hasattr(self, "engine"):
            self.engine.close()
        super().close()

    def offload(self) -> None:
        with self.lock:
            self.engine.offload(str(self.ctx.run_dir / "offload" / f"{self.ctx.name}.bin"))

    def restore(self) -> None:
        with self.lock:
            self.engine.restore()

    def receive_weights(self) -> None:
        """Thread: wait for each publication, then load it into the engine.

        interrupt="finish": load directly if no batch is in progress; else receive into a staging copy
        without the engine lock (the trainer is never held up by a batch in progress), then swap it in
        once the batch is done. An engine whose workers receive the weights themselves (vLLM) cannot
        stage here: its update waits for the batch in progress.
        interrupt="continue": ask the batch in progress to stop at its next token, load the weights
        directly, and let the batch continue on them.
        """
        try:
            while True:
                header = self.weights.wait()
                if header["version"] < 0:  # the trainer is done publishing
                    return
                t0 = time.perf_counter()
                try:
                    version = self.receive_version(header)
                except GroupBroken as e:  # another replica died; the version comes again once it is back
                    self.log.warning("weight group broke during version %d (%s)", header["version"], e)
                    continue
                level = (
                    logging.INFO if version % 50 == 0 else logging.DEBUG
                )  # 64 replicas x every step adds up
                self.log.log(level, "weights version %d applied in %.3fs", version, time.perf_counter() - t0)
        except BaseException as e:  # surfaced by the main loop
            self.receiver_error = e
            with self.version_changed:
                self.version_changed.notify_all()
            if self.loop is not None and self.new_version is not None:
                self.loop.call_soon_threadsafe(self.new_version.set)

    def receive_version(self, header: dict[str, Any]) -> int:
        """Load one announced version; generation may use it as soon as every bucket is in, while the
        group's final barrier is still under way."""
        version = int(header["version"])
        if version == self.engine.version:  # sent again for a replica that re-joined: nothing new here
            return self.weights.receive(header, lambda named: None)
        continuing = self.config.interrupt == "continue"
        if continuing:
            self.update_pending.set()
        # "continue" waits for the batch in progress to stop; "finish" loads directly only when no batch
        # is in progress (always, in lock-step), else stages a copy and swaps it in after the batch; an
        # engine whose workers receive the tensors themselves (no copy passes here) waits for the batch
        if not self.lock.acquire(blocking=continuing or self.weights.member is not None):
            staged: list[tuple[str, torch.Tensor]] = []
            self.weights.receive(header, functools.partial(_stage, staged))  # the trainer is not held up
            with self.lock:
                self.engine.load_weights(staged)
                self.engine.set_version(version)
            self.announce(version)
            return version
        held = True

        def applied() -> None:  # every bucket is in: generate while the group's barrier completes
            nonlocal held
            self.engine.set_version(version)
            self.lock.release()
            held = False
            self.update_pending.clear()
            self.announce(version)

        def load(named: list[tuple[str, torch.Tensor]]) -> None:  # no batch in progress: the engine is ours
            with one_thread():
                self.engine.load_weights(named)

        try:
            return self.weights.receive(header, load, applied=applied)
        finally:
            if held:  # cut short: part old, part new; serve nothing until a complete version
                self.engine.set_version(-1)
                self.lock.release()
                self.update_pending.clear()

    def row_seeds(self, batch: Batch, rows: list[int]) -> list[int]:
        """A sampling seed per row from the row's identity (rollout's group sequence and member, or the
        evaluation's version, prompt and member), not from this process's history or batch: a resumed
        run, or a row that lands in another batch, samples the same tokens."""
        seeds = []
        groups, members = batch.meta_of(GROUP), batch.meta_of(MEMBER, 0)
        for i in rows:
            if groups[i] is None:  # evaluation rows
                key = (
                    1,
                    int(batch.meta_of(EVAL_VERSION, 0)[i] or 0),
                    int(batch.meta_of(PROMPT_ID, 0)[i] or 0),
                )
            else:  # a trajectory's turns differ by their number
                key = (0, int(groups[i]), int(batch.meta_of(TURN, 0)[i] or 0))
            seeds.append(row_seed(self.ctx.recipe.seed, key, int(members[i] or 0)))
        return seeds

    def newer_than(self, version: int) -> bool:
        return self.engine.version > version or self.receiver_error is not None

    def generate(self, batch: Batch, rows: list[int], *, eval_rows: bool) -> dict[str, Any]:
        """Completions for `rows` of `batch`; rows interrupted by a weight update are continued on the
        new weights and record both versions."""
        cfg = self.config
        prompts = [batch.ragged(PROMPT)[i].tolist() for i in rows]
        flags = batch.meta_of(GREEDY, False)
        greedy = [bool(flags[i]) if eval_rows else False for i in rows]
        tokens: list[list[int]] = [[] for _ in rows]
        logprobs: list[list[float]] = [[] for _ in rows]
        first = [-1] * len(rows)
        last = [-1] * len(rows)
        todo = list(range(len(rows)))
        seeds = self.row_seeds(batch, rows)
        seed = seeds[0]
        # evaluation rows are never continued on newer weights: an evaluation measures one version
        checks = [self.update_pending.is_set] if cfg.interrupt == "continue" and not eval_rows else []
        if self.ring is not None and cfg.preempt == "abort":
            checks.append(self.ring.preempt.is_set)
        interrupt = (lambda: any(c() for c in checks)) if checks else None
        t0 = time.perf_counter()
        while todo:
            with self.lock:
                version = self.engine.version
                for mode in (False, True):
                    index = [i for i in todo if greedy[i] == mode]
                    for left in sorted({cfg.max_new_tokens - len(tokens[i]) for i in index}):
                        same = [i for i in index if cfg.max_new_tokens - len(tokens[i]) == left]
                        params = SamplingParams(
                            temperature=0.0 if mode else self.ctx.recipe.temperature,
                            top_k=cfg.top_k,
                            top_p=cfg.top_p,
                            max_new_tokens=left,
                            seed=seed,
                        )
                        done = self.engine.generate(
                            [prompts[i] + tokens[i] for i in same], params, interrupt=interrupt,
                            seeds=[(seeds[i] * 4099 + len(tokens[i])) % 2**63 for i in same],
                        )  # fmt: skip
                        for i, c in zip(same, done, strict=True):
                            first[i] = version if first[i] < 0 else first[i]
                            last[i] = version
                            tokens[i] += c.tokens
                            logprobs[i] += c.logprobs
                            if c.finish_reason != FINISH_INTERRUPTED or len(tokens[i]) >= cfg.max_new_tokens:
                                todo.remove(i)
            if todo and self.ring is not None and self.ring.preempt.is_set() and cfg.preempt == "abort":
                # preempted: the partial completions go, the devices go to the member that asked, and
                # the rows start again once they are back
                for i in todo:
                    tokens[i], logprobs[i], first[i], last[i] = [], [], -1, -1
                self.aborted += len(todo)
                self.ctx.health.info["aborted"] = self.aborted
                self.log.info(
                    "preempted mid-batch: %d rows dropped, regenerated once the devices are back", len(todo)
                )
                self.ring.yield_if_preempted()
                self.ring.acquire()
                continue
            if todo:  # interrupted: wait until the new weights are in, then continue
                with self.version_changed:
                    self.version_changed.wait_for(functools.partial(self.newer_than, version), timeout=600)
                if self.receiver_error is not None:
                    raise RuntimeError("weight receiver failed") from self.receiver_error
        gen_s = time.perf_counter() - t0
        self.busy_s += gen_s
        self.span = (t0 if self.span is None else self.span[0], t0 + gen_s)
        self.batches += 1
        self.generated += len(prompts)
        self.ctx.health.info.update(batches=self.batches, generated=self.generated)
        n = len(prompts)
        lengths = [len(t) for t in tokens]
        return {  # ragged columns built flat: one tensor each, not one per row
            RESPONSE: Ragged(
                torch.tensor(list(itertools.chain.from_iterable(tokens)), dtype=torch.int64), lengths
            ),
            LOGPROBS: Ragged(
                torch.tensor(list(itertools.chain.from_iterable(logprobs)), dtype=torch.float32), lengths
            ),
            VERSION: torch.tensor(list(zip(first, last, strict=True)), dtype=torch.int64).view(n, 2),
            GEN_S: torch.full((n,), gen_s, dtype=torch.float32),
            GEN_BATCH: torch.full(
                (n,), self.ctx.replica.index * 1_000_000_000 + self.batches, dtype=torch.int64
            ),
        }


def _stage(into: list[tuple[str, torch.Tensor]], named: list[tuple[str, torch.Tensor]]) -> None:
    """Keep a copy of a received bucket (its buffer is reused by the next one)."""
    into.extend((name, t.clone()) for name, t in named)


def row_seed(recipe_seed: int, key: tuple[int, int, int], member: int) -> int:
    """The sampling seed of one row: (0, group, 0) for training rows, (1, version, prompt) for
    evaluation rows (`meshrl eval` samples with the same seeds as the run's evaluation at version 0)."""
    return hash((recipe_seed, *key, member)) % 2**63


def build_engine(
    cfg: InferenceConfig,
    *,
    device: str,
    seed: int,
    replica: int = 0,
    work_dir: str | None = None,
    model: Any = None,
    adapters: Any = None,
) -> InferenceEngine:
    """The engine `cfg` names, on `device` (`model`: a trainer's live model to generate with, in a
    hybrid ring; `adapters`: the trainer's LoRA settings when it publishes adapters alone, to vLLM).
    Shared by the inference service and `meshrl eval`, so both generate alike."""
    if cfg.engine == "sim":
        from meshrl.engines.sim import SimInferenceEngine

        return SimInferenceEngine(cfg.sim, seed=seed * 7919 + replica)
    if cfg.engine == "vllm":
        from meshrl.engines.vllm import VLLMEngine

        return VLLMEngine(
            cfg.model, device=device, loader_kwargs=cfg.loader_kwargs, max_batch_size=cfg.max_batch,
            max_model_len=cfg.vllm.max_model_len, kv_cache_gb=cfg.vllm.kv_cache_gb, threads=cfg.threads,
            gpu_memory_fraction=cfg.vllm.gpu_memory_fraction, work_dir=work_dir, seed=seed, adapters=adapters,
        )  # fmt: skip
    if cfg.engine == "sglang":
        from meshrl.engines.sglang import SGLangEngine

        return SGLangEngine(
            cfg.model, device=device, loader_kwargs=cfg.loader_kwargs, max_batch_size=cfg.max_batch,
            max_model_len=cfg.sglang.max_model_len, mem_fraction=cfg.sglang.mem_fraction, seed=seed,
        )  # fmt: skip
    from meshrl.engines.hf import HFEngine

    return HFEngine(
        cfg.model, device=device, loader_kwargs=cfg.loader_kwargs, max_batch_size=cfg.max_batch, model=model
    )
