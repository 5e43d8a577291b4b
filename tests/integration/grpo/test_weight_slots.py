"""A replica keeps the versions it receives by shared memory as its weights (no copy), so the trainer
must never write a version's slot while a replica may still read it: a replica that receives while a
batch is in progress passes the barrier of version n+1 with version n still in use."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from meshrl.runtime.weights import WeightGroup
from tests.conftest import free_base_port

MANIFEST = [("a", (64, 32), "float32"), ("b", (1000,), "float32")]


def version(v: int) -> list[torch.Tensor]:
    return [torch.full(shape, float(v)) for _, shape, _ in MANIFEST]


def test_a_kept_version_is_not_written_while_the_next_one_is_received(tmp_path: Path) -> None:
    port = free_base_port()
    groups: dict[int, WeightGroup] = {}
    trainer = threading.Thread(
        target=lambda: groups.setdefault(
            0, WeightGroup("127.0.0.1", port, 0, 2, timeout_s=60, shm=(str(tmp_path), "meshrl-test-w"))
        )
    )
    trainer.start()
    replica = WeightGroup("127.0.0.1", port, 1, 2, timeout_s=60)
    trainer.join()
    kept: dict[int, dict[str, torch.Tensor]] = {}

    def receive(n: int) -> None:
        header = replica.wait()
        assert header["version"] == n
        kept[n] = {}
        replica.receive(header, lambda named: kept[n].update(named))

    for v in range(1, 7):
        send = groups[0].send
        publish = threading.Thread(target=send, args=(v, MANIFEST, version(v)), kwargs={"bucket_bytes": 4096})
        publish.start()
        receive(v)
        publish.join()
        # a replica that passed the barrier of v-1 while a batch ran on v-2 may still read v-2 while v
        # is written (its swap to v-1 waits for the batch): v-2, v-1 and v are intact
        for n in (v - 2, v - 1, v):
            if n in kept:
                assert all(torch.equal(t, torch.full_like(t, float(n))) for t in kept[n].values()), (v, n)
        assert all(t.untyped_storage().data_ptr() != 0 for t in kept[v].values())
    # the tensors are views of the trainer's segments, not copies
    assert not kept[6]["a"].untyped_storage().resizable()
    groups[0].close()
    assert replica.wait()["version"] == -1
