"""A reply that cannot be sent (its peer died) must not disturb the request being handled.

The controller answers parked claims while it handles a put. When one of those answers fails, the dead
connection's claims go back to the pool, which serves parked claims again; done in the middle of the
first pass, that second pass lost the claims parked behind the dead one, and the controller later
crashed on their deadline. Driven in-process, with real socket pairs, so the order is deterministic.
"""

import socket
import time

import pytest

from meshrl.dataplane import protocol as P
from meshrl.dataplane.controller import Controller
from meshrl.dataplane.rpc import HEADER, Connection


def frames(sock: socket.socket) -> list[object]:
    sock.setblocking(False)
    data = b""
    try:
        while chunk := sock.recv(1 << 16):
            data += chunk
    except BlockingIOError:
        pass
    out = []
    while data:
        length, _ = HEADER.unpack_from(data)
        out.append(P.decode_reply(data[HEADER.size : HEADER.size + length]))
        data = data[HEADER.size + length :]
    return out


@pytest.fixture
def controller(tmp_path):
    ctl = Controller("tcp://127.0.0.1:0", shm_dir=str(tmp_path))
    yield ctl
    ctl.close()


def connect(ctl: Controller, name: str) -> tuple[Connection, socket.socket]:
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    conn = Connection(ours, name, None)
    ctl.server.conns.add(conn)
    return conn, theirs


def test_a_reply_to_a_dead_peer_keeps_the_claims_parked_behind_it(controller):
    ctl = controller
    dead, dead_peer = connect(ctl, "dead")
    waiting, waiting_peer = connect(ctl, "waiting")
    producer, producer_peer = connect(ctl, "producer")
    ctl._handle(producer, b"0" * 8, P.encode(P.CreatePartition("p", 8)))
    # parked in this order: the dead peer's claim first, then one that the put will not satisfy
    ctl._handle(dead, b"1" * 8, P.encode(P.Claim("p", "a", ["x"], 1, timeout=30.0)))
    ctl._handle(waiting, b"2" * 8, P.encode(P.Claim("p", "c", ["y"], 1, timeout=0.2)))
    dead_peer.close()
    segment = P.SegmentRef(f"meshrl-{ctl.run}-producer-1", ctl.host, 4096)
    put = P.Put("producer", "p", 1, segment, [P.ColumnWrite("x", "int64", [], False, 0, 8)])
    ctl._handle(producer, b"3" * 8, P.encode(put))  # answers the dead peer's claim: the send fails
    ctl.server.poll(0)  # the dead connection's claim goes back to the pool now
    assert len(ctl.parked_claims["p"]) == 1
    assert ctl.partitions["p"].consumers["a"].nready == 1 and not ctl.partitions["p"].consumers["a"].leases
    time.sleep(0.25)
    ctl._timers()  # the waiting claim's deadline: an empty answer, and the controller goes on
    (reply,) = frames(waiting_peer)
    assert isinstance(reply, P.ClaimReply) and not reply.ids
    assert isinstance(frames(producer_peer)[-1], P.PutReply)
    waiting_peer.close()
    producer_peer.close()
