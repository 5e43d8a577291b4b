"""The storage server of a host that joined a running run outlives its launcher (`--linger`): killed, the
launcher takes its processes with it, but the rows they wrote are still the run's, served from that
host's storage until they are read; then the server ends by itself."""

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

LAUNCHER = """
import os, subprocess, sys, time
ready, argv = sys.argv[1], sys.argv[2:]
env = {**os.environ, "MESHRL_PARENT": str(os.getpid())}
server = subprocess.Popen([sys.executable, "-m", "meshrl.dataplane.serve", *argv, "--ready-file", ready], env=env)
print(server.pid, flush=True)
time.sleep(3600)
"""

WRITER = """
import sys, torch
from meshrl.dataplane import Client
with Client(sys.argv[1]) as c:
    print(c.put("rows", {"x": torch.arange(12).reshape(3, 4)}).tolist(), flush=True)
"""


def test_a_killed_launchers_storage_serves_its_rows_until_they_are_read(plane, tmp_path: Path) -> None:
    elsewhere = tmp_path / "shm-elsewhere"  # another host's shared memory
    elsewhere.mkdir()
    env = {**os.environ, "MESHRL_HOST_ID": "elsewhere", "MESHRL_SHM_DIR": str(elsewhere)}
    ready = tmp_path / "storage.ready"
    argv = ["--storage-only", "--controller", plane.controller, "--storage", "tcp://127.0.0.1:0",
            "--shm-dir", str(elsewhere), "--linger", "60"]  # fmt: skip
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(ready), *argv], env=env,
                                stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert launcher.stdout is not None
    server = int(launcher.stdout.readline())
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with Client(plane.controller) as c:
            c.create_partition("rows", 16, delete_when_acked_by=["reader"])
            written = subprocess.run([sys.executable, "-c", WRITER, plane.controller], env=env, text=True,
                                     capture_output=True, timeout=60)  # fmt: skip
            assert written.returncode == 0, written.stderr
            assert [p.name for p in elsewhere.iterdir()]  # the rows' bytes live on the other host
            launcher.kill()  # the launcher of that host dies: its storage server lingers
            launcher.wait()
            time.sleep(0.5)
            assert _alive(server)
            batch = c.claim("rows", "reader", ["x"], 3)
            assert batch.ids.tolist() == json.loads(written.stdout) and torch.equal(
                batch["x"], torch.arange(12).reshape(3, 4)
            )  # read from that host's storage server, after its launcher died
            c.ack(batch)  # the last rows on it are gone: so are their segments, and then the server
            deadline = time.monotonic() + 30
            while _alive(server):
                assert time.monotonic() < deadline, "the lingering storage server did not end"
                time.sleep(0.1)
        assert not list(elsewhere.iterdir())
    finally:
        if launcher.poll() is None:
            launcher.kill()
        if _alive(server):
            os.kill(server, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)  # not our child: raises
        return done == 0
    except ChildProcessError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        with open(f"/proc/{pid}/stat") as f:  # a zombie waiting for its (gone) parent is dead
            return f.read().split(") ")[1][0] != "Z"
