"""`meshrl dashboard`'s bad input: a clear line and exit 2, nothing started."""

from __future__ import annotations

import socket
import subprocess
import sys


def test_a_port_in_use_is_named_with_what_to_do(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "meshrl.cli", "dashboard", str(tmp_path), "--port", str(port)],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in r.stderr and "--port 0" in r.stderr
