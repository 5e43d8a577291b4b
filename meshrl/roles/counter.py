"""A trivial producer/consumer pair, so the launcher and data plane can be exercised without models.

The producer writes `count` rows of consecutive integers; the consumer reads them in batches, checks
that none is missing or repeated, and ends the run. `fail_after` makes the consumer raise (tests of the
launcher's failure path).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from meshrl.planning.config import ServiceConfig
from meshrl.planning.wiring import Read, Write
from meshrl.runtime.service import Service


@dataclass(frozen=True, kw_only=True)
class CounterProducerConfig(ServiceConfig):
    service = "meshrl.roles.counter:CounterProducer"
    count: int = 100
    """Rows to write."""
    batch: int = 10
    """Rows per put."""

    def validate(self) -> Iterator[str]:
        if self.count < 1 or self.batch < 1:
            yield "count, batch: must be >= 1"

    def writes(self) -> tuple[Write, ...]:
        return (Write("counter", "counter", ("n",)),)


@dataclass(frozen=True, kw_only=True)
class CounterConsumerConfig(ServiceConfig):
    service = "meshrl.roles.counter:CounterConsumer"
    expect: int = 100
    """Rows to read before ending the run."""
    batch: int = 7
    fail_after: int | None = None
    """Raise after this many rows (for tests)."""
    delay_s: float = 0.0
    """Pause after each batch (to watch a run with `meshrl status`)."""

    def reads(self) -> tuple[Read, ...]:
        return (Read("counter", "counter", ("n",), consumer="consumer"),)


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
