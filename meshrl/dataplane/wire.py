"""Sockets shared by the controller, storage servers and clients: binding rules and authentication.

Loopback is the default. Binding any other address requires the run's shared secret, which is then
checked for every connecting peer by ZMQ's authentication handshake (PLAIN mechanism, ZAP handler): a
peer without it never gets a single frame through to our code.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
import socket
from pathlib import Path
from urllib.parse import urlparse

import zmq
import zmq.auth.thread

log = logging.getLogger(__name__)

USER = b"meshrl"
MAX_FRAME = 1 << 30  # refuse absurd frames before they are buffered


class AuthError(ConnectionError):
    """The server refused our credentials."""


def host_id() -> str:
    """Which machine this process runs on, as the data plane sees it (overridable for tests)."""
    return os.environ.get("MESHRL_HOST_ID") or socket.gethostname()


def is_loopback(endpoint: str) -> bool:
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    host = urlparse(endpoint).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(endpoint: str, secret: str | None) -> None:
    if not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(f"endpoint {endpoint!r} must start with tcp://, ipc:// or inproc://")
    if not is_loopback(endpoint) and not secret:
        raise ValueError(
            f"refusing to bind {endpoint}: it is not a loopback address, and binding off loopback "
            "requires a shared secret (set MESHRL_SECRET or pass secret=...)"
        )


def new_secret() -> str:
    return secrets.token_urlsafe(32)


def write_secret(path: Path, secret: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret)


def bind_server(ctx: zmq.Context, endpoint: str, secret: str | None) -> tuple[zmq.Socket, object | None]:
    """A ROUTER socket bound to `endpoint`; with a secret, only peers presenting it get through."""
    check_bind(endpoint, secret)
    auth = None
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    if secret:
        auth = zmq.auth.thread.ThreadAuthenticator(ctx, log=logging.getLogger("meshrl.auth"))
        auth.start()
        auth.configure_plain(domain="*", passwords={USER.decode(): secret})
        sock.plain_server = True
    sock.bind(endpoint)
    return sock, auth


def connect_client(ctx: zmq.Context, endpoint: str, secret: str | None) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, -1)
    if secret:
        sock.plain_username = USER
        sock.plain_password = secret.encode()
    sock.connect(endpoint)
    return sock


def bound_port(sock: zmq.Socket) -> int:
    last = sock.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(last, bytes)
    return int(last.decode().rsplit(":", 1)[1])
