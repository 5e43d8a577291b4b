"""A producer's segment pool: a put reuses the smallest free segment that holds it (at most 4 times its
size), a new one otherwise; free segments past the budget are unlinked, the biggest first."""

from __future__ import annotations

from pathlib import Path

from meshrl.dataplane.shm import SegmentPool


def test_free_segments_are_reused_by_size_and_the_budget_holds(tmp_path: Path) -> None:
    pool = SegmentPool(str(tmp_path), "meshrl-test-p", max_free_bytes=3 * 65536)
    small = [pool.acquire(100) for _ in range(3)]  # 4 KiB each (the smallest class)
    big = pool.acquire(60_000)  # 64 KiB
    assert [s.size for s in small] == [4096] * 3 and big.size == 65536
    pool.release([s.name for s in small] + [big.name])
    first = pool.acquire(50)
    assert first.name in {s.name for s in small}  # a free small one, not a new segment
    assert pool.acquire(30_000).name == big.name  # 64 KiB holds 30 KB and is within 4x of it
    fresh = pool.acquire(200_000)  # nothing free fits: a new segment
    assert fresh.size == 262144 and fresh.name not in {s.name for s in [*small, big]}
    pool.release([fresh.name, big.name])  # 256 + 64 + 8 KiB free, past the 192 KiB budget: the biggest goes
    assert not Path(fresh.path).exists() and Path(big.path).exists()
    pool.close()  # the free ones go; the busy one holds rows and stays (its host's storage frees it)
    assert [p.name for p in tmp_path.iterdir()] == [Path(first.path).name]
