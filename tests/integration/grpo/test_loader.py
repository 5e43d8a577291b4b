"""The trainer's loader against a real data plane: mini-batches one ahead, nothing lost when it stops,
and a row it cannot prepare stops training with the cause."""

from __future__ import annotations

import time

import pytest
import torch

from meshrl.dataplane import Client, Ragged
from meshrl.planning.wiring import Claim
from meshrl.roles.trainer.config import TrainerConfig
from meshrl.roles.trainer.loader import Loader, MiniBatch
from meshrl.schema import SAMPLES

CFG, GROUP = TrainerConfig(model="unused"), 2
CLAIM = Claim(SAMPLES, "trainer", CFG.columns())


def put_groups(c: Client, groups: range, *, version_width: int = 2) -> None:
    n = 2 * len(groups)
    c.put(
        SAMPLES,
        {
            "prompt": Ragged.from_list([torch.tensor([3, 4])] * n),
            "response": Ragged.from_list([torch.arange(1 + i % 3) + 5 for i in range(n)]),
            "logprobs": Ragged.from_list([torch.full((1 + i % 3,), -0.5) for i in range(n)]),
            "version": torch.zeros((n, version_width), dtype=torch.int64).squeeze(-1),
            "reward": torch.arange(n, dtype=torch.float32),
            "advantage": torch.ones(n),
            "valid": torch.ones(n, dtype=torch.bool),
            "gen_s": torch.zeros(n),
            "gen_batch": torch.zeros(n, dtype=torch.int64),
        },
        meta=[{"group": g} for g in groups for _ in range(2)],
    )


def claim_all(c: Client):
    return c.claim(SAMPLES, "trainer", CFG.columns(), 16, group_size=GROUP, timeout=5.0)


def take(loader: Loader) -> MiniBatch:
    mini = None
    for _ in range(20):
        mini = loader.get(timeout=0.5)
        if mini is not None:
            break
    assert mini is not None, "no mini-batch within 10 s"
    return mini


def test_loader_delivers_in_order_and_hands_back_what_it_claimed_ahead(plane):
    with Client(plane.controller) as c:
        c.create_partition(SAMPLES, 64)
        put_groups(c, range(4))
        loader = Loader(Client(plane.controller, name="loader"), CLAIM, CFG, 2, GROUP)
        first = take(loader)
        assert first.summary["group"].tolist() == [0, 0]
        c.ack(first.batch)  # acknowledged on another connection, as the trainer does
        deadline = time.monotonic() + 10
        while not loader.ready.full() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert loader.ready.full()  # the next one is claimed and packed before it is asked for
        loader.close()  # groups 1 (prepared), 2 (held or in flight) and 3 go back to the pool
        assert sorted(set(claim_all(c).meta_of("group"))) == [1, 2, 3]


def test_a_row_the_loader_cannot_prepare_stops_training_with_its_cause(plane):
    with Client(plane.controller) as c:
        c.create_partition(SAMPLES, 64)
        put_groups(c, range(1), version_width=1)  # "version" without its [first, last] pair
        loader = Loader(Client(plane.controller, name="loader"), CLAIM, CFG, 2, GROUP)
        with pytest.raises(RuntimeError, match="loader failed") as info:
            for _ in range(20):
                loader.get(timeout=0.5)
        assert isinstance(info.value.__cause__, IndexError)
        loader.close()
        assert len(claim_all(c)) == 2  # the claim it failed on is not lost
