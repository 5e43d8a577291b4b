"""The training service: claim whole groups, update the policy, publish weights, open the gate.

Every rank of the trainer replica claims its own share of each step's groups straight from the data
plane (consumer name "trainer", whole groups), so no rank ever forwards samples to another. Rank 0
publishes each new weight version to the inference replicas, then writes the gate row that lets
rollout start the next step, and appends the step's metrics to <run_dir>/metrics.jsonl.
"""

from __future__ import annotations

import json
import math
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from meshrl.dataplane import Batch
from meshrl.engines.fsdp import FSDPEngine, OptimConfig, pack
from meshrl.roles import GATE, SAMPLES
from meshrl.roles.trainer.config import TrainerConfig
from meshrl.service import Service
from meshrl.weights import WeightGroup

CLAIM_POLL_S = 1.0


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
        recipe = self.ctx.recipe
        optim = OptimConfig(
            lr=cfg.lr,
            schedule=cfg.schedule,
            warmup_steps=cfg.warmup_steps,
            total_steps=recipe.total_steps * cfg.mini_batches,
            weight_decay=cfg.weight_decay,
            betas=cfg.betas,
            grad_clip=cfg.grad_clip,
        )
        self.engine = FSDPEngine(
            cfg.model, optim, device=self.ctx.device, loader_kwargs=cfg.loader_kwargs, seed=recipe.seed
        )
        self.client = self.ctx.client()
        self.weights: WeightGroup | None = None
        if self.rank == 0:
            members = [r for r in self.ctx.topology.replicas if r.group in cfg.inference]
            whost, wport = replica.weights_endpoint
            self.weights = WeightGroup(
                self.ctx.address(whost), wport, 0, 1 + len(members), device=str(self.ctx.device)
            )
        self.version = 0
        self.nan_streak = 0
        self.metrics_file = self.ctx.run_dir / "metrics.jsonl"
        if self.rank == 0:
            self.metrics_file.write_text("")  # a fresh run starts a fresh file

    @property
    def config(self) -> TrainerConfig:
        cfg = self.ctx.config
        assert isinstance(cfg, TrainerConfig)
        return cfg

    # ---------------------------------------------------------------------------------------------------

    def run(self) -> None:
        total = self.ctx.recipe.total_steps
        sync_s = self.publish(final=False)  # version 0: inference starts from exactly the trainer's weights
        last_gate = time.perf_counter()
        for step in range(total):
            t0 = time.perf_counter()
            batch = self.claim_step()
            t1 = time.perf_counter()
            stats = self.train(batch)
            t2 = time.perf_counter()
            self.version += 1
            sync_s = self.publish(final=step == total - 1)
            self.client.ack(batch)
            self.client.delete(SAMPLES, batch.ids)
            now = time.perf_counter()
            self.record(
                step, batch, stats, wait_s=t1 - t0, train_s=t2 - t1, sync_s=sync_s, step_s=now - last_gate
            )
            last_gate = now
            self.ctx.health.info.update(step=step + 1, version=self.version)
        if self.weights is not None:
            self.weights.close()
        if self.config.save_final:
            self.engine.save_pretrained(str(self.ctx.run_dir / "final"), tokenizer_from=self.config.model)
        while not self.finished():  # rollout ends the run once its last evaluation is in
            time.sleep(0.2)

    def claim_step(self) -> Batch:
        """This rank's share of the step: whole groups, all columns ready. Waits as long as it takes."""
        cfg = self.config
        n = cfg.batch_size // self.world
        while True:
            batch = self.client.claim(
                SAMPLES, "trainer", cfg.columns(), n, min_n=n, group_size=cfg.group_size,
                timeout=CLAIM_POLL_S, lease=3600,
            )  # fmt: skip
            if batch:
                return batch
            if self.finished(every=5.0):
                raise RuntimeError("the run ended before the trainer received its next batch")

    def train(self, batch: Batch) -> dict[str, float]:
        cfg = self.config
        ref = batch.ragged("ref_logprobs").tolist() if "ref_logprobs" in batch else None
        packed = pack(
            batch.ragged("prompt").tolist(),
            batch.ragged("response").tolist(),
            batch.ragged("logprobs").tolist(),
            batch.tensor("advantage"),
            batch.tensor("valid"),
            ref_logprobs=ref,
        )
        stats = self.engine.update_policy(packed, cfg)
        if stats["nan_skipped"]:
            self.nan_streak += 1
            self.log.warning("step skipped: non-finite loss or gradient (%d in a row)", self.nan_streak)
            if self.nan_streak >= cfg.max_nan_steps:
                raise FloatingPointError(
                    f"{self.nan_streak} consecutive steps had a non-finite loss or gradient; stopping "
                    "(lower trainer.lr or check the rewards)"
                )
        else:
            self.nan_streak = 0
        return stats

    def publish(self, *, final: bool) -> float:
        """Broadcast the current weights as `self.version`, then open the gate for it."""
        t0 = time.perf_counter()
        weights = self.engine.get_weights(self.config.bucket_mb << 20)
        if self.rank == 0:
            assert self.weights is not None
            self.weights.send(
                self.version, self.engine.manifest(), weights, bucket_bytes=self.config.bucket_mb << 20
            )
        else:
            for _ in weights:  # take part in the gather
                pass
        if self.rank == 0:
            meta: list[Any] = [{"final": final, "step": self.version}]
            self.client.put(GATE, {"version": torch.tensor([self.version])}, meta=meta)
        return time.perf_counter() - t0

    def record(self, step: int, batch: Batch, stats: dict[str, float], **times: float) -> None:
        valid = batch.tensor("valid").bool()
        reward = batch.tensor("reward")[valid].double()
        adv = batch.tensor("advantage")[valid].double()
        lengths = batch.ragged("response").lengths.double()
        gen = {}
        for b, s in zip(batch.tensor("gen_batch").tolist(), batch.tensor("gen_s").tolist(), strict=True):
            gen[b] = s
        local = [
            float(reward.sum()), float((reward**2).sum()), float(len(reward)), float(len(valid) - len(reward)),
            float(adv.sum()), float((adv**2).sum()), float(lengths.sum()), float(len(lengths)), sum(gen.values()),
        ]  # fmt: skip
        t = torch.tensor(local, dtype=torch.float64)
        mx = torch.tensor(
            [float(lengths.max()), float(adv.abs().max()) if len(adv) else 0.0, sum(gen.values())],
            dtype=torch.float64,
        )
        if self.world > 1:
            dist.all_reduce(t)
            dist.all_reduce(mx, op=dist.ReduceOp.MAX)
        r_sum, r_sq, r_n, failed, a_sum, a_sq, l_sum, l_n, _ = t.tolist()
        gen_s = float(mx[2])  # ranks may share inference batches: count the busiest rank's
        if self.rank != 0:
            return
        mean = r_sum / max(r_n, 1)
        a_mean = a_sum / max(r_n, 1)
        step_s = times["step_s"]
        compute = gen_s + stats["time/forward_backward_s"] + stats["time/optimizer_s"]
        row = {
            "step": step,
            "version": self.version,
            "reward_mean": mean,
            "reward_std": math.sqrt(max(r_sq / max(r_n, 1) - mean**2, 0.0)),
            "advantage_mean": a_mean,
            "advantage_std": math.sqrt(max(a_sq / max(r_n, 1) - a_mean**2, 0.0)),
            "advantage_absmax": float(mx[1]),
            "response_len_mean": l_sum / max(l_n, 1),
            "response_len_max": float(mx[0]),
            "failed": failed,
            **{k: v for k, v in stats.items() if not k.startswith("time/")},
            "time/step_s": step_s,
            "time/generate_s": gen_s,
            "time/train_s": times["train_s"],
            "time/forward_backward_s": stats["time/forward_backward_s"],
            "time/optimizer_s": stats["time/optimizer_s"],
            "time/sync_s": times["sync_s"],
            "time/wait_s": times["wait_s"],
            "overhead_fraction": max(0.0, 1.0 - compute / step_s) if step_s > 0 else 0.0,
            "samples_per_s": l_n / step_s if step_s > 0 else 0.0,
        }
        with open(self.metrics_file, "a") as f:
            f.write(json.dumps(row) + "\n")

    def close(self) -> None:
        if hasattr(self, "client"):
            self.client.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        super().close()
