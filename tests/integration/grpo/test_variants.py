"""Each shipped GRPO variant (advantage estimator, loss, DAPO's filters) runs end to end from its recipe."""

from __future__ import annotations

import pytest

from tests.integration.grpo.test_grpo import REPO, rows, run

VARIANTS = ["dr_grpo_arith", "rloo_arith", "reinforce_pp_arith", "gspo_arith", "dapo_arith"]


@pytest.mark.parametrize("name", VARIANTS)
def test_variant_trains(tmp_path, arith_model, name):
    r = run(tmp_path, f"*.model={arith_model}", f"run_dir={tmp_path / 'run'}", "total_steps=3",
            "rollout.eval_every=0", recipe=str(REPO / "recipes" / f"{name}.py"))  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = rows(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2]
    assert all(m["samples"] == 128 and m["grad_norm"] > 0 for m in metrics)
    if name == "dapo_arith":  # dynamic sampling: every trained group carries a signal
        assert all(m["no_signal_fraction"] == 0 for m in metrics)
    else:
        assert any(m["no_signal_fraction"] > 0 for m in metrics)  # what DAPO's filter would remove
