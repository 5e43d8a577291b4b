"""Snapshot/restore, authentication, hostile frames and the async client."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import time
from urllib.parse import urlparse

import msgspec
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshrl.dataplane import AsyncClient, AuthError, Client
from meshrl.dataplane import protocol as P
from meshrl.dataplane.rpc import GREETING_LEN, HEADER
from tests.conftest import start_plane, stop_plane


def test_snapshot_restore_round_trip(tmp_path):
    first = start_plane(tmp_path)
    snap = tmp_path / "snap"
    try:
        with Client(first.controller) as c:
            c.create_partition("rows", 64, delete_when_acked_by=["trainer"])
            ids = c.put("rows", {"t": [torch.arange(n) for n in (2, 5, 1, 4)], "r": torch.arange(4.0)})
            c.put("rows", {"extra": torch.tensor([7, 8])}, ids=ids[:2])
            done = c.claim("rows", "trainer", ["t", "r"], 1)
            c.ack(done)  # deleted by retention: must not come back
            c.claim("rows", "trainer", ["t", "r"], 1)  # claimed but not acked: must come back
            c.claim("rows", "critic", ["t"], 4)
            keyed = c.put("rows", {"t": [torch.arange(2)], "r": torch.tensor([6.0])}, key="traj/1")
            c.snapshot(snap)
            c.put("rows", {"t": [torch.arange(3)], "r": torch.tensor([9.0])})  # after the snapshot: gone
    finally:
        stop_plane(first)
    assert (snap / "controller.msgpack").exists()
    second = start_plane(tmp_path, "--restore", str(snap))
    try:
        with Client(second.controller) as c:
            b = c.claim("rows", "trainer", ["t", "r"], 3)
            assert b.ids.tolist() == ids[1:].tolist()
            assert [t.tolist() for t in b["t"]] == [list(range(5)), [0], list(range(4))]  # type: ignore[union-attr]
            assert b["r"].tolist() == [1.0, 2.0, 3.0]  # type: ignore[union-attr]
            e = c.claim("rows", "extra", ["extra"], 10)
            assert e.ids.tolist() == ids[1:2].tolist() and e["extra"].tolist() == [8]  # type: ignore[union-attr]
            critic = c.claim("rows", "critic", ["t"], 4)
            assert critic.ids.tolist() == [*ids[1:].tolist(), *keyed.tolist()], (
                "claimed-but-unacked rows come back"
            )
            # a producer repeating a put the snapshot holds (its ack came after) gets that row, not a new one
            again = c.put("rows", {"t": [torch.arange(2)], "r": torch.tensor([6.0])}, key="traj/1")
            assert again.tolist() == keyed.tolist()
            new = c.put("rows", {"t": [torch.arange(2)], "r": torch.tensor([5.0])})
            assert new[0] > keyed.max(), "row ids must not be reused after a restore"
            c.ack(b)
            assert c.status().partitions[0].rows == 2  # the keyed row and the new one, not trained yet
    finally:
        stop_plane(second)
    assert not os.listdir(second.shm_dir)


def test_client_without_the_secret_is_refused(tmp_path):
    p = start_plane(tmp_path, env={"MESHRL_SECRET": "s3cret"})
    try:
        with pytest.raises(AuthError, match="shared secret"):
            Client(p.controller, timeout=5)
        with pytest.raises((ConnectionError, TimeoutError, OSError)):
            Client(p.controller, secret="wrong", timeout=3)
        with Client(p.controller, secret="s3cret") as c:
            c.create_partition("rows", 4)
            c.put("rows", {"x": torch.arange(2)})
            local = c._local
        # the controller's Unix socket (same-host clients) asks for the same secret
        assert local.startswith("ipc://@")
        with pytest.raises(AuthError, match="shared secret"):
            Client(local, timeout=5)
        # the storage server refuses unauthenticated ZMQ peers before any frame reaches it
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(p.storage)
        sock.send_multipart([b"12345678", P.encode(P.Read([]))])
        assert not sock.poll(1000), "storage answered a peer without the secret"
        sock.close()
        ctx.term()
    finally:
        out = stop_plane(p)
    assert "refused" in out


def test_binding_off_loopback_requires_a_secret():
    from meshrl.dataplane.controller import Controller

    with pytest.raises(ValueError, match="requires a shared secret"):
        Controller("tcp://0.0.0.0:0")


def _raw(endpoint: str) -> socket.socket:
    url = urlparse(endpoint)
    s = socket.create_connection((url.hostname, url.port), timeout=5)
    assert len(s.recv(GREETING_LEN)) == GREETING_LEN
    return s


def frames(run: str) -> st.SearchStrategy[bytes]:
    """Garbage, foreign msgpack, and protocol messages with hostile field values, aimed at partition
    "fuzzed" (some of them are valid requests, which may change it)."""
    ints = st.integers(-(2**63), 2**63 - 1)
    put = st.builds(
        lambda n, size, off, nb, lengths: P.encode(
            P.Put(
                client="fuzz",
                partition="fuzzed",
                n=n,
                segment=P.SegmentRef(f"meshrl-{run}-fuzz-1", "h", size),
                columns=[P.ColumnWrite("x", "int64", [], lengths is not None, off, nb, lengths)],
            )
        ),
        st.integers(-5, 10),
        st.integers(-10, 1 << 20),
        st.integers(-10, 100),
        st.integers(-10, 100),
        st.none() | st.binary(max_size=24),
    )
    claim = st.builds(
        lambda n, m, g, lease: P.encode(P.Claim("fuzzed", "fuzz", ["x"], n, m, g, 0.0, lease)),
        st.integers(-3, 5),
        st.integers(-3, 5),
        st.none() | st.integers(-2, 5),
        st.floats(allow_nan=True, allow_infinity=True),
    )
    return st.one_of(
        st.binary(max_size=200),
        st.builds(msgspec.msgpack.encode, st.dictionaries(st.text(max_size=8), ints, max_size=4)),
        put,
        claim,
        st.builds(lambda ids: P.encode(P.Delete("fuzzed", ids)), st.binary(max_size=40)),
        st.builds(lambda c: P.encode(P.Ack("fuzzed", "fuzz", c)), ints),
        st.builds(
            lambda r: P.encode(P.Read(r)), st.lists(st.tuples(st.text(max_size=30), ints, ints), max_size=3)
        ),
    )


def test_hostile_frames_do_not_stop_the_servers(plane):
    with Client(plane.controller) as c:
        c.create_partition("rows", 16)
        c.create_partition("fuzzed", 16)
        c.put("rows", {"x": torch.arange(3)})
        run = c.core.pool.prefix.split("-")[1]  # type: ignore[union-attr]

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(bodies=st.lists(frames(run), min_size=1, max_size=5), truncate=st.booleans())
    def hammer(bodies: list[bytes], truncate: bool) -> None:
        s = _raw(plane.controller)
        data = b"".join(HEADER.pack(len(b), b"fuzzfuzz") + b for b in bodies)
        s.sendall(data[: len(data) // 2] if truncate else data)
        s.close()
        ctx = zmq.Context()
        z = ctx.socket(zmq.DEALER)
        z.setsockopt(zmq.LINGER, 0)
        z.connect(plane.storage)
        z.send_multipart([b"x" * 8, *bodies])
        z.send_multipart([b"y" * 8, bodies[0]])
        z.close()
        ctx.term()

    hammer()
    # an absurd length prefix and garbage: only that connection is closed
    s = _raw(plane.controller)
    s.sendall(struct.pack("<I", 1 << 31) + b"8bytesid" + b"junk")
    assert s.recv(10) == b""
    s.close()
    with Client(plane.controller) as c:
        b = c.claim("rows", "after", ["x"], 3)
        assert b["x"].tolist() == [0, 1, 2]  # type: ignore[union-attr]
        c.put("rows", {"x": torch.arange(2)})
        assert c.status().partitions[0].rows == 5


def test_wire_modules_never_unpickle():
    """No pickle (or anything that executes code while decoding) in the data plane's modules."""
    import ast
    from pathlib import Path

    import meshrl.dataplane as dp

    banned_modules = {"pickle", "cPickle", "dill", "marshal", "shelve", "cloudpickle", "joblib"}
    banned_calls = {"recv_pyobj", "send_pyobj", "recv_serialized", "load", "loads"}
    for path in Path(dp.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                names = {(node.module or "").split(".")[0]}
            else:
                names = set()
            assert not names & banned_modules, f"{path.name} imports {names & banned_modules}"
            if isinstance(node, ast.Attribute) and node.attr in banned_calls:
                owner = ast.unparse(node.value)
                assert owner not in ("torch", "np", "numpy", "pickle", "sock", "self.sock"), (
                    f"{path.name}: {owner}.{node.attr}"
                )


def test_async_client(plane):
    async def main() -> None:
        c = await AsyncClient.connect(plane.controller)
        assert c.rpc.endpoint.startswith("ipc://@")  # same host: the controller's Unix socket
        await c.create_partition("rows", 32, delete_when_acked_by=["t"])
        waiting = asyncio.create_task(c.claim("rows", "t", ["x"], 4, min_n=4, timeout=10))
        await asyncio.sleep(0.1)
        t0 = time.monotonic()
        ids = await c.put("rows", {"x": torch.arange(4)})
        b = await waiting
        assert time.monotonic() - t0 < 5
        assert b.ids.tolist() == ids.tolist() and b["x"].tolist() == [0, 1, 2, 3]  # type: ignore[union-attr]
        assert await c.ack(b) == 4
        assert (await c.status()).partitions[0].rows == 0
        await c.close()

    asyncio.run(main())


def test_a_request_cancelled_as_its_reply_arrives_is_cancelled(plane):
    """A service shuts down by cancelling its tasks; a task whose reply is already in when the
    cancellation comes must still end (Python 3.11's asyncio.wait_for returned the reply instead, and the
    service's claim loop went on forever)."""

    async def main() -> None:
        c = await AsyncClient.connect(plane.controller)
        for _ in range(20):
            asking = asyncio.create_task(c.status())
            while not c.rpc.pending:  # sent
                await asyncio.sleep(0)
            (reply,) = c.rpc.pending.values()
            while not reply.done():  # the reply is in; the task has not run since
                await asyncio.sleep(0)
            asking.cancel()
            with pytest.raises(asyncio.CancelledError):
                await asking
        await c.close()

    asyncio.run(main())


@pytest.fixture
def outside_address():
    """A non-loopback address on the loopback interface (never an outside address); skipped when the
    machine does not let us add one."""
    import subprocess

    addr = "10.254.0.1"
    added = subprocess.run(["ip", "addr", "add", f"{addr}/32", "dev", "lo"], capture_output=True)
    if added.returncode != 0:
        pytest.skip(f"cannot add {addr} to lo: {added.stderr.decode().strip()}")
    try:
        yield addr
    finally:
        subprocess.run(["ip", "addr", "del", f"{addr}/32", "dev", "lo"], capture_output=True)


def test_a_peer_off_loopback_without_the_secret_is_refused(tmp_path, outside_address):
    from tests.conftest import free_base_port

    port = free_base_port()
    p = start_plane(tmp_path, "--controller", f"tcp://0.0.0.0:{port}", env={"MESHRL_SECRET": "s3cret"})
    try:
        endpoint = f"tcp://{outside_address}:{port}"
        with pytest.raises(AuthError, match="shared secret"):
            Client(endpoint, timeout=5)
        with Client(endpoint, secret="s3cret") as c:  # the same peer with the secret is served
            c.create_partition("rows", 4)
    finally:
        stop_plane(p)


def test_clients_on_the_controllers_host_talk_over_its_unix_socket(plane, monkeypatch):
    """The controller listens on TCP and on a Unix socket; a client on its host moves to the latter
    (cheaper per message), one on another host stays on TCP, and both see the same table."""
    with Client(plane.controller) as here:
        assert here._rpc is not None and here._rpc.endpoint.startswith("ipc://@")
        here.create_partition("rows", 8)
        ids = here.put("rows", {"x": torch.arange(3)})
        monkeypatch.setenv("MESHRL_HOST_ID", "elsewhere")
        with Client(plane.controller) as there:
            assert there._rpc is not None and there._rpc.endpoint == plane.controller
            b = there.claim("rows", "t", ["x"], 3)
            assert b.ids.tolist() == ids.tolist() and b["x"].tolist() == [0, 1, 2]  # type: ignore[union-attr]
            there.ack(b)
