"""The controller: one process holding the data plane's metadata, serving every client.

A single event loop over plain sockets (`rpc.py`) makes every request atomic without locks. A claim
that cannot be served yet is parked and answered the moment rows become ready (or at its timeout); a
put into a full partition is parked until rows are deleted. Clients never poll. Leases that expire return their rows.

Malformed or hostile frames are answered with an `Error` (or dropped when they cannot even be routed)
and logged; nothing a peer sends can stop the loop.

Run standalone with `meshrl queue serve`, or in-process with `start_controller` (tests).
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import os
import secrets
import struct
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import zmq

from meshrl.dataplane import protocol as P
from meshrl.dataplane import snapshot as snap
from meshrl.dataplane.ledger import Ledger
from meshrl.dataplane.rpc import Connection, RpcServer
from meshrl.dataplane.shm import DEFAULT_SHM_DIR
from meshrl.dataplane.storage import StorageLinks
from meshrl.dataplane.table import Consumer, Partition, SegmentInfo, TableError
from meshrl.dataplane.wire import host_id

log = logging.getLogger("meshrl.controller")

_I32 = struct.Struct("<i")
MAX_RELEASED_PER_CLIENT = 64
PUT_KEYS = 4096  # idempotency keys remembered (a producer repeats at most its last few puts)
STORAGE_TIMEOUT_S = 600.0


@dataclass
class ClientInfo:
    host: str
    pid: int
    released: list[str] = field(default_factory=list)
    alive: bool = True


@dataclass
class Parked:
    conn: Connection
    rid: bytes
    msg: Any
    deadline: float
    done: bool = False


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
        self.segments: dict[int, SegmentInfo] = {}
        self.seg_by_name: dict[str, int] = {}
        self.clients: dict[str, ClientInfo] = {}
        self.storage = StorageLinks(self.ctx, secret, STORAGE_TIMEOUT_S)
        # claims by the connection that made them: a connection that ends (its process died, or closed
        # its client) gives its unacknowledged rows back at once instead of when their leases run out
        self.claims_of: dict[Connection, set[tuple[str, str, int]]] = {}
        self.parked_claims: dict[str, deque[Parked]] = {}
        self.parked_puts: dict[str, deque[Parked]] = {}
        # deadlines of leases and parked requests: (when, sequence, what); stale entries are skipped
        self.timers: list[tuple[float, int, Any]] = []
        self._seq = 0
        self.next_id = 0
        self.next_seg = 0
        self.next_claim = 1
        self.put_keys: OrderedDict[str, bytes] = OrderedDict()  # idempotency key -> ids, the latest
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._waiting_hosts: set[str] = set()
        self._deferred: list[tuple[Connection, bytes, bytes]] = []
        self.ledger = ledger
        if restore is not None:
            self._waiting_hosts = snap.load_controller(self, Path(restore))
            log.info("restored from %s; waiting for storage on %s", restore, sorted(self._waiting_hosts))

    # ---------------------------------------------------------------------------------------------------
    # loop

    def serve_forever(self) -> None:
        try:
            while not self._stop.is_set():
                self.server.poll(self._next_timeout())
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

    def _next_timeout(self) -> float:
        deadline = time.monotonic() + 0.1
        if self.timers:
            deadline = min(deadline, self.timers[0][0])
        return max(0.0, deadline - time.monotonic()) + 0.0005

    def _at(self, when: float, what: Any) -> None:
        self._seq += 1
        heapq.heappush(self.timers, (when, self._seq, what))

    def _park(self, queue: deque[Parked], conn: Connection, rid: bytes, msg: Any, timeout: float) -> None:
        p = Parked(conn, rid, msg, time.monotonic() + min(max(timeout, 0.0), 86400.0))
        queue.append(p)
        self._at(p.deadline, p)

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
            reply = self._apply(conn, rid, msg)
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
    # requests

    def _apply(self, conn: Connection, rid: bytes, msg: Any) -> msgspec.Struct | None:
        if isinstance(msg, P.Put):
            return self._put(conn, rid, msg)
        if isinstance(msg, P.Claim):
            return self._claim(conn, rid, msg)
        if isinstance(msg, P.Ack):
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
        if isinstance(msg, P.Release):
            part = self._partition(msg.partition)
            c = self._consumer_of(part, msg.consumer)
            if msg.claim not in c.leases:
                raise TableError("expired", f"claim {msg.claim} is unknown or its lease expired")
            back = part.expire(c, msg.claim)
            self._serve_claims(part)
            return P.Ok(back)
        if isinstance(msg, P.Renew):
            part = self._partition(msg.partition)
            c = self._consumer_of(part, msg.consumer)
            lease = c.leases.get(msg.claim)
            if lease is None:
                raise TableError("expired", f"claim {msg.claim} is unknown or its lease expired")
            lease.deadline = time.monotonic() + _positive(msg.lease, "lease")
            self._at(lease.deadline, (part.name, c.name, msg.claim))
            return P.Ok(lease.n)
        if isinstance(msg, P.Delete):
            part = self._partition(msg.partition)
            ids = P.int64s(msg.ids, "ids")
            slots = part.slots_of(ids, strict=False)
            if self.ledger is not None and self.ledger.tracks(part.name):
                self.ledger.delete(part.name, ids[slots >= 0])
            return P.Ok(self._delete(part, np.unique(slots[slots >= 0])))
        if isinstance(msg, P.CreatePartition):
            return self._create(msg)
        if isinstance(msg, P.Status):
            return self.status()
        if isinstance(msg, P.Hello):
            return self._hello(msg)
        if isinstance(msg, P.Bye):
            info = self.clients.get(msg.client)
            if info is not None:
                info.alive = False
                self._unlink(info.host, info.released)
                info.released = []
            return P.Ok()
        if isinstance(msg, P.Snapshot):
            snap.save(self, Path(msg.path))
            return P.Ok()
        raise P.ProtocolError(f"{type(msg).__name__} is not a controller request")

    def _hello(self, msg: P.Hello) -> P.HelloReply:
        P.check_name(msg.client, "client")
        if msg.role == "storage":
            self.storage.register(msg.host, msg.endpoint)
            self._waiting_hosts.discard(msg.host)
        else:
            self.clients[msg.client] = ClientInfo(msg.host, msg.pid)
        return P.HelloReply(
            run=self.run,
            shm_dir=self.shm_dir,
            storages=dict(self.storage.endpoints),
            host=self.host,
            local=self.server.local_endpoint,
        )

    def _create(self, msg: P.CreatePartition) -> P.Ok:
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
        self.parked_claims[msg.partition] = deque()
        self.parked_puts[msg.partition] = deque()
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
        if not P.check_segment_name(msg.segment.name).startswith(f"meshrl-{self.run}-"):
            raise P.ProtocolError(f"segment {msg.segment.name!r} does not belong to run {self.run}")
        if msg.segment.size < 0:
            raise P.ProtocolError("negative segment size")
        if msg.key is not None and not 0 < len(msg.key) <= P.MAX_KEY:
            raise P.ProtocolError(f"put key must be 1 to {P.MAX_KEY} characters, got {len(msg.key)}")
        if msg.ids is None and not part.can_put(msg.n):
            if msg.n > part.capacity:
                raise TableError(
                    "full", f"put of {msg.n} rows can never fit partition {part.name!r} of {part.capacity}"
                )
            if msg.timeout > 0:
                self._park(self.parked_puts[part.name], conn, rid, msg, msg.timeout)
                return None
            raise TableError("full", _full_message(part, msg.timeout))
        if self.parked_puts[part.name] and msg.ids is None:  # keep FIFO order behind parked producers
            self._park(self.parked_puts[part.name], conn, rid, msg, msg.timeout)
            return None
        return self._do_put(part, msg)

    def _do_put(self, part: Partition, msg: P.Put) -> P.PutReply:
        client = self.clients.get(msg.client)
        if msg.key is not None and (done := self.put_keys.get(msg.key)) is not None:
            # a repeat of an applied put: the same ids, nothing written, the segment back to its owner
            back = [msg.segment.name]
            if client is not None:
                back, client.released = back + client.released, []
            return P.PutReply(ids=done, released=back)
        index = self.seg_by_name.get(msg.segment.name)
        if index is None:
            index = self.next_seg
            info = SegmentInfo(msg.segment, msg.client)
        else:
            info = self.segments[index]
            if info.refs or info.owner != msg.client or info.ref != msg.segment:
                raise TableError("conflict", f"segment {msg.segment.name} is in use by live rows")
        ids, refs = part.put(index, msg.segment, msg.n, msg.columns, msg.ids, msg.meta, self.next_id)
        if index == self.next_seg:
            self.next_seg += 1
            self.segments[index] = info
            self.seg_by_name[msg.segment.name] = index
        if self.ledger is not None and self.ledger.tracks(part.name):
            names = [c.name for c in msg.columns]
            if msg.ids is None:
                self.ledger.put(part.name, self.next_id, msg.n, names)
            else:
                self.ledger.set(part.name, names, ids)
        if msg.ids is None:
            self.next_id += msg.n
        info.refs += refs
        released: list[str] = []
        if client is not None:
            released, client.released = client.released, []
        reply = P.PutReply(ids=ids.astype("<i8").tobytes(), released=released)
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
        _positive(msg.lease, "lease")
        c = part.consumer(msg.consumer, msg.columns, msg.group_size)
        reply = self._try_claim(conn, part, c, msg)
        if reply is not None:
            return reply
        if msg.timeout > 0:
            self._park(self.parked_claims[part.name], conn, rid, msg, msg.timeout)
            return None
        return _empty_claim()

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
        self._at(c.leases[claim_id].deadline, (part.name, c.name, claim_id))
        mine = self.claims_of.setdefault(conn, set())
        if len(mine) >= 1024:  # forget the finished ones
            mine -= {k for k in mine if not self._has_lease(*k)}
        mine.add((part.name, c.name, claim_id))
        return self._claim_reply(part, c, claim_id, chunk.ids, chunk.slots)

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

    def _claim_reply(
        self, part: Partition, c: Consumer, claim_id: int, ids: np.ndarray, slots: np.ndarray
    ) -> P.ClaimReply:
        seg_list: list[P.SegmentRef] = []
        seg_pos: dict[int, int] = {}
        columns = []
        n = len(slots)
        for name in c.columns:
            col = part.columns[name]
            assert col.dtype is not None
            segs = col.seg[slots]
            first = int(segs[0])
            if n == 1 or not np.count_nonzero(segs != first):  # the usual case: rows of one write
                pos = seg_pos.get(first)
                if pos is None:
                    pos = seg_pos[first] = len(seg_list)
                    seg_list.append(self.segments[first].ref)
                segment = _I32.pack(pos) * n
            else:
                uniq, inverse = np.unique(segs, return_inverse=True)
                where = np.empty(len(uniq), dtype="<i4")
                for k, s in enumerate(uniq.tolist()):
                    if s not in seg_pos:
                        seg_pos[s] = len(seg_list)
                        seg_list.append(self.segments[s].ref)
                    where[k] = seg_pos[s]
                segment = where[inverse].tobytes()
            columns.append(
                P.ColumnRead(
                    name=name,
                    dtype=col.dtype,
                    shape=col.shape,
                    ragged=col.ragged,
                    segment=segment,
                    offset=col.off[slots].tobytes(),  # little-endian arrays (see `Partition.declare`)
                    length=col.length[slots].tobytes(),
                )
            )
        return P.ClaimReply(
            claim=claim_id,
            ids=ids.astype("<i8", copy=False).tobytes(),
            segments=seg_list,
            columns=columns,
            meta=[part.meta[s] for s in slots.tolist()] if part.meta_rows else None,
        )

    def _delete(self, part: Partition, slots: np.ndarray) -> int:
        n, dropped = part.delete_slots(slots)
        for index, k in dropped.items():
            info = self.segments[index]
            info.refs -= k
            if info.refs == 0:
                self._release(index, info)
        if n:
            self._serve_puts(part)
        return n

    def _release(self, index: int, info: SegmentInfo) -> None:
        client = self.clients.get(info.owner)
        if client is not None and client.alive and len(client.released) < MAX_RELEASED_PER_CLIENT:
            client.released.append(info.ref.name)  # the producer recycles it
            return
        del self.segments[index]
        del self.seg_by_name[info.ref.name]
        self._unlink(info.ref.host, [info.ref.name])

    def _unlink(self, host: str, names: list[str]) -> None:
        if not names:
            return
        for name in names:
            index = self.seg_by_name.pop(name, None)
            if index is not None:
                self.segments.pop(index, None)
        if self.storage.unlink(host, names):
            return
        if host == self.host:  # no storage server here (embedded use): the files are ours to remove
            for name in names:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.shm_dir, P.check_segment_name(name)))
        else:
            log.warning("no storage server on %s to free %d segments", host, len(names))

    # ---------------------------------------------------------------------------------------------------
    # parked requests and leases

    def _serve_claims(self, part: Partition) -> None:
        queue = self.parked_claims[part.name]
        if not queue:
            return
        keep: deque[Parked] = deque()
        while queue:
            p = queue.popleft()
            if p.conn.closed:  # the waiter went away: leave the rows for others
                p.done = True
                continue
            c = part.consumers[p.msg.consumer]
            reply = self._try_claim(p.conn, part, c, p.msg)
            if reply is None:
                keep.append(p)
            else:
                p.done = True
                self._reply(p.conn, p.rid, reply)
        self.parked_claims[part.name] = keep

    def _serve_puts(self, part: Partition) -> None:
        queue = self.parked_puts[part.name]
        while queue and part.can_put(queue[0].msg.n):
            p = queue.popleft()
            p.done = True
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
        while self.timers and self.timers[0][0] <= now:
            _, _, what = heapq.heappop(self.timers)
            if isinstance(what, Parked):
                if what.done:
                    continue
                what.done = True
                pname = what.msg.partition
                if isinstance(what.msg, P.Claim):
                    self.parked_claims[pname].remove(what)
                    self._reply(what.conn, what.rid, _empty_claim())
                else:
                    self.parked_puts[pname].remove(what)
                    part = self.partitions[pname]
                    self._reply(what.conn, what.rid, P.Error("full", _full_message(part, what.msg.timeout)))
                continue
            pname, cname, claim_id = what
            owner = self.partitions.get(pname)
            c = owner.consumers.get(cname) if owner else None
            lease = c.leases.get(claim_id) if c else None
            if owner is None or c is None or lease is None or lease.deadline > now:
                continue  # acked, or renewed (a newer entry exists)
            back = owner.expire(c, claim_id)
            log.info(
                "lease of claim %d (%s/%s) expired; %d rows back in the pool", claim_id, pname, cname, back
            )
            self._serve_claims(owner)

    def status(self) -> P.StatusReply:
        return P.StatusReply(
            partitions=[
                part.status(len(self.parked_puts[name]), len(self.parked_claims[name]))
                for name, part in self.partitions.items()
            ],
            segments=len(self.segments),
            clients=sum(1 for c in self.clients.values() if c.alive),
            uptime_s=time.monotonic() - self.started,
        )


def _positive(x: float, what: str) -> float:
    if not x > 0 or x > 86400 * 365:
        raise P.ProtocolError(f"{what} must be a positive number of seconds, got {x}")
    return x


def _empty_claim() -> P.ClaimReply:
    return P.ClaimReply(claim=0, ids=b"", segments=[], columns=[])


def _full_message(part: Partition, timeout: float) -> str:
    return (
        f"partition {part.name!r} is full ({part.rows}/{part.capacity} rows) and stayed full for "
        f"{timeout:.1f}s; a consumer must ack/delete rows (is the terminal consumer running?) or the "
        "partition needs a larger capacity"
    )


def start_controller(
    endpoint: str = "tcp://127.0.0.1:0", **kwargs: Any
) -> tuple[Controller, threading.Thread]:
    """Run a controller in a daemon thread of this process (tests, notebooks)."""
    ctl = Controller(endpoint, **kwargs)
    thread = threading.Thread(target=ctl.serve_forever, name="meshrl-controller", daemon=True)
    thread.start()
    return ctl, thread
