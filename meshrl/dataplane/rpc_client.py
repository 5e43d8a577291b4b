"""The clients' end of the controller's request channel (`rpc.py` holds the frame format, the handshake
and the server): `RpcClient`, blocking, for `Client` and the storage servers; `AsyncRpcClient` for
`AsyncClient`. Both keep several requests in flight over one connection and match replies by id.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import os
import select
import socket
import time
from typing import Any

from meshrl.dataplane.rpc import GREETING_LEN, HEADER, Spin, address, answer, tune

RECV_CHUNK = 1 << 16
_RIDS = itertools.count(1)  # request ids, unique within this process (0 is the auth answer's)


def _rid() -> bytes:
    return next(_RIDS).to_bytes(8, "little")


class RpcClient:
    """Blocking requests over one connection; several may be in flight, replies are matched by id.

    The socket stays in blocking mode and every wait goes through `select` with the time left: a socket
    with a Python-level timeout would add a `poll` before each call, and switching modes costs a call too.
    Replies are read in large chunks into a buffer, so a small reply is one `recv`.
    """

    def __init__(self, endpoint: str, secret: str | None, timeout: float) -> None:
        family, addr = address(endpoint)
        self.endpoint = endpoint
        self.stash: dict[bytes, bytes] = {}
        self.rbuf = bytearray()
        self.spin = Spin()
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(addr)
        except OSError as e:
            self.sock.close()
            raise ConnectionError(f"cannot reach the data-plane controller at {endpoint}: {e}") from e
        tune(self.sock)
        self.sock.settimeout(None)
        try:
            deadline = time.monotonic() + timeout
            while len(self.rbuf) < GREETING_LEN:
                self._fill(deadline)
            greeting = bytes(self.rbuf[:GREETING_LEN])
            del self.rbuf[:GREETING_LEN]
            reply = answer(secret, greeting)
            if reply:
                self.sock.sendall(HEADER.pack(len(reply), bytes(8)) + reply)
        except TimeoutError:
            self.sock.close()
            raise ConnectionError(f"the data-plane controller at {endpoint} did not greet") from None
        except BaseException:
            self.sock.close()
            raise

    def _spin(self, start: float) -> None:
        """Wait briefly for the reply without sleeping (see `Spin`)."""
        spin_until = start + self.spin.budget()
        while time.perf_counter() < spin_until:
            os.sched_yield()
            if _readable(self.sock, 0.0):
                return

    def _fill(self, deadline: float | None) -> bool:
        """Append what the socket holds to the buffer. Without a deadline, never block (returns whether
        anything came); with one, wait for data until then (TimeoutError)."""
        try:
            data = self.sock.recv(RECV_CHUNK, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            if deadline is None:
                return False
            left = deadline - time.monotonic()
            if left <= 0 or not _readable(self.sock, left):
                raise TimeoutError(f"no reply from {self.endpoint}") from None
            data = self.sock.recv(RECV_CHUNK)
        if not data:
            raise ConnectionError(f"the controller at {self.endpoint} closed the connection")
        self.rbuf += data
        return True

    def _frame(self) -> tuple[bytes, bytes] | None:
        """The next whole reply in the buffer as (request id, body), or None."""
        buf = self.rbuf
        if len(buf) < HEADER.size:
            return None
        length, rid = HEADER.unpack_from(buf)
        end = HEADER.size + length
        if len(buf) < end:
            return None
        body = bytes(buf[HEADER.size : end])
        del buf[:end]
        return rid, body

    def send(self, body: bytes) -> bytes:
        """Send a request without waiting; returns its id for `wait`."""
        rid = _rid()
        self.sock.sendall(HEADER.pack(len(body), rid) + body)
        return rid

    def wait(self, rid: bytes, timeout: float) -> bytes:
        """The reply to request `rid`. Replies to other requests that arrive first are kept for later.

        After a timeout or error the stream may hold half a frame: drop this connection.
        """
        if rid in self.stash:
            return self.stash.pop(rid)
        deadline = time.monotonic() + timeout
        start = time.perf_counter()
        waited = False
        if len(self.rbuf) < HEADER.size:
            self._spin(start)
            waited = True
        while True:
            frame = self._frame()
            if frame is None:
                self._fill(deadline)
                waited = True
                continue
            got, body = frame
            if got == rid:
                if waited:
                    self.spin.record(time.perf_counter() - start)
                return body
            self.stash[got] = body

    def poll(self) -> None:
        """Read every reply that has already arrived into the stash, without blocking."""
        while self._fill(None):
            pass
        while (frame := self._frame()) is not None:
            self.stash[frame[0]] = frame[1]

    def call(self, body: bytes, timeout: float) -> bytes:
        return self.wait(self.send(body), timeout)

    def close(self) -> None:
        self.sock.close()


class AsyncRpcClient:
    """Many requests in flight over one connection; a reader task routes replies by id."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, endpoint: str) -> None:
        self.reader = reader
        self.writer = writer
        self.endpoint = endpoint
        self.pending: dict[bytes, asyncio.Future[bytes]] = {}
        self.task = asyncio.create_task(self._read())

    @classmethod
    async def connect(cls, endpoint: str, secret: str | None, timeout: float) -> AsyncRpcClient:
        _, addr = address(endpoint)
        try:
            if isinstance(addr, str):
                opening = asyncio.open_unix_connection(addr)
            else:
                opening = asyncio.open_connection(*addr)
            async with asyncio.timeout(timeout):
                reader, writer = await opening
        except OSError as e:
            raise ConnectionError(f"cannot reach the data-plane controller at {endpoint}: {e}") from e
        sock = writer.get_extra_info("socket")
        if sock is not None:
            tune(sock)
        async with asyncio.timeout(timeout):
            greeting = await reader.readexactly(GREETING_LEN)
        reply = answer(secret, greeting)
        if reply:
            writer.write(HEADER.pack(len(reply), bytes(8)) + reply)
        return cls(reader, writer, endpoint)

    async def _read(self) -> None:
        try:
            while True:
                length, rid = HEADER.unpack(await self.reader.readexactly(HEADER.size))
                data = await self.reader.readexactly(length)
                fut = self.pending.get(rid)
                if fut is not None and not fut.done():
                    fut.set_result(data)
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            err = ConnectionError(f"the controller at {self.endpoint} closed the connection")
            for fut in self.pending.values():
                if not fut.done():
                    fut.set_exception(err)
            del e

    async def call(self, body: bytes, timeout: float) -> bytes:
        rid = _rid()
        fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self.pending[rid] = fut
        try:
            self.writer.write(HEADER.pack(len(body), rid) + body)
            # not asyncio.wait_for: on Python 3.11 it swallows a cancellation that arrives with the reply,
            # and a service's claim loop then outlives the shutdown that cancelled it
            async with asyncio.timeout(timeout):
                return await fut
        finally:
            self.pending.pop(rid, None)

    async def close(self) -> None:
        self.task.cancel()
        self.writer.close()
        with contextlib.suppress(ConnectionError, asyncio.CancelledError):
            await self.writer.wait_closed()


