"""The controller's state: partitions of rows, their column locations, and per-consumer progress.

Pure bookkeeping, no sockets: every method is called from the controller's single event-loop thread,
which makes each request atomic. Per-row state lives in numpy arrays indexed by a slot (a partition has
`capacity` slots), so a 256-row put, claim or ack costs a few vectorised operations rather than 256
Python objects. Tensor bytes are never seen here, only (segment, offset, length) triples.

Row states per consumer: NOT_READY (some needed column missing), PARTIAL (ready, waiting for the rest
of its group), READY (queued for this consumer), CLAIMED (leased to a claim), ACKED (done). A lease
that expires puts its rows back at the front of the queue; acking an expired claim is an error, so a
row is consumed at most once per consumer name. Queues hold (id, slot) pairs; an entry is live when
the slot still holds that id in the expected state, so deletions never have to search the queues.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from meshrl.dataplane.protocol import (
    MAX_COLUMNS,
    ColumnWrite,
    ConsumerStatus,
    Meta,
    PartitionStatus,
    SegmentRef,
    int64s,
    item_bytes,
)
from meshrl.dataplane.slots import FreeSlots, RowIndex

NOT_READY, READY, CLAIMED, ACKED, PARTIAL = 0, 1, 2, 3, 4


class TableError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class SegmentInfo:
    ref: SegmentRef
    owner: str
    refs: int = 0


@dataclass
class Column:
    """A column's schema (fixed by its first write) and per-slot locations.

    A consumer may declare a column before anyone wrote it; its dtype is then None until the first write.
    """

    name: str
    bit: int
    dtype: str | None
    shape: list[int]
    ragged: bool
    item: int  # bytes per item
    seg: np.ndarray
    off: np.ndarray
    length: np.ndarray


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


@dataclass
class Consumer:
    name: str
    columns: list[str]
    need: int
    group_size: int | None
    state: np.ndarray
    ready: deque[Chunk] = field(default_factory=deque)
    partial: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # group -> (id, slot)
    nready: int = 0  # rows in READY state
    leases: dict[int, Lease] = field(default_factory=dict)


class Partition:
    def __init__(self, name: str, capacity: int, delete_when_acked_by: list[str]) -> None:
        if capacity < 1 or capacity > 1 << 26:
            raise TableError("bad_request", f"partition {name!r}: capacity {capacity} must be in 1..2**26")
        self.name = name
        self.capacity = capacity
        self.delete_when_acked_by = list(delete_when_acked_by)
        self.columns: dict[str, Column] = {}
        self.row_id = np.full(capacity, -1, dtype="<i8")
        self.mask = np.zeros(capacity, dtype=np.int64)
        self.group = np.full(capacity, -1, dtype=np.int64)
        self.created = np.zeros(capacity, dtype=np.float64)
        self.meta: list[Meta | None] = [None] * capacity
        self.meta_rows = 0  # live rows carrying metadata (claims skip the meta list when 0)
        self.free = FreeSlots(capacity)
        self.index = RowIndex()
        self.consumers: dict[str, Consumer] = {}

    @property
    def rows(self) -> int:
        return self.capacity - len(self.free)

    def can_put(self, n: int) -> bool:
        return len(self.free) >= n

    # ---------------------------------------------------------------------------------------------------
    # schema

    def slots_of(self, ids: np.ndarray, *, strict: bool) -> np.ndarray:
        out = self.index.find(ids, self.row_id)
        if strict and np.count_nonzero(out < 0):
            missing = ids[out < 0][:5].tolist()
            raise TableError("bad_request", f"partition {self.name!r}: unknown row ids {missing}")
        return out

    def declare(self, name: str) -> Column:
        col = self.columns.get(name)
        if col is None:
            if len(self.columns) >= MAX_COLUMNS:
                raise TableError("bad_request", f"partition {self.name!r}: at most {MAX_COLUMNS} columns")
            cap = self.capacity
            col = Column(
                name,
                len(self.columns),
                None,
                [],
                False,
                0,
                np.zeros(cap, dtype="<i4"),  # little-endian: claim replies send slices of these as is
                np.zeros(cap, dtype="<i8"),
                np.zeros(cap, dtype="<i8"),
            )
            self.columns[name] = col
        return col

    def _column(self, cw: ColumnWrite, item: int) -> Column:
        col = self.columns.get(cw.name) or self.declare(cw.name)
        if col.dtype == cw.dtype and col.ragged == cw.ragged and col.shape == cw.shape:  # the usual case
            return col
        if col.dtype is None:
            col.dtype, col.shape, col.ragged, col.item = cw.dtype, list(cw.shape), cw.ragged, item
        elif (col.dtype, col.shape, col.ragged) != (cw.dtype, list(cw.shape), cw.ragged):

            def kind(d: str | None, s: list[int], r: bool) -> str:
                return f"{d}{s}{' ragged' if r else ''}"

            raise TableError(
                "bad_request",
                f"partition {self.name!r} column {cw.name!r} is {kind(col.dtype, col.shape, col.ragged)}, "
                f"write has {kind(cw.dtype, cw.shape, cw.ragged)}",
            )
        return col

    def consumer(self, name: str, columns: list[str], group_size: int | None) -> Consumer:
        """The consumer of that name, declared on first use with its columns and grouping."""
        c = self.consumers.get(name)
        if c is None:
            if group_size is not None and group_size < 1:
                raise TableError("bad_request", f"group_size must be >= 1, got {group_size}")
            if not columns or len(set(columns)) != len(columns):
                raise TableError(
                    "bad_request", f"consumer {name!r}: columns {columns} must be non-empty, unique"
                )
            need = 0
            for col in columns:  # a column nobody wrote yet is declared now; its rows arrive later
                need |= 1 << self.declare(col).bit
            c = Consumer(name, list(columns), need, group_size, np.zeros(self.capacity, dtype=np.int8))
            self.consumers[name] = c
            live = np.flatnonzero(self.row_id >= 0)
            live = live[np.argsort(self.row_id[live], kind="stable")]
            self.mark_ready(c, live[(self.mask[live] & need) == need])
        elif (c.columns != columns and sorted(c.columns) != sorted(columns)) or c.group_size != group_size:
            raise TableError(
                "conflict",
                f"consumer {name!r} of partition {self.name!r} was declared with columns {c.columns} "
                f"and group_size {c.group_size}; this claim asks for {columns} and {group_size}",
            )
        return c

    def mark_ready(self, c: Consumer, slots: np.ndarray, ids: np.ndarray | None = None) -> None:
        """Queue rows for `c` (`ids`: their row ids, when the caller has them at hand)."""
        if not len(slots):
            return
        if ids is None:
            ids = self.row_id[slots]
        if c.group_size is None:
            c.state[slots] = READY
            c.ready.append(Chunk(ids, slots))
            c.nready += len(ids)
            return
        c.state[slots] = PARTIAL
        g = c.group_size
        for rid, s, gid in zip(ids.tolist(), slots.tolist(), self.group[slots].tolist(), strict=True):
            bucket = c.partial.setdefault(gid, [])
            bucket.append((rid, s))
            if len(bucket) == g:
                del c.partial[gid]
                chunk = Chunk(np.array([b[0] for b in bucket]), np.array([b[1] for b in bucket]))
                c.state[chunk.slots] = READY
                c.ready.append(chunk)
                c.nready += g

    def _alive(self, chunk: Chunk, c: Consumer, state: int) -> np.ndarray:
        return (self.row_id[chunk.slots] == chunk.ids) & (c.state[chunk.slots] == state)

    # ---------------------------------------------------------------------------------------------------
    # operations

    def put(
        self,
        seg_index: int,
        seg: SegmentRef,
        n: int,
        columns: list[ColumnWrite],
        ids: bytes | None,
        meta: list[Meta] | None,
        next_id: int,
    ) -> tuple[np.ndarray, int]:
        """Validate and apply a put. Returns (row ids, number of (row, column) references to `seg`)."""
        if n < 1:
            raise TableError("bad_request", f"put of {n} rows")
        if not columns:
            raise TableError("bad_request", "put without columns")
        if len({c.name for c in columns}) != len(columns):
            raise TableError("bad_request", "put names a column twice")
        if meta is not None and len(meta) != n:
            raise TableError("bad_request", f"put of {n} rows carries {len(meta)} meta entries")
        groups = None
        if meta is not None:
            groups = [m.get("group") for m in meta]
            for g in groups:
                if g is not None and (not isinstance(g, int) or isinstance(g, bool)):
                    raise TableError("bad_request", f"meta 'group' must be an int, got {g!r}")
        # validate every column against the segment before touching any state
        checked = []
        for cw in columns:
            col = self.columns.get(cw.name)
            if (
                col is not None
                and col.dtype == cw.dtype
                and col.shape == cw.shape
                and col.ragged == cw.ragged
            ):
                item = col.item  # the usual case: validated by the column's first write
            else:
                col, item = None, item_bytes(cw.dtype, cw.shape)  # `_column` checks it once the put is valid
            lengths: np.ndarray | int
            if cw.ragged:
                lengths = int64s(cw.lengths, f"column {cw.name!r} lengths")
                if len(lengths) != n or (lengths < 0).any():
                    raise TableError("bad_request", f"column {cw.name!r}: need {n} non-negative lengths")
                items = int(lengths.sum())
                starts = np.empty(n, dtype=np.int64)
                starts[0] = cw.offset
                np.cumsum(lengths[:-1] * item, out=starts[1:])
                starts[1:] += cw.offset
            else:
                if cw.lengths is not None:
                    raise TableError("bad_request", f"dense column {cw.name!r} carries lengths")
                lengths, items = 1, n
                starts = (
                    np.arange(cw.offset, cw.offset + n * item, item, dtype=np.int64)
                    if item
                    else np.full(n, cw.offset, dtype=np.int64)
                )
            if items * item != cw.nbytes or cw.offset < 0 or cw.offset + cw.nbytes > seg.size:
                raise TableError(
                    "bad_request",
                    f"column {cw.name!r}: {cw.nbytes} bytes at offset {cw.offset} do not match "
                    f"{items} items of {item} bytes in a {seg.size}-byte segment",
                )
            checked.append((col, cw, item, starts, lengths))
        if ids is not None:
            rows = int64s(ids, "ids").copy()
            if len(rows) != n:
                raise TableError("bad_request", f"put of {n} rows names {len(rows)} ids")
            slots = self.slots_of(rows, strict=True)
            if len(np.unique(slots)) != n:
                raise TableError("bad_request", "put names a row id twice")
        elif len(self.free) < n:
            raise TableError("full", f"partition {self.name!r} full")  # the controller checks first
        layouts = [
            (col or self._column(cw, item), starts, lengths) for col, cw, item, starts, lengths in checked
        ]
        cmask = 0
        for col, _, _ in layouts:
            cmask |= 1 << col.bit

        if ids is None:
            rows = np.arange(next_id, next_id + n, dtype=np.int64)
            slots = self.free.take(n)
            self.row_id[slots] = rows
            self.created[slots] = time.monotonic()
            self.group[slots] = -1
            self.index.add(rows, slots, self.row_id)
        else:
            old = self.mask[slots]
            if np.count_nonzero(old & cmask):
                twice = [col.name for col, _, _ in layouts if np.count_nonzero(old & (1 << col.bit))]
                raise TableError("conflict", f"columns {twice} already written for some of these rows")
        if meta is not None:
            for s, m, g in zip(slots.tolist(), meta, groups or [], strict=True):
                cur = self.meta[s]
                if cur is None:
                    self.meta_rows += 1
                self.meta[s] = dict(m) if cur is None else {**cur, **m}
                if g is not None:
                    self.group[s] = g
        for col, starts, lengths in layouts:
            col.seg[slots] = seg_index
            col.off[slots] = starts
            col.length[slots] = lengths
        if ids is None:  # new rows all have the same columns: a consumer finds all of them ready, or none
            self.mask[slots] = cmask
            for c in self.consumers.values():
                if cmask & c.need == c.need:
                    self.mark_ready(c, slots, rows)
                else:
                    c.state[slots] = NOT_READY
            return rows, n * len(layouts)
        new = old | cmask
        self.mask[slots] = new
        for c in self.consumers.values():
            if not cmask & c.need:  # this write adds nothing the consumer reads
                continue
            became = ((old & c.need) != c.need) & ((new & c.need) == c.need)
            self.mark_ready(c, slots[became & (c.state[slots] == NOT_READY)])
        return rows, n * len(layouts)

    def claim(self, c: Consumer, n: int, lease_s: float, claim_id: int) -> Chunk | None:
        """Lease up to n READY rows (whole groups for grouped consumers). None if none is ready."""
        taken: list[Chunk] = []
        count = 0
        grouped = c.group_size is not None
        while c.ready and count < n:
            chunk = c.ready[0]
            if grouped and count + len(chunk.ids) > n:
                break
            if not grouped and len(chunk.ids) > n - count:
                k = n - count
                c.ready[0] = Chunk(chunk.ids[k:], chunk.slots[k:])
                chunk = Chunk(chunk.ids[:k], chunk.slots[:k])
            else:
                c.ready.popleft()
            alive = self._alive(chunk, c, READY)
            whole = np.count_nonzero(alive) == len(alive)
            if grouped and not whole:  # a row of the group was deleted: the rest waits for a refill
                live = chunk.slots[alive]
                c.nready -= len(live)
                c.state[live] = NOT_READY
                self.mark_ready(c, live)
                continue
            if not whole:
                chunk = Chunk(chunk.ids[alive], chunk.slots[alive])
            taken.append(chunk)
            count += len(chunk.ids)
        if not count:
            return None
        for chunk in taken:
            c.state[chunk.slots] = CLAIMED
        c.nready -= count
        c.leases[claim_id] = Lease(taken, time.monotonic() + lease_s)
        if len(taken) == 1:
            return taken[0]
        return Chunk(np.concatenate([t.ids for t in taken]), np.concatenate([t.slots for t in taken]))

    def expire(self, c: Consumer, claim_id: int) -> int:
        """Return a lease's surviving rows to the front of the queue (lease ran out, or released)."""
        lease = c.leases.pop(claim_id)
        back = 0
        for chunk in reversed(lease.chunks):
            alive = self._alive(chunk, c, CLAIMED)
            whole = np.count_nonzero(alive) == len(alive)
            if c.group_size is not None and not whole:
                live = chunk.slots[alive]
                c.state[live] = NOT_READY
                self.mark_ready(c, live)
                continue
            if not whole:
                chunk = Chunk(chunk.ids[alive], chunk.slots[alive])
            if len(chunk.ids):
                c.state[chunk.slots] = READY
                c.ready.appendleft(chunk)
                c.nready += len(chunk.ids)
                back += len(chunk.ids)
        return back

    def ack(self, c: Consumer, claim_id: int, ids: np.ndarray | None = None) -> tuple[int, np.ndarray]:
        """Mark a lease's rows consumed: all of them, or only `ids` (the rest stay leased).

        Returns (rows acked, slots now due for deletion by the retention rule).
        """
        lease = c.leases.get(claim_id)
        if lease is None:
            raise TableError(
                "expired",
                f"claim {claim_id} of consumer {c.name!r} is unknown or its lease expired; "
                "its rows went back to the pool",
            )
        if ids is None:
            del c.leases[claim_id]
            done_chunks = lease.chunks
        else:
            wanted = set(ids.tolist())
            leased = {int(i) for chunk in lease.chunks for i in chunk.ids.tolist()}
            if not wanted <= leased:
                raise TableError(
                    "bad_request", f"rows {sorted(wanted - leased)[:5]} are not in claim {claim_id}"
                )
            done_chunks, keep = [], []
            for chunk in lease.chunks:
                hit = np.isin(chunk.ids, ids)
                done_chunks.append(Chunk(chunk.ids[hit], chunk.slots[hit]))
                if not hit.all():
                    keep.append(Chunk(chunk.ids[~hit], chunk.slots[~hit]))
            if keep:
                lease.chunks = keep
            else:
                del c.leases[claim_id]
        live = [chunk.slots[self._alive(chunk, c, CLAIMED)] for chunk in done_chunks]
        slots = live[0] if len(live) == 1 else np.concatenate(live)
        c.state[slots] = ACKED
        if not self.delete_when_acked_by:
            return len(slots), slots[:0]
        done: np.ndarray | None = None  # None: every row (so far only this consumer, which just acked)
        for name in self.delete_when_acked_by:
            other = self.consumers.get(name)
            if other is None:
                return len(slots), slots[:0]
            if other is not c:
                acked = other.state[slots] == ACKED
                done = acked if done is None else done & acked
        return len(slots), slots if done is None else slots[done]

    def delete_ids(self, ids: np.ndarray) -> tuple[int, dict[int, int]]:
        slots = self.slots_of(ids, strict=False)
        return self.delete_slots(np.unique(slots[slots >= 0]))

    def delete_slots(self, slots: np.ndarray) -> tuple[int, dict[int, int]]:
        """Delete live rows. Returns (rows deleted, per segment index the references dropped)."""
        slots = slots[self.row_id[slots] >= 0]  # a free slot pushed twice would hand two rows one slot
        if not len(slots):
            return 0, {}
        for c in self.consumers.values():
            st = c.state[slots]
            c.nready -= int(np.count_nonzero(st == READY))
            partial = slots[st == PARTIAL]
            if len(partial):
                gone = set(partial.tolist())
                for gid in np.unique(self.group[partial]).tolist():
                    bucket = [b for b in c.partial.get(gid, []) if b[1] not in gone]
                    if bucket:
                        c.partial[gid] = bucket
                    else:
                        c.partial.pop(gid, None)
            c.state[slots] = NOT_READY
        dropped: dict[int, int] = {}
        masks = self.mask[slots]
        mask0 = int(masks[0])
        # the usual case: every row has the same columns (one pass, no per-column masks)
        same = len(masks) == 1 or np.count_nonzero(masks != mask0) == 0
        for col in self.columns.values():
            if same:
                if not mask0 >> col.bit & 1:
                    continue
                k, segs = len(slots), col.seg[slots]
            else:
                has = (masks >> col.bit) & 1 == 1
                k = int(np.count_nonzero(has))
                if not k:
                    continue
                segs = col.seg[slots] if k == len(slots) else col.seg[slots[has]]
            first = int(segs[0])
            if k == 1 or np.count_nonzero(segs != first) == 0:  # the usual case: rows of one write
                dropped[first] = dropped.get(first, 0) + k
                continue
            uniq, counts = np.unique(segs, return_counts=True)
            for s, cnt in zip(uniq.tolist(), counts.tolist(), strict=True):
                dropped[s] = dropped.get(s, 0) + cnt
        if self.meta_rows:
            for s in slots.tolist():
                if self.meta[s] is not None:
                    self.meta[s] = None
                    self.meta_rows -= 1
        self.row_id[slots] = -1
        self.mask[slots] = 0
        self.group[slots] = -1
        self.free.give(slots)
        return len(slots), dropped

    def status(self, waiting_puts: int, waiting_claims: int) -> PartitionStatus:
        live = np.flatnonzero(self.row_id >= 0)
        cols = {name: int(((self.mask[live] >> c.bit) & 1).sum()) for name, c in self.columns.items()}
        consumers = [
            ConsumerStatus(
                name=c.name,
                columns=c.columns,
                ready=c.nready,
                claimed=int((c.state[live] == CLAIMED).sum()),
                acked=int((c.state[live] == ACKED).sum()),
            )
            for c in self.consumers.values()
        ]
        age = float(time.monotonic() - self.created[live].min()) if len(live) else 0.0
        return PartitionStatus(
            name=self.name,
            capacity=self.capacity,
            rows=len(live),
            columns=cols,
            consumers=consumers,
            oldest_age_s=age,
            waiting_puts=waiting_puts,
            waiting_claims=waiting_claims,
        )
