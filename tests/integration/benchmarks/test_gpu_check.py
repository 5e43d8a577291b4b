"""benchmarks/gpu_check.py: its CPU version runs the GPU check's whole path (the model built at a vocabulary
the tokenizer is padded to, the run with bf16-mixed + checkpointing + packing and the coin reward, the
figures read back); without a GPU the GPU check stops with a message."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"


def test_the_gpu_check_runs_its_path_on_cpu(tmp_path: Path) -> None:
    cmd = [sys.executable, str(SCRIPT), "--cpu", "--json", "--steps", "3", "--warmup", "1", "--prompts", "4",
           "--group-size", "4", "--max-new-tokens", "12", "--tokens-per-micro-batch", "128", "--keep", str(tmp_path)]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["engine"] == "hf" and report["steps"] == 3 and report["samples_per_step"] == 16
    assert report["train_tokens_per_s"] > 0 and report["generate_tokens_per_s"] > 0
    assert 0 <= report["kl_behaviour_first"] < 1e-3 and 0 <= report["kl_behaviour_synced"] < 1e-3
    assert report["grad_norm"] > 0  # the coin reward gives real advantages: the weights move
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["version"] for m in metrics] == [1, 2, 3]
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert "bf16-mixed" in json.dumps(config) and "gpu_check:coin" in json.dumps(config)


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a machine with nvidia-smi")
def test_without_a_gpu_the_gpu_check_stops_with_a_message() -> None:
    r = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh")], capture_output=True, text=True)
    assert r.returncode == 2 and "this check needs one GPU" in r.stderr
    r = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env={**os.environ})
    assert r.returncode == 2 and "no CUDA GPU is visible" in r.stderr
