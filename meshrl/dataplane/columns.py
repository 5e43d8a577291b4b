"""A partition's columns: each one's schema, fixed by its first write, and where each row's bytes lie.

A put names, per column, a byte range of its segment. `place` checks that range against the column's
schema and the segment before the put changes anything, and works out each row's offset and length;
the partition then records them per slot (segment index, offset, length). A claim reads them back with
`locate`, as the arrays a `ClaimReply` carries. Tensor bytes are never seen here.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from meshrl.dataplane.protocol import ColumnRead, ColumnWrite, SegmentRef, TableError, int64s, item_bytes

_I32 = struct.Struct("<i")

# A column write checked against its segment: (the column when its schema already matched, else None;
# the write; bytes per item; each row's offset in the segment; each row's length in items, or 1)
Placed = tuple["Column | None", ColumnWrite, int, np.ndarray, "np.ndarray | int"]


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

    @classmethod
    def new(cls, name: str, bit: int, capacity: int) -> Column:
        return cls(
            name,
            bit,
            None,
            [],
            False,
            0,
            np.zeros(capacity, dtype="<i4"),  # little-endian: claim replies send slices of these as is
            np.zeros(capacity, dtype="<i8"),
            np.zeros(capacity, dtype="<i8"),
        )

    def fix(self, cw: ColumnWrite, item: int, partition: str) -> None:
        """Take the schema of the column's first write, or check a later write against it."""
        if self.dtype is None:
            self.dtype, self.shape, self.ragged, self.item = cw.dtype, list(cw.shape), cw.ragged, item
        elif (self.dtype, self.shape, self.ragged) != (cw.dtype, list(cw.shape), cw.ragged):

            def kind(d: str | None, s: list[int], r: bool) -> str:
                return f"{d}{s}{' ragged' if r else ''}"

            raise TableError(
                "bad_request",
                f"partition {partition!r} column {cw.name!r} is {kind(self.dtype, self.shape, self.ragged)}, "
                f"write has {kind(cw.dtype, cw.shape, cw.ragged)}",
            )


def place(col: Column | None, cw: ColumnWrite, n: int, seg: SegmentRef) -> Placed:
    """Check a write of n rows against its segment (`col`: the column of that name, if any)."""
    if col is not None and col.dtype == cw.dtype and col.shape == cw.shape and col.ragged == cw.ragged:
        item = col.item  # the usual case: validated by the column's first write
    else:
        col, item = None, item_bytes(cw.dtype, cw.shape)  # the schema is fixed once the whole put is valid
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
    return col, cw, item, starts, lengths


def locate(
    columns: dict[str, Column], names: list[str], slots: np.ndarray, ref: Callable[[int], SegmentRef]
) -> tuple[list[SegmentRef], list[ColumnRead]]:
    """Where the rows in `slots` lie in the columns `names`: the segments they name (`ref`: a segment
    index's reference) and per column the reply's arrays, whose segment entries index that list."""
    seg_list: list[SegmentRef] = []
    seg_pos: dict[int, int] = {}
    reads = []
    n = len(slots)
    for name in names:
        col = columns[name]
        assert col.dtype is not None
        segs = col.seg[slots]
        first = int(segs[0])
        if n == 1 or not np.count_nonzero(segs != first):  # the usual case: rows of one write
            pos = seg_pos.get(first)
            if pos is None:
                pos = seg_pos[first] = len(seg_list)
                seg_list.append(ref(first))
            segment = _I32.pack(pos) * n
        else:
            uniq, inverse = np.unique(segs, return_inverse=True)
            where = np.empty(len(uniq), dtype="<i4")
            for k, s in enumerate(uniq.tolist()):
                if s not in seg_pos:
                    seg_pos[s] = len(seg_list)
                    seg_list.append(ref(s))
                where[k] = seg_pos[s]
            segment = where[inverse].tobytes()
        reads.append(
            ColumnRead(
                name=col.name,
                dtype=col.dtype,
                shape=col.shape,
                ragged=col.ragged,
                segment=segment,
                offset=col.off[slots].tobytes(),  # little-endian arrays (see `Column.new`)
                length=col.length[slots].tobytes(),
            )
        )
    return seg_list, reads
