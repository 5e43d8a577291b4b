"""The weight group's shared-memory path: every receiver on the trainer's host (CPU), no process group.

When all inference replicas share the trainer's host, a version does not need a broadcast: the trainer
copies it into a segment, the announcement names the segment, and each receiver takes the version's
tensors as views of its own mapping: no copy out, and the replicas share one copy of the weights. The
trainer announces first and then fills the segment bucket by bucket, marking each in the store, so a
receiver takes bucket k while bucket k+1 goes in. Versions go into `SLOTS` segments in turn, so the one
a replica serves is never written while it reads it. The barrier goes through the group's store too
(`store_barrier`): each receiver counts itself in and the last one says so. No process group exists at
all, which matters with dozens of replicas on a few cores. `WeightGroup` (`weights.py`) decides when
each of these runs; this module is the segments and the store's barrier.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshrl.dataplane.shm import Segment

BARRIER_POLL = timedelta(seconds=2)  # how often the trainer looks for a replica re-joining meanwhile


SLOTS = 3
"""Versions staged in turn, each in a segment of its own. Receivers load a version as views of its slot
(no copy out) and serve from it until the next; the trainer writes a slot again only after the barrier
of the publication that followed the version it held, and by then no replica reads it. Two would not
do: a replica that receives while a batch is in progress (`inference.update="finish"`) passes the
barrier of version n+1 before it swaps it in, so the batch may still read version n."""


class SharedWeights:
    """The segments holding the last versions, one per slot. Rank 0 creates each in `where` (directory,
    name prefix), again when a version outgrows it, and fills them in turn; a receiver maps the ones
    the announcements name."""

    def __init__(self, where: tuple[str, str] | None) -> None:
        self.where = where
        self.slots: list[Segment | None] = [None] * SLOTS  # rank 0
        self.current = -1  # rank 0: the slot of the last version staged
        self.maps: dict[str, Segment] = {}  # a receiver's mappings, by path, the newest last

    def staging(self, size: int, epoch: int) -> torch.Tensor:
        """Rank 0: the next slot, as bytes, big enough for one version of `size` bytes."""
        assert self.where is not None
        self.current = (self.current + 1) % SLOTS
        segment = self.slots[self.current]
        if segment is None or segment.size < size:
            if segment is not None:
                segment.unlink()  # receivers that still hold its tensors keep their mapping
            directory, name = self.where
            segment = Segment.create(directory, f"{name}-{self.current}-{epoch}-{size}", size)
            self.slots[self.current] = segment
        return torch.frombuffer(segment.mm, dtype=torch.uint8, count=size)

    def staged(self, size: int) -> torch.Tensor:
        """Rank 0: the slot of the last version staged (to send it again)."""
        segment = self.slots[self.current]
        assert segment is not None, "nothing staged"
        return torch.frombuffer(segment.mm, dtype=torch.uint8, count=size)

    def path(self) -> str:
        """Rank 0: where receivers find the version just staged (for the announcement)."""
        segment = self.slots[self.current]
        assert segment is not None, "nothing staged"
        return str(segment.path)

    def mapped(self, name: str, size: int) -> torch.Tensor:
        """A receiver: the trainer's segment at path `name`, mapped once (its pages fault in on the
        first read only). Tensors taken from it keep their mapping alive after it leaves `maps`."""
        segment = self.maps.pop(name, None)
        if segment is None:
            path = Path(name)
            try:
                segment = Segment.open(str(path.parent), path.name)
            except FileNotFoundError as e:
                raise RuntimeError(
                    f"weight receiver: the trainer's shared-memory segment {name} is not visible here; "
                    "shared memory needs every inference replica on the trainer's host"
                ) from e
        self.maps[name] = segment
        while len(self.maps) > SLOTS:  # a slot re-created bigger: its old mapping goes with its tensors
            del self.maps[next(iter(self.maps))]
        return torch.frombuffer(segment.mm, dtype=torch.uint8, count=size)

    def unlink(self) -> None:
        """Rank 0, at the end: receivers keep their mappings; the names go."""
        for segment in self.slots:
            if segment is not None:
                segment.unlink()


def store_barrier(
    store: Any, n: int, rank: int, world_size: int, *, gone: Callable[[], bool], timeout: timedelta
) -> bool:
    """The barrier of publication `n` through the store: each receiver counts itself in and returns, the
    last one says so, and rank 0 waits for that. Rank 0 gives up (False) when `gone()`: a restarted
    replica asks to join, so the one missing will never count itself in."""
    if rank != 0:
        if store.add(f"done/{n}", 1) == world_size - 1:
            store.set(f"all/{n}", "1")
        return True
    waited = timedelta()
    while True:
        try:
            store.wait([f"all/{n}"], BARRIER_POLL)
            return True
        except dist.DistStoreError as e:
            if "timeout" not in str(e).lower():
                raise
        waited += BARRIER_POLL
        if gone():
            return False
        if waited > timeout:
            raise TimeoutError(f"weight publication {n}: a receiver did not apply it in {waited}")
