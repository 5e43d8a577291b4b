"""Child processes of a launcher: start with a log file, wait until healthy, watch, stop, clean up; the
signals that stop a launch, and its progress line.

A child is either executed (the data-plane servers and the zygote: `subprocess.Popen`) or forked by the
launch's zygote (service processes, see `meshrl/runtime/zygote.py`); both run in a session of their own,
so that stopping one stops everything it started, and a launcher only ever signals the process groups
of children it started. Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from meshrl.runtime.zygote import Forker


@dataclass
class Child:
    name: str
    argv: list[str]
    """The command; for a child forked by `zygote`, the service worker's arguments."""
    log_path: Path
    env: dict[str, str]
    health_port: int | None = None
    zygote: Forker | None = None
    pass_fds: tuple[int, ...] = ()
    proc: subprocess.Popen | None = None
    pid: int = 0
    log: IO[bytes] | None = None
    started: float = field(default_factory=time.monotonic)

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        command = (
            self.argv if self.zygote is None else [sys.executable, "-m", "meshrl.runtime.worker", *self.argv]
        )
        self.log.write(f"\n==== start {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(command)}\n".encode())
        self.log.flush()
        self.started = time.monotonic()
        if self.zygote is not None:  # the zygote's child opens the log itself
            self.pid = self.zygote.spawn(self.name, self.argv, self.env, self.log_path)
            return
        self.proc = subprocess.Popen(
            self.argv,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**self.env, "MESHRL_PARENT": str(os.getpid())},
            start_new_session=True,
            pass_fds=self.pass_fds,
        )
        self.pid = self.proc.pid

    def poll(self) -> int | None:
        """The exit code once the child has ended (as Popen.returncode: -N if killed by signal N)."""
        if self.zygote is not None:
            return self.zygote.returncode(self.pid)
        assert self.proc is not None
        return self.proc.poll()

    def health(self, timeout: float = 1.0) -> dict[str, Any] | None:
        if self.health_port is None:
            return None
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/", timeout=timeout) as r:
                return json.loads(r.read())
        except (OSError, ValueError, http.client.HTTPException):  # not up yet, or going away
            return None

    def tail(self, lines: int = 30) -> str:
        try:
            data = self.log_path.read_bytes()[-16384:].decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(data.splitlines()[-lines:])

    def terminate(self) -> None:
        """SIGTERM to the child's process group, if it runs."""
        if self.pid and self.poll() is None:
            signal_group(self.pid, signal.SIGTERM)

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM the child's process group, SIGKILL what is left after `grace` seconds."""
        if self.pid and self.poll() is None:
            signal_group(self.pid, signal.SIGTERM)
            if not self._wait(grace):
                signal_group(self.pid, signal.SIGKILL)
                self._wait(None)
        if self.pid:
            signal_group(self.pid, signal.SIGKILL)  # grandchildren that outlived their parent
        if self.log is not None:
            self.log.close()
            self.log = None

    def _wait(self, timeout: float | None) -> bool:
        if self.proc is not None:
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                return False
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True


class Interrupted(Exception):
    """SIGINT or SIGTERM reached the launcher; its processes are stopped."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Signals:
    """SIGINT and SIGTERM, recorded by the handler and acted on at the launcher's next wait (never in the
    middle of starting or stopping a process, so nothing started is left untracked)."""

    def __init__(self) -> None:
        self.received = 0
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._record)

    def _record(self, signum: int, _frame: object) -> None:
        self.received = self.received or signum

    def check(self) -> None:
        if self.received:
            raise Interrupted(self.received)

    def sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.check()
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
        self.check()


def stop_all(children: list[Child], grace: float = 10.0) -> int:
    """Stop children together (SIGTERM to all, then wait, SIGKILL what is left after `grace` seconds).
    Returns how many were running."""
    running = [c for c in children if c.pid and c.poll() is None]
    for c in running:
        c.terminate()
    deadline = time.monotonic() + grace
    for c in children:
        c.stop(grace=max(0.0, deadline - time.monotonic()))
    return len(running)


def signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def sweep(directory: str, prefix: str) -> int:
    """Remove the files `directory/prefix*` (a run's shared-memory segments). Returns how many."""
    removed = 0
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            if name.startswith(prefix):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(directory, name))
                    removed += 1
    return removed


def wait_ready(children: list[Child], timeout: float, check: Any = None) -> Child | None:
    """Wait until every child with a health endpoint reports ready (or finished: a short service may exit
    cleanly before its first health probe); the others (a zygote) must stay alive meanwhile. Returns a
    child that failed, if one did. `check()` runs between probes (it raises to give up)."""
    pending = [c for c in children if c.health_port is not None]
    watched = [c for c in children if c.health_port is None]
    deadline = time.monotonic() + timeout
    while pending:
        for c in watched:
            if c.poll() is not None:
                return c
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
        if check is not None:
            check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"services not ready after {timeout:.0f}s: {[c.name for c in pending]}")
        time.sleep(0.05)
    return None
