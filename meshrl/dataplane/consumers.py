"""A consumer name's progress through a partition: which rows are ready for it, leased to it, done.

Every consumer name sees the partition's rows independently, in the state held for it per slot:
NOT_READY (some needed column missing), PARTIAL (ready, waiting for the rest of its group), READY
(queued for this consumer), CLAIMED (leased to a claim), ACKED (done). A consumer with an address sees
only the rows addressed to it (their metadata's "to", addresses joined by commas, set when the row is put):
the replica of a service that must answer its own requests claims its own rows from a shared partition. Every change of that state
happens here. A lease that expires puts its rows back at the front of the queue; acking an expired
claim is an error, so a row is consumed at most once per consumer name. The queue holds chunks of (id,
slot) pairs; an entry is live when the slot still holds that id in the expected state, so deleting rows
never has to search the queue.

Driven by `table.Partition`; like the rest of the table, it runs on the controller's single thread.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from meshrl.dataplane.protocol import ConsumerStatus, TableError

NOT_READY, READY, CLAIMED, ACKED, PARTIAL = 0, 1, 2, 3, 4


@dataclass
class Chunk:
    """Rows queued or leased together (one whole group for grouped consumers)."""

    ids: np.ndarray
    slots: np.ndarray


@dataclass
class Lease:
    chunks: list[Chunk]
    deadline: float

    @property
    def n(self) -> int:
        return sum(len(c.ids) for c in self.chunks)


class Consumer:
    """One consumer name's view of a partition's rows.

    `row_id` and `group` are the partition's own arrays (which id and which group each slot holds),
    shared, not copied: a row deleted or put there is seen here at once.
    """

    def __init__(
        self,
        name: str,
        columns: list[str],
        need: int,
        group_size: int | None,
        row_id: np.ndarray,
        group: np.ndarray,
        address: str | None = None,
        meta: list[Any] | None = None,
    ) -> None:
        self.name = name
        self.columns = columns
        self.need = need  # the bits of the columns it reads
        self.group_size = group_size
        self.row_id = row_id
        self.group = group
        self.address = address
        self.meta = meta  # the partition's per-slot metadata (read for the address)
        self.state = np.zeros(len(row_id), dtype=np.int8)
        self.ready: deque[Chunk] = deque()
        self.partial: dict[int, list[tuple[int, int]]] = {}  # group -> (id, slot)
        self.nready = 0  # rows in READY state
        self.leases: dict[int, Lease] = {}

    # ---------------------------------------------------------------------------------------------------
    # rows arriving

    def mark_ready(self, slots: np.ndarray, ids: np.ndarray | None = None) -> None:
        """Queue rows (`ids`: their row ids, when the caller has them at hand)."""
        if not len(slots):
            return
        if self.address is not None:
            mine = np.array([self._addressed(s) for s in slots.tolist()], dtype=bool)
            slots = slots[mine]
            ids = None if ids is None else ids[mine]
            if not len(slots):
                return
        if ids is None:
            ids = self.row_id[slots]
        if self.group_size is None:
            self.state[slots] = READY
            self.ready.append(Chunk(ids, slots))
            self.nready += len(ids)
            return
        self.state[slots] = PARTIAL
        g = self.group_size
        for rid, s, gid in zip(ids.tolist(), slots.tolist(), self.group[slots].tolist(), strict=True):
            bucket = self.partial.setdefault(gid, [])
            bucket.append((rid, s))
            if len(bucket) == g:
                del self.partial[gid]
                chunk = Chunk(np.array([b[0] for b in bucket]), np.array([b[1] for b in bucket]))
                self.state[chunk.slots] = READY
                self.ready.append(chunk)
                self.nready += g

    def _addressed(self, slot: int) -> bool:
        m = self.meta[slot] if self.meta is not None else None
        to = m.get("to") if m else None
        return isinstance(to, str) and self.address in to.split(",")

    def new_rows(self, slots: np.ndarray, ids: np.ndarray, mask: int) -> None:
        """Rows just put, all with the columns in `mask`: queued if they hold every column read here."""
        if mask & self.need == self.need:
            self.mark_ready(slots, ids)
        else:
            self.state[slots] = NOT_READY

    def more_columns(self, slots: np.ndarray, old: np.ndarray, new: np.ndarray) -> None:
        """Columns added to existing rows (`old`, `new`: their masks before and after): queue the rows
        that now hold every column read here."""
        became = ((old & self.need) != self.need) & ((new & self.need) == self.need)
        self.mark_ready(slots[became & (self.state[slots] == NOT_READY)])

    def forget(self, slots: np.ndarray) -> None:
        """Rows about to be deleted: out of the counts and the partial groups (queue entries die alone)."""
        st = self.state[slots]
        self.nready -= int(np.count_nonzero(st == READY))
        partial = slots[st == PARTIAL]
        if len(partial):
            gone = set(partial.tolist())
            for gid in np.unique(self.group[partial]).tolist():
                bucket = [b for b in self.partial.get(gid, []) if b[1] not in gone]
                if bucket:
                    self.partial[gid] = bucket
                else:
                    self.partial.pop(gid, None)
        self.state[slots] = NOT_READY

    # ---------------------------------------------------------------------------------------------------
    # claims and leases

    def _alive(self, chunk: Chunk, state: int) -> np.ndarray:
        return (self.row_id[chunk.slots] == chunk.ids) & (self.state[chunk.slots] == state)

    def _requeue(self, slots: np.ndarray) -> None:
        """Rows of a group that lost a member: they wait again for the group to fill."""
        self.state[slots] = NOT_READY
        self.mark_ready(slots)

    def claim(self, n: int, lease_s: float, claim_id: int) -> Chunk | None:
        """Lease up to n READY rows (whole groups for grouped consumers). None if none is ready."""
        taken: list[Chunk] = []
        count = 0
        grouped = self.group_size is not None
        while self.ready and count < n:
            chunk = self.ready[0]
            if grouped and count + len(chunk.ids) > n:
                break
            if not grouped and len(chunk.ids) > n - count:
                k = n - count
                self.ready[0] = Chunk(chunk.ids[k:], chunk.slots[k:])
                chunk = Chunk(chunk.ids[:k], chunk.slots[:k])
            else:
                self.ready.popleft()
            alive = self._alive(chunk, READY)
            whole = np.count_nonzero(alive) == len(alive)
            if grouped and not whole:  # a row of the group was deleted: the rest waits for a refill
                live = chunk.slots[alive]
                self.nready -= len(live)
                self._requeue(live)
                continue
            if not whole:
                chunk = Chunk(chunk.ids[alive], chunk.slots[alive])
            taken.append(chunk)
            count += len(chunk.ids)
        if not count:
            return None
        for chunk in taken:
            self.state[chunk.slots] = CLAIMED
        self.nready -= count
        self.leases[claim_id] = Lease(taken, time.monotonic() + lease_s)
        if len(taken) == 1:
            return taken[0]
        return Chunk(np.concatenate([t.ids for t in taken]), np.concatenate([t.slots for t in taken]))

    def expire(self, claim_id: int) -> int:
        """Return a lease's surviving rows to the front of the queue (lease ran out, or released)."""
        lease = self.leases.pop(claim_id)
        back = 0
        for chunk in reversed(lease.chunks):
            alive = self._alive(chunk, CLAIMED)
            whole = np.count_nonzero(alive) == len(alive)
            if self.group_size is not None and not whole:
                self._requeue(chunk.slots[alive])
                continue
            if not whole:
                chunk = Chunk(chunk.ids[alive], chunk.slots[alive])
            if len(chunk.ids):
                self.state[chunk.slots] = READY
                self.ready.appendleft(chunk)
                self.nready += len(chunk.ids)
                back += len(chunk.ids)
        return back

    def ack(self, claim_id: int, ids: np.ndarray | None = None) -> np.ndarray:
        """Mark a lease's rows consumed: all of them, or only `ids` (the rest stay leased). Returns the
        slots of the rows acked that still live."""
        lease = self.leases.get(claim_id)
        if lease is None:
            raise TableError(
                "expired",
                f"claim {claim_id} of consumer {self.name!r} is unknown or its lease expired; "
                "its rows went back to the pool",
            )
        if ids is None:
            del self.leases[claim_id]
            done = lease.chunks
        else:
            done = self._split(claim_id, lease, ids)
        live = [chunk.slots[self._alive(chunk, CLAIMED)] for chunk in done]
        slots = live[0] if len(live) == 1 else np.concatenate(live)
        self.state[slots] = ACKED
        return slots

    def _split(self, claim_id: int, lease: Lease, ids: np.ndarray) -> list[Chunk]:
        """Take `ids` out of a lease (which ends when nothing is left in it); returns their chunks."""
        wanted = set(ids.tolist())
        leased = {int(i) for chunk in lease.chunks for i in chunk.ids.tolist()}
        if not wanted <= leased:
            raise TableError("bad_request", f"rows {sorted(wanted - leased)[:5]} are not in claim {claim_id}")
        done, keep = [], []
        for chunk in lease.chunks:
            hit = np.isin(chunk.ids, ids)
            done.append(Chunk(chunk.ids[hit], chunk.slots[hit]))
            if not hit.all():
                keep.append(Chunk(chunk.ids[~hit], chunk.slots[~hit]))
        if keep:
            lease.chunks = keep
        else:
            del self.leases[claim_id]
        return done

    def acked(self, slots: np.ndarray) -> np.ndarray:
        """Which of these rows this consumer has acked."""
        return self.state[slots] == ACKED

    def status(self, live: np.ndarray) -> ConsumerStatus:
        """Counts over the partition's live slots."""
        st = self.state[live]
        return ConsumerStatus(
            name=self.name,
            columns=self.columns,
            ready=self.nready,
            claimed=int((st == CLAIMED).sum()),
            acked=int((st == ACKED).sum()),
        )
