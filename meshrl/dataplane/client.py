"""Data-plane clients: `Client` (blocking) and, in `aio.py`, `AsyncClient`.

A put copies every column once into a shared-memory segment this client owns (recycled when the
controller says its rows are gone) and sends one metadata message: one round trip. A claim returns
locations; same-host segments are mapped (no copy), other hosts' bytes arrive as raw ZMQ frames from
their storage server.

One `Client` per thread: requests on one client are serialised by a lock. A claim with a timeout parks
at the controller, which answers as soon as rows are ready; nothing polls.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Generator, Mapping, Sequence
from typing import Any

import msgspec
import numpy as np
import zmq

from meshrl.dataplane import protocol as P
from meshrl.dataplane.batch import Batch
from meshrl.dataplane.core import (
    ClientCore,
    DataPlaneError,
    LeaseExpired,
    PartitionFull,
    PreparedPut,
    UnknownPartition,
    raise_for,
)
from meshrl.dataplane.rpc_client import RpcClient
from meshrl.dataplane.wire import connect_client

__all__ = ["Client", "DataPlaneError", "LeaseExpired", "PartitionFull", "PendingPut", "UnknownPartition"]


class PendingPut:
    """A put sent without waiting (`Client.put(..., wait=False)`); `result()` gives its row ids."""

    def __init__(self, client: Client, rid: bytes, prepared: PreparedPut, wait: float) -> None:
        self._client = client
        self._rid = rid
        self._prepared = prepared
        self._wait = wait
        self._ids: np.ndarray | None = None

    def done(self) -> bool:
        return self._ids is not None

    def result(self) -> np.ndarray:
        if self._ids is None:
            reply = self._client._wait(self._rid, self._wait, "Put")
            self._client._inflight_puts.remove(self)
            self._ids = self._client.core.finish_put(self._prepared, reply)
        return self._ids


class Client:
    """Blocking data-plane client. See the module docstring for the cost model.

    Throughput tools: `put(..., wait=False)` pipelines puts (at most `max_inflight` unanswered),
    `ack(..., wait=False)` does not wait for the controller (a failure is raised by the next call),
    and `stream()` keeps claims in flight so the next batch arrives while this one is processed.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        secret: str | None = None,
        name: str | None = None,
        timeout: float = 30.0,
        max_inflight: int = 4,
    ) -> None:
        self.endpoint = endpoint
        self.secret = secret
        self.timeout = timeout
        self.max_inflight = max_inflight
        self.core = ClientCore(name)
        self._rpc: RpcClient | None = RpcClient(endpoint, secret, timeout)
        self._ctx: zmq.Context | None = None  # ZMQ only for reading other hosts' storage
        self._storage_socks: dict[str, zmq.Socket] = {}
        self._lock = threading.RLock()
        self._closed = False
        self._inflight_puts: list[PendingPut] = []
        self._unconfirmed: list[bytes] = []  # ids of acks sent with wait=False
        hello = self._call(self.core.hello(), self.timeout)
        self.core.on_hello(hello)
        self._local = self.core.local(hello)
        if self._local:
            self._drop_rpc()
            self._rpc = self._connect()

    @property
    def name(self) -> str:
        return self.core.name

    # ---------------------------------------------------------------------------------------------------
    # transport

    def _send(self, msg: msgspec.Struct) -> bytes:
        with self._lock:
            if self._closed:
                raise RuntimeError("client is closed")
            if self._rpc is None:
                if self._inflight_puts or self._unconfirmed:
                    raise ConnectionError("lost the controller connection with requests in flight")
                self._rpc = self._connect()
            try:
                return self._rpc.send(P.encode(msg))
            except OSError:
                self._drop_rpc()
                raise

    def _connect(self) -> RpcClient:
        """A connection to the controller: its Unix socket when it runs on this host, else TCP."""
        if self._local:
            try:
                return RpcClient(self._local, self.secret, self.timeout)
            except ConnectionError:  # another network namespace, or a restarted controller
                self._local = ""
        return RpcClient(self.endpoint, self.secret, self.timeout)

    def _wait(self, rid: bytes, wait: float, what: str) -> Any:
        """The decoded reply to `rid` (errors are returned, not raised)."""
        with self._lock:
            if self._rpc is None:
                raise ConnectionError(f"lost the controller connection before the reply to {what}")
            try:
                body = self._rpc.wait(rid, wait)
            except TimeoutError:
                self._drop_rpc()
                raise TimeoutError(
                    f"no answer to {what} within {wait:.1f}s from the controller at {self.endpoint}"
                ) from None
            except OSError:
                self._drop_rpc()
                raise
        return P.decode_reply(body)

    def _call(self, msg: msgspec.Struct, wait: float) -> Any:
        self._check_unconfirmed(block=False)
        return raise_for(self._wait(self._send(msg), wait, type(msg).__name__))

    def _check_unconfirmed(self, block: bool) -> None:
        """Surface failures of acks sent with wait=False (the controller answers those only on error).

        With `block`, first make sure the controller has processed them all: requests on one connection
        are handled in order, so the answer to a status request comes after theirs.
        """
        if not self._unconfirmed or self._rpc is None:
            return
        with self._lock:
            if block:
                self._wait(self._send(P.Status()), self.timeout, "Status")
            self._rpc.poll()
            errors = [self._rpc.stash.pop(rid) for rid in self._unconfirmed if rid in self._rpc.stash]
            if block:
                self._unconfirmed = []
            elif len(self._unconfirmed) > 4096:  # old enough to have been answered had they failed
                self._unconfirmed = self._unconfirmed[-1024:]
        if errors:
            raise_for(P.decode_reply(errors[0]))

    def _drop_rpc(self) -> None:
        if self._rpc is not None:
            self._rpc.close()
            self._rpc = None

    def _read_storage(self, host: str, msg: P.Read) -> list[Any]:
        with self._lock:
            sock = self._storage(host)
            rid = os.urandom(8)
            sock.send_multipart([rid, P.encode(msg)])
            deadline = time.monotonic() + self.timeout
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not sock.poll(max(1, int(left * 1000))):
                    raise TimeoutError(
                        f"storage server on {host} did not answer a read within {self.timeout}s"
                    )
                frames = sock.recv_multipart(copy=False)
                if frames[0].bytes == rid:
                    raise_for(P.decode_reply(frames[1].buffer))
                    return [f.buffer for f in frames[2:]]

    def _storage(self, host: str) -> zmq.Socket:
        sock = self._storage_socks.get(host)
        if sock is None:
            if host not in self.core.storages:
                raise DataPlaneError(
                    "no_storage", f"rows live on host {host!r}, which runs no storage server"
                )
            if self._ctx is None:
                self._ctx = zmq.Context()
            sock = connect_client(self._ctx, self.core.storages[host], self.secret)
            self._storage_socks[host] = sock
        return sock

    # ---------------------------------------------------------------------------------------------------
    # API

    def create_partition(self, name: str, capacity: int, *, delete_when_acked_by: Sequence[str] = ()) -> None:
        """Create a bounded table (idempotent for identical arguments).

        `delete_when_acked_by`: rows are deleted as soon as every named consumer acked them.
        """
        self._call(P.CreatePartition(name, capacity, list(delete_when_acked_by)), self.timeout)

    def put(
        self,
        partition: str,
        columns: Mapping[str, Any],
        ids: Sequence[int] | np.ndarray | None = None,
        *,
        meta: Sequence[P.Meta] | None = None,
        timeout: float = 30.0,
        wait: bool = True,
        key: str | None = None,
    ) -> Any:
        """Write new rows (ids=None) or more columns of existing rows. Returns the row ids.

        Blocks while the partition is full, up to `timeout` seconds, then raises `PartitionFull`.
        A row's `meta["group"]` (an int) groups rows for whole-group claims. With `wait=False` the
        call returns a `PendingPut` at once (after copying the data) and blocks only when
        `max_inflight` puts are unanswered. A `key` makes the put idempotent: the controller applies
        the first put under a key and answers a repeat (say, by a restarted producer that cannot know
        whether its predecessor's put went through) with the same ids, writing nothing.
        """
        while len(self._inflight_puts) >= self.max_inflight:
            self._inflight_puts[0].result()
        self._check_unconfirmed(block=False)
        prepared = self.core.prepare_put(partition, columns, ids, meta, timeout, key)
        # On a transport error the segment stays busy: the controller may have applied the put, and a
        # segment that rows might reference is only recycled once the controller releases it.
        pending = PendingPut(self, self._send(prepared.msg), prepared, timeout + self.timeout)
        self._inflight_puts.append(pending)
        return pending.result() if wait else pending

    def flush(self) -> None:
        """Wait for every put and ack sent without waiting; raise the first failure."""
        while self._inflight_puts:
            self._inflight_puts[0].result()
        self._check_unconfirmed(block=True)

    def claim(
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
        """Up to n rows that have every listed column and that `consumer` has not claimed.

        Waits up to `timeout` seconds for at least `min_n` rows; returns an empty batch otherwise.
        With `group_size`, only whole groups (rows sharing meta["group"]) are returned; with `address`,
        only rows addressed to it (meta["to"], addresses joined by commas, names it; a consumer name keeps the address it was
        first claimed with). Unless acked
        within `lease` seconds, the rows return to the pool for this consumer name.
        """
        msg = P.Claim(partition, consumer, list(columns), n, min_n, group_size, timeout, lease, address)
        return self._batch(partition, consumer, self._call(msg, timeout + self.timeout))

    def stream(
        self,
        partition: str,
        consumer: str,
        columns: Sequence[str],
        n: int,
        *,
        min_n: int = 1,
        group_size: int | None = None,
        prefetch: int = 2,
        poll: float = 1.0,
        lease: float = 60.0,
        skip_empty: bool = True,
    ) -> Generator[Batch, None, None]:
        """Batches as `claim` returns them, forever, with `prefetch` claims kept in flight (so the next
        batch travels while this one is processed).

        Each batch must be acked (or released) by the caller. Leaving the loop releases the batches
        that were prefetched but not yet handed out. With `skip_empty=False`, a claim that found nothing
        within `poll` seconds yields an empty batch (a chance for the caller to look around).
        """
        msg = P.Claim(partition, consumer, list(columns), n, min_n, group_size, poll, lease)
        inflight: deque[bytes] = deque()
        try:
            while True:
                while len(inflight) < prefetch:
                    inflight.append(self._send(msg))
                batch = self._batch(
                    partition,
                    consumer,
                    raise_for(self._wait(inflight.popleft(), poll + self.timeout, "Claim")),
                )
                if batch or not skip_empty:
                    yield batch
        finally:
            while inflight and self._rpc is not None:
                reply = self._wait(inflight.popleft(), poll + self.timeout, "Claim")
                if isinstance(reply, P.ClaimReply) and reply.claim:
                    self._call(P.Release(partition, consumer, reply.claim), self.timeout)

    def _batch(self, partition: str, consumer: str, reply: P.ClaimReply) -> Batch:
        if not reply.ids:
            return Batch(partition, consumer, 0, np.empty(0, dtype=np.int64), None, {})
        return self.core.build_batch(partition, consumer, reply, self._fetch(reply))

    def _fetch(self, reply: P.ClaimReply) -> dict[tuple[int, int, int], Any] | None:
        wanted = self.core.remote_ranges(reply)
        if not wanted:
            return None
        if any(host not in self.core.storages for host in wanted):  # a storage server joined later
            self.core.storages = dict(self._call(self.core.hello(), self.timeout).storages)
        fetched: dict[tuple[int, int, int], Any] = {}
        for host, runs in wanted.items():
            ranges = [(reply.segments[s].name, off, nb) for s, off, nb in runs]
            buffers = self._read_storage(host, P.Read(ranges))
            fetched.update(zip(runs, buffers, strict=True))
        return fetched

    def ack(self, batch: Batch, ids: Sequence[int] | np.ndarray | None = None, *, wait: bool = True) -> int:
        """Mark a claim consumed (or only the rows `ids` of it; the others stay leased).

        Raises `LeaseExpired` if its lease ran out first. With `wait=False` the ack is sent without
        waiting; a failure is raised by a later call.
        """
        if not batch.claim:
            return 0
        subset = None if ids is None else np.asarray(ids, dtype="<i8").tobytes()
        if wait:
            return int(
                self._call(P.Ack(batch.partition, batch.consumer, batch.claim, ids=subset), self.timeout).n
            )
        msg = P.Ack(batch.partition, batch.consumer, batch.claim, reply=False, ids=subset)
        self._unconfirmed.append(self._send(msg))
        return len(batch) if ids is None else len(ids)

    def release(self, batch: Batch) -> None:
        """Give a claim's rows back unprocessed: they are the next ones this consumer name gets."""
        if batch.claim:
            self._call(P.Release(batch.partition, batch.consumer, batch.claim), self.timeout)

    def renew(self, batch: Batch, lease: float) -> None:
        """Extend a claim's lease (long-running consumers)."""
        self._call(P.Renew(batch.partition, batch.consumer, batch.claim, lease), self.timeout)

    def delete(self, partition: str, ids: Sequence[int] | np.ndarray) -> int:
        return int(self._call(P.Delete(partition, np.asarray(ids, dtype="<i8").tobytes()), self.timeout).n)

    def status(self) -> P.StatusReply:
        return self._call(P.Status(), self.timeout)

    def snapshot(self, path: str | os.PathLike[str]) -> None:
        """Consistent copy of controller metadata and every live segment into `path`."""
        self._call(P.Snapshot(os.path.abspath(path)), 600.0)

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.flush()
        finally:
            with contextlib.suppress(OSError, DataPlaneError):
                self._call(P.Bye(self.core.name), 2.0)
            self._closed = True
            if self.core.pool is not None:
                self.core.pool.close()
            for s in self._storage_socks.values():
                s.close(0)
            if self._ctx is not None:
                self._ctx.term()
            self._drop_rpc()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
