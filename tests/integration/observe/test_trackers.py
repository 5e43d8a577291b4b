"""Experiment trackers fed by a real run: each one read back with its own reader."""

from __future__ import annotations

import json

import pytest

from tests.integration.grpo.test_grpo import run
from tests.integration.observe import trackers_read

pytest.importorskip("tensorboard")
pytest.importorskip("wandb")
pytest.importorskip("mlflow")


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_tracker_holds_the_runs_metrics_on_one_step_axis(tmp_path, tiny_model, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    run_dir = tmp_path / "run"
    r = run(tmp_path, f"*.model={tiny_model}", f"run_dir={run_dir}", "total_steps=4", "rollout.eval_every=2",
            "log.tensorboard=true", "log.wandb.project=meshrl-test", "log.mlflow.experiment=meshrl-test",
            "log.samples_per_step=3")  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    assert "tracker" not in r.stderr, r.stderr[-4000:]  # no tracker warned
    metrics, evals = lines(run_dir / "metrics.jsonl"), lines(run_dir / "eval.jsonl")
    rewards = [(m["version"], pytest.approx(m["reward_mean"], rel=1e-5)) for m in metrics]
    assert [m["version"] for m in metrics] == [1, 2, 3, 4]

    tb = trackers_read.tensorboard_scalars(run_dir / "tensorboard")
    assert sorted(tb["train/reward_mean"]) == rewards
    assert [s for s, _ in sorted(tb["eval/greedy_accuracy"])] == [e["version"] for e in evals]
    assert {"train/loss", "train/time/step_s", "train/samples_per_s"} <= set(tb)
    assert "dataplane/samples/trainer/ready" in tb  # the backlog, probed by the launcher
    texts = trackers_read.tensorboard_texts(run_dir / "tensorboard")
    assert len(texts) == 4 and all("| prompt |" in t or "prompt" in t.splitlines()[0] for t in texts)

    history = trackers_read.wandb_history(run_dir)
    train = [h for h in history if "train/reward_mean" in h]
    assert [(h["step"], pytest.approx(h["train/reward_mean"], rel=1e-5)) for h in train] == rewards
    assert any("eval/greedy_accuracy" in h for h in history)
    assert len([h for h in history if any(k.startswith("samples") for k in h)]) == 4
    assert len(list(run_dir.glob("wandb/offline-run-*/files/media/table/*.json"))) == 4

    ml = trackers_read.mlflow_metrics(run_dir, "meshrl-test")
    assert sorted(ml["train/reward_mean"]) == rewards
    assert len(ml["eval/greedy_accuracy"]) == len(evals)

    samples = lines(run_dir / "samples.jsonl")
    assert [s["step"] for s in samples] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert all(s["prompt"] and "completion" in s and s["staleness"] == 0 for s in samples)


def test_a_tracker_that_cannot_write_warns_once_and_the_run_goes_on(tmp_path, tiny_model):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "tensorboard").write_text("a file where the tracker wants a folder")
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")
    r = run(tmp_path, f"*.model={tiny_model}", f"run_dir={run_dir}", "total_steps=3", "rollout.eval_every=0",
            "log.tensorboard=true", "log.mlflow.experiment=x", f"log.mlflow.tracking_uri={(blocked / 'store').as_uri()}",
            "log.wandb.project=meshrl-test")  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stderr.count("tracker tensorboard") == 1 and r.stderr.count("tracker mlflow") == 1
    assert "the run goes on without it" in r.stderr
    assert len(lines(run_dir / "metrics.jsonl")) == 3
    assert len([h for h in trackers_read.wandb_history(run_dir) if "train/loss" in h]) == 3
