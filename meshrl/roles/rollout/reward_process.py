"""Reward functions that asked to run in a process of their own (`meshrl.rewards.in_process`).

A worker is `python -m meshrl.roles.rollout.reward_process`: a fresh interpreter (no fork of rollout's
threads, no re-import of the parent's main module) that reads calls from stdin and writes results to
stdout, one length-prefixed pickle each: `(module:function, args, kwargs)` in, `(ok, value or error)`
out. Its main thread runs the function, so signal-based time limits (math-verify's) work. Rollout
keeps a few workers; a call past its time limit ends its worker, and the next call starts a new one.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import pickle
import struct
import sys
from typing import Any

_LEN = struct.Struct("<Q")


class ProcessPool:
    """Up to `size` worker processes, started when first needed, each running one call at a time."""

    def __init__(self, size: int) -> None:
        self.idle: list[asyncio.subprocess.Process] = []
        self.slots = asyncio.Semaphore(size)

    async def call(self, spec: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """`spec(*args, **kwargs)` in a worker. Cancelled (a time limit), it ends that worker."""
        async with self.slots:
            proc = self.idle.pop() if self.idle else await _start()
            try:
                assert proc.stdin is not None and proc.stdout is not None
                data = pickle.dumps((spec, args, kwargs))
                proc.stdin.write(_LEN.pack(len(data)) + data)
                await proc.stdin.drain()
                (n,) = _LEN.unpack(await proc.stdout.readexactly(_LEN.size))
                ok, value = pickle.loads(await proc.stdout.readexactly(n))
            except BaseException:
                _kill(proc)
                raise
            self.idle.append(proc)
        if not ok:
            raise value
        return value

    def close(self) -> None:
        for proc in self.idle:
            _kill(proc)
        self.idle = []


async def _start() -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "meshrl.roles.rollout.reward_process",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env={**os.environ},
    )  # fmt: skip


def _kill(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.kill()


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
