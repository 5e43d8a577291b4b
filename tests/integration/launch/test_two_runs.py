"""Two runs on one host: a recipe without a base port takes free ports; a port or run directory another
run holds is a one-line error naming that run; `meshrl eval` works beside a run."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.integration.launch.test_launcher import (
    COUNTER,
    REPO,
    assert_all_gone,
    free_port_base,
    meshrl,
    started_pids,
)

SLOW = ["consumer.delay_s=0.25"]  # the counter's 200 rows take ~8 s to read: the runs overlap


def start(run_dir: Path, *overrides: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "meshrl.cli", "run", COUNTER, f"run_dir={run_dir}", *SLOW, *overrides],
        cwd=run_dir.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip


def wait_ready(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        if "service processes ready" in line:
            return
    raise AssertionError(f"the run ended before it was ready:\n{proc.stderr.read() if proc.stderr else ''}")


def base_port(run_dir: Path) -> int:
    overrides = json.loads((run_dir / "config.json").read_text())["overrides"]
    return next(int(o.split("=")[1]) for o in overrides if o.startswith("base_port="))


def test_two_runs_without_a_base_port_share_the_host(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    first = start(a)
    wait_ready(first)
    second = start(b)
    wait_ready(second)
    assert first.poll() is None  # both at once
    assert first.wait(timeout=120) == 0 and second.wait(timeout=120) == 0, second.stderr.read()  # type: ignore[union-attr]
    assert base_port(a) != base_port(b)  # each chose its own free range and recorded it
    assert_all_gone({**started_pids(a), **started_pids(b)})


def test_a_port_another_run_holds_is_one_line_naming_that_run(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    base = free_port_base()
    first = start(a, f"base_port={base}")
    try:
        wait_ready(first)
        r = meshrl("run", COUNTER, f"run_dir={b}", f"base_port={base}", cwd=tmp_path)
        assert r.returncode == 2
        assert (
            f"base_port: port {base} (the data plane's controller) is in use by the meshrl run in {a}"
            in r.stderr
        ), r.stderr
        assert "Traceback" not in r.stderr
        # the same run directory as a live run: refused before anything of that run is touched
        r = meshrl("run", COUNTER, f"run_dir={a}", cwd=tmp_path)
        assert r.returncode == 2 and f"run_dir: {a} is in use by the meshrl run of pid" in r.stderr, r.stderr
        assert first.wait(timeout=120) == 0
        assert (a / "ledger.jsonl").exists()
    finally:
        if first.poll() is None:
            first.send_signal(signal.SIGINT)
            first.wait(timeout=60)


def test_meshrl_eval_beside_a_run(tmp_path, tiny_model):
    run_dir = tmp_path / "run"
    run = subprocess.Popen(
        [sys.executable, "-m", "meshrl.cli", "run", str(REPO / "recipes" / "grpo_arith.py"), f"*.model={tiny_model}",
         f"run_dir={run_dir}", "total_steps=1000", "rollout.eval_every=0"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    try:
        wait_ready(run)
        t0 = time.monotonic()
        r = meshrl("eval", str(REPO / "recipes" / "grpo_arith.py"), f"--model={tiny_model}",
                   "rollout.eval_size=8", "rollout.eval_samples=1", cwd=tmp_path)  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        result = json.loads(r.stdout.strip().splitlines()[-1])
        assert result["prompts"] == 8 and run.poll() is None, (result, time.monotonic() - t0)
        # what each service of the run is doing, and for how long
        status = json.loads(meshrl("status", str(run_dir), "--json", cwd=tmp_path).stdout)
        phases = {s["name"]: s["health"].get("phase", "") for s in status["services"]}
        assert re.search(
            r"(training|waiting for) mini-batch \d/4 of step \d+|publishing version", phases["trainer-0-1"]
        ), phases
        assert re.search(
            r"generating \d+ prompt rows|waiting for prompts|rows wait for version", phases["inference-0-0"]
        ), phases
        assert re.search(r"samples scored|evaluating version", phases["rollout-0-0"]), phases
    finally:
        run.send_signal(signal.SIGINT)
        assert run.wait(timeout=60) == 130
    assert_all_gone(started_pids(run_dir))
