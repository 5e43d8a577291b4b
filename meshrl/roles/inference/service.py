"""The inference service: turn prompt rows into completions with the latest published weights.

Two claims are kept in flight on one asyncio client, training prompts (`samples`) and held-out prompts
(`eval`); replicas share the work under the consumer name "inference". New weights arrive on a thread
that waits in the weight group's broadcast; it takes the engine's lock while it loads them, so a batch
is generated entirely with one version, and every completion records that version.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Any

import torch

from meshrl.dataplane import AsyncClient, Batch
from meshrl.engines.base import InferenceEngine, SamplingParams
from meshrl.roles import EVAL, SAMPLES
from meshrl.roles.inference.config import InferenceConfig
from meshrl.roles.trainer.config import TrainerConfig
from meshrl.service import Service
from meshrl.weights import WeightGroup

POLL_S = 1.0
LEASE_S = 300.0  # a replica that dies mid-batch gives its prompts back after this long


class InferenceService(Service):
    def setup(self) -> None:
        cfg = self.config
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.engine = self.build_engine()
        trainer_cfg = self.ctx.recipe.group(cfg.trainer).config
        assert isinstance(trainer_cfg, TrainerConfig)
        members = [r for r in self.ctx.topology.replicas if r.group in trainer_cfg.inference]
        trainer = self.ctx.topology.replicas_of(cfg.trainer)[0]
        host, port = trainer.weights_endpoint
        self.weights = WeightGroup(
            self.ctx.address(host),
            port,
            1 + members.index(self.ctx.replica),
            1 + len(members),
            device=str(self.ctx.device),
        )
        self.batches = 0
        self.generated = 0
        self.lock = threading.Lock()
        self.receiver_error: BaseException | None = None
        threading.Thread(target=self.receive_weights, name="weights", daemon=True).start()

    @property
    def config(self) -> InferenceConfig:
        cfg = self.ctx.config
        assert isinstance(cfg, InferenceConfig)
        return cfg

    def build_engine(self) -> InferenceEngine:
        from meshrl.engines.hf import HFEngine

        cfg = self.config
        return HFEngine(
            cfg.model,
            device=str(self.ctx.device),
            loader_kwargs=cfg.loader_kwargs,
            max_batch_size=cfg.max_batch,
        )

    def run(self) -> None:
        asyncio.run(self.serve())

    async def serve(self) -> None:
        cfg = self.config
        client = await AsyncClient.connect(self.ctx.controller, secret=self.ctx.secret, name=self.ctx.name)
        pending = {
            kind: asyncio.create_task(self.claim(client, kind, cfg.max_batch)) for kind in (EVAL, SAMPLES)
        }
        try:
            while not self.finished():
                if self.receiver_error is not None:
                    raise RuntimeError("weight receiver failed") from self.receiver_error
                await asyncio.wait(pending.values(), timeout=POLL_S, return_when=asyncio.FIRST_COMPLETED)
                for kind, task in list(pending.items()):
                    if not task.done():
                        continue
                    batch = task.result()
                    if batch:
                        with self.lock:
                            columns = self.generate(batch, eval_rows=kind == EVAL)
                        await client.put(kind, columns, ids=batch.ids)
                        await client.ack(batch)
                    pending[kind] = asyncio.create_task(self.claim(client, kind, cfg.max_batch))
        finally:
            for task in pending.values():
                task.cancel()
            for task in pending.values():
                with contextlib.suppress(BaseException):
                    await task
            await client.close()

    @staticmethod
    async def claim(client: AsyncClient, kind: str, n: int) -> Batch:
        return await client.claim(kind, "inference", ["prompt"], n, timeout=POLL_S, lease=LEASE_S)

    def receive_weights(self) -> None:
        """Thread: wait for each publication, then load it under the engine lock."""
        try:
            while True:
                header = self.weights.wait()
                t0 = time.perf_counter()
                with self.lock:
                    version = self.weights.receive(header, self.engine.load_weights)
                    self.engine.set_version(version)
                self.ctx.health.info["version"] = version
                self.log.info("weights version %d applied in %.3fs", version, time.perf_counter() - t0)
        except BaseException as e:  # surfaced by the main loop
            self.receiver_error = e

    def generate(self, batch: Batch, *, eval_rows: bool) -> dict[str, Any]:
        cfg = self.config
        prompts = [t.tolist() for t in batch.ragged("prompt")]
        greedy = batch.meta_of("greedy", False) if eval_rows else [False] * len(prompts)
        out: list[Any] = [None] * len(prompts)
        t0 = time.perf_counter()
        for mode in (False, True):
            index = [i for i, g in enumerate(greedy) if bool(g) == mode]
            if not index:
                continue
            params = SamplingParams(
                temperature=0.0 if mode else cfg.temperature,
                top_k=cfg.top_k,
                top_p=cfg.top_p,
                max_new_tokens=cfg.max_new_tokens,
                seed=self.ctx.recipe.seed * 1_000_003 + self.ctx.replica.index * 100_003 + self.batches,
            )
            for i, completion in zip(
                index, self.engine.generate([prompts[i] for i in index], params), strict=True
            ):
                out[i] = completion
        gen_s = time.perf_counter() - t0
        self.batches += 1
        self.generated += len(prompts)
        self.ctx.health.info.update(batches=self.batches, generated=self.generated)
        n = len(prompts)
        version = self.engine.version
        return {
            "response": [torch.tensor(c.tokens, dtype=torch.int64) for c in out],
            "logprobs": [torch.tensor(c.logprobs, dtype=torch.float32) for c in out],
            "version": torch.tensor([[version, version]] * n, dtype=torch.int64),
            "gen_s": torch.full((n,), gen_s, dtype=torch.float32),
            "gen_batch": torch.full(
                (n,), self.ctx.replica.index * 1_000_000_000 + self.batches, dtype=torch.int64
            ),
        }
