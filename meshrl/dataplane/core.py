"""The client logic that does no I/O, shared by `Client` (blocking) and `AsyncClient` (asyncio).

A put is prepared here: every column copied once into a shared-memory segment this client owns (see
`shm.py`) and described in one `Put` message. A claim reply is turned here into a `Batch`: same-host
columns become views on the mapped segments, other hosts' bytes arrive as buffers fetched by the
transport. The error classes a reply maps to live here too.
"""

from __future__ import annotations

import itertools
import math
import os
import struct
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from meshrl.dataplane import protocol as P
from meshrl.dataplane.batch import (
    DTYPE_NAMES,
    NUMPY_DTYPES,
    Batch,
    Ragged,
    Value,
    as_numpy,
    from_numpy,
    normalise,
)
from meshrl.dataplane.shm import MapCache, Segment, SegmentPool, align, shm_directory
from meshrl.dataplane.wire import host_id


class DataPlaneError(RuntimeError):
    """The controller or a storage server refused a request; the message says why."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class PartitionFull(DataPlaneError):
    """Back-pressure: the partition stayed full for the whole put timeout."""


class LeaseExpired(DataPlaneError):
    """The claim's lease ran out before the ack; its rows went back to the pool."""


class UnknownPartition(DataPlaneError):
    pass


_ERRORS = {"full": PartitionFull, "expired": LeaseExpired, "unknown_partition": UnknownPartition}


def raise_for(reply: Any) -> Any:
    if isinstance(reply, P.Error):
        raise _ERRORS.get(reply.code, DataPlaneError)(reply.code, reply.message)
    return reply


@dataclass
class PreparedPut:
    segment: Segment
    msg: P.Put


_POOLS = itertools.count()
BIG_COPY = 256 << 10


class ClientCore:
    """Transport-independent client logic shared by the blocking and asyncio clients."""

    def __init__(self, name: str | None) -> None:
        self.name = P.check_name(name or f"{host_id()[:40]}-{os.getpid()}-{uuid.uuid4().hex[:6]}", "client")
        self.host = host_id()
        self.pool: SegmentPool | None = None
        self.maps: MapCache | None = None
        self.storages: dict[str, str] = {}

    def hello(self) -> P.Hello:
        return P.Hello(client=self.name, host=self.host, pid=os.getpid())

    def on_hello(self, reply: P.HelloReply) -> None:
        # the pid keeps a restarted process (same client name, restored run) clear of its predecessor's
        # segments, which a restored data plane may still hold; the count keeps two clients of one name
        # in one process clear of each other's
        shm_dir = shm_directory(reply.shm_dir)
        self.pool = SegmentPool(shm_dir, f"meshrl-{reply.run}-{self.name}-{os.getpid()}-{next(_POOLS)}")
        self.maps = MapCache(shm_dir)
        self.storages = dict(reply.storages)

    def local(self, reply: P.HelloReply) -> str:
        """The controller's Unix-socket endpoint if it runs on this host (cheaper than TCP), else ""."""
        return reply.local if reply.local and reply.host == self.host else ""

    def prepare_put(
        self,
        partition: str,
        columns: Mapping[str, Any],
        ids: Sequence[int] | np.ndarray | None,
        meta: Sequence[P.Meta] | None,
        timeout: float,
        key: str | None = None,
    ) -> PreparedPut:
        assert self.pool is not None
        if not columns:
            raise ValueError("put needs at least one column")
        prepared = []
        n: int | None = None
        offset = 0
        for name, value in columns.items():
            values, lengths = normalise(value)
            rows = len(lengths) if lengths is not None else values.shape[0]
            if n is None:
                n = rows
            elif rows != n:
                raise ValueError(f"column {name!r} has {rows} rows, {next(iter(columns))!r} has {n}")
            if values.dtype not in DTYPE_NAMES:
                raise TypeError(f"column {name!r}: dtype {values.dtype} is not supported")
            nbytes = values.numel() * values.element_size()
            prepared.append((name, values, lengths, list(values.shape[1:]), offset, nbytes))
            offset = align(offset + nbytes)
        assert n is not None
        if ids is not None and len(ids) != n:
            raise ValueError(f"put of {n} rows names {len(ids)} ids")
        if meta is not None and len(meta) != n:
            raise ValueError(f"put of {n} rows carries {len(meta)} meta entries")
        seg = self.pool.acquire(max(offset, 1))
        try:
            writes = []
            for name, values, lengths, shape, off, nbytes in prepared:
                if nbytes >= BIG_COPY:  # torch's copy is a few percent faster on buffers that miss the cache
                    dst = torch.frombuffer(seg.mm, dtype=values.dtype, count=values.numel(), offset=off)
                    dst.copy_(values.reshape(-1))
                elif nbytes:  # a memoryview copy costs less per call
                    seg.bytes[off : off + nbytes] = as_numpy(values).data.cast("B")
                writes.append(
                    P.ColumnWrite(
                        name=name,
                        dtype=DTYPE_NAMES[values.dtype],
                        shape=shape,
                        ragged=lengths is not None,
                        offset=off,
                        nbytes=nbytes,
                        lengths=None if lengths is None else np.asarray(lengths, dtype="<i8").tobytes(),
                    )
                )
        except BaseException:
            self.pool.give_back(seg)
            raise
        msg = P.Put(
            client=self.name,
            partition=partition,
            n=n,
            segment=P.SegmentRef(seg.name, self.host, seg.size),
            columns=writes,
            ids=None if ids is None else np.asarray(ids, dtype="<i8").tobytes(),
            meta=None if meta is None else [dict(m) for m in meta],
            timeout=timeout,
            key=key,
        )
        return PreparedPut(seg, msg)

    def finish_put(self, prepared: PreparedPut, reply: Any) -> np.ndarray:
        assert self.pool is not None
        if isinstance(reply, P.Error):
            self.pool.give_back(prepared.segment)
            raise_for(reply)
        assert isinstance(reply, P.PutReply)
        if reply.released:
            self.pool.release(reply.released)
        return np.frombuffer(reply.ids, dtype="<i8").copy()

    def remote_ranges(self, reply: P.ClaimReply) -> dict[str, list[tuple[int, int, int]]]:
        """Per remote host: (segment index, offset, nbytes) runs to fetch from its storage server."""
        wanted: dict[str, list[tuple[int, int, int]]] = {}
        if all(ref.host == self.host for ref in reply.segments):  # the usual case: nothing to fetch
            return wanted
        for col in reply.columns:
            for seg, off, nbytes in runs(col):
                ref = reply.segments[seg]
                if ref.host != self.host:
                    wanted.setdefault(ref.host, []).append((seg, off, nbytes))
        return wanted

    def build_batch(
        self,
        partition: str,
        consumer: str,
        reply: P.ClaimReply,
        fetched: dict[tuple[int, int, int], Any] | None = None,
    ) -> Batch:
        assert self.maps is not None
        ids = np.frombuffer(reply.ids, dtype="<i8").copy()
        n = len(ids)
        columns: dict[str, Value] = {}
        for col in reply.columns:
            dtype = NUMPY_DTYPES[col.dtype]
            pieces = []
            for seg, off, nbytes in runs(col):
                if not nbytes:
                    continue
                ref = reply.segments[seg]
                if ref.host == self.host:
                    pieces.append(self.maps.get(ref.name, off + nbytes).u8[off : off + nbytes])
                else:
                    assert fetched is not None
                    pieces.append(np.frombuffer(fetched[(seg, off, nbytes)], dtype=np.uint8))
            # one run (the usual case) stays a view on shared memory
            flat = (
                pieces[0] if len(pieces) == 1 else np.concatenate(pieces) if pieces else np.empty(0, np.uint8)
            )
            items = flat.view(dtype)
            if not col.ragged:
                columns[col.name] = from_numpy(items.reshape(n, *col.shape), col.dtype)
                continue
            lengths = torch.from_numpy(np.frombuffer(col.length, dtype="<i8").copy())
            width = math.prod(col.shape)
            values = items.reshape(-1, *col.shape) if width else np.empty((0, *col.shape), dtype)
            columns[col.name] = Ragged(from_numpy(values, col.dtype), lengths, check=False)
        return Batch(partition, consumer, reply.claim, ids, reply.meta, columns)


