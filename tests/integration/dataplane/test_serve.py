"""`meshrl queue serve` as a process: what its ready file says, and how it stops."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from meshrl.dataplane import Client

IN_HANDLER = str(Path(__file__).with_name("signal_in_handler.py"))
SERVE = ("-m", "meshrl.dataplane.serve")


def serve(tmp: Path, *args: str, command: tuple[str, ...] = SERVE) -> tuple[subprocess.Popen, dict, Path]:
    """Start the server (as `tests/conftest.py: start_plane` does) and wait for its ready file; returns
    the process, the ready file's content and the shared-memory directory."""
    tmp.mkdir(parents=True, exist_ok=True)
    ready, shm = tmp / "ready.json", tmp / "shm"
    shm.mkdir(exist_ok=True)
    proc = subprocess.Popen(
        [sys.executable, *command, "--ready-file", str(ready), "--shm-dir", str(shm), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"data plane did not start:\n{proc.communicate()[0]}")
        time.sleep(0.02)
    return proc, json.loads(ready.read_text()), shm


def put_rows(endpoint: str) -> None:
    """Rows that stay when the client leaves: their segment is the storage server's to remove."""
    with Client(endpoint) as c:
        c.create_partition("rows", 16)
        c.put("rows", {"x": torch.arange(4)})


def stopped(proc: subprocess.Popen, since: float) -> tuple[float, str]:
    """Wait for the server to exit (at most 10 s); returns how long it took since `since`, and its output."""
    try:
        out, _ = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        out = proc.communicate()[0]
        raise AssertionError(f"the server did not stop within 10 s of SIGTERM:\n{out[-3000:]}") from None
    return time.monotonic() - since, out


def test_the_ready_file_names_the_run_its_segments_carry_and_a_restore_keeps_it(tmp_path):
    proc, ready, shm = serve(tmp_path / "first")
    snap = tmp_path / "snap"
    try:
        assert set(ready) == {"controller", "storage", "run"}
        put_rows(ready["controller"])
        left = os.listdir(shm)
        assert left and all(name.startswith(f"meshrl-{ready['run']}-") for name in left), left
        with Client(ready["controller"]) as c:
            c.snapshot(snap)
    finally:
        proc.send_signal(signal.SIGTERM)
        stopped(proc, time.monotonic())
    restored, again, _ = serve(tmp_path / "second", "--restore", str(snap))
    try:
        assert again["run"] == ready["run"]
    finally:
        restored.send_signal(signal.SIGTERM)
        stopped(restored, time.monotonic())


def test_a_second_sigterm_inside_the_handler_stops_the_server_promptly(tmp_path):
    proc, ready, shm = serve(tmp_path, command=(IN_HANDLER,))
    put_rows(ready["controller"])
    assert os.listdir(shm)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    took, out = stopped(proc, t0)
    assert "second SIGTERM sent inside the handler" in out, out[-3000:]
    assert proc.returncode == 0, out[-3000:]
    assert took < 1.0, f"stopped {took:.2f} s after SIGTERM"
    assert not os.listdir(shm)


def test_two_sigterms_in_quick_succession_or_during_shutdown_stop_the_server_promptly(tmp_path):
    for gap in (0.0, 0.005, 0.02, 0.05):  # a shutdown takes about 0.05 - 0.2 s
        proc, ready, shm = serve(tmp_path / f"gap-{gap}")
        put_rows(ready["controller"])
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(gap)
        proc.send_signal(signal.SIGTERM)  # a no-op once it has exited (it is not reaped yet)
        took, out = stopped(proc, t0)
        assert proc.returncode == 0, f"gap {gap}: {out[-3000:]}"
        assert took < 1.0, f"gap {gap}: stopped {took:.2f} s after the first SIGTERM"
        assert not os.listdir(shm), f"gap {gap}: segments left behind"