class Wire:
    """A connection to the controller that speaks its messages directly (`call`), for the launcher: the
    data-plane client imports torch, and a launcher does not."""

    def __init__(self, controller: str, secret: str | None, name: str, timeout: float = 30.0) -> None:
        from meshrl.dataplane import protocol as P
        from meshrl.dataplane.wire import host_id

        self.P, self.name, self.timeout = P, name, timeout
        self.rpc = RpcClient(controller, secret, timeout)
        try:
            self.hello = self.call(P.Hello(client=name, host=host_id(), pid=os.getpid()))
        except BaseException:
            self.rpc.close()
            raise

    def call(self, msg: Any) -> Any:
        reply = self.P.decode_reply(self.rpc.call(self.P.encode(msg), self.timeout))
        if isinstance(reply, self.P.Error):
            raise RuntimeError(f"data plane: {type(msg).__name__} refused: {reply.message}")
        return reply

    def close(self) -> None:
        try:
            self.call(self.P.Bye(self.name))
        finally:
            self.rpc.close()

    def __enter__(self) -> Wire:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _readable(sock: socket.socket, timeout: float) -> bool:
    """Whether `sock` has data within `timeout` seconds: poll, not select (a process with over 1024
    open descriptors, rollout's near the end of a long agents run, made select raise)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(max(0, math.ceil(timeout * 1000))))
