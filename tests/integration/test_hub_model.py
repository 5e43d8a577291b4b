"""A run of a model named by hub id, offline: every service loads the snapshot from the local
huggingface_hub cache (the run's config records the folder), and an absent id stops it at start-up."""

from __future__ import annotations

import json
import shutil

from tests.integration.grpo.test_grpo import rows, run


def test_a_run_by_hub_id_offline_loads_the_cached_snapshot(tmp_path, tiny_model, monkeypatch):
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--meshrl-test--tiny"
    shutil.copytree(tiny_model, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    run_dir = tmp_path / "run"
    r = run(
        tmp_path, "*.model=meshrl-test/tiny", f"run_dir={run_dir}", "total_steps=2", "rollout.eval_every=0"
    )
    assert r.returncode == 0, r.stderr[-4000:]
    assert len(rows(run_dir / "metrics.jsonl")) == 2
    groups = json.loads((run_dir / "config.json").read_text())["recipe"]["groups"]
    assert {g["config"]["model"] for g in groups} == {str(repo / "snapshots" / commit)}
    r = run(tmp_path, "*.model=meshrl-test/absent")
    assert r.returncode == 2 and "fetch it with `hf download meshrl-test/absent`" in r.stderr
