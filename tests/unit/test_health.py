"""A service's loopback health endpoint: answers its snapshot, and a prober that hangs up is no error."""

from __future__ import annotations

import json
import socket
import struct
import urllib.request

import pytest

from meshrl.runtime.service import Health


@pytest.fixture
def server():
    health = Health("inference-0.0", state="ready", info={"version": 3})
    srv = health.serve(0)
    yield srv
    srv.shutdown()
    srv.server_close()


def get(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as r:
        return json.loads(r.read())


def test_health_endpoint_answers_the_snapshot(server):
    snap = get(server.server_address[1])
    assert snap["service"] == "inference-0.0" and snap["state"] == "ready" and snap["version"] == 3


def test_a_prober_that_hangs_up_leaves_no_traceback_and_the_endpoint_keeps_answering(server, capfd):
    port = server.server_address[1]
    for _ in range(20):  # reset mid-request, as a probe that timed out does
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()
    # the same path deterministically: the handler's error hook inside a broken connection
    try:
        raise BrokenPipeError(32, "Broken pipe")
    except BrokenPipeError:
        server.handle_error(None, ("127.0.0.1", 1))
    assert get(port)["state"] == "ready"
    assert "Traceback" not in capfd.readouterr().err
    try:  # anything else is still reported
        raise ValueError("a real bug")
    except ValueError:
        server.handle_error(None, ("127.0.0.1", 1))
    assert "a real bug" in capfd.readouterr().err
