"""The counter pair's services: the producer writes consecutive integers, the consumer reads them all
once (or fails on purpose) and ends the run."""

from __future__ import annotations

import time

import torch

from meshrl.roles.counter.config import CounterConsumerConfig, CounterProducerConfig
from meshrl.runtime.service import Service


class CounterProducer(Service):
    def run(self) -> None:
        cfg = self.ctx.config
        assert isinstance(cfg, CounterProducerConfig)
        partition = self.ctx.wiring.partition("counter")
        with self.ctx.client() as c:
            for start in range(0, cfg.count, cfg.batch):
                c.put(partition, {"n": torch.arange(start, min(cfg.count, start + cfg.batch))})
                self.ctx.health.info["written"] = min(cfg.count, start + cfg.batch)
        while not self.finished():
            time.sleep(0.05)


class CounterConsumer(Service):
    def run(self) -> None:
        cfg = self.ctx.config
        assert isinstance(cfg, CounterConsumerConfig)
        seen: list[int] = []
        claim = self.ctx.wiring.claim("counter")
        with self.ctx.client() as c:
            while len(seen) < cfg.expect:
                b = c.claim(claim.partition, claim.consumer, list(claim.columns), cfg.batch, timeout=1.0)
                seen.extend(b.tensor("n").tolist() if b else [])
                c.ack(b)
                c.delete(claim.partition, b.ids)
                self.ctx.health.info["read"] = len(seen)
                time.sleep(cfg.delay_s)
                if cfg.fail_after is not None and len(seen) >= cfg.fail_after:
                    raise RuntimeError(f"counter consumer failing on purpose after {len(seen)} rows")
        if sorted(seen) != list(range(cfg.expect)):
            raise RuntimeError(
                f"counter rows missing or repeated: got {len(seen)} rows, {len(set(seen))} distinct"
            )
        self.log.info("read all %d rows exactly once", cfg.expect)
        self.finish_run()
