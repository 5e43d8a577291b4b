"""`meshrl dashboard` outside a browser: bad input gets a clear line and exit 2, nothing started; a
signal stops it."""

from __future__ import annotations

import signal
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


def test_sigint_or_sigterm_stops_it_even_where_sigint_came_ignored(tmp_path):
    """A script's background job inherits SIGINT ignored; the dashboard still stops on it."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        dash = subprocess.Popen([sys.executable, "-m", "meshrl.cli", "dashboard", str(tmp_path), "--port", "0"],
                                stdout=subprocess.PIPE, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))  # fmt: skip
        try:
            assert dash.stdout.readline().startswith("meshrl dashboard: http://127.0.0.1:")
            dash.send_signal(sig)
            assert dash.wait(timeout=30) == 0
        finally:
            if dash.poll() is None:
                dash.kill()