def runs(col: P.ColumnRead) -> list[tuple[int, int, int]]:
    """Maximal runs of rows stored back to back: (segment index, byte offset, nbytes)."""
    item = P.item_bytes(col.dtype, col.shape)
    if len(col.segment) == 4:  # one row: skip numpy (latency path)
        (seg0,) = struct.unpack("<i", col.segment)
        (off0,) = struct.unpack("<q", col.offset)
        (len0,) = struct.unpack("<q", col.length)
        return [(seg0, off0, len0 * item)]
    n = len(col.segment) // 4
    if not n:
        return []
    off = np.frombuffer(col.offset, dtype="<i8")
    length = np.frombuffer(col.length, dtype="<i8")
    nbytes = length * item
    end_bytes = (off + nbytes).tobytes()
    # the common case, rows of one write in order: one segment, each row starting where the one before
    # ends (compared as bytes: a numpy comparison costs more than the whole test on 32 rows)
    if col.segment == col.segment[:4] * n and col.offset[8:] == end_bytes[:-8]:
        (seg0,) = struct.unpack_from("<i", col.segment)
        (off0,) = struct.unpack_from("<q", col.offset)
        (end,) = struct.unpack_from("<q", end_bytes, len(end_bytes) - 8)
        return [(seg0, off0, end - off0)]
    seg = np.frombuffer(col.segment, dtype="<i4")
    ends = np.frombuffer(end_bytes, dtype="<i8")
    breaks = np.flatnonzero((seg[1:] != seg[:-1]) | (off[1:] != ends[:-1])) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(seg)]))
    csum = np.concatenate(([0], np.cumsum(nbytes)))
    return [
        (int(seg[a]), int(off[a]), int(csum[b] - csum[a]))
        for a, b in zip(starts.tolist(), ends.tolist(), strict=True)
    ]
