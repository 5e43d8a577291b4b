"""Where a partition's rows sit: which slots are free, and which slot holds a row id.

Both keep per-put state rather than per-row state, so a 256-row put or delete costs a few vectorised
operations. Used by `table.Partition` (and a restore, `snapshot.py`), from the controller's single thread.
"""

from __future__ import annotations

import numpy as np


class RowIndex:
    """Row id -> slot, kept per put rather than per row.

    A put of new rows takes a run of consecutive ids, so the index keeps one entry per put: its ids
    (ascending) and their slots. Neither a put nor a delete touches rows one by one; a lookup is a binary
    search over entries, then one within the entry. A slot whose row was deleted may hold another row
    by now, so a hit counts only if the slot still holds that id. Entries whose rows are mostly gone are
    trimmed (or dropped) once the entries double, which bounds the index by the live rows.
    """

    def __init__(self) -> None:
        self.ids: list[np.ndarray] = []
        self.slots: list[np.ndarray] = []
        self._firsts: np.ndarray | None = None  # first id of each entry, built on the first lookup
        self._trim_at = 64

    def add(self, ids: np.ndarray, slots: np.ndarray, row_id: np.ndarray) -> None:
        """Index new rows: `ids` ascending and above every id indexed so far."""
        if not len(ids):  # a restored partition without rows
            return
        if len(self.ids) >= self._trim_at:
            self._trim(row_id)
        self.ids.append(ids)
        self.slots.append(slots)
        self._firsts = None

    def find(self, ids: np.ndarray, row_id: np.ndarray) -> np.ndarray:
        """The slot of each id; -1 where the partition does not hold it (any more)."""
        out = np.full(len(ids), -1, dtype=np.int64)
        if not self.ids or not len(ids):
            return out
        if self._firsts is None:
            self._firsts = np.fromiter((e[0] for e in self.ids), dtype=np.int64, count=len(self.ids))
        entry = np.searchsorted(self._firsts, ids, side="right") - 1
        for e in np.unique(entry).tolist():  # usually one: the rows of one put
            if e < 0:
                continue
            sel = entry == e
            want, have = ids[sel], self.ids[e]
            pos = np.minimum(np.searchsorted(have, want), len(have) - 1)
            out[sel] = np.where(have[pos] == want, self.slots[e][pos], -1)
        hit = np.flatnonzero(out >= 0)
        out[hit[row_id[out[hit]] != ids[hit]]] = -1
        return out

    def _trim(self, row_id: np.ndarray) -> None:
        # one pass over every indexed row, then per entry its count of live rows (entries are never empty)
        live = row_id[np.concatenate(self.slots)] == np.concatenate(self.ids)
        starts = np.cumsum([0] + [len(i) for i in self.ids[:-1]])
        counts = np.add.reduceat(live, starts, dtype=np.int64).tolist()
        ids, slots = [], []
        for i, s, start, k in zip(self.ids, self.slots, starts.tolist(), counts, strict=True):
            if k > len(i) // 2:  # mostly live: keep it whole
                ids.append(i)
                slots.append(s)
            elif k:
                mine = live[start : start + len(i)]
                ids.append(i[mine])
                slots.append(s[mine])
        self.ids, self.slots = ids, slots
        self._trim_at = max(64, 2 * len(ids))
        self._firsts = None


class FreeSlots:
    """A partition's free slots as a stack in one array (the most recently freed are reused first)."""

    def __init__(self, capacity: int, used: int = 0) -> None:
        """Slots below `used` start taken (a restored partition's rows)."""
        self.stack = np.arange(capacity - 1, -1, -1, dtype=np.int64)
        self.n = capacity - used

    def __len__(self) -> int:
        return self.n

    def take(self, n: int) -> np.ndarray:
        self.n -= n
        return self.stack[self.n : self.n + n][::-1].copy()

    def give(self, slots: np.ndarray) -> None:
        self.stack[self.n : self.n + len(slots)] = slots
        self.n += len(slots)
