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
        meta=[{"group": g, "member": m} for g in groups for m in range(2)],
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


def test_mixed_mini_batches_split_one_claim_at_random_and_give_back_only_the_untrained_rows(plane):
    """mix_groups: the step's rows are claimed at once and split into random parts, each a part of the
    claim acknowledged by its rows; the split is the same in every run of the seed; stopping after the
    first part was trained gives back exactly the rest."""
    from meshrl.roles.trainer.loader import mixed

    with Client(plane.controller) as c:
        c.create_partition(SAMPLES, 64)
        put_groups(c, range(4))  # 8 rows: one step of 4 groups, in 2 mini-batches of 4 rows
        loader = Loader(Client(plane.controller, name="loader"), CLAIM, CFG, 8, GROUP, split=2, seed=7)
        first = take(loader)
        assert first.part and len(first.batch) == 4
        rows = first.summary["reward"].tolist()  # reward = the row's position in the put
        assert len({int(r) // 2 for r in rows}) > 1, rows  # more than one group in the mini-batch
        c.ack(first.batch, first.batch.ids)  # trained: acknowledged by its rows
        loader.close()  # the second part (prepared, untrained) goes back; the first stays consumed
        back = claim_all(c)
        assert sorted(back.tensor("reward").tolist()) == sorted(set(range(8)) - set(rows))
        # the same rows split the same way in whatever order they were claimed, seeded
        parts = mixed(back, 2, 7)
        assert sorted(i for p in parts for i in p) == list(range(4)) and parts == mixed(back, 2, 7)
        backwards = back.select([3, 2, 1, 0])
        rewards = lambda b, p: [sorted(b.tensor("reward")[q].tolist()) for q in p]  # noqa: E731
        assert rewards(backwards, mixed(backwards, 2, 7)) == rewards(back, parts)
