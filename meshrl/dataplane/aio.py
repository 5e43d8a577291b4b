"""`AsyncClient`: the data-plane client for asyncio services (same API as `Client`, awaitable).

Many requests may be in flight at once on one client (for example a parked claim while puts go on):
replies are matched to requests by id by one reader task.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import numpy as np
import zmq
import zmq.asyncio

from meshrl.dataplane import protocol as P
from meshrl.dataplane.batch import Batch
from meshrl.dataplane.core import ClientCore, DataPlaneError, raise_for
from meshrl.dataplane.rpc_client import AsyncRpcClient
from meshrl.dataplane.wire import connect_client

WATCH_S = 60.0
"""How long a service parks an idle claim: it comes back empty this often and is parked again."""
CLAIM_GRACE_S = 900.0


class AsyncClient:
    def __init__(self, rpc: AsyncRpcClient, *, secret: str | None, name: str | None, timeout: float) -> None:
        """Create with `await AsyncClient.connect(...)`."""
        self.rpc = rpc
        self.endpoint = rpc.endpoint
        self.secret = secret
        self.timeout = timeout
        self.core = ClientCore(name)
        self._ctx: zmq.asyncio.Context | None = None
        self._storage_socks: dict[str, Any] = {}
        self._storage_lock = asyncio.Lock()

    @classmethod
    async def connect(
        cls, endpoint: str, *, secret: str | None = None, name: str | None = None, timeout: float = 30.0
    ) -> AsyncClient:
        rpc = await AsyncRpcClient.connect(endpoint, secret, timeout)
        self = cls(rpc, secret=secret, name=name, timeout=timeout)
        hello = await self._call(self.core.hello(), timeout)
        self.core.on_hello(hello)
        if local := self.core.local(hello):  # the controller's Unix socket: cheaper (see `Client`)
            try:
                self.rpc = await AsyncRpcClient.connect(local, secret, timeout)
            except ConnectionError:
                pass
            else:
                await rpc.close()
        return self

    @property
    def name(self) -> str:
        return self.core.name

    async def _call(self, msg: msgspec.Struct, wait: float) -> Any:
        try:
            body = await self.rpc.call(P.encode(msg), wait)
        except TimeoutError:
            raise TimeoutError(
                f"no answer to {type(msg).__name__} within {wait:.1f}s from the controller at {self.endpoint}"
            ) from None
        return raise_for(P.decode_reply(body))

    async def _read_storage(self, host: str, msg: P.Read) -> list[Any]:
        async with self._storage_lock:  # one read at a time per client keeps reply matching trivial
            sock: Any = self._storage_socks.get(host)
            if sock is None:
                if host not in self.core.storages:
                    self.core.storages = dict((await self._call(self.core.hello(), self.timeout)).storages)
                if host not in self.core.storages:
                    raise DataPlaneError(
                        "no_storage", f"rows live on host {host!r}, which runs no storage server"
                    )
                if self._ctx is None:
                    self._ctx = zmq.asyncio.Context()
                sock = connect_client(self._ctx, self.core.storages[host], self.secret)
                self._storage_socks[host] = sock
            rid = os.urandom(8)
            await sock.send_multipart([rid, P.encode(msg)])
            while True:
                async with asyncio.timeout(self.timeout):
                    frames = await sock.recv_multipart(copy=False)
                if frames[0].bytes == rid:
                    raise_for(P.decode_reply(frames[1].buffer))
                    return [f.buffer for f in frames[2:]]

    async def create_partition(
        self, name: str, capacity: int, *, delete_when_acked_by: Sequence[str] = ()
    ) -> None:
        await self._call(P.CreatePartition(name, capacity, list(delete_when_acked_by)), self.timeout)

    async def put(
        self,
        partition: str,
        columns: Mapping[str, Any],
        ids: Sequence[int] | np.ndarray | None = None,
        *,
        meta: Sequence[P.Meta] | None = None,
        timeout: float = 30.0,
        key: str | None = None,
    ) -> np.ndarray:
        """See `Client.put`."""
        prepared = self.core.prepare_put(partition, columns, ids, meta, timeout, key)
        try:
            reply: Any = await self._call(prepared.msg, timeout + self.timeout)
        except DataPlaneError as e:
            reply = P.Error(e.code, str(e))
        return self.core.finish_put(prepared, reply)

    async def claim(
        self,
        partition: str,
        consumer: str,
        columns: Sequence[str],
        n: int,
        *,
        min_n: int = 1,
        group_size: int | None = None,
        timeout: float = 0.0,
        lease: float = 60.0,
        address: str | None = None,
    ) -> Batch:
        msg = P.Claim(partition, consumer, list(columns), n, min_n, group_size, timeout, lease, address)
        # the controller answers a parked claim within `timeout`; the client's own guard is generous, since
        # it runs on this event loop, which a service may hold for minutes (a real model's generation
        # batch): a closed connection is noticed at once anyway
        reply = await self._call(msg, timeout + CLAIM_GRACE_S)
        if not reply.ids:
            return Batch(partition, consumer, 0, np.empty(0, dtype=np.int64), None, {})
        fetched: dict[tuple[int, int, int], Any] | None = None
        wanted = self.core.remote_ranges(reply)
        if wanted:
            fetched = {}
            for host, runs in wanted.items():
                ranges = [(reply.segments[s].name, off, nb) for s, off, nb in runs]
                fetched.update(zip(runs, await self._read_storage(host, P.Read(ranges)), strict=True))
        return self.core.build_batch(partition, consumer, reply, fetched)

    async def ack(self, batch: Batch, ids: Sequence[int] | np.ndarray | None = None) -> int:
        """Mark a claim consumed (or only the rows `ids` of it; the others stay leased)."""
        if not batch.claim:
            return 0
        subset = None if ids is None else np.asarray(ids, dtype="<i8").tobytes()
        msg = P.Ack(batch.partition, batch.consumer, batch.claim, ids=subset)
        return int((await self._call(msg, self.timeout)).n)

    async def release(self, batch: Batch) -> None:
        """Give a claim's unacknowledged rows back: they are the next ones this consumer name gets."""
        if batch.claim:
            await self._call(P.Release(batch.partition, batch.consumer, batch.claim), self.timeout)

    async def renew(self, batch: Batch, lease: float) -> None:
        await self._call(P.Renew(batch.partition, batch.consumer, batch.claim, lease), self.timeout)

    async def delete(self, partition: str, ids: Sequence[int] | np.ndarray) -> int:
        reply = await self._call(P.Delete(partition, np.asarray(ids, dtype="<i8").tobytes()), self.timeout)
        return int(reply.n)

    async def status(self) -> P.StatusReply:
        return await self._call(P.Status(), self.timeout)

    async def snapshot(self, path: str | os.PathLike[str]) -> None:
        await self._call(P.Snapshot(os.path.abspath(path)), 600.0)

    async def close(self) -> None:
        with contextlib.suppress(OSError, DataPlaneError):
            await self._call(P.Bye(self.core.name), 2.0)
        if self.core.pool is not None:
            self.core.pool.close()
        for s in self._storage_socks.values():
            s.close(0)
        if self._ctx is not None:
            self._ctx.term()
        await self.rpc.close()
