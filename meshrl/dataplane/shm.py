"""Shared-memory segments: the same-host storage of the data plane.

A segment is a file under /dev/shm (POSIX shared memory, mode 0600) holding the column buffers of one
put. Producers write into segments they own and recycle them once the controller reports that no live
row references them any more, so a steady-state put is one memcpy into already-mapped, already-faulted
pages. Readers on the same host map segments by name; a tensor built on a mapping is a view, not a copy.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from pathlib import Path

import numpy as np

from meshrl.dataplane.protocol import check_segment_name

DEFAULT_SHM_DIR = "/dev/shm"


def shm_directory(default: str = DEFAULT_SHM_DIR) -> str:
    """Where this host's segments live: MESHRL_SHM_DIR if set (a host's own directory, so that two
    "hosts" of a test on one machine share no memory), else `default` (the controller's)."""
    return os.environ.get("MESHRL_SHM_DIR") or default


ALIGN = 64


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _round_size(n: int) -> int:
    """Segment sizes come in few classes so that recycled segments fit later writes."""
    n = max(n, 4096)
    if n <= 1 << 20:
        return 1 << (n - 1).bit_length()
    step = 1 << 20
    return (n + step - 1) // step * step


class Segment:
    """One mapped segment file."""

    def __init__(self, path: Path, mm: mmap.mmap) -> None:
        self.path = path
        self.name = path.name
        self.mm = mm
        self.size = len(mm)
        # per-call costs matter for small puts and claims: slicing these beats a new view per column
        self.u8 = np.frombuffer(mm, dtype=np.uint8)
        self.bytes = memoryview(mm)

    @classmethod
    def create(cls, directory: str, name: str, size: int) -> Segment:
        path = Path(directory) / check_segment_name(name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        return cls(path, mm)

    @classmethod
    def open(cls, directory: str, name: str) -> Segment:
        path = Path(directory) / check_segment_name(name)
        fd = os.open(path, os.O_RDWR)
        try:
            mm = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        return cls(path, mm)

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class SegmentPool:
    """Segments owned by one producer client: new ones on demand, recycled ones when released.

    Free segments are kept by size (sizes come in few classes: `_round_size`), so a put finds one by
    looking at the classes, not at every free segment (a service with hundreds of rows in flight has
    hundreds free)."""

    def __init__(self, directory: str, prefix: str, max_free_bytes: int = 512 << 20) -> None:
        self.directory = directory
        self.prefix = prefix
        self.max_free_bytes = max_free_bytes
        self._counter = 0
        self._free: dict[int, list[Segment]] = {}
        self._free_bytes = 0
        self._busy: dict[str, Segment] = {}
        self._lock = threading.Lock()

    def acquire(self, nbytes: int) -> Segment:
        """The smallest free segment that holds `nbytes` and is at most 4 times as big, else a new one."""
        with self._lock:
            fits = [
                size for size, segs in self._free.items() if segs and nbytes <= size <= 4 * max(nbytes, 4096)
            ]
            if fits:
                seg = self._free[min(fits)].pop()
                self._free_bytes -= seg.size
            else:
                self._counter += 1
                seg = Segment.create(self.directory, f"{self.prefix}-{self._counter}", _round_size(nbytes))
            self._busy[seg.name] = seg
            return seg

    def give_back(self, seg: Segment) -> None:
        """A segment whose put failed: nothing references it."""
        self.release([seg.name])

    def release(self, names: list[str]) -> None:
        with self._lock:
            for name in names:
                seg = self._busy.pop(name, None)
                if seg is not None:
                    self._free.setdefault(seg.size, []).append(seg)
                    self._free_bytes += seg.size
            while self._free_bytes > self.max_free_bytes:  # past the budget: the biggest go first
                seg = self._free[max(size for size, segs in self._free.items() if segs)].pop(0)
                self._free_bytes -= seg.size
                seg.unlink()

    def close(self) -> None:
        """Unlink the free segments. Busy ones hold live rows and stay (their host's storage frees them)."""
        with self._lock:
            for segs in self._free.values():
                for seg in segs:
                    seg.unlink()
            self._free.clear()
            self._free_bytes = 0


class MapCache:
    """Read-side mappings by segment name, bounded by total mapped bytes (the oldest mapped go first).

    Evicting only drops our reference: tensors built on a mapping keep it alive until they are freed.
    """

    def __init__(self, directory: str, max_bytes: int = 4 << 30) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self._maps: dict[str, Segment] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, name: str, min_size: int) -> Segment:
        seg = self._maps.get(name)  # the usual case, without the lock (a dict lookup is atomic)
        if seg is not None and seg.size >= min_size:
            return seg
        with self._lock:
            seg = self._maps.get(name)
            if seg is not None and seg.size >= min_size:  # another thread mapped it meanwhile
                return seg
            if seg is not None:  # cannot happen for names that are never reused; be safe anyway
                self._drop(name)
            seg = Segment.open(self.directory, name)
            self._maps[name] = seg
            self._bytes += seg.size
            while self._bytes > self.max_bytes and len(self._maps) > 1:
                self._drop(next(iter(self._maps)))
            return seg

    def forget(self, names: list[str]) -> None:
        with self._lock:
            for name in names:
                if name in self._maps:
                    self._drop(name)

    def _drop(self, name: str) -> None:
        seg = self._maps.pop(name)
        self._bytes -= seg.size
