"""The simulated pipeline: many inference replicas on 2 cores, every sample accounted for, pacing honoured."""

from __future__ import annotations

import pytest

from tests.integration.grpo.test_grpo import REPO, rows, run

SIM = str(REPO / "recipes" / "pipeline_sim.py")
STEPS, SAMPLES = 4, 16 * 8


# The window bounds when generation starts (version >= batch - window + 1); a straggling group that is
# ready only after the next batch's groups is trained one step later, so window 2 allows staleness 2.
@pytest.mark.parametrize(("window", "max_staleness"), [("1", 0), ("2", 2), ("none", STEPS)])
def test_every_step_trains_a_full_batch_within_the_window(tmp_path, tiny_model, window, max_staleness):
    run_dir = tmp_path / "run"
    r = run(
        tmp_path,
        f"*.model={tiny_model}",
        f"run_dir={run_dir}",
        f"total_steps={STEPS}",
        "inference.replicas=4",
        f"rollout.window={window}",
        "inference.sim.median_tokens=20",
        recipe=SIM,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = rows(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(STEPS))
    assert all(m["samples"] == SAMPLES for m in metrics), [m.get("samples") for m in metrics]
    assert max(m["staleness_max"] for m in metrics) <= max_staleness
