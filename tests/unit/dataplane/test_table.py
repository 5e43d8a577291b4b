"""The controller's bookkeeping against a plain reference model (no sockets, no processes)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, precondition, rule

from meshrl.dataplane import protocol as P
from meshrl.dataplane.slots import RowIndex
from meshrl.dataplane.table import READY, Partition, TableError

SEG = P.SegmentRef("meshrl-t-1", "h", 1 << 30)


def write(name: str, n: int) -> P.ColumnWrite:
    return P.ColumnWrite(name, "int64", [], False, 0, 8 * n)


class TableModel(RuleBasedStateMachine):
    """Random puts, claims, acks, lease expiries and deletes; delivery must stay exactly-once."""

    claims = Bundle("claims")

    def __init__(self) -> None:
        super().__init__()
        self.part = Partition("p", 64, ["a", "b"])  # rows are due for deletion once both acked them
        self.next_id = 0
        self.next_claim = 1
        self.cols: dict[int, set[str]] = {}
        self.group: dict[int, int] = {}
        self.need = {"a": {"x"}, "b": {"x", "y"}, "g": {"x"}}
        for name, cols in self.need.items():
            self.part.consumer(name, sorted(cols), 2 if name == "g" else None)
        self.acked: dict[str, set[int]] = {k: set() for k in self.need}
        self.leased: dict[str, dict[int, set[int]]] = {k: {} for k in self.need}

    def in_flight(self, consumer: str) -> set[int]:
        return set().union(*self.leased[consumer].values()) if self.leased[consumer] else set()

    @rule(
        n=st.integers(1, 6), with_y=st.booleans(), groups=st.lists(st.integers(0, 4), min_size=6, max_size=6)
    )
    def put_new(self, n: int, with_y: bool, groups: list[int]) -> None:
        cols = ["x", "y"] if with_y else ["x"]
        if not self.part.can_put(n):
            return
        meta: list[P.Meta] = [{"group": g} for g in groups[:n]]
        ids, _ = self.part.put(0, SEG, n, [write(c, n) for c in cols], None, meta, self.next_id)
        self.next_id += n
        for i, g in zip(ids.tolist(), groups, strict=False):
            self.cols[i] = set(cols)
            self.group[i] = g

    @rule(data=st.data())
    def add_y(self, data: st.DataObject) -> None:
        missing = sorted(i for i, c in self.cols.items() if "y" not in c)
        if not missing:
            return
        chosen = data.draw(st.lists(st.sampled_from(missing), min_size=1, max_size=4, unique=True))
        ids = np.asarray(chosen, dtype="<i8")
        self.part.put(0, SEG, len(ids), [write("y", len(ids))], ids.tobytes(), None, self.next_id)
        for i in chosen:
            self.cols[i].add("y")
        with pytest.raises(TableError, match="already written"):
            self.part.put(0, SEG, len(ids), [write("y", len(ids))], ids.tobytes(), None, self.next_id)

    @rule(target=claims, consumer=st.sampled_from(["a", "b", "g"]), n=st.integers(2, 8))
    def claim(self, consumer: str, n: int) -> tuple[str, int]:
        c = self.part.consumers[consumer]
        chunk = self.part.claim(c, n, 60.0, self.next_claim)
        claim_id = self.next_claim
        self.next_claim += 1
        if chunk is None:
            return consumer, -1
        got = chunk.ids.tolist()
        assert len(got) == len(set(got)) <= n
        for i in got:
            assert i in self.cols, "claimed a deleted row"
            assert self.need[consumer] <= self.cols[i], "claimed a row missing a needed column"
            assert i not in self.acked[consumer], "row delivered again after its ack"
            assert i not in self.in_flight(consumer), "row leased twice at once"
        if consumer == "g":
            groups = [self.group[i] for i in got]
            assert all(groups.count(g) % 2 == 0 for g in groups), f"not whole groups: {groups}"
        self.leased[consumer][claim_id] = set(got)
        return consumer, claim_id

    @rule(claim=claims)
    def ack(self, claim: tuple[str, int]) -> None:
        consumer, claim_id = claim
        c = self.part.consumers[consumer]
        if claim_id not in self.leased[consumer]:
            if claim_id > 0:
                with pytest.raises(TableError, match="expired"):
                    self.part.ack(c, claim_id)
            return
        _, due = self.part.ack(c, claim_id)
        rows = self.leased[consumer].pop(claim_id) & set(self.cols)
        self.acked[consumer] |= rows
        want = {i for i in rows if i in self.acked["a"] and i in self.acked["b"]}
        assert set(self.part.row_id[due].tolist()) == want
        self.part.delete_slots(due)  # as the controller does
        for i in want:
            del self.cols[i]
            self.group.pop(i)

    @rule(claim=claims)
    def expire(self, claim: tuple[str, int]) -> None:
        consumer, claim_id = claim
        if claim_id in self.leased[consumer]:
            self.part.expire(self.part.consumers[consumer], claim_id)
            del self.leased[consumer][claim_id]

    @precondition(lambda self: bool(self.cols))
    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        chosen = data.draw(st.lists(st.sampled_from(sorted(self.cols)), min_size=1, max_size=5, unique=True))
        n, _ = self.part.delete_ids(np.asarray(chosen))
        assert n == len(chosen)
        for i in chosen:
            del self.cols[i]
            self.group.pop(i)

    @invariant()
    def ready_counts_match(self) -> None:
        for name in ("a", "b"):
            c = self.part.consumers[name]
            want = {
                i
                for i, cols in self.cols.items()
                if self.need[name] <= cols and i not in self.acked[name] and i not in self.in_flight(name)
            }
            assert c.nready == len(want) == int((c.state == READY).sum())
        assert self.part.rows == len(self.cols)

    @invariant()
    def every_id_is_found_exactly_while_its_row_lives(self) -> None:
        ids = np.arange(self.next_id, dtype=np.int64)
        slots = self.part.slots_of(ids, strict=False)
        live = np.asarray([i in self.cols for i in range(self.next_id)], dtype=bool)
        assert (slots[~live] == -1).all()
        assert (self.part.row_id[slots[live]] == ids[live]).all()

    def teardown(self) -> None:
        """Liveness: everything not acked or in flight is still deliverable, exactly once."""
        for name in ("a", "b"):
            c = self.part.consumers[name]
            want = {
                i
                for i, cols in self.cols.items()
                if self.need[name] <= cols and i not in self.acked[name] and i not in self.in_flight(name)
            }
            got: list[int] = []
            while (chunk := self.part.claim(c, 5, 60.0, self.next_claim)) is not None:
                self.next_claim += 1
                got.extend(chunk.ids.tolist())
            assert sorted(got) == sorted(want)


TestTableModel = TableModel.TestCase
TestTableModel.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_put_validation_names_the_problem() -> None:
    part = Partition("p", 8, [])
    with pytest.raises(TableError, match="do not match"):
        part.put(0, SEG, 2, [P.ColumnWrite("x", "int64", [], False, 0, 8)], None, None, 0)
    with pytest.raises(ValueError, match="not supported"):
        part.put(0, SEG, 1, [P.ColumnWrite("x", "complex7", [], False, 0, 8)], None, None, 0)
    part.put(0, SEG, 1, [write("x", 1)], None, None, 0)
    with pytest.raises(TableError, match="column 'x' is int64"):
        part.put(0, SEG, 1, [P.ColumnWrite("x", "float32", [], False, 0, 4)], None, None, 1)
    with pytest.raises(TableError, match="unknown row ids"):
        part.put(0, SEG, 1, [write("y", 1)], np.asarray([99], dtype="<i8").tobytes(), None, 1)
    with pytest.raises(TableError, match="must be an int"):
        part.put(0, SEG, 1, [write("x", 1)], None, [{"group": "a"}], 1)


def test_consumer_declaration_is_fixed() -> None:
    part = Partition("p", 8, [])
    part.consumer("t", ["x"], None)
    with pytest.raises(TableError, match="was declared with columns"):
        part.consumer("t", ["x", "y"], None)
    with pytest.raises(TableError, match="group_size"):
        part.consumer("u", ["x"], 0)


def test_partial_ack_keeps_the_rest_leased() -> None:
    part = Partition("p", 8, ["t"])
    ids, _ = part.put(0, SEG, 4, [write("x", 4)], None, None, 0)
    c = part.consumer("t", ["x"], None)
    chunk = part.claim(c, 4, 60.0, 1)
    assert chunk is not None
    n, due = part.ack(c, 1, ids[:2])
    assert n == 2 and sorted(part.row_id[due].tolist()) == ids[:2].tolist()
    with pytest.raises(TableError, match="not in claim"):
        part.ack(c, 1, ids[:1])
    assert part.expire(c, 1) == 2  # only the un-acked rows come back
    assert part.claim(c, 4, 60.0, 2).ids.tolist() == ids[2:].tolist()  # type: ignore[union-attr]


def test_row_index_finds_live_rows_through_slot_reuse_and_trimming() -> None:
    """Thousands of puts through a small partition: slots are reused many times over and the index trims
    itself; every live id is found at its slot, and no deleted id is found at all."""
    rng = np.random.default_rng(0)
    part = Partition("p", 32, [])
    live: list[int] = []
    next_id = 0
    for _ in range(3000):
        n = int(rng.integers(1, 6))
        while not part.can_put(n):  # delete random rows, as several consumers finishing out of order would
            gone = rng.choice(len(live), size=min(len(live), int(rng.integers(1, 4))), replace=False)
            part.delete_ids(np.asarray([live[g] for g in gone]))
            live = [x for k, x in enumerate(live) if k not in set(gone.tolist())]
        ids, _ = part.put(0, SEG, n, [write("x", n)], None, None, next_id)
        next_id += n
        live += ids.tolist()
    assert len(part.index.ids) < 200, "the index must stay bounded by the live rows"
    everything = np.arange(next_id, dtype=np.int64)
    slots = part.slots_of(everything, strict=False)
    assert set(everything[slots >= 0].tolist()) == set(live)
    assert (part.row_id[slots[slots >= 0]] == everything[slots >= 0]).all()
    with pytest.raises(TableError, match="unknown row ids"):
        part.slots_of(np.asarray([0, live[0]]), strict=True)


def test_row_index_lookup_spans_entries() -> None:
    index = RowIndex()
    row_id = np.full(16, -1, dtype=np.int64)
    index.add(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), row_id)  # a restore of no rows
    assert index.find(np.asarray([3]), row_id).tolist() == [-1]
    for ids, slots in [([3, 4, 5], [0, 1, 2]), ([9, 10], [7, 3]), ([20], [15])]:
        row_id[slots] = ids
        index.add(np.asarray(ids), np.asarray(slots), row_id)
    got = index.find(np.asarray([20, 3, 10, 6, 2, 9, 21, 5]), row_id)
    assert got.tolist() == [15, 0, 3, -1, -1, 7, -1, 2]


def test_an_addressed_consumer_sees_only_the_rows_addressed_to_it() -> None:
    part = Partition("p", 8, [])
    to = [{"to": "a.0,b.1"}, {"to": "a.1"}, {}, {"to": "a.0"}]
    ids, _ = part.put(0, SEG, 4, [write("x", 4)], None, to, 0)
    early = part.consumer("a0", ["x", "y"], None, "a.0")  # declared before its column is there
    late = part.consumer("a1", ["x"], None, "a.1")  # declared after the rows came
    everyone = part.consumer("all", ["x"], None)
    assert part.claim(late, 8, 60.0, 1).ids.tolist() == [ids[1]]  # type: ignore[union-attr]
    assert part.claim(everyone, 8, 60.0, 2).ids.tolist() == ids.tolist()  # type: ignore[union-attr]
    assert part.claim(early, 8, 60.0, 3) is None
    part.put(0, SEG, 4, [write("y", 4)], ids.astype("<i8").tobytes(), None, 4)
    assert part.claim(early, 8, 60.0, 4).ids.tolist() == [ids[0], ids[3]]  # type: ignore[union-attr]
    with pytest.raises(TableError, match="address"):
        part.consumer("a0", ["x", "y"], None, "a.1")
