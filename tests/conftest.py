"""Shared fixtures: a real data plane (its own process, loopback), and cleanup checks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Plane:
    controller: str
    storage: str
    proc: subprocess.Popen
    shm_dir: str


def start_plane(
    tmp: Path, *extra: str, env: dict[str, str] | None = None, shm_dir: str | None = None
) -> Plane:
    ready = tmp / f"ready-{time.monotonic_ns()}.json"
    shm = shm_dir or str(tmp / "shm")
    os.makedirs(shm, exist_ok=True)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "meshrl.dataplane.serve",
            "--ready-file",
            str(ready),
            "--shm-dir",
            shm,
            *extra,
        ],
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 60
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            out = proc.stdout.read().decode() if proc.stdout else ""
            proc.kill()
            raise RuntimeError(f"data plane did not start:\n{out}")
        time.sleep(0.02)
    info = json.loads(ready.read_text())
    return Plane(info["controller"], info.get("storage", ""), proc, shm)


def stop_plane(plane: Plane) -> str:
    if plane.proc.poll() is None:
        plane.proc.send_signal(signal.SIGTERM)
    try:
        out, _ = plane.proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        plane.proc.kill()
        out, _ = plane.proc.communicate()
    return out.decode() if out else ""


@pytest.fixture
def plane(tmp_path: Path) -> Iterator[Plane]:
    """Controller + storage as one real process on loopback, with a private shared-memory directory."""
    p = start_plane(tmp_path)
    yield p
    stop_plane(p)
    left = os.listdir(p.shm_dir)
    assert not left, f"segments left behind after shutdown: {left}"
