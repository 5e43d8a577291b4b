"""The storage server of one host: serves this host's segments to readers on other hosts.

Producers write their column buffers into shared-memory segments on their own host; same-host readers
map them directly. A reader on another host asks this server, which answers with one raw ZMQ frame per
requested byte range, sent straight from the mapping (zero-copy). The server also frees segments the
controller reports dead, copies live segments into a snapshot, restores them, and on exit removes every
segment of the run that is still on this host.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import zmq

from meshrl.dataplane import protocol as P
from meshrl.dataplane.rpc_client import RpcClient
from meshrl.dataplane.shm import DEFAULT_SHM_DIR, MapCache
from meshrl.dataplane.wire import bind_server, connect_client, host_id

log = logging.getLogger("meshrl.storage")


class Storage:
    def __init__(
        self,
        endpoint: str,
        controller: str,
        *,
        secret: str | None = None,
        shm_dir: str = DEFAULT_SHM_DIR,
        restore: str | Path | None = None,
        advertise: str | None = None,
    ) -> None:
        self.ctx = zmq.Context()
        self.sock, self._auth = bind_server(self.ctx, endpoint, secret)
        self.endpoint = advertise or self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()  # type: ignore[union-attr]
        self.shm_dir = shm_dir
        self.host = host_id()
        self.maps = MapCache(shm_dir, max_bytes=8 << 30)
        self._stop = threading.Event()
        if restore is not None:
            self._restore(Path(restore) / "segments" / self.host)
        self.run = self._register(controller, secret)

    def _restore(self, src: Path) -> None:
        if not src.is_dir():
            return
        for f in sorted(src.iterdir()):
            dst = Path(self.shm_dir) / P.check_segment_name(f.name)
            shutil.copyfile(f, dst)
            os.chmod(dst, 0o600)
        log.info("restored segments from %s", src)

    def _register(self, controller: str, secret: str | None) -> str:
        deadline = time.monotonic() + 60.0
        while True:  # the controller may still be starting
            try:
                rpc = RpcClient(controller, secret, timeout=30.0)
                break
            except ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        try:
            hello = P.Hello(
                client=f"storage-{self.host}",
                host=self.host,
                pid=os.getpid(),
                role="storage",
                endpoint=self.endpoint,
            )
            reply = P.decode_reply(rpc.call(P.encode(hello), 30.0))
            if isinstance(reply, P.Error):
                raise ConnectionError(f"controller refused storage registration: {reply.message}")
            return str(reply.run)
        finally:
            rpc.close()

    def serve_forever(self) -> None:
        try:
            while not self._stop.is_set():
                if self.sock.poll(100):
                    for _ in range(64):
                        try:
                            frames = self.sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._dispatch(frames)
        finally:
            self.close()

    def stop(self) -> None:
        self._stop.set()

    def unlink_segments(self) -> None:
        """Remove this run's segments from shared memory (idempotent; also called by `serve` on exit in
        case this server's thread is stuck)."""
        for f in Path(self.shm_dir).glob(f"meshrl-{self.run}-*"):
            with contextlib.suppress(FileNotFoundError):
                f.unlink()

    def close(self) -> None:
        self.unlink_segments()
        self.sock.close(0)
        if self._auth is not None:
            self._auth.stop()  # type: ignore[attr-defined]
        self.ctx.term()

    def _dispatch(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) > 16:
            log.warning("dropped a frame set of %d parts", len(frames))
            return
        ident, rid, body = frames
        try:
            msg = P.decode_request(body)
            reply, payload = self._apply(msg)
        except (msgspec.DecodeError, msgspec.ValidationError, P.ProtocolError, ValueError, OSError) as e:
            log.warning("bad request: %s", e)
            reply, payload = P.Error("bad_request", str(e)), []
        except Exception as e:
            log.exception("internal error")
            reply, payload = P.Error("internal", f"{type(e).__name__}: {e}"), []
        if reply is None:
            return
        try:
            self.sock.send_multipart([ident, rid, P.encode(reply), *payload], zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as e:
            log.debug("reply dropped: %s", e)

    def _ours(self, name: str) -> str:
        """Only this run's segments may be read, freed or saved through this server."""
        if not P.check_segment_name(name).startswith(f"meshrl-{self.run}-"):
            raise P.ProtocolError(f"segment {name!r} does not belong to run {self.run}")
        return name

    def _apply(self, msg: Any) -> tuple[msgspec.Struct | None, list[Any]]:
        if isinstance(msg, P.Read):
            views = []
            for name, offset, nbytes in msg.ranges:
                seg = self.maps.get(self._ours(name), 0)
                if offset < 0 or nbytes < 0 or offset + nbytes > seg.size:
                    raise P.ProtocolError(f"range {offset}+{nbytes} outside segment {name} of {seg.size}")
                views.append(memoryview(seg.mm)[offset : offset + nbytes])
            return P.ReadReply([len(v) for v in views]), views
        if isinstance(msg, P.Unlink):
            names = [self._ours(n) for n in msg.names]
            self.maps.forget(names)
            for name in names:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.shm_dir, name))
            return None, []
        if isinstance(msg, P.Save):
            dst = Path(msg.path)
            dst.mkdir(parents=True, exist_ok=True)
            for name in msg.names:
                src = Path(self.shm_dir) / self._ours(name)
                tmp = dst / (name + ".tmp")
                shutil.copyfile(src, tmp)
                os.replace(tmp, dst / name)
            return P.Ok(len(msg.names)), []
        raise P.ProtocolError(f"{type(msg).__name__} is not a storage request")


