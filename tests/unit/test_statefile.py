"""The two-slot state file services re-join from: the latest complete state survives a torn write."""

from __future__ import annotations

from pathlib import Path

from meshrl.state.statefile import HEADER, StateFile


def test_round_trip_and_a_successor_goes_on_from_the_latest(tmp_path: Path) -> None:
    stem = tmp_path / "rejoin" / "rollout-0-0.0"
    assert StateFile(stem).read() is None  # nothing written yet: a fresh start
    first = StateFile(stem)
    for k in range(5):
        first.write({"step": k})
    successor = StateFile(stem)
    assert successor.read() == {"step": 4}
    successor.write({"step": 5})
    assert StateFile(stem).read() == {"step": 5}
    successor.remove()
    assert not list((tmp_path / "rejoin").iterdir())


def test_a_torn_write_leaves_the_state_before(tmp_path: Path) -> None:
    stem = tmp_path / "critic-0-0.0"
    state = StateFile(stem)
    state.write({"version": 1, "rows": list(range(100))})
    state.write({"version": 2, "rows": list(range(200))})  # slot 0 (sequence 2)
    latest = state.paths[state.seq % 2]
    raw = latest.read_bytes()
    for cut in (3, HEADER.size, HEADER.size + 10, len(raw) - 1):  # a kill at any point of the write
        latest.write_bytes(raw[:cut])
        assert StateFile(stem).read() == {"version": 1, "rows": list(range(100))}
    latest.write_bytes(raw[:-5] + b"00000")  # same length, other bytes: the checksum tells
    assert StateFile(stem).read() == {"version": 1, "rows": list(range(100))}
    latest.write_bytes(raw)
    assert StateFile(stem).read() == {"version": 2, "rows": list(range(200))}


def test_a_shorter_state_over_a_longer_one_reads_back_exactly(tmp_path: Path) -> None:
    state = StateFile(tmp_path / "s")
    state.write({"long": "x" * 5000})
    state.write({"long": "y" * 5000})
    state.write({"short": 1})  # written over the first, which was longer
    assert StateFile(tmp_path / "s").read() == {"short": 1}
