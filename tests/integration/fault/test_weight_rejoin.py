"""The weight group re-forms around a restarted receiver, and no survivor restarts or hangs.

The test process is the trainer (rank 0); receivers are real processes; the tensors travel by broadcast
or, all on one host, through one shared-memory segment. A receiver killed with SIGKILL
(during a publication, and between publications) is replaced by a fresh process with the same rank:
the publication in flight reaches everyone once the replacement has asked to join, and a replacement
that arrives between publications gets the version already published (`send` again, as the trainer's
watcher does). Every receiver checks the bytes it got.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from meshrl.runtime.weights import WeightGroup, declare_left
from tests.conftest import free_base_port

REPO = Path(__file__).resolve().parents[3]
MANIFEST = [("a", (1000,), "float32"), ("b", (3, 7), "int64")]
BUCKET = 1000  # two buckets: with shared memory, the receivers read the first while the second goes in

RECEIVER = """
import json, os, sys
import torch
from meshrl.runtime.weights import GroupBroken, WeightGroup
port, rank = int(sys.argv[1]), int(sys.argv[2])
group = WeightGroup("127.0.0.1", port, rank, 3, timeout_s=60, name=sys.argv[3] if len(sys.argv) > 3 else None)
print(json.dumps({"joined": group.epoch}), flush=True)
while True:
    header = group.wait()
    if header["version"] < 0:
        break
    got = {}
    try:
        version = group.receive(header, lambda named: got.update({n: t.clone() for n, t in named}))
    except GroupBroken as e:
        print(json.dumps({"broken": header["version"]}), flush=True)
        continue
    ok = bool((got["a"] == version).all() and (got["b"] == version * 10).all())
    print(json.dumps({"version": version, "epoch": header["epoch"], "ok": ok}), flush=True)
