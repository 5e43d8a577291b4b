"""Checkpoints of a whole run, taken at a step boundary without a central controller.

The trainer coordinates, through rows like everything else. After step s (before it publishes version
s), it writes its own state into `<run_dir>/checkpoints/.tmp-<s>/`, then a request row {step: s} into
the `checkpoint` partition. Every stateful service (rollout replicas, the critic) watches that
partition: it stops taking new work at a safe point, writes its state into the same directory, and
answers with a row in `checkpoint_acks`. Once all have answered, the trainer has the data plane
snapshot itself into the directory (metadata, segment bytes and the ledger offset, consistent because
every producer of new work is paused), marks the directory complete, renames it to `step-<s>` and points
`latest` at it, and writes a `done` row: the paused services resume. Stateless services (inference,
reference, reward model) keep running; work they do during the snapshot is either in it or redone. A
row can be caught between such a service's put and its ack: after a restore it is handed to that service
again while its other consumers, seeing the column, may finish and delete it; the service's put then
keeps what is there, or skips the row that is gone (`meshrl/roles/scorer.py: put_missing`).

Resume (`meshrl run ... --resume`, or automatically after a failure under a restart policy): the
controller restores the snapshot (claims in flight become ready again), and every service loads its
state from that checkpoint (`ServiceContext.resume`).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from meshrl.schema import BY, CHECKPOINT, CHECKPOINT_ACKS, STEP

COMPLETE = "COMPLETE"
DONE = "done"


def root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def tmp_dir(run_dir: Path, step: int) -> Path:
    return root(run_dir) / f".tmp-step-{step:08d}"


def latest(run_dir: Path) -> Path | None:
    """The newest complete checkpoint. A directory without its COMPLETE marker (a crash or a full disk
    mid-write) or with an unreadable marker is skipped in favour of the one before."""
    base = root(run_dir)
    if not base.is_dir():
        return None
    for d in sorted(base.glob("step-*"), reverse=True):
        try:
            marker = json.loads((d / COMPLETE).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(marker, dict) and all((d / f).exists() for f in marker.get("files", [])):
            return d
    return None


def commit(tmp: Path, step: int, keep: int) -> Path:
    """Mark `tmp` complete, rename it to step-<step> (atomic) and drop all but the `keep` newest."""
    files = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
    _write_atomic(tmp / COMPLETE, json.dumps({"step": step, "files": files}))
    _fsync_dir(tmp)
    final = tmp.parent / f"step-{step:08d}"
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    done = sorted(final.parent.glob("step-*"))
    for old in done[: max(0, len(done) - keep)]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def save_json(path: Path, obj: Any) -> None:
    _write_atomic(path, json.dumps(obj))


def load_json(path: Path) -> Any:
    return json.loads(path.read_text())


def truncate_jsonl(path: Path, keep: int) -> None:
    """Keep the first `keep` lines of a metrics file (those written before the checkpoint)."""
    if not path.exists():
        return
    lines = path.read_text().splitlines(keepends=True)[:keep]
    _write_atomic(path, "".join(lines))


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Pause:
    """Safe points for an asyncio service's loops: `async with pause.work():` around each piece of work
    that changes state; `checkpoint()` waits until no work is in progress and holds new work back."""

    def __init__(self) -> None:
        self.open = asyncio.Event()
        self.open.set()
        self.busy = 0
        self.idle = asyncio.Event()
        self.idle.set()

    def work(self) -> _Work:
        return _Work(self)

    async def hold(self) -> None:
        self.open.clear()
        await self.idle.wait()

    def release(self) -> None:
        self.open.set()


class _Work:
    def __init__(self, pause: Pause) -> None:
        self.pause = pause

    async def __aenter__(self) -> None:
        await self.pause.open.wait()
        self.pause.busy += 1
        self.pause.idle.clear()

    async def __aexit__(self, *exc: object) -> None:
        self.pause.busy -= 1
        if self.pause.busy == 0:
            self.pause.idle.set()


async def take_part(
    client: Any,
    name: str,
    pause: Pause,
    save: Callable[[Path], Awaitable[None] | None],
    reach: Callable[[int], Awaitable[None]] | None = None,
) -> None:
    """A stateful asyncio service's side of the protocol: forever, on each request, pause, save into the
    request's directory, answer, and resume once the trainer says the checkpoint is done. `reach(step)`,
    if given, is awaited first (unpaused): a service that trails the trainer catches up to the step."""
    import torch

    from meshrl.dataplane.aio import WATCH_S  # (the launcher imports this module: no torch at the top)

    while True:
        batch = await client.claim(CHECKPOINT, name, [STEP], 16, timeout=WATCH_S)
        if not batch:
            continue
        for step, meta in zip(batch.tensor(STEP).tolist(), batch.meta or [], strict=True):
            meta = meta or {}
            if meta.get(DONE):
                pause.release()
                continue
            directory = Path(meta["dir"])
            if not directory.is_dir():  # committed (renamed) or abandoned: nothing to answer
                continue
            if reach is not None:
                await reach(step)
            await pause.hold()
            try:
                result = save(directory)
                if result is not None:
                    await result
            except FileNotFoundError:
                if directory.is_dir():
                    raise
                continue  # committed meanwhile without this answer; its `done` row releases the pause
            await client.put(CHECKPOINT_ACKS, {STEP: torch.tensor([step])}, meta=[{BY: name}])
        # Acknowledged once answered: a process killed in between is restarted (in place, or with the
        # run) and answers again; the trainer ignores a second answer. A request that comes back after
        # its checkpoint was committed (from the snapshot, which holds it claimed) finds no directory.
        await client.ack(batch)
