"""The client's grouping of claimed rows into byte runs it maps as one view each."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from meshrl.dataplane.core import runs
from meshrl.dataplane.protocol import ColumnRead


def column(rows: list[tuple[int, int, int]], shape: list[int]) -> ColumnRead:
    seg, off, length = zip(*rows, strict=True) if rows else ((), (), ())
    return ColumnRead(
        "c", "float32", shape, True,
        np.asarray(seg, "<i4").tobytes(), np.asarray(off, "<i8").tobytes(), np.asarray(length, "<i8").tobytes(),
    )  # fmt: skip


def reference(rows: list[tuple[int, int, int]], item: int) -> list[tuple[int, int, int]]:
    """Row by row: a row continues the run when it is in the same segment and starts where it ends."""
    runs: list[list[int]] = []
    for seg, off, length in rows:
        if runs and runs[-1][0] == seg and runs[-1][1] + runs[-1][2] == off:
            runs[-1][2] += length * item
        else:
            runs.append([seg, off, length * item])
    return [tuple(r) for r in runs]  # type: ignore[misc]


@settings(max_examples=300, deadline=None)
@given(
    layout=st.lists(
        st.tuples(st.integers(0, 2), st.integers(0, 3), st.integers(0, 5)),  # segment, gap in items, items
        min_size=0,
        max_size=40,
    ),
    width=st.integers(1, 3),
)
def test_runs_match_a_row_by_row_grouping(layout: list[tuple[int, int, int]], width: int) -> None:
    item = 4 * width  # float32 items of shape [width]
    rows, ends = [], {}
    for seg, gap, length in layout:
        off = ends.get(seg, 0) + gap * item
        rows.append((seg, off, length))
        ends[seg] = off + length * item
    assert runs(column(rows, [width])) == reference(rows, item)


def test_rows_of_one_write_in_order_are_one_run_and_out_of_order_rows_are_not() -> None:
    rows = [(0, 16 * k, 4) for k in range(32)]  # 4 float32 items per row, back to back
    assert runs(column(rows, [])) == [(0, 0, 32 * 16)]
    swapped = [rows[1], rows[0], *rows[2:]]
    assert runs(column(swapped, [])) == [(0, 16, 16), (0, 0, 16), (0, 32, 30 * 16)]
