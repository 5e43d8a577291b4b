"""GRPO with inference and trainer taking turns on one device slot, through real services."""

from __future__ import annotations

import pytest

from meshrl.dataplane.ledger import account
from tests.integration.grpo.test_grpo import REPO, rows, run

COLOCATED = str(REPO / "recipes" / "grpo_arith_colocated.py")


def test_colocated_run_takes_turns_and_loses_nothing(tmp_path, arith_model):
    run_dir = tmp_path / "run"
    r = run(tmp_path, f"*.model={arith_model}", f"run_dir={run_dir}", "total_steps=8", "rollout.eval_every=4",
            recipe=COLOCATED)  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    m = rows(run_dir / "metrics.jsonl")
    assert [x["step"] for x in m] == list(range(8))
    assert all(x["time/ring_s"] >= 0 for x in m)
    # both services really offloaded: their parameters (and the trainer's optimizer state) went to files
    sizes = {p.name: p.stat().st_size for p in (run_dir / "offload").iterdir()}
    assert sizes["trainer-0-0.bin"] > 2 * sizes["inference-0-0.bin"] > 0, sizes
    tally = account(run_dir / "ledger.jsonl")
    assert (tally.consumed, tally.duplicated, tally.unknown) == (8 * 128, 0, 0)
    # inference generated each step with the newest weights, restored from its file
    assert all(x["staleness_max"] == 0 for x in m)


@pytest.mark.slow
def test_colocated_grpo_learns_like_the_disaggregated_recipe(tmp_path, arith_model):
    run_dir = tmp_path / "run"
    r = run(tmp_path, f"*.model={arith_model}", f"run_dir={run_dir}", "total_steps=100", recipe=COLOCATED)
    assert r.returncode == 0, r.stderr[-4000:]
    m = rows(run_dir / "metrics.jsonl")
    first = sum(x["reward_mean"] for x in m[:10]) / 10
    last = sum(x["reward_mean"] for x in m[-10:]) / 10
    assert last >= first + 0.12, (first, last)  # the disaggregated run's measure (seeds 0-3: 0.22-0.32)


def test_bounded_async_colocated_with_aborted_generation_loses_nothing(tmp_path, arith_model):
    """Window 2: inference generates the next step while the trainer waits for the devices; asked for
    them mid-batch, it drops the partial completions and regenerates the rows once they are back."""
    run_dir = tmp_path / "run"
    r = run(tmp_path, f"*.model={arith_model}", f"run_dir={run_dir}", "total_steps=10", "rollout.eval_every=0",
            "rollout.window=2", "inference.preempt=abort", recipe=COLOCATED)  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    m = rows(run_dir / "metrics.jsonl")
    assert [x["step"] for x in m] == list(range(10))
    assert all(x["staleness_max"] <= 1 for x in m)
    tally = account(run_dir / "ledger.jsonl")
    assert (tally.consumed, tally.duplicated, tally.unknown) == (10 * 128, 0, 0)