def start_storage(
    controller: str, endpoint: str = "tcp://127.0.0.1:0", **kwargs: Any
) -> tuple[Storage, threading.Thread]:
    """Run a storage server in a daemon thread of this process (tests, notebooks)."""
    st = Storage(endpoint, controller, **kwargs)
    thread = threading.Thread(target=st.serve_forever, name="meshrl-storage", daemon=True)
    thread.start()
    return st, thread


class StorageLinks:
    """The controller's side of the storage servers: one socket per host, opened on first use, for
    freeing segments (no reply awaited) and for blocking calls (snapshots)."""

    def __init__(self, ctx: zmq.Context, secret: str | None, timeout_s: float = 600.0) -> None:
        self.ctx, self.secret, self.timeout_s = ctx, secret, timeout_s
        self.endpoints: dict[str, str] = {}  # host -> the endpoint its storage server registered
        self._socks: dict[str, zmq.Socket] = {}

    def register(self, host: str, endpoint: str) -> None:
        """A storage server (re)started on `host`: talk to it from now on."""
        self.endpoints[host] = endpoint
        old = self._socks.pop(host, None)
        if old is not None:
            old.close(0)

    def _socket(self, host: str) -> zmq.Socket | None:
        sock = self._socks.get(host)
        if sock is None and host in self.endpoints:
            sock = connect_client(self.ctx, self.endpoints[host], self.secret)
            self._socks[host] = sock
        return sock

    def unlink(self, host: str, names: list[str]) -> bool:
        """Ask `host`'s storage server to free segments; False if that host runs none."""
        sock = self._socket(host)
        if sock is None:
            return False
        sock.send_multipart([b"\0" * 8, P.encode(P.Unlink(names))], zmq.NOBLOCK)
        return True

    def call(self, host: str, msg: msgspec.Struct) -> Any:
        """A request to `host`'s storage server, waiting for the reply (decoded, errors included)."""
        sock = self._socket(host)
        if sock is None:
            raise ConnectionError(f"no storage server registered for host {host}")
        rid = os.urandom(8)
        sock.send_multipart([rid, P.encode(msg)])
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if sock.poll(1000):
                frames = sock.recv_multipart()
                if frames[0] == rid:
                    return P.decode_reply(frames[1])
        raise TimeoutError(f"storage server on {host} did not answer {type(msg).__name__}")

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close(0)
