"""The critic service: values for new samples, and a value model trained on the returns.

Two claims on one asyncio client, served one at a time on one model:
- values (consumer "critic-values"): new samples (prompt + response). Like inference, each row's
  `min_version` says which critic version it needs: the critic's version counts its completed batches
  (one per trainer step), so at window 1 the values of step n's samples come from the critic trained
  on steps 0..n-1, exactly as in synchronous PPO. Rows whose version is not there yet stay claimed.
- train (consumer "critic"): a batch of rows whose `returns` rollout has written, in `mini_batches`
  optimizer steps (`epochs` each) of the clipped value loss: one critic version. Metrics per version go
  to <run_dir>/critic.jsonl.
Batch v (the critic's version) is trained on only once every sample of it has its values, so values
are never computed by weights half-way through an update of their own batch.

Re-joining: before each effect on the data plane (values put and acknowledged, a trained batch
acknowledged) the critic writes its progress to `<run_dir>/rejoin/<process>.<launch>.{0,1}.json`: version,
optimizer steps, samples valued, metrics lines, and the rows of the effect in flight. A critic killed and
restarted in place takes that progress and the weights and optimizer state of the run's latest
checkpoint (the updates since are lost: its values for the rest of the run are those of a critic that
missed them, so the run no longer repeats an uninterrupted one bit for bit; restarting the whole run
from the checkpoint instead, `critic.restart.mode=never` plus a resume, is exact). Rows of the effect in
flight come back when the dead connection closes: values already written are kept and not counted
again, and a batch already trained on is acknowledged without training on it twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

import torch

from meshrl.dataplane import AsyncClient, Batch, Ragged
from meshrl.dataplane.missing import put_missing_async
from meshrl.engines.packing import pack
from meshrl.engines.value import ValueEngine
from meshrl.models import vision
from meshrl.observe.metrics import JsonlSink, merged
from meshrl.roles.critic.config import CriticConfig
from meshrl.runtime.service import WATCH_S, Service
from meshrl.schema import GROUP, MEMBER, MIN_VERSION, PROMPT, RESPONSE, RETURNS, SEGMENTS, VALID, VALUES
from meshrl.state import checkpoint as ckpt
from meshrl.state.statefile import StateFile

LEASE_S = 600.0


class CriticService(Service):
    def setup(self) -> None:
        cfg = self.config
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.engine = ValueEngine(
            cfg.model, cfg.optim, memory=cfg.memory, device=self.ctx.device,
            total_steps=self.ctx.run.total_steps * cfg.mini_batches * cfg.epochs,
            loader_kwargs=cfg.loader_kwargs, seed=self.ctx.run.seed, head="value",
        )  # fmt: skip
        self.version = 0
        self.minibatches = 0
        self.valued = 0
        self.stats: list[dict[str, float]] = []  # the current version's updates
        self.last = time.perf_counter()
        # the rows of the effect in flight (in the state file), and those a predecessor had in flight
        self.valuing: list[int] = []
        self.training: list[int] = []
        self.replay_values: set[int] = set()
        self.replay_train: set[int] = set()
        self.state = StateFile(self.ctx.run_dir / "rejoin" / f"{self.ctx.name}.{self.ctx.launch}")
        predecessor = self.state.read()
        lines = 0  # metrics lines to keep: none in a fresh run
        if predecessor is not None:
            lines = self.rejoin(predecessor)
        else:
            for old in (self.ctx.run_dir / "rejoin").glob(f"{self.ctx.name}.*.json"):  # earlier launches'
                old.unlink()
            if self.ctx.resume is not None:
                lines = self.load_state(self.ctx.resume)
        self.metrics = JsonlSink(self.ctx.run_dir / "critic.jsonl", keep=lines)

    @property
    def config(self) -> CriticConfig:
        cfg = self.ctx.config
        assert isinstance(cfg, CriticConfig)
        return cfg

    def run(self) -> None:
        asyncio.run(self.serve())
        self.state.remove()  # the run is over: nothing to re-join
        if self.config.save_final:
            self.engine.save_pretrained(str(self.ctx.run_dir / "critic"), source=self.config.model)

    async def serve(self) -> None:
        client = await AsyncClient.connect(self.ctx.controller, secret=self.ctx.secret, name=self.ctx.name)
        self.client = client
        self.pause = ckpt.Pause()
        run_over = asyncio.create_task(self.watch_run(client))
        self.version_changed = asyncio.Event()
        checkpoints = asyncio.create_task(
            ckpt.take_part(client, self.ctx.name, self.pause, self.save_state, self.reach)
        )
        self.values_claim, self.train_claim = self.claim_values(), self.claim_train()
        self.parked: list[tuple[Batch, list[int], float]] = []
        self.held: Batch | None = None  # a training mini-batch waiting for its batch's values
        try:
            while not run_over.done():
                waiting = [self.values_claim, run_over, checkpoints]
                if self.held is None:
                    waiting.append(self.train_claim)
                await asyncio.wait(waiting, return_when="FIRST_COMPLETED")
                if checkpoints.done():
                    checkpoints.result()  # a failure while checkpointing
                async with self.pause.work():  # a checkpoint may pause us here
                    await self.round()
            run_over.result()
        finally:
            for task in (self.values_claim, self.train_claim, run_over, checkpoints):
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            await client.close()

    def claim_values(self) -> asyncio.Task[Batch]:
        c = self.ctx.wiring.claim("values")
        return asyncio.create_task(
            self.client.claim(c.partition, c.consumer, list(c.columns), self.config.max_batch,
                              timeout=WATCH_S, lease=LEASE_S)
        )  # fmt: skip

    def claim_train(self) -> asyncio.Task[Batch]:
        c, n = self.ctx.wiring.claim("train"), self.ctx.run.batch_size
        return asyncio.create_task(
            self.client.claim(c.partition, c.consumer, list(c.columns), n, min_n=n, timeout=WATCH_S, lease=LEASE_S)
        )  # fmt: skip

    async def round(self) -> None:
        """Take what the claims brought, serve the values the current version may, train when allowed."""
        if self.values_claim.done():
            batch = self.values_claim.result()
            if batch:
                self.parked.append((batch, list(range(len(batch))), time.monotonic()))
            self.values_claim = self.claim_values()
        self.parked = await self.serve_values(self.client, self.parked)
        if self.held is None and self.train_claim.done():
            self.held = self.train_claim.result() or None
            if self.held is None:
                self.train_claim = self.claim_train()
            elif set(self.held.ids.tolist()) <= self.replay_train:  # a predecessor trained on it
                self.replay_train -= set(self.held.ids.tolist())
                await self.client.ack(self.held)
                self.held = None
                self.train_claim = self.claim_train()
        # Synchronous PPO computes a batch's values before any update on it: train on batch v (this
        # critic's version) only once every sample of it has its values.
        if self.held is not None and self.valued >= (self.version + 1) * self.ctx.run.batch_size:
            await asyncio.to_thread(self.train, self.held)
            self.version_changed.set()
            self.training = self.held.ids.tolist()
            self.persist()
            await self.client.ack(self.held)
            self.held = None
            self.train_claim = self.claim_train()
            self.parked = await self.serve_values(self.client, self.parked)

    async def serve_values(
        self, client: AsyncClient, parked: list[tuple[Batch, list[int], float]]
    ) -> list[tuple[Batch, list[int], float]]:
        """Write values for the parked rows the current critic version may serve; keep the others."""
        still = []
        for batch, rows, since in parked:
            needs = batch.meta_of(MIN_VERSION, 0)
            ready = [i for i in rows if int(needs[i] or 0) <= self.version]
            later = [i for i in rows if int(needs[i] or 0) > self.version]
            if ready:
                columns = await asyncio.to_thread(self.values, batch, ready)
                ids = batch.ids[ready]
                # counted ahead of the effects; rows a predecessor counted are only finished
                self.valued += sum(int(i) not in self.replay_values for i in ids.tolist())
                self.replay_values -= set(ids.tolist())
                self.valuing = ids.tolist()
                self.persist()
                await put_missing_async(
                    client, batch.partition, columns, ids
                )  # keeps what a predecessor wrote
                await client.ack(batch, None if not later and len(ready) == len(batch) else ids)
            if later:
                if time.monotonic() - since > LEASE_S / 3:
                    await client.renew(batch, LEASE_S)
                    since = time.monotonic()
                still.append((batch, later, since))
        return still

    def values(self, batch: Batch, rows: list[int]) -> dict[str, Any]:
        self.phase(f"valuing {len(rows)} samples with version {self.version}")
        prompts = Ragged.from_list([batch.ragged(PROMPT)[i] for i in rows])
        responses = Ragged.from_list([batch.ragged(RESPONSE)[i] for i in rows])
        segments = Ragged.from_list([batch.ragged(SEGMENTS)[i] for i in rows]) if SEGMENTS in batch else None
        packed = pack(
            prompts, responses, None, torch.zeros(len(rows)), torch.ones(len(rows), dtype=torch.bool),
            segments=segments, images=vision.from_batch(batch, rows),
        )  # fmt: skip
        v = self.engine.compute_values(packed, self.config.memory.micro_batch)
        return {VALUES: [v[k][packed.mask[k]] for k in range(len(rows))]}

    def train(self, batch: Batch) -> None:
        """One critic version: a batch of samples in `mini_batches` optimizer steps. The mini-batches are
        cut from the batch sorted by rollout's group sequence, so their composition does not depend on
        the order in which rows became ready (a resumed run cuts the same ones)."""
        cfg = self.config
        self.phase(f"training version {self.version + 1} on {len(batch)} samples")
        groups = torch.tensor(batch.meta_of(GROUP, 0), dtype=torch.int64)
        members = torch.tensor(batch.meta_of(MEMBER, 0), dtype=torch.int64)
        order = torch.argsort(groups * 65536 + members, stable=True)
        for index in order.chunk(cfg.mini_batches):
            self.train_minibatch(batch, index.tolist())
        self.version += 1
        self.record()

    def train_minibatch(self, batch: Batch, index: list[int]) -> None:
        valid = batch.tensor(VALID).bool()[index]
        pick = lambda name: Ragged.from_list([batch.ragged(name)[i] for i in index])  # noqa: E731
        packed = pack(
            pick(PROMPT), pick(RESPONSE), None, torch.zeros(len(index)), valid,
            values=pick(VALUES), returns=pick(RETURNS), segments=pick(SEGMENTS) if SEGMENTS in batch else None,
            images=vision.from_batch(batch, index),
        )  # fmt: skip
        assert packed.values is not None and packed.returns is not None
        m = packed.mask
        returns, old = packed.returns[m].double(), packed.values[m].double()
        var = float(returns.var(unbiased=False)) if len(returns) > 1 else 0.0
        explained = 1.0 - float((returns - old).var(unbiased=False)) / var if var > 0 else 0.0
        stats = self.engine.update_value(packed, clip=self.config.value_clip, epochs=self.config.epochs)
        self.stats.append(
            {
                **stats,
                "explained_variance": explained,
                "returns_mean": float(returns.mean()) if len(returns) else 0.0,
            }
        )
        self.minibatches += 1

    async def reach(self, step: int) -> None:
        """Checkpoint after trainer step `step` - 1: first train every batch up to it (always possible:
        the trainer has consumed those batches, so their returns are written)."""
        while self.version < step:
            self.version_changed.clear()
            await self.version_changed.wait()

    def progress(self) -> dict[str, Any]:
        """What the critic saves besides its weights and optimizer: in a checkpoint, and in its state file
        ahead of every effect (with the rows of the effect in flight)."""
        return {
            "version": self.version, "minibatches": self.minibatches, "valued": self.valued, "stats": self.stats,
            "steps": self.engine.steps, "metrics_lines": self.metrics.lines,
            "valuing": self.valuing, "training": self.training,
        }  # fmt: skip

    def take_progress(self, progress: dict[str, Any]) -> int:
        """Take the counters of `progress`; returns its metrics lines."""
        self.version, self.minibatches = int(progress["version"]), int(progress["minibatches"])
        self.valued, self.stats = int(progress["valued"]), list(progress["stats"])
        return int(progress["metrics_lines"])

    async def save_state(self, directory: Path) -> None:
        await asyncio.to_thread(self.engine.save_checkpoint, str(directory / self.ctx.name))
        ckpt.save_json(directory / f"{self.ctx.name}.json", self.progress())

    def load_state(self, directory: Path) -> int:
        """Resume from a checkpoint: its weights, optimizer state and progress."""
        self.engine.load_checkpoint(str(directory / self.ctx.name))
        lines = self.take_progress(ckpt.load_json(directory / f"{self.ctx.name}.json"))
        self.log.info("resumed from %s at critic version %d", directory, self.version)
        return lines

    def persist(self) -> None:
        """Write the progress, ahead of the data-plane effect about to happen (see the module's doc)."""
        self.state.write(self.progress())

    def rejoin(self, state: dict[str, Any]) -> int:
        """Take over from a predecessor of this launch: its progress, the latest checkpoint's weights."""
        latest = ckpt.latest(self.ctx.run_dir)
        weights = "the initial weights"
        if latest is not None and (latest / f"{self.ctx.name}.json").exists():
            self.engine.load_checkpoint(str(latest / self.ctx.name))
            saved = ckpt.load_json(latest / f"{self.ctx.name}.json")["version"]
            weights = f"the weights of {latest.name} (critic version {saved})"
        self.engine.continue_schedule(int(state["steps"]))
        self.replay_values, self.replay_train = set(state["valuing"]), set(state["training"])
        self.log.warning("re-joined the run at critic version %d with %s", state["version"], weights)
        return self.take_progress(state)  # the metrics lines: a line its predecessor wrote after is cut

    def record(self) -> None:
        stats, self.stats = self.stats, []
        now = time.perf_counter()
        row = {
            "version": self.version,
            **merged(stats),
            "time/step_s": now - self.last,
            "valued": self.valued,
        }
        self.last = now
        self.metrics.write(row)
        self.ctx.health.info.update(version=self.version, valued=self.valued)
        if row["nan_skipped"] >= len(stats) * self.config.epochs:  # not one step of this version counted
            raise FloatingPointError("every critic update of a batch had a non-finite loss or gradient")
