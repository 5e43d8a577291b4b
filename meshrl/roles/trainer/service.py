"""The training service: claim whole groups, update the policy, publish weights, open the gate.

Every rank of the trainer replica claims its own share of each step straight from the data plane
(consumer name "trainer", whole groups), so no rank ever forwards samples to another: with
`mix_groups` the share at once, split at random into the step's mini-batches, else a mini-batch of
whole groups at a time. A loader thread claims and packs the next mini-batch while the current one
trains (`loader.py`). After each step
rank 0 publishes the new weight version to the inference replicas, which then opens the gate
(`publish.py`), and appends the step's metrics to <run_dir>/metrics.jsonl (`report.py`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshrl.algorithms import advantages as adv
from meshrl.algorithms.distill import reverse_kl_advantages
from meshrl.algorithms.losses import AdaptiveKL
from meshrl.engines.fsdp import FSDPEngine
from meshrl.engines.packing import TrainBatch
from meshrl.engines.settings import GAESettings
from meshrl.observe.follow import NO_SIGNAL_STEPS, no_signal_advice
from meshrl.observe.metrics import JsonlSink
from meshrl.roles.trainer.config import TrainerConfig
from meshrl.roles.trainer.loader import CLAIM_POLL_S, Loader, MiniBatch
from meshrl.roles.trainer.publish import Publisher
from meshrl.roles.trainer.report import SampleLog, sample_metrics, step_row
from meshrl.runtime.service import Service
from meshrl.schema import BY, CHECKPOINT, CHECKPOINT_ACKS, STEP
from meshrl.state import checkpoint as ckpt


class TrainerService(Service):
    def setup(self) -> None:
        cfg = self.config
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        replica = self.ctx.replica
        self.rank = self.ctx.process.worker
        self.world = replica.world_size
        host, port = replica.master
        backend = "nccl" if self.ctx.device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            init_method=f"tcp://{self.ctx.address(host)}:{port}",
            rank=self.rank,
            world_size=self.world,
            timeout=timedelta(minutes=30),
        )
        run, wiring = self.ctx.run, self.ctx.wiring
        self.engine: Any
        if cfg.engine == "sim":
            from meshrl.engines.sim import SimTrainEngine

            self.engine = SimTrainEngine(cfg.sim, lr=cfg.optim.lr)
        else:
            weights = wiring.weights
            self.engine = FSDPEngine(
                cfg.model, cfg.optim, memory=cfg.memory, lora=cfg.adapters(), device=self.ctx.device,
                total_steps=run.total_steps * cfg.mini_batches, loader_kwargs=cfg.loader_kwargs,
                seed=run.seed, head="lm+value" if cfg.value.head else "lm", temperature=run.temperature,
                publish_adapters=weights is not None and weights.adapters is not None,
                train_vision=cfg.train_vision,
            )  # fmt: skip
        # the actor-critic computes GAE with the settings of the rollout that writes its token rewards
        self.gae: GAESettings | None = wiring.inputs.get("gae")
        self.client = self.ctx.client()
        self.loader: Loader | None = None
        self.publisher = Publisher(self.ctx, self.engine, cfg.bucket_mb, self.client.core.pool)
        self.version = 0
        self.start_step = 0
        self.nan_streak = 0
        self.kl = AdaptiveKL(cfg.kl.coef, cfg.kl.target, cfg.kl.horizon)
        self.quiet_steps = 0  # steps in a row in which no group's rewards differed
        metrics_lines = 0  # a fresh run starts a fresh metrics.jsonl
        if self.ctx.resume is not None:
            metrics_lines = self.resume(self.ctx.resume)
        self.metrics = (
            JsonlSink(self.ctx.run_dir / "metrics.jsonl", keep=metrics_lines) if self.rank == 0 else None
        )
        shown = self.ctx.run.log.samples_per_step
        self.samples = (
            SampleLog(self.ctx.run_dir / "samples.jsonl", cfg.model, shown, fresh=self.ctx.resume is None)
            if self.rank == 0 and shown
            else None
        )

    @property
    def config(self) -> TrainerConfig:
        cfg = self.ctx.config
        assert isinstance(cfg, TrainerConfig)
        return cfg

    # ---------------------------------------------------------------------------------------------------

    def run(self) -> None:
        cfg = self.config
        total = self.ctx.run.total_steps
        every = self.ctx.run.checkpoint_every
        # A step's metrics line covers the time since the line before: the publication that opened the
        # step, the wait for its data, its training. It is written before the next publication, whose
        # announcement wakes every inference replica: bookkeeping after it would compete with dozens
        # of processes for a few cores.
        last_line = time.perf_counter()
        # inference starts from exactly the trainer's weights (after a resume: the gate of this version
        # was written before the checkpoint and must not be written twice)
        with self.device_turn():
            sync_s = self.publish(final=False, gate=self.start_step == 0)
        for step in range(self.start_step, total):
            # sharing devices in a ring, the step's data must all be there before the trainer takes the
            # devices: its mini-batches come from the generation it would otherwise keep off them
            t0 = time.perf_counter()
            ready = (
                [self.next_minibatch(step, k) for k in range(cfg.mini_batches)]
                if self.ring is not None
                else []
            )
            t1 = time.perf_counter()
            self.phase(f"waiting for the devices (step {step + 1})")
            with self.device_turn():
                ring_s = time.perf_counter() - t1
                rows, stats, wait_s, train_s = self.train_step(step, ready)
                self.version += 1
                now = time.perf_counter()
                self.record(
                    step, rows, stats, wait_s=wait_s + t1 - t0, train_s=train_s, sync_s=sync_s,
                    step_s=now - last_line, ring_s=ring_s,
                )  # fmt: skip
                last_line = now
                sync_s = self.publish(final=step == total - 1)
                if step == total - 1 and cfg.save_final:  # still holding the devices, if in a ring
                    self.engine.save_pretrained(str(self.ctx.run_dir / "final"), source=cfg.model)
            self.ctx.health.info.update(step=step + 1, version=self.version)
            if every and (step + 1) % every == 0 and step + 1 < total:
                self.phase(f"checkpointing step {step + 1}")
                with self.device_turn():
                    self.checkpoint(step + 1)
        self.phase("finishing: the last publication, then waiting for rollout's last evaluation")
        self.publisher.finish()
        self.client.flush()  # the acks first: closing the loader's connection hands back its open claims
        if self.loader is not None:
            self.loader.close()  # the mini-batches claimed ahead go back to the pool
        while not self.finished():  # rollout ends the run once its last evaluation is in
            time.sleep(0.2)

    def train_step(
        self, step: int, ready: list[MiniBatch]
    ) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, float]], float, float]:
        """One optimizer step per mini-batch (taken here as each is ready, or given in `ready`).
        Returns the per-row summaries, the update statistics, and the seconds waiting and training."""
        cfg = self.config
        rows: list[dict[str, torch.Tensor]] = []
        stats: list[dict[str, float]] = []
        wait_s = train_s = 0.0
        for k in range(cfg.mini_batches):  # streaming: train on each mini-batch as soon as it is ready
            t0 = time.perf_counter()
            mini = ready[k] if ready else self.next_minibatch(step, k)
            t1 = time.perf_counter()
            self.phase(f"training mini-batch {k + 1}/{cfg.mini_batches} of step {step + 1}")
            summary = mini.summary
            summary["staleness"] = self.version - mini.born
            keep = torch.ones(len(mini.batch), dtype=torch.bool)
            if cfg.max_staleness is not None:
                keep = summary["staleness"] <= cfg.max_staleness
            summary["dropped"] = ~keep
            if self.samples is not None:
                self.samples.take(mini.batch, summary, self.version)
            if keep.any():
                stats.append(self.train(mini, keep, summary))
            # the rows go now (retention); all used was copied. A part of a claim: its rows by id
            self.client.ack(mini.batch, mini.batch.ids if mini.part else None, wait=False)
            rows.append(summary)
            wait_s += t1 - t0
            train_s += time.perf_counter() - t1
        return rows, stats, wait_s, train_s

    def next_minibatch(self, step: int, k: int) -> MiniBatch:
        """This rank's share of mini-batch `k` of `step`, packed, all columns ready: whole groups, or with
        `mix_groups` a random part of this rank's share of the step (claimed whole, then split). Waits as
        long as needed; the loader has usually claimed and packed it while the one before trained."""
        self.phase(
            f"waiting for mini-batch {k + 1}/{self.config.mini_batches} of step {step + 1} (generation, scoring)"
        )
        if self.loader is None:
            cfg = self.config
            # mixed groups: one claim of the step's rows, split at random; else a claim per mini-batch
            split = cfg.mini_batches if cfg.mix_groups else 1
            n = self.ctx.run.batch_size // cfg.mini_batches * split // self.world
            self.loader = Loader(
                self.ctx.client(f"{self.ctx.name}-loader"), self.ctx.wiring.claim("train"), cfg, n,
                self.ctx.run.group_size, split, self.ctx.run.seed,
            )  # fmt: skip
        while True:
            mini = self.loader.get(timeout=CLAIM_POLL_S)
            if mini is not None:
                return mini
            if self.finished(every=5.0):
                raise RuntimeError("the run ended before the trainer received its next batch")

    def train(
        self, mini: MiniBatch, keep: torch.Tensor, summary: dict[str, torch.Tensor]
    ) -> dict[str, float]:
        cfg = self.config
        packed = mini.packed
        if not bool(keep.all()):
            packed = packed.rows(keep.nonzero().squeeze(-1))
        packed.stale = mini.born[keep] < self.version
        critic: dict[str, float] = {}
        if cfg.value.head:
            critic = self.actor_critic_advantages(packed)
            summary["advantage"][keep] = _masked_row_means(packed.advantages, packed.mask)
        if cfg.distill.advantage > 0 or cfg.loss.pg_coef != 1.0:
            packed.advantages = distilled_advantages(packed, cfg)
        kl = cfg.kl if cfg.kl.target is None else dataclasses.replace(cfg.kl, coef=self.kl.coef)
        stats = self.engine.update_policy(
            packed, cfg.loss, kl=kl, distill=cfg.distill, value=cfg.value, moe=cfg.moe, epochs=cfg.epochs
        )
        stats.update(critic)
        if cfg.kl.target is not None:
            stats["kl_coef"] = kl.coef
            self.kl.update(stats["kl_ref"], int(keep.sum()) * self.world)
        if stats["nan_skipped"]:
            self.nan_streak += 1
            self.log.warning("update skipped: non-finite loss or gradient (%d in a row)", self.nan_streak)
            if self.nan_streak >= cfg.max_nan_steps:
                raise FloatingPointError(
                    f"{self.nan_streak} consecutive updates had a non-finite loss or gradient; stopping "
                    "(lower trainer.optim.lr or check the rewards)"
                )
        else:
            self.nan_streak = 0
        return stats

    def actor_critic_advantages(self, packed: TrainBatch) -> dict[str, float]:
        """The value head's values for `packed` (weights before this mini-batch's update: at window 1,
        for the first mini-batch, those that generated it), then GAE over the per-token rewards in
        `packed.advantages`; sets packed.values, .returns and .advantages (whitened over the whole
        mini-batch, every rank's rows, when the rollout whitens). Returns the explained variance of
        the returns by the values, and the returns' mean."""
        cfg, gae_cfg = self.config, self.gae
        assert gae_cfg is not None  # the planner hands the value head its GAE settings
        mask = packed.mask
        values = self.engine.compute_values(packed, cfg.memory.micro_batch)
        advantage, returns = adv.gae(packed.advantages, values, mask, gamma=gae_cfg.gamma, lam=gae_cfg.lam)
        r, v = returns[mask].double(), values[mask].double()
        a = advantage[mask].double()
        sums = [len(r), a.sum(), (a**2).sum(), r.sum(), (r**2).sum(), (r - v).sum(), ((r - v) ** 2).sum()]
        n, a_sum, a_sq, r_sum, r_sq, e_sum, e_sq = self.engine.all_sum([float(x) for x in sums])
        if gae_cfg.whiten and n > 1:
            mean = a_sum / n
            std = math.sqrt(max(a_sq / n - mean**2, 0.0))  # as adv.whiten, over every rank's tokens
            advantage = torch.where(mask, (advantage - mean) / (std + 1e-8), 0.0)
        packed.values, packed.returns, packed.advantages = values, returns, advantage
        var = r_sq / max(n, 1) - (r_sum / max(n, 1)) ** 2
        resid = e_sq / max(n, 1) - (e_sum / max(n, 1)) ** 2
        return {
            "explained_variance": 1.0 - resid / var if var > 1e-12 else 0.0,
            "returns_mean": r_sum / max(n, 1),
        }

    def publish(self, *, final: bool, gate: bool = True) -> float:
        """Publish the current weights as `self.version` (see publish.py); returns the seconds taken here."""
        self.phase(f"publishing version {self.version}")
        if self.config.loss.off_policy == "decoupled":  # the proximal policy of the coming step's loss
            self.engine.snapshot()
        return self.publisher.publish(self.version, final=final, gate=gate)

    # ---------------------------------------------------------------------------------------------------
    # checkpoints (the protocol is described in meshrl/state/checkpoint.py)

    def checkpoint(self, step: int) -> None:
        """Steps 0..step-1 are done and version `step` is published: save the whole run. A failure
        (typically a full disk) removes the partial directory and stops with the cause; the checkpoint
        before stays whole."""
        # imported here: torch.distributed.checkpoint brings DTensor and sympy (0.6 s of every start-up)
        from torch.distributed.checkpoint.api import CheckpointException

        tmp = ckpt.tmp_dir(self.ctx.run_dir, step)
        try:
            self._checkpoint(step, tmp)
        except (OSError, RuntimeError, CheckpointException) as e:
            if self.rank != 0:
                raise
            free = shutil.disk_usage(tmp.parent).free / 2**20 if tmp.parent.exists() else float("nan")
            shutil.rmtree(tmp, ignore_errors=True)
            before = ckpt.latest(self.ctx.run_dir)
            cause = str(e).strip().splitlines()[-1]  # the last line: a failed DCP save lists every rank's
            raise RuntimeError(
                f"checkpoint {step} could not be written to {tmp.parent} ({free:.1f} MB free there: a full "
                f"disk fails like this): {cause}. The checkpoint before, {before.name if before else '(none)'}, "
                "is intact: free some space and continue with `meshrl run RECIPE --resume`"
            ) from e

    def _checkpoint(self, step: int, tmp: Path) -> None:
        t0 = time.perf_counter()
        run_dir = self.ctx.run_dir
        if self.rank == 0:
            self.publisher.wait()  # the gate of this version is in the data plane
            self.client.flush()  # and so are this step's acks
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        if self.world > 1:
            dist.barrier()
        self.engine.save_checkpoint(str(tmp / "trainer"))
        if self.rank != 0:
            dist.barrier()  # rank 0 commits
            return
        ckpt.save_json(tmp / "trainer.json", {
            "step": step, "version": self.version, "nan_streak": self.nan_streak, "kl_coef": self.kl.coef,
            "metrics_lines": step, "torch_rng": torch.get_rng_state().tolist(),
        })  # fmt: skip
        self.client.put(CHECKPOINT, {STEP: torch.tensor([step])}, meta=[{"dir": str(tmp)}])
        waiting = set(self.ctx.wiring.checkpoint)  # every process of the stateful groups
        while waiting:
            batch = self.client.claim(CHECKPOINT_ACKS, "trainer", [STEP], 64, timeout=5.0)
            for s, meta in zip(batch.tensor(STEP).tolist() if batch else [], batch.meta or [], strict=False):
                if s == step:
                    waiting.discard(str((meta or {}).get(BY)))
            if batch:
                self.client.ack(batch)
            if waiting and self.finished(every=5.0):
                raise RuntimeError(f"the run ended while checkpoint {step} waited for {sorted(waiting)}")
        self.client.snapshot(tmp / "dataplane")
        ckpt.save_json(tmp / "recipe.json", json.loads((run_dir / "config.json").read_text()))
        final = ckpt.commit(tmp, step, self.ctx.run.keep_checkpoints)
        self.client.put(CHECKPOINT, {STEP: torch.tensor([step])}, meta=[{ckpt.DONE: True}])
        if self.world > 1:
            dist.barrier()
        self.log.info("checkpoint %s in %.2fs", final.name, time.perf_counter() - t0)

    def resume(self, path: Path) -> int:
        """Continue from checkpoint `path`; returns the metrics lines written before it."""
        state = ckpt.load_json(path / "trainer.json")
        self.engine.load_checkpoint(str(path / "trainer"))
        self.start_step, self.version = int(state["step"]), int(state["version"])
        self.nan_streak = int(state["nan_streak"])
        self.kl.coef = float(state["kl_coef"])
        torch.set_rng_state(torch.tensor(state["torch_rng"], dtype=torch.uint8))
        self.log.info("resumed from %s at step %d (version %d)", path, self.start_step, self.version)
        return int(state["metrics_lines"])

    def record(
        self, step: int, parts: list[dict[str, torch.Tensor]], stats: list[dict[str, float]], **times: float
    ) -> None:
        """Reduce the step's per-row summaries over ranks; rank 0 appends a line to metrics.jsonl."""
        samples = sample_metrics(parts, dist.group.WORLD if self.world > 1 else None)
        self.warn_without_signal(step, samples.get("no_signal_fraction", 0.0))
        if self.metrics is not None:
            times["publish_s"] = self.publisher.publish_s
            self.metrics.write(step_row(step, self.version, samples, stats, times))
        if self.samples is not None:
            self.samples.write(step, self.version)

    def warn_without_signal(self, step: int, no_signal: float) -> None:
        """A run in which every group's rewards agree (all 0 or all 1) learns nothing: say so, with what
        to try, after NO_SIGNAL_STEPS such steps in a row (and every 10 more)."""
        self.quiet_steps = self.quiet_steps + 1 if no_signal >= 0.999 else 0
        n = self.quiet_steps
        if self.rank == 0 and n >= NO_SIGNAL_STEPS and (n - NO_SIGNAL_STEPS) % 10 == 0:
            self.log.warning("step %d: %s", step, no_signal_advice(n))

    def offload(self) -> None:
        self.engine.offload(str(self.ctx.run_dir / "offload" / f"{self.ctx.name}.bin"))

    def restore(self) -> None:
        self.engine.restore()

    def close(self) -> None:
        if hasattr(self, "publisher"):
            self.publisher.close()
        if getattr(self, "samples", None) is not None:
            self.samples.close()  # type: ignore[union-attr]
        if hasattr(self, "client"):
            self.client.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        super().close()


def distilled_advantages(packed: TrainBatch, cfg: TrainerConfig) -> torch.Tensor:
    """Per-token advantages [n, L-1]: loss.pg_coef x the task advantage plus distill.advantage x each
    teacher's weight x (its logprob - the behaviour logprob) of every sampled token."""
    adv, distill = packed.advantages, cfg.distill
    adv = cfg.loss.pg_coef * (adv.unsqueeze(-1).expand(packed.mask.shape) if adv.dim() == 1 else adv)
    for name, (_, _, sampled) in packed.teachers.items() if distill.advantage > 0 else ():
        adv = adv + distill.advantage * distill.teachers[name] * reverse_kl_advantages(
            sampled, packed.old_logprobs, packed.mask
        )
    return torch.where(packed.mask, adv, 0.0)


def _masked_row_means(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (torch.where(mask, x, 0.0).sum(1) / mask.sum(1).clamp_min(1)).float()
