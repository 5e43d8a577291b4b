"""A stateful service killed while it answers a checkpoint request: restarted, it answers again, so the
trainer, which waits for every answer, is never left waiting for a process that no longer exists."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import torch

from meshrl.dataplane import Client
from meshrl.state import checkpoint as ckpt
from tests.conftest import REPO

# One stateful service's side of the protocol; with DIE=1 it is SIGKILLed right after saving its state,
# before its answer.
PART = """
import asyncio, os, signal, sys
from meshrl.state import checkpoint as ckpt
from meshrl.dataplane import AsyncClient

async def main(controller, name, die):
    client = await AsyncClient.connect(controller, name=name)
    def save(directory):
        (directory / f"{name}.json").write_text(str(os.getpid()))
        if die == "1":
            os.kill(os.getpid(), signal.SIGKILL)
    try:
        await ckpt.take_part(client, name, ckpt.Pause(), save)
    finally:
        await client.close()

asyncio.run(main(*sys.argv[1:4]))
"""


def part(controller: str, die: bool) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", PART, controller, "rollout-0-0", "1" if die else "0"], cwd=REPO
    )


def test_a_service_killed_while_answering_a_checkpoint_answers_it_once_restarted(plane, tmp_path):
    with Client(plane.controller) as c:
        c.create_partition(ckpt.CHECKPOINT, 64)
        c.create_partition(ckpt.CHECKPOINT_ACKS, 64)
        tmp = ckpt.tmp_dir(tmp_path, 3)
        tmp.mkdir(parents=True)
        first = part(plane.controller, die=True)
        c.put(ckpt.CHECKPOINT, {"step": torch.tensor([3])}, meta=[{"dir": str(tmp)}])
        assert first.wait(timeout=60) == -signal.SIGKILL
        saved_by = (tmp / "rollout-0-0.json").read_text()
        assert saved_by == str(first.pid)  # it saved, then died before answering
        second = part(plane.controller, die=False)
        try:
            answer = c.claim(ckpt.CHECKPOINT_ACKS, "trainer", ["step"], 4, timeout=60)
            assert answer.tensor("step").tolist() == [3] and answer.meta_of("by") == ["rollout-0-0"]
            assert (tmp / "rollout-0-0.json").read_text() == str(second.pid)  # the successor's state
            c.ack(answer)
            ckpt.commit(tmp, 3, keep=2)
            c.put(ckpt.CHECKPOINT, {"step": torch.tensor([3])}, meta=[{ckpt.DONE: True}])
            # the request and its `done` row are both acknowledged by the successor, answered once
            for _ in range(600):
                [status] = [p for p in c.status().partitions if p.name == ckpt.CHECKPOINT]
                [mine] = [s for s in status.consumers if s.name == "rollout-0-0"]
                if mine.acked == 2 or second.poll() is not None:
                    break
                time.sleep(0.05)
            assert (mine.acked, mine.claimed, mine.ready) == (2, 0, 0)
            assert not c.claim(ckpt.CHECKPOINT_ACKS, "trainer", ["step"], 4, timeout=0.5)
        finally:
            second.kill()
            second.wait()
