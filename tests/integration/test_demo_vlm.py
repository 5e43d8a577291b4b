"""`meshrl demo vlm`, short: it builds the tiny vision-language model, warm-starts it with `meshrl sft` on
image chat rows, runs recipes/grpo_vlm.py through real services and `meshrl eval` on the blanked pictures,
and prints one JSON object with the figures (`--json`). The full demo's figures are in the README."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_demo_vlm_runs_end_to_end_and_reports_json(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "meshrl.cli", "demo", "vlm", "--root", str(tmp_path), "--steps", "2",
           "--sft-steps", "4", "--json"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    (line,) = done.stdout.strip().splitlines()  # progress went to stderr
    figures = json.loads(line)
    assert figures["prompts"] == 200 and figures["steps"] == 2 and figures["sft_steps"] == 4
    for key in ("before", "after", "blank_before", "blank_after", "chance"):
        assert 0.0 <= figures[key] <= 1.0, (key, figures)
    assert set(figures["evals"]) == {"0", "2"} and len(figures["reward"]) == 2
    assert figures["wall_s"] > 0 and figures["chance"] < 0.35
    run = tmp_path / "grpo_vlm"
    assert (run / "final" / "processor_config.json").is_file() or (
        run / "final" / "preprocessor_config.json"
    ).is_file()
    assert (tmp_path / "vlm-sft" / "config.json").is_file() and (tmp_path / "vlm-blank.jsonl").is_file()
    assert "supervised warm start" in done.stderr and "[meshrl] run finished" in done.stderr
