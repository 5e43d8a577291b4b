"""Hybrid (co-process) colocation: trainer and inference in one process, one copy of the weights."""

from __future__ import annotations

import json

from meshrl.dataplane.ledger import account
from tests.integration.grpo.test_grpo import REPO, rows, run

HYBRID = str(REPO / "recipes" / "grpo_arith_hybrid.py")
DISAGGREGATED = str(REPO / "recipes" / "grpo_arith.py")


def test_hybrid_trains_on_the_same_samples_as_the_disaggregated_run(tmp_path, arith_model):
    """Same seed, same samples: rewards and lengths agree exactly at every step, losses within 1e-6.
    (Not bitwise: the trainer's float32 forward runs in a thread of a process that also runs inference,
    and its last bits differ from those of a process of its own; the samples do not.)"""
    out = {}
    for name, recipe in (("hybrid", HYBRID), ("split", DISAGGREGATED)):
        run_dir = tmp_path / name
        r = run(tmp_path, f"*.model={arith_model}", f"run_dir={run_dir}", "total_steps=6",
                "rollout.eval_every=3", recipe=recipe)  # fmt: skip
        assert r.returncode == 0, r.stderr[-4000:]
        out[name] = rows(run_dir / "metrics.jsonl")
    hybrid_dir = tmp_path / "hybrid"
    # one OS process hosts both services (its log is the first member's)
    pids = json.loads((hybrid_dir / "pids-0.json").read_text())
    assert "inference-0-0" in pids and "trainer-0-0" not in pids
    assert not (hybrid_dir / "offload").exists()  # nothing to hand over between processes
    for h, s in zip(out["hybrid"], out["split"], strict=True):
        assert (h["reward_mean"], h["response_len_mean"]) == (s["reward_mean"], s["response_len_mean"])
        assert abs(h["loss"] - s["loss"]) < 1e-6 and h["version"] == s["version"]
    tally = account(hybrid_dir / "ledger.jsonl")
    assert (tally.consumed, tally.duplicated) == (6 * 128, 0)
    assert (hybrid_dir / "final" / "config.json").exists()