os._exit(0)  # as a service leaves (meshrl/runtime/worker.py): no teardown of a group whose store is gone
"""


def tensors(version: int) -> list[torch.Tensor]:
    return [torch.full((1000,), float(version)), torch.full((3, 7), version * 10, dtype=torch.int64)]


def receiver(port: int, rank: int, name: str = "", host: str = "") -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", RECEIVER, str(port), str(rank), *([name] if name else [])], stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO), **({"MESHRL_HOST_ID": host} if host else {})},
    )  # fmt: skip


def line(proc: subprocess.Popen[str]) -> dict[str, object]:
    assert proc.stdout is not None
    text = proc.stdout.readline()
    assert text, f"receiver {proc.pid} exited with {proc.wait()}"
    return dict(json.loads(text))


@pytest.mark.parametrize("transport", ["broadcast", "shm"])
def test_a_killed_receiver_is_replaced_and_the_group_reforms(tmp_path: Path, transport: str) -> None:
    port = free_base_port()
    survivor, lost = receiver(port, 1), receiver(port, 2)
    procs = [survivor, lost]
    shm = (str(tmp_path), "meshrl-test-weights") if transport == "shm" else None
    try:
        group = WeightGroup("127.0.0.1", port, 0, 3, timeout_s=60, shm=shm)
        assert line(survivor) == line(lost) == {"joined": 0}
        group.send(0, MANIFEST, tensors(0), bucket_bytes=BUCKET)
        assert line(survivor) == line(lost) == {"version": 0, "epoch": 0, "ok": True}

        # killed between publications: the next publication fails on it and waits for its replacement
        lost.send_signal(signal.SIGKILL)
        lost.wait()
        sending = threading.Thread(
            target=group.send,
            args=(1, MANIFEST, tensors(1)),
            kwargs={"rejoin_timeout_s": 60, "bucket_bytes": BUCKET},
        )
        sending.start()
        lost = receiver(port, 2)
        procs.append(lost)
        assert line(lost) == {"joined": 1}
        sending.join(timeout=60)
        assert not sending.is_alive()
        seen = line(survivor)
        # the first attempt broke on the survivor (broadcast) or reached it (shared memory: only the
        # trainer's barrier waited for the lost one); either way the version came again in epoch 1
        if seen in ({"broken": 1}, {"version": 1, "epoch": 0, "ok": True}):
            seen = line(survivor)
        assert seen == line(lost) == {"version": 1, "epoch": 1, "ok": True}

        # killed while idle, replaced before the next version: it gets the version already published
        lost.send_signal(signal.SIGKILL)
        lost.wait()
        lost = receiver(port, 2)
        procs.append(lost)
        group.wait_for_change(2)  # what the trainer's watcher thread does
        assert group.changes_pending()
        group.send(1, MANIFEST, tensors(1), bucket_bytes=BUCKET)
        assert line(lost) == {"joined": 2}
        assert line(lost) == line(survivor) == {"version": 1, "epoch": 2, "ok": True}
        assert not group.changes_pending()

        group.send(2, MANIFEST, tensors(2), bucket_bytes=BUCKET)  # and the re-formed group goes on as before
        assert line(lost) == line(survivor) == {"version": 2, "epoch": 2, "ok": True}
        group.close()
        assert survivor.wait(timeout=30) == 0 and lost.wait(timeout=30) == 0
        assert not list(tmp_path.glob("meshrl-test-weights*"))  # the segment goes with the group
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.parametrize("transport", ["broadcast", "shm"])
def test_members_join_and_leave_during_a_publication(tmp_path: Path, transport: str) -> None:
    """The group changes shape while the trainer publishes: a new replica that asks to join during a
    publication gets that version next, in a new epoch; a member that vanishes during one (SIGKILL, not
    restarted) and is declared gone by its launcher does not hang the trainer, and the next epochs go
    on without it; a member drained between publications leaves without a hitch."""
    port = free_base_port()
    stays, vanishes = receiver(port, 1), receiver(port, 2)
    procs = [stays, vanishes]
    shm = (str(tmp_path), "meshrl-test-weights") if transport == "shm" else None
    try:
        group = WeightGroup("127.0.0.1", port, 0, 3, timeout_s=60, shm=shm)
        assert line(stays) == line(vanishes) == {"joined": 0}
        group.send(0, MANIFEST, tensors(0), bucket_bytes=BUCKET)
        assert line(stays) == line(vanishes) == {"version": 0, "epoch": 0, "ok": True}

        # during publication 1: a new member asks to join, another vanishes and is declared gone
        group.post(1, MANIFEST, tensors(1), bucket_bytes=BUCKET)
        joins = receiver(port, 3, "inference-7")  # its rank comes with its epoch
        procs.append(joins)
        asked = group.wait_for_change(1)  # it has asked (the watcher's wait)
        assert asked["join"] == "inference-7"
        vanishes.send_signal(signal.SIGKILL)
        vanishes.wait()
        declare_left("127.0.0.1", port, "rank2")
        group.finish(rejoin_timeout_s=60)  # returns: it never waits for the one that is gone
        if group.changes_pending():  # it reached everyone first (shared memory): the watcher sends it again
            group.send(1, MANIFEST, tensors(1), bucket_bytes=BUCKET)
        assert group.members == ["rank1", "inference-7"] and group.world_size == 3
        assert line(joins) == {"joined": 1}
        seen = line(stays)
        if seen in ({"broken": 1}, {"version": 1, "epoch": 0, "ok": True}):  # the first try, in epoch 0
            seen = line(stays)
        assert seen == line(joins) == {"version": 1, "epoch": 1, "ok": True}

        # drained between publications: its launcher declares it gone once it has ended
        joins.send_signal(signal.SIGTERM)
        joins.wait()
        declare_left("127.0.0.1", port, "inference-7")
        group.send(2, MANIFEST, tensors(2), bucket_bytes=BUCKET, rejoin_timeout_s=60)
        assert group.members == ["rank1"] and group.epoch == 2
        assert line(stays) == {"version": 2, "epoch": 2, "ok": True}
        group.close()
        assert stays.wait(timeout=30) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_a_member_on_another_host_turns_shared_memory_into_a_broadcast_and_back(tmp_path: Path) -> None:
    """Every receiver on the trainer's host: shared memory. A replica of another host joins (`meshrl
    join`): its epochs go by broadcast, to everyone, the bytes read from the segment the version was
    staged in (a join between publications gets the version already published); once it has left, the
    next epoch is shared memory again."""
    port = free_base_port()
    here = [receiver(port, 1), receiver(port, 2)]
    procs = list(here)
    try:
        group = WeightGroup("127.0.0.1", port, 0, 3, timeout_s=60, shm=(str(tmp_path), "meshrl-test-weights"))
        assert [line(p) for p in here] == [{"joined": 0}] * 2
        group.send(0, MANIFEST, tensors(0), bucket_bytes=BUCKET)
        assert [line(p) for p in here] == [{"version": 0, "epoch": 0, "ok": True}] * 2
        away = receiver(port, 3, "inference-2", host="another-host")
        procs.append(away)
        assert group.wait_for_change(1) == {"join": "inference-2", "host": "another-host"}
        group.send(0, MANIFEST, None, bucket_bytes=BUCKET)  # the watcher's re-send: from the segment
        assert not group.shared and group.members == ["rank1", "rank2", "inference-2"]
        assert line(away) == {"joined": 1}
        assert [line(p) for p in [*here, away]] == [{"version": 0, "epoch": 1, "ok": True}] * 3
        group.send(1, MANIFEST, tensors(1), bucket_bytes=BUCKET)
        assert [line(p) for p in [*here, away]] == [{"version": 1, "epoch": 1, "ok": True}] * 3
        away.send_signal(signal.SIGTERM)
        away.wait()
        declare_left("127.0.0.1", port, "inference-2")
        group.send(2, MANIFEST, tensors(2), bucket_bytes=BUCKET)
        assert group.shared and group.members == ["rank1", "rank2"]
        assert [line(p) for p in here] == [{"version": 2, "epoch": 2, "ok": True}] * 2
        group.close()
        assert all(p.wait(timeout=30) == 0 for p in here)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
