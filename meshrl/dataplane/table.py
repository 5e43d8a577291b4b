"""The controller's state: partitions of rows, their column locations, and per-consumer progress.

Pure bookkeeping, no sockets: every method is called from the controller's single event-loop thread,
which makes each request atomic. Per-row state lives in numpy arrays indexed by a slot (a partition has
`capacity` slots), so a 256-row put, claim or ack costs a few vectorised operations rather than 256
Python objects. Tensor bytes are never seen here, only (segment, offset, length) triples.

A partition holds what each slot holds (row id, which columns it has, group, metadata) and ties the
rest together: where a row's bytes lie per column (`columns.py`), which row id sits in which slot and
which slots are free (`slots.py`), and per consumer name which rows are ready, leased, acked
(`consumers.py`, which also names the row states: `READY` ...).
"""

from __future__ import annotations

import time

import numpy as np

from meshrl.dataplane.columns import Column, Placed, place
from meshrl.dataplane.consumers import READY as READY  # the row states are part of a partition's interface
from meshrl.dataplane.consumers import Chunk, Consumer
from meshrl.dataplane.protocol import (
    MAX_COLUMNS,
    ColumnWrite,
    Meta,
    PartitionStatus,
    SegmentRef,
    TableError,
    int64s,
)
from meshrl.dataplane.slots import FreeSlots, RowIndex


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

    def slots_of(self, ids: np.ndarray, *, strict: bool) -> np.ndarray:
        out = self.index.find(ids, self.row_id)
        if strict and np.count_nonzero(out < 0):
            missing = ids[out < 0][:5].tolist()
            raise TableError("bad_request", f"partition {self.name!r}: unknown row ids {missing}")
        return out

    # ---------------------------------------------------------------------------------------------------
    # schema

    def declare(self, name: str) -> Column:
        col = self.columns.get(name)
        if col is None:
            if len(self.columns) >= MAX_COLUMNS:
                raise TableError("bad_request", f"partition {self.name!r}: at most {MAX_COLUMNS} columns")
            col = self.columns[name] = Column.new(name, len(self.columns), self.capacity)
        return col

    def consumer(
        self, name: str, columns: list[str], group_size: int | None, address: str | None = None
    ) -> Consumer:
        """The consumer of that name, declared on first use with its columns, grouping and address."""
        c = self.consumers.get(name)
        if c is None:
            if group_size is not None and group_size < 1:
                raise TableError("bad_request", f"group_size must be >= 1, got {group_size}")
            if not columns or len(set(columns)) != len(columns):
                raise TableError(
                    "bad_request", f"consumer {name!r}: columns {columns} must be non-empty, unique"
                )
            c = self.add_consumer(name, columns, group_size, address)
            live = np.flatnonzero(self.row_id >= 0)
            live = live[np.argsort(self.row_id[live], kind="stable")]
            c.mark_ready(live[(self.mask[live] & c.need) == c.need])
        elif (
            (c.columns != columns and sorted(c.columns) != sorted(columns))
            or c.group_size != group_size
            or c.address != address
        ):
            raise TableError(
                "conflict",
                f"consumer {name!r} of partition {self.name!r} was declared with columns {c.columns}, "
                f"group_size {c.group_size} and address {c.address}; this claim asks for {columns}, "
                f"{group_size} and {address}",
            )
        return c

    def add_consumer(
        self, name: str, columns: list[str], group_size: int | None, address: str | None = None
    ) -> Consumer:
        """A new consumer, nothing queued yet (a column nobody wrote yet is declared now)."""
        need = 0
        for col in columns:
            need |= 1 << self.declare(col).bit
        c = self.consumers[name] = Consumer(
            name, list(columns), need, group_size, self.row_id, self.group, address, self.meta
        )
        return c

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
        """Validate and apply a put of new rows (`ids` None) or of more columns for existing rows.

        Returns (row ids, number of (row, column) references to `seg`). No row changes unless the whole
        put is valid."""
        groups = _check_put(n, columns, meta)
        placed = [place(self.columns.get(cw.name), cw, n, seg) for cw in columns]
        if ids is not None:
            rows = int64s(ids, "ids").copy()
            slots = self._existing(rows, n)
        elif len(self.free) < n:
            raise TableError("full", f"partition {self.name!r} full")  # the controller checks first
        layouts = self._layouts(placed)
        cmask = 0
        for col, _, _ in layouts:
            cmask |= 1 << col.bit
        if ids is None:  # a free slot's group is already -1 (`delete_slots` resets it)
            rows = np.arange(next_id, next_id + n, dtype=np.int64)
            slots = self.free.take(n)
            self.row_id[slots] = rows
            self.created[slots] = time.monotonic()
            self.index.add(rows, slots, self.row_id)
        else:
            old = self.mask[slots]
            if np.count_nonzero(old & cmask):
                twice = [col.name for col, _, _ in layouts if np.count_nonzero(old & (1 << col.bit))]
                raise TableError("conflict", f"columns {twice} already written for some of these rows")
        if meta is not None:
            self._set_meta(slots, meta, groups)
        for col, starts, lengths in layouts:
            col.seg[slots] = seg_index
            col.off[slots] = starts
            col.length[slots] = lengths
        if ids is None:  # new rows all have the same columns: a consumer finds all of them ready, or none
            self.mask[slots] = cmask
            for c in self.consumers.values():
                c.new_rows(slots, rows, cmask)
        else:
            new = old | cmask
            self.mask[slots] = new
            for c in self.consumers.values():
                if cmask & c.need:  # else this write adds nothing the consumer reads
                    c.more_columns(slots, old, new)
        return rows, n * len(layouts)

    def _existing(self, rows: np.ndarray, n: int) -> np.ndarray:
        """The slots of the rows a put of more columns names."""
        if len(rows) != n:
            raise TableError("bad_request", f"put of {n} rows names {len(rows)} ids")
        slots = self.slots_of(rows, strict=True)
        if len(np.unique(slots)) != n:
            raise TableError("bad_request", "put names a row id twice")
        return slots

    def _layouts(self, placed: list[Placed]) -> list[tuple[Column, np.ndarray, np.ndarray | int]]:
        """The columns a valid put writes, each with its rows' offsets and lengths; a new column, or a
        column's first write, fixes its schema now."""
        out = []
        for col, cw, item, starts, lengths in placed:
            if col is None:
                col = self.columns.get(cw.name) or self.declare(cw.name)
                col.fix(cw, item, self.name)
            out.append((col, starts, lengths))
        return out

    def _set_meta(self, slots: np.ndarray, meta: list[Meta], groups: list[int | None]) -> None:
        for s, m, g in zip(slots.tolist(), meta, groups, strict=True):
            cur = self.meta[s]
            if cur is None:
                self.meta_rows += 1
            self.meta[s] = dict(m) if cur is None else {**cur, **m}
            if g is not None:
                self.group[s] = g

    def claim(self, c: Consumer, n: int, lease_s: float, claim_id: int) -> Chunk | None:
        """Lease up to n of `c`'s ready rows (whole groups for grouped consumers). None if none is ready."""
        return c.claim(n, lease_s, claim_id)

    def expire(self, c: Consumer, claim_id: int) -> int:
        """Return a lease's surviving rows to the front of `c`'s queue (lease ran out, or released)."""
        return c.expire(claim_id)

    def ack(self, c: Consumer, claim_id: int, ids: np.ndarray | None = None) -> tuple[int, np.ndarray]:
        """Mark a lease's rows consumed: all of them, or only `ids` (the rest stay leased).

        Returns (rows acked, slots now due for deletion by the retention rule).
        """
        slots = c.ack(claim_id, ids)
        if not self.delete_when_acked_by:
            return len(slots), slots[:0]
        done: np.ndarray | None = None  # None: every row (so far only this consumer, which just acked)
        for name in self.delete_when_acked_by:
            other = self.consumers.get(name)
            if other is None:
                return len(slots), slots[:0]
            if other is not c:
                acked = other.acked(slots)
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
            c.forget(slots)
        dropped = self._references(slots)
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

    def _references(self, slots: np.ndarray) -> dict[int, int]:
        """Per segment index, how many (row, column) references the rows in `slots` hold to it."""
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
        return dropped

    def status(self, waiting_puts: int, waiting_claims: int) -> PartitionStatus:
        live = np.flatnonzero(self.row_id >= 0)
        cols = {name: int(((self.mask[live] >> c.bit) & 1).sum()) for name, c in self.columns.items()}
        age = float(time.monotonic() - self.created[live].min()) if len(live) else 0.0
        return PartitionStatus(
            name=self.name,
            capacity=self.capacity,
            rows=len(live),
            columns=cols,
            consumers=[c.status(live) for c in self.consumers.values()],
            oldest_age_s=age,
            waiting_puts=waiting_puts,
            waiting_claims=waiting_claims,
        )


def _check_put(n: int, columns: list[ColumnWrite], meta: list[Meta] | None) -> list[int | None]:
    """Check a put's shape; returns the group each row names in its metadata (None: none)."""
    if n < 1:
        raise TableError("bad_request", f"put of {n} rows")
    if not columns:
        raise TableError("bad_request", "put without columns")
    if len({c.name for c in columns}) != len(columns):
        raise TableError("bad_request", "put names a column twice")
    if meta is None:
        return []
    if len(meta) != n:
        raise TableError("bad_request", f"put of {n} rows carries {len(meta)} meta entries")
    groups: list[int | None] = []
    for m in meta:
        g = m.get("group")
        if g is not None and (not isinstance(g, int) or isinstance(g, bool)):
            raise TableError("bad_request", f"meta 'group' must be an int, got {g!r}")
        groups.append(g)
    return groups
