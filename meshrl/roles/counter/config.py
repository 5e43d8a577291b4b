"""Configuration of a trivial producer/consumer pair, so the launcher and data plane can be exercised
without models.

The producer writes `count` rows of consecutive integers; the consumer reads them in batches, checks
that none is missing or repeated, and ends the run. `fail_after` makes the consumer raise (tests of the
launcher's failure path).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from meshrl.planning.config import ServiceConfig
from meshrl.planning.wiring import Read, Write


@dataclass(frozen=True, kw_only=True)
class CounterProducerConfig(ServiceConfig):
    service = "meshrl.roles.counter.service:CounterProducer"
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
    service = "meshrl.roles.counter.service:CounterConsumer"
    expect: int = 100
    """Rows to read before ending the run."""
    batch: int = 7
    fail_after: int | None = None
    """Raise after this many rows (for tests)."""
    delay_s: float = 0.0
    """Pause after each batch (to watch a run with `meshrl status`)."""

    def reads(self) -> tuple[Read, ...]:
        return (Read("counter", "counter", ("n",), consumer="consumer"),)
