"""`meshrl eval`: held-out reward, accuracy (by the correctness check), pass@k and each reward
function's mean of a model or a run's final checkpoint, as one JSON object, with the engine and the
evaluation code of a run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def meshrl_eval(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "meshrl.cli", "eval", str(REPO / "recipes" / "grpo_arith.py"), *args],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip


def test_eval_of_a_run_final_checkpoint_reports_accuracy_pass_at_k_and_each_reward(tmp_path, tiny_model):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "final").symlink_to(tiny_model)
    r = meshrl_eval(tmp_path, "--model", str(tmp_path / "run"), "rollout.eval_samples=2",
                    'rollout.rewards={"meshrl.tasks.arith:reward": 1, "meshrl.rewards:answer_format": 0}',
                    "rollout.correctness=meshrl.tasks.arith:reward", "--out", str(tmp_path / "eval.json"))  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result == json.loads((tmp_path / "eval.json").read_text())
    assert result["model"] == str(tmp_path / "run" / "final") and result["prompts"] == 20
    for key in ("greedy_accuracy", "sampled_accuracy", "pass@2", "greedy_reward", "sampled_reward", "reward/reward",
                "reward/answer_format"):  # fmt: skip
        assert 0 <= result[key] <= 1, key
    assert (
        result["greedy_accuracy"] == result["reward/reward"]
    )  # the arithmetic reward is the correctness check
    again = json.loads(meshrl_eval(tmp_path, f"*.model={tiny_model}", "rollout.eval_samples=2").stdout)
    assert again["greedy_accuracy"] == result["greedy_accuracy"]  # greedy: the same model, the same answers
    assert again["sampled_accuracy"] == result["sampled_accuracy"]  # seeded as a run's evaluation


def test_eval_with_a_bad_setting_fails_at_start_up(tmp_path):
    r = meshrl_eval(tmp_path, "*.model=/nonexistent/model")
    assert r.returncode == 2 and "path '/nonexistent/model' does not exist" in r.stderr


def always_one(prompt, completion, row):
    """A reward every completion earns (a format bonus the model always meets)."""
    return 1.0


def test_accuracy_counts_correct_answers_not_reward(tmp_path, tiny_model):
    """A reward that every completion earns lifts the reward to 1, and not the accuracy: that is the
    correctness check's alone."""
    r = meshrl_eval(tmp_path, f"*.model={tiny_model}", "rollout.eval_samples=2",
                    'rollout.rewards={"tests.integration.test_eval:always_one": 1, "meshrl.tasks.arith:reward": 0}',
                    "rollout.correctness=meshrl.tasks.arith:reward")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["greedy_reward"] == 1.0 and result["sampled_reward"] == 1.0
    assert result["greedy_accuracy"] == result["reward/reward"] < 0.5  # a random-init model: rarely right
