"""The controller's record of shared-memory segments: which rows reference each, and where one goes when
its last row is deleted.

A put names the segment that holds its bytes; the controller numbers it (columns store that number per
row, see `columns.py`) and counts the (row, column) references to it. When the count falls to 0 the
segment goes back to the producer that wrote it, in the reply to that producer's next put, so steady-
state puts write into pages already mapped; when that producer has left (or already holds
`MAX_RELEASED_PER_CLIENT` of them), the segment's host unlinks it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field

from meshrl.dataplane import protocol as P
from meshrl.dataplane.storage import StorageLinks

log = logging.getLogger("meshrl.controller")

MAX_RELEASED_PER_CLIENT = 64


@dataclass
class SegmentInfo:
    ref: P.SegmentRef
    owner: str
    refs: int = 0


@dataclass
class ClientInfo:
    host: str
    pid: int
    released: list[str] = field(default_factory=list)  # its segments that no row references any more
    alive: bool = True


class Segments:
    """Segments by number, their owners, and the clients that own them."""

    def __init__(self, host: str, shm_dir: str, storage: StorageLinks) -> None:
        self.host = host
        self.shm_dir = shm_dir
        self.storage = storage
        self.info: dict[int, SegmentInfo] = {}
        self.by_name: dict[str, int] = {}
        self.next = 0  # the number the next new segment gets
        self.clients: dict[str, ClientInfo] = {}

    def __len__(self) -> int:
        return len(self.info)

    def ref(self, index: int) -> P.SegmentRef:
        return self.info[index].ref

    # ---------------------------------------------------------------------------------------------------
    # clients

    def hello(self, client: str, host: str, pid: int) -> None:
        self.clients[client] = ClientInfo(host, pid)

    def bye(self, client: str) -> None:
        """A client that closed: segments handed back to it from now on are unlinked instead, and so are
        those waiting for it."""
        info = self.clients.get(client)
        if info is not None:
            info.alive = False
            self.unlink(info.host, info.released)
            info.released = []

    def alive_clients(self) -> int:
        return sum(1 for c in self.clients.values() if c.alive)

    def released(self, client: str) -> list[str]:
        """The client's segments that it may reuse, handed over now (each is handed over once)."""
        info = self.clients.get(client)
        if info is None:
            return []
        released, info.released = info.released, []
        return released

    # ---------------------------------------------------------------------------------------------------
    # references

    def for_put(self, ref: P.SegmentRef, owner: str) -> tuple[int, SegmentInfo]:
        """The number of a put's segment: its own when known (a producer reusing a segment handed back),
        else the next one, registered by `add` once the put has been applied."""
        index = self.by_name.get(ref.name)
        if index is None:
            return self.next, SegmentInfo(ref, owner)
        info = self.info[index]
        if info.refs or info.owner != owner or info.ref != ref:
            raise P.TableError("conflict", f"segment {ref.name} is in use by live rows")
        return index, info

    def add(self, index: int, info: SegmentInfo, refs: int) -> None:
        """References of an applied put to its segment (numbered by `for_put`)."""
        if index == self.next:
            self.next += 1
            self.info[index] = info
            self.by_name[info.ref.name] = index
        info.refs += refs

    def drop(self, dropped: dict[int, int]) -> None:
        """References gone with deleted rows, per segment number; a segment without any is released."""
        for index, k in dropped.items():
            info = self.info[index]
            info.refs -= k
            if info.refs == 0:
                self._release(index, info)

    def restore(self, refs: list[P.SegmentRef]) -> None:
        """A snapshot's segments, numbered in order, owned by their hosts' storage servers (no rows yet)."""
        for i, ref in enumerate(refs):
            P.check_segment_name(ref.name)
            self.info[i] = SegmentInfo(ref, owner=f"storage:{ref.host}")
            self.by_name[ref.name] = i
        self.next = len(refs)

    def _release(self, index: int, info: SegmentInfo) -> None:
        client = self.clients.get(info.owner)
        if client is not None and client.alive and len(client.released) < MAX_RELEASED_PER_CLIENT:
            client.released.append(info.ref.name)  # the producer recycles it
            return
        del self.info[index]
        del self.by_name[info.ref.name]
        self.unlink(info.ref.host, [info.ref.name])

    def unlink(self, host: str, names: list[str]) -> None:
        """Forget segments and have their host remove them."""
        if not names:
            return
        for name in names:
            index = self.by_name.pop(name, None)
            if index is not None:
                self.info.pop(index, None)
        if self.storage.unlink(host, names):
            return
        if host == self.host:  # no storage server here (embedded use): the files are ours to remove
            for name in names:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.shm_dir, P.check_segment_name(name)))
        else:
            log.warning("no storage server on %s to free %d segments", host, len(names))
