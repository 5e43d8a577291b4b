"""The controller: one process holding the data plane's metadata, serving every client.

A single event loop over plain sockets (`rpc.py`) makes every request atomic without locks. Each request
type has one handler here; the state they work on lives beside: the partitions (`table.py`), the
segments their rows reference (`segments.py`), and requests that wait (`parking.py`): a claim that
cannot be served yet is parked and answered the moment rows become ready (or at its timeout), a put into
a full partition is parked until rows are deleted. Clients never poll. Leases that expire return their
rows.

Malformed or hostile frames are answered with an `Error` (or dropped when they cannot even be routed)
and logged; nothing a peer sends can stop the loop.

Run standalone with `meshrl queue serve`, or in-process with `serve.start_controller` (tests).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import zmq

from meshrl.dataplane import protocol as P
from meshrl.dataplane import snapshot as snap
from meshrl.dataplane.columns import locate
from meshrl.dataplane.consumers import Consumer
from meshrl.dataplane.ledger import Ledger
from meshrl.dataplane.parking import Parked, Parking, full_message
from meshrl.dataplane.protocol import TableError
from meshrl.dataplane.rpc import Connection, RpcServer
from meshrl.dataplane.segments import Segments
from meshrl.dataplane.shm import DEFAULT_SHM_DIR
from meshrl.dataplane.storage import StorageLinks
from meshrl.dataplane.table import Partition
from meshrl.dataplane.wire import host_id

log = logging.getLogger("meshrl.controller")

PUT_KEYS = 4096  # idempotency keys remembered (a producer repeats at most its last few puts)
STORAGE_TIMEOUT_S = 600.0

Handler = Callable[[Connection, bytes, Any], msgspec.Struct | None]


class Controller:
    def __init__(
        self,
        endpoint: str,
        *,
        secret: str | None = None,
        shm_dir: str = DEFAULT_SHM_DIR,
        restore: str | Path | None = None,
        run: str | None = None,
        ledger: Ledger | None = None,
    ) -> None:
        self.ctx = zmq.Context()  # only for talking to storage servers
        self.server = RpcServer(endpoint, secret, self._dispatch, on_close=self._closed)
        self.endpoint = self.server.endpoint
        self.secret = secret
        self.shm_dir = shm_dir
        self.host = host_id()
        self.run = run or secrets.token_hex(4)
        self.partitions: dict[str, Partition] = {}
        self.storage = StorageLinks(self.ctx, secret, STORAGE_TIMEOUT_S)
        self.segments = Segments(self.host, shm_dir, self.storage)
        # claims by the connection that made them: a connection that ends (its process died, or closed
        # its client) gives its unacknowledged rows back at once instead of when their leases run out
        self.claims_of: dict[Connection, set[tuple[str, str, int]]] = {}
        self.parking = Parking()
        self.next_id = 0
        self.next_claim = 1
        self.put_keys: OrderedDict[str, bytes] = OrderedDict()  # idempotency key -> ids, the latest
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._waiting_hosts: set[str] = set()
        self._deferred: list[tuple[Connection, bytes, bytes]] = []
        self.ledger = ledger
        self._handlers: dict[type, Handler] = {
            P.Put: self._put,
            P.Claim: self._claim,
            P.Ack: self._ack,
            P.Release: self._release,
            P.Renew: self._renew,
            P.Delete: self._delete_rows,
            P.CreatePartition: self._create,
            P.Status: lambda *_: self.status(),
            P.Hello: self._hello,
            P.Bye: self._bye,
            P.Snapshot: self._snapshot,
        }
        if restore is not None:
            self._waiting_hosts = snap.load_controller(self, Path(restore))
            log.info("restored from %s; waiting for storage on %s", restore, sorted(self._waiting_hosts))
        self._segment_prefix = f"meshrl-{self.run}-"  # every segment of the run (a restored run: its own)

    @property
    def parked_claims(self) -> dict[str, deque[Parked]]:
        """Per partition, the claims waiting for rows."""
        return self.parking.claims

    # ---------------------------------------------------------------------------------------------------
    # loop

    def serve_forever(self) -> None:
        try:
            while not self._stop.is_set():
                self.server.poll(self.parking.timeout(0.1))
                self._timers()
        finally:
            self.close()

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        self.storage.close()
        self.server.shutdown()
        if self.ledger is not None:
            self.ledger.close()
        self.ctx.term()

    def _dispatch(self, conn: Connection, rid: bytes, body: bytes) -> None:
        if self._waiting_hosts:
            try:
                msg = P.decode_request(body)
            except Exception:
                msg = None
            if not (isinstance(msg, P.Hello) and msg.role == "storage"):
                self._deferred.append((conn, rid, body))
                return
        self._handle(conn, rid, body)
        if not self._waiting_hosts and self._deferred:
            deferred, self._deferred = self._deferred, []
            for d in deferred:
                self._handle(*d)

    def _handle(self, conn: Connection, rid: bytes, body: bytes) -> None:
        try:
            msg = P.decode_request(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            log.warning("undecodable request from %s: %s", conn.peer, e)
            self._reply(conn, rid, P.Error("bad_request", f"undecodable request: {e}"))
            return
        try:
            handler = self._handlers.get(type(msg))
            if handler is None:
                raise P.ProtocolError(f"{type(msg).__name__} is not a controller request")
            reply = handler(conn, rid, msg)
        except TableError as e:
            reply = P.Error(e.code, str(e))
        except (P.ProtocolError, ValueError, OverflowError) as e:
            reply = P.Error("bad_request", str(e))
        except Exception as e:  # a bug must not take the controller down
            log.exception("internal error on %s", type(msg).__name__)
            reply = P.Error("internal", f"{type(e).__name__}: {e}")
        if reply is not None:
            self._reply(conn, rid, reply)

    def _reply(self, conn: Connection, rid: bytes, reply: msgspec.Struct) -> None:
        self.server.send(conn, rid, P.encode(reply))

    # ---------------------------------------------------------------------------------------------------
    # requests: one handler each, (connection, request id, request) -> reply, or None to answer later

    def _hello(self, conn: Connection, rid: bytes, msg: P.Hello) -> P.HelloReply:
        P.check_name(msg.client, "client")
        if msg.role == "storage":
            self.storage.register(msg.host, msg.endpoint)
            self._waiting_hosts.discard(msg.host)
        else:
            self.segments.hello(msg.client, msg.host, msg.pid)
        return P.HelloReply(
            run=self.run,
            shm_dir=self.shm_dir,
            storages=dict(self.storage.endpoints),
            host=self.host,
            local=self.server.local_endpoint,
        )

    def _bye(self, conn: Connection, rid: bytes, msg: P.Bye) -> P.Ok:
        self.segments.bye(msg.client)
        return P.Ok()

    def _snapshot(self, conn: Connection, rid: bytes, msg: P.Snapshot) -> P.Ok:
        snap.save(self, Path(msg.path))
        return P.Ok()

    def _create(self, conn: Connection, rid: bytes, msg: P.CreatePartition) -> P.Ok:
        P.check_name(msg.partition, "partition")
        for name in msg.delete_when_acked_by:
            P.check_name(name, "consumer")
        part = self.partitions.get(msg.partition)
        if part is not None:
            if part.capacity != msg.capacity or part.delete_when_acked_by != list(msg.delete_when_acked_by):
                raise TableError(
                    "conflict",
                    f"partition {msg.partition!r} exists with capacity {part.capacity} and "
                    f"delete_when_acked_by {part.delete_when_acked_by}",
                )
            return P.Ok()
        self.partitions[msg.partition] = Partition(
            msg.partition, msg.capacity, list(msg.delete_when_acked_by)
        )
        self.parking.open(msg.partition)
        return P.Ok()

    def _partition(self, name: str) -> Partition:
        part = self.partitions.get(name)
        if part is None:
            raise TableError("unknown_partition", f"no partition {name!r} (known: {sorted(self.partitions)})")
        return part

    def _consumer_of(self, part: Partition, name: str) -> Consumer:
        c = part.consumers.get(name)
        if c is None:
            raise TableError("bad_request", f"partition {part.name!r} has no consumer {name!r}")
        return c

    def _put(self, conn: Connection, rid: bytes, msg: P.Put) -> msgspec.Struct | None:
        part = self._partition(msg.partition)
        name = msg.segment.name
        known = name in self.segments.by_name  # a segment handed back for reuse was checked when first put
        if not known and not P.check_segment_name(name).startswith(self._segment_prefix):
            raise P.ProtocolError(f"segment {name!r} does not belong to run {self.run}")
        if msg.segment.size < 0:
            raise P.ProtocolError("negative segment size")
        if msg.key is not None and not 0 < len(msg.key) <= P.MAX_KEY:
            raise P.ProtocolError(f"put key must be 1 to {P.MAX_KEY} characters, got {len(msg.key)}")
        parked = self.parking.puts[part.name]
        if msg.ids is None and not part.can_put(msg.n):
            if msg.n > part.capacity:
                raise TableError(
                    "full", f"put of {msg.n} rows can never fit partition {part.name!r} of {part.capacity}"
                )
            if msg.timeout > 0:
                self.parking.park(parked, conn, rid, msg, msg.timeout)
                return None
            raise TableError("full", full_message(part, msg.timeout))
        if parked and msg.ids is None:  # keep FIFO order behind parked producers
            self.parking.park(parked, conn, rid, msg, msg.timeout)
            return None
        return self._do_put(part, msg)

    def _do_put(self, part: Partition, msg: P.Put) -> P.PutReply:
        if msg.key is not None and (done := self.put_keys.get(msg.key)) is not None:
            # a repeat of an applied put: the same ids, nothing written, the segment back to its owner
            return P.PutReply(ids=done, released=[msg.segment.name, *self.segments.released(msg.client)])
        index, info = self.segments.for_put(msg.segment, msg.client)
        ids, refs = part.put(index, msg.segment, msg.n, msg.columns, msg.ids, msg.meta, self.next_id)
        self.segments.add(index, info, refs)
        if self.ledger is not None and self.ledger.tracks(part.name):
            names = [c.name for c in msg.columns]
            if msg.ids is None:
                self.ledger.put(part.name, self.next_id, msg.n, names)
            else:
                self.ledger.set(part.name, names, ids)
        if msg.ids is None:
            self.next_id += msg.n
        released = self.segments.released(msg.client)
        reply = P.PutReply(ids=ids.astype("<i8", copy=False).tobytes(), released=released)
        if msg.key is not None:
            self.put_keys[msg.key] = reply.ids
            if len(self.put_keys) > PUT_KEYS:
                self.put_keys.popitem(last=False)
        self._serve_claims(part)
        return reply

    def _claim(self, conn: Connection, rid: bytes, msg: P.Claim) -> msgspec.Struct | None:
        part = self._partition(msg.partition)
        if msg.consumer not in part.consumers:  # a known one was checked when it was declared
            P.check_name(msg.consumer, "consumer")
        if msg.n < 1 or not 1 <= msg.min_n <= msg.n:
            raise P.ProtocolError(
                f"claim needs n >= 1 and 1 <= min_n <= n (got n={msg.n}, min_n={msg.min_n})"
            )
        if msg.group_size is not None and msg.group_size > msg.n:
            raise P.ProtocolError(f"claim of n={msg.n} rows can never hold a group of {msg.group_size}")
        P.positive_seconds(msg.lease, "lease")
        c = part.consumer(msg.consumer, msg.columns, msg.group_size, msg.address)
        reply = self._try_claim(conn, part, c, msg)
        if reply is not None:
            return reply
        if msg.timeout > 0:
            self.parking.park(self.parking.claims[part.name], conn, rid, msg, msg.timeout)
            return None
        return P.empty_claim()

    def _try_claim(self, conn: Connection, part: Partition, c: Consumer, msg: P.Claim) -> P.ClaimReply | None:
        need = msg.min_n
        if c.group_size is not None:
            need = -(-need // c.group_size) * c.group_size
        if c.nready < need:
            return None
        claim_id = self.next_claim
        chunk = part.claim(c, msg.n, msg.lease, claim_id)
        if chunk is None:
            return None
        self.next_claim += 1
        self.parking.at(c.leases[claim_id].deadline, (part.name, c.name, claim_id))
        mine = self.claims_of.setdefault(conn, set())
        if len(mine) >= 1024:  # forget the finished ones
            mine -= {k for k in mine if not self._has_lease(*k)}
        mine.add((part.name, c.name, claim_id))
        segments, columns = locate(part.columns, c.columns, chunk.slots, self.segments.ref)
        return P.ClaimReply(
            claim=claim_id,
            ids=chunk.ids.astype("<i8", copy=False).tobytes(),
            segments=segments,
            columns=columns,
            meta=[part.meta[s] for s in chunk.slots.tolist()] if part.meta_rows else None,
        )

    def _ack(self, conn: Connection, rid: bytes, msg: P.Ack) -> P.Ok | None:
        part = self._partition(msg.partition)
        c = self._consumer_of(part, msg.consumer)
        ids = None if msg.ids is None else P.int64s(msg.ids, "ids")
        lease = c.leases.get(msg.claim)
        n, due = part.ack(c, msg.claim, ids)
        if self.ledger is not None and self.ledger.tracks(part.name) and lease is not None:
            acked = ids if ids is not None else np.concatenate([ch.ids for ch in lease.chunks])
            self.ledger.ack(part.name, c.name, acked)
        if len(due):
            self._delete(part, due)
        return P.Ok(n) if msg.reply else None

    def _release(self, conn: Connection, rid: bytes, msg: P.Release) -> P.Ok:
        part = self._partition(msg.partition)
        c = self._consumer_of(part, msg.consumer)
        if msg.claim not in c.leases:
            raise TableError("expired", f"claim {msg.claim} is unknown or its lease expired")
        back = part.expire(c, msg.claim)
        self._serve_claims(part)
        return P.Ok(back)

    def _renew(self, conn: Connection, rid: bytes, msg: P.Renew) -> P.Ok:
        part = self._partition(msg.partition)
        c = self._consumer_of(part, msg.consumer)
        lease = c.leases.get(msg.claim)
        if lease is None:
            raise TableError("expired", f"claim {msg.claim} is unknown or its lease expired")
        lease.deadline = time.monotonic() + P.positive_seconds(msg.lease, "lease")
        self.parking.at(lease.deadline, (part.name, c.name, msg.claim))
        return P.Ok(lease.n)

    def _delete_rows(self, conn: Connection, rid: bytes, msg: P.Delete) -> P.Ok:
        part = self._partition(msg.partition)
        ids = P.int64s(msg.ids, "ids")
        slots = part.slots_of(ids, strict=False)
        if self.ledger is not None and self.ledger.tracks(part.name):
            self.ledger.delete(part.name, ids[slots >= 0])
        return P.Ok(self._delete(part, np.unique(slots[slots >= 0])))

    def _delete(self, part: Partition, slots: np.ndarray) -> int:
        n, dropped = part.delete_slots(slots)
        self.segments.drop(dropped)
        if n:
            self._serve_puts(part)
        return n

    def _has_lease(self, pname: str, cname: str, claim_id: int) -> bool:
        part = self.partitions.get(pname)
        c = part.consumers.get(cname) if part is not None else None
        return c is not None and claim_id in c.leases

    def _closed(self, conn: Connection) -> None:
        """A client connection ended: its claims that are still open go back to the pool now."""
        for pname, cname, claim_id in sorted(self.claims_of.pop(conn, ())):
            if not self._has_lease(pname, cname, claim_id):
                continue  # acknowledged or released
            part = self.partitions[pname]
            back = part.expire(part.consumers[cname], claim_id)
            log.info("claim %d (%s/%s) of a closed connection (%s): %d rows back in the pool", claim_id, pname,
                     cname, conn.peer, back)  # fmt: skip
            self._serve_claims(part)

    # ---------------------------------------------------------------------------------------------------
    # parked requests and leases

    def _serve_claims(self, part: Partition) -> None:
        if not self.parking.claims[part.name]:
            return

        def serve(p: Parked) -> bool:
            reply = self._try_claim(p.conn, part, part.consumers[p.msg.consumer], p.msg)
            if reply is not None:
                self._reply(p.conn, p.rid, reply)
            return reply is not None

        self.parking.serve_claims(part.name, serve)

    def _serve_puts(self, part: Partition) -> None:
        while (p := self.parking.next_put(part.name, len(part.free))) is not None:
            if p.conn.closed:
                continue
            try:
                reply: msgspec.Struct = self._do_put(part, p.msg)
            except TableError as e:
                reply = P.Error(e.code, str(e))
            except (P.ProtocolError, ValueError) as e:
                reply = P.Error("bad_request", str(e))
            self._reply(p.conn, p.rid, reply)

    def _timers(self) -> None:
        now = time.monotonic()
        while (what := self.parking.pop_due(now)) is not None:
            if not isinstance(what, Parked):
                self._lease_due(*what, now)
            elif isinstance(what.msg, P.Claim):
                self._reply(what.conn, what.rid, P.empty_claim())
            else:
                part = self.partitions[what.msg.partition]
                self._reply(what.conn, what.rid, P.Error("full", full_message(part, what.msg.timeout)))

    def _lease_due(self, pname: str, cname: str, claim_id: int, now: float) -> None:
        part = self.partitions.get(pname)
        c = part.consumers.get(cname) if part else None
        lease = c.leases.get(claim_id) if c else None
        if part is None or c is None or lease is None or lease.deadline > now:
            return  # acked, or renewed (a newer entry exists)
        back = part.expire(c, claim_id)
        log.info("lease of claim %d (%s/%s) expired; %d rows back in the pool", claim_id, pname, cname, back)
        self._serve_claims(part)

    def status(self) -> P.StatusReply:
        return P.StatusReply(
            partitions=[
                part.status(len(self.parking.puts[name]), len(self.parking.claims[name]))
                for name, part in self.partitions.items()
            ],
            segments=len(self.segments),
            clients=self.segments.alive_clients(),
            uptime_s=time.monotonic() - self.started,
        )
