"""The sample ledger: an append-only record, kept by the controller, of every row produced, consumed
(per consumer) and deleted in the partitions it is asked to track.

One JSON line per operation: {"op": "put", "p": partition, "first": id, "n": rows, "cols": [...]} for
new rows (ids are consecutive), {"op": "set", "p", "cols": [...], "ids": [...]} for columns added to
existing rows, {"op": "ack", "p", "c": consumer, "ids": [...]}, {"op": "del", "p", "ids": [...]} for
explicit deletes (retention deletes follow from acks and are not written). With the column writes, the
ledger shows what every row held when each consumer took it (`written_before`). The controller writes it as
it applies requests, so the order is the order of effect. A data-plane snapshot records the ledger's
length; restoring it cuts the ledger back to that length, so after a resume the ledger describes the
run that continued, and `account` can prove that no row was lost or consumed twice.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np


class Ledger:
    def __init__(self, path: str | Path, partitions: list[str]) -> None:
        self.path = Path(path)
        self.partitions = set(partitions)
        self.file: IO[str] = open(self.path, "a")  # noqa: SIM115 (kept open for the controller's life)

    def tracks(self, partition: str) -> bool:
        return partition in self.partitions

    def put(self, partition: str, first: int, n: int, columns: list[str]) -> None:
        self._write({"op": "put", "p": partition, "first": first, "n": n, "cols": columns})

    def set(self, partition: str, columns: list[str], ids: np.ndarray) -> None:
        self._write({"op": "set", "p": partition, "cols": columns, "ids": ids.tolist()})

    def ack(self, partition: str, consumer: str, ids: np.ndarray) -> None:
        self._write({"op": "ack", "p": partition, "c": consumer, "ids": ids.tolist()})

    def delete(self, partition: str, ids: np.ndarray) -> None:
        self._write({"op": "del", "p": partition, "ids": ids.tolist()})

    def _write(self, record: dict[str, object]) -> None:
        self.file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def offset(self) -> int:
        """Flush and return the ledger's length in bytes (a snapshot records it)."""
        self.file.flush()
        os.fsync(self.file.fileno())
        return self.file.tell()

    def truncate(self, offset: int) -> None:
        """Cut the ledger back to `offset` bytes (on restore from a snapshot taken at that length)."""
        self.file.close()
        with open(self.path, "r+") as f:
            f.truncate(offset)
        self.file = open(self.path, "a")  # noqa: SIM115

    def flush(self) -> None:
        if not self.file.closed:
            self.file.flush()

    def close(self) -> None:
        self.file.close()


@dataclass
class Account:
    produced: int
    consumed: int
    deleted: int
    pending: int
    """Produced, neither consumed nor deleted (in flight; lost if the run is over)."""
    duplicated: int
    """Consumptions beyond the first of a row."""
    unknown: int
    """Consumed rows that were never produced (must be 0)."""


def account(path: str | Path, partition: str = "samples", consumer: str = "trainer") -> Account:
    """Tally one consumer's view of one partition from a ledger file."""
    produced: set[int] = set()
    deleted: set[int] = set()
    consumed: Counter[int] = Counter()
    for r in records(path, partition):
        if r["op"] == "put":
            produced.update(range(r["first"], r["first"] + r["n"]))
        elif r["op"] == "ack" and r["c"] == consumer:
            consumed.update(r["ids"])
        elif r["op"] == "del":
            deleted.update(r["ids"])
    done = set(consumed)
    return Account(
        produced=len(produced),
        consumed=len(done),
        deleted=len(deleted - done),
        pending=len(produced - done - deleted),
        duplicated=sum(n - 1 for n in consumed.values()),
        unknown=len(done - produced),
    )


def written_before(
    path: str | Path,
    columns: tuple[str, ...] | list[str],
    partition: str = "samples",
    consumer: str = "trainer",
) -> tuple[int, int]:
    """(rows `consumer` acknowledged, of those how many had every one of `columns` written before the
    acknowledgement), from a ledger file: a consumer whose claim lists the columns must give equal
    numbers."""
    have: dict[int, set[str]] = {}
    want = set(columns)
    acked = complete = 0
    for r in records(path, partition):
        if r["op"] == "put":
            for i in range(r["first"], r["first"] + r["n"]):
                have[i] = set(r.get("cols", ()))
        elif r["op"] == "set":
            for i in r["ids"]:
                have.setdefault(i, set()).update(r["cols"])
        elif r["op"] == "ack" and r["c"] == consumer:
            acked += len(r["ids"])
            complete += sum(want <= have.get(i, set()) for i in r["ids"])
    return acked, complete


def records(path: str | Path, partition: str) -> Iterator[dict]:
    """The ledger's records of one partition, in order."""
    with open(path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                if r["p"] == partition:
                    yield r
