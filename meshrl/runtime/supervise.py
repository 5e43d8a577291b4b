"""Child processes of a launcher: start with a log file, wait until healthy, watch, stop.

Every child runs in its own session so that stopping it stops everything it started; a launcher only
ever signals the process groups of children it started.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str]
    health_port: int | None = None
    proc: subprocess.Popen | None = None
    log: IO[bytes] | None = None
    started: float = field(default_factory=time.monotonic)
    restarts: int = 0

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.log.write(f"\n==== start {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(self.argv)}\n".encode())
        self.log.flush()
        self.proc = subprocess.Popen(
            self.argv,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**self.env, "MESHRL_PARENT": str(os.getpid())},
            start_new_session=True,
        )
        self.started = time.monotonic()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def poll(self) -> int | None:
        assert self.proc is not None
        return self.proc.poll()

    def health(self, timeout: float = 1.0) -> dict[str, Any] | None:
        if self.health_port is None:
            return None
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/", timeout=timeout) as r:
                return json.loads(r.read())
        except (OSError, ValueError):
            return None

    def tail(self, lines: int = 30) -> str:
        try:
            data = self.log_path.read_bytes()[-16384:].decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(data.splitlines()[-lines:])

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM the child's process group, SIGKILL what is left after `grace` seconds."""
        if self.proc is not None and self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                _signal_group(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self.proc is not None:
            _signal_group(self.proc.pid, signal.SIGKILL)  # grandchildren that outlived their parent
        if self.log is not None:
            self.log.close()
            self.log = None


def die_with_parent() -> None:
    """First thing in a service process: get SIGTERM when the launcher that started it dies, even by
    SIGKILL (Linux). Asked for here, after exec, and not in a pre-exec hook: Python code run between
    fork and exec in a launcher with threads (gloo, ZMQ) can deadlock on a lock another thread held at
    the fork, and Popen then waits for that child forever."""
    parent = os.environ.get("MESHRL_PARENT")
    if parent is None:
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != int(parent):  # the launcher died before we could ask
        os.kill(os.getpid(), signal.SIGTERM)


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def wait_ready(children: list[Child], timeout: float) -> Child | None:
    """Wait until every child reports ready (or finished: a short service may exit cleanly before its
    first health probe). Returns a child that failed, if one did."""
    pending = [c for c in children if c.health_port is not None]
    deadline = time.monotonic() + timeout
    while pending:
        for c in list(pending):
            code = c.poll()
            if code == 0:
                pending.remove(c)
                continue
            if code is not None:
                return c
            h = c.health(timeout=0.5)
            if h is not None and h.get("state") in ("running", "finished"):
                pending.remove(c)
        if time.monotonic() > deadline:
            raise TimeoutError(f"services not ready after {timeout:.0f}s: {[c.name for c in pending]}")
        time.sleep(0.05)
    return None
