"""Reward functions that asked to run in a process of their own (`meshrl.rewards.in_process`).

A worker is `python -m meshrl.roles.rollout.reward_process`: a fresh interpreter (no fork of rollout's
threads, no re-import of the parent's main module) that reads calls from stdin and writes results to
stdout, one length-prefixed pickle each: `(module:function, args, kwargs)` in, `(ok, value or error)`
out. Its main thread runs the function, so signal-based time limits (math-verify's) work. Rollout
keeps a few workers; a call past its time limit ends its worker, and the next call starts a new one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import pickle
import struct
import subprocess
import sys
import threading
from typing import Any

_LEN = struct.Struct("<Q")


class ProcessPool:
    """Up to `size` worker processes, started when first needed, each running one call at a time. The
    pipes are read on threads, so a pool outlives any event loop that used it."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.idle: list[subprocess.Popen[bytes]] = []
        self.io = concurrent.futures.ThreadPoolExecutor(max_workers=size, thread_name_prefix="reward-io")
        self.lock = threading.Lock()
        self.slots: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None

    async def call(self, spec: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """`spec(*args, **kwargs)` in a worker. Cancelled (a time limit), it ends that worker."""
        loop = asyncio.get_running_loop()
        if self.slots is None or self.slots[0] is not loop:  # a semaphore of this loop's
            self.slots = (loop, asyncio.Semaphore(self.size))
        async with self.slots[1]:
            proc = self._take()
            try:
                data = pickle.dumps((spec, args, kwargs))
                ok, value = await loop.run_in_executor(self.io, _roundtrip, proc, data)
            except BaseException:
                _kill(proc)
                raise
            with self.lock:
                self.idle.append(proc)
        if not ok:
            raise value
        return value

    def _take(self) -> subprocess.Popen[bytes]:
        with self.lock:
            while self.idle:
                proc = self.idle.pop()
                if proc.poll() is None:
                    return proc
        cmd = [sys.executable, "-m", "meshrl.roles.rollout.reward_process"]
        return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def close(self) -> None:
        with self.lock:
            idle, self.idle = self.idle, []
        for proc in idle:
            _kill(proc)
        self.io.shutdown(wait=False, cancel_futures=True)


def _roundtrip(proc: subprocess.Popen[bytes], data: bytes) -> tuple[bool, Any]:
    """Send one call, read its answer (on an I/O thread)."""
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(_LEN.pack(len(data)) + data)
    proc.stdin.flush()
    header = proc.stdout.read(_LEN.size)
    if len(header) < _LEN.size:
        raise RuntimeError(f"the reward worker process exited ({proc.poll()})")
    (n,) = _LEN.unpack(header)
    return pickle.loads(proc.stdout.read(n))


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def main() -> None:
    """The worker: calls from stdin, results to stdout, until stdin closes."""
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # a function's prints go to the log, not into the results
    while header := stdin.read(_LEN.size):
        (n,) = _LEN.unpack(header)
        spec, args, kwargs = pickle.loads(stdin.read(n))
        try:
            module, _, name = spec.partition(":")
            reply = (True, getattr(importlib.import_module(module), name)(*args, **kwargs))
        except Exception as e:  # sent back: the sample fails with it
            reply = (False, e)
        try:
            data = pickle.dumps(reply)
        except Exception as e:
            data = pickle.dumps(
                (False, TypeError(f"{spec} returned something that cannot be sent back: {e}"))
            )
        stdout.write(_LEN.pack(len(data)) + data)
        stdout.flush()


if __name__ == "__main__":
    main()
