"""A run that changes shape while it runs: inference scaled 1 -> 3 -> 1, one replica lost on the way.

    python benchmarks/elastic.py --json

One `meshrl run` of recipes/pipeline_sim.py (real services and data plane; generation and training
replaced by sleeps), synchronous (rollout.window=1), one inference replica whose group's
restart.mode is "leave". The benchmark drives it as a user would, from outside:

1. one replica: steady-state samples/s over steps [WARM, SCALE_OUT);
2. `meshrl scale RUN inference=3` at step SCALE_OUT; steady-state samples/s over [MEASURE_3, KILL);
3. SIGKILL of one joined replica at step KILL: the run goes on with two, no restart;
4. `meshrl scale RUN inference=1` at step SCALE_IN; the run ends at total_steps.

Keys: samples_per_s_1, samples_per_s_3 (steady state in each phase, from the trainer's step times),
scale_out_ratio (target >= 2.5), join_s (median over the joined replicas: the command to the replica's
first generated row, as `meshrl scale` reports it; target <= 5 s), lost (rows put and never trained, at
the end), duplicated (rows trained or generated twice, by the ledger), whole_run_restarts (the run
restarted as a whole; 0), and each phase's figures. The simulated costs: batches of 4, response lengths
lognormal (median 40 tokens, sigma 0.25), 2 ms a decoding step; training 2 us a token.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "pipeline_sim.py"
WARM, SCALE_OUT, MEASURE_3, KILL, SCALE_IN, TOTAL = 2, 8, 11, 19, 22, 26
SAMPLES = 16 * 8


def steps(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_step(proc: subprocess.Popen[str], run_dir: Path, step: int, log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while len(steps(run_dir)) < step:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the run stopped before step {step}:\n{log.read_text()[-4000:]}")
        time.sleep(0.05)


def rate(metrics: list[dict[str, Any]], first: int, end: int) -> float:
    """Samples trained per second of the trainer's steps [first, end)."""
    window = metrics[first:end]
    return sum(m["samples"] for m in window) / sum(m["time/step_s"] for m in window)


def scale(run_dir: Path, n: int) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "meshrl.cli", "scale", str(run_dir), f"inference={n}", "--json"],
        capture_output=True, text=True, cwd=REPO, timeout=180,
    )  # fmt: skip
    if out.returncode != 0:
        raise SystemExit(f"meshrl scale inference={n} failed: {out.stdout}{out.stderr}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def pid_of(run_dir: Path, name: str) -> int:
    for pids in run_dir.glob("pids-*.json"):
        found = json.loads(pids.read_text()).get(name)
        if found:
            return int(found)
    raise SystemExit(f"no process {name} in {run_dir}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from meshrl.dataplane.ledger import account
    from meshrl.models.tiny import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="meshrl-elastic-") as tmp:
        work = Path(tmp)
        model = build_tiny_model(work / "model")  # only its tokenizer is used
        run_dir, log = work / "run", work / "run.log"
        cmd = [sys.executable, "-m", "meshrl.cli", "run", str(RECIPE), f"*.model={model}", f"run_dir={run_dir}",
               "inference.replicas=1", "inference.restart.mode=leave", "rollout.window=1",
               "inference.max_batch=4", "inference.max_new_tokens=200", "inference.sim.token_s=0.002",
               "inference.sim.median_tokens=40", "inference.sim.sigma=0.25", "trainer.sim.token_s=2e-6",
               f"total_steps={TOTAL}"]  # fmt: skip
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, cwd=work)
            try:
                wait_step(proc, run_dir, SCALE_OUT, log)
                t0 = time.perf_counter()
                out_answer = scale(run_dir, 3)
                scale_out_s = time.perf_counter() - t0
                wait_step(proc, run_dir, KILL, log)
                victim = out_answer["joined"][-1]
                os.kill(pid_of(run_dir, victim), signal.SIGKILL)
                wait_step(proc, run_dir, SCALE_IN, log)
                in_answer = scale(run_dir, 1)
                code = proc.wait(timeout=600)
            finally:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGINT)
                    proc.wait(timeout=60)
        if code != 0:
            raise SystemExit(f"the run failed (exit code {code}):\n{log.read_text()[-4000:]}")
        metrics = steps(run_dir)
        members = json.loads((run_dir / "members.json").read_text())
        restarts_path = run_dir / "restarts.jsonl"
        restarts = (
            [json.loads(x) for x in restarts_path.read_text().splitlines()] if restarts_path.exists() else []
        )
        trained = account(run_dir / "ledger.jsonl", "samples", "trainer")
        generated = account(run_dir / "ledger.jsonl", "samples", "inference")
    one, three = rate(metrics, WARM, SCALE_OUT), rate(metrics, MEASURE_3, KILL)
    join = list(out_answer["join_s"].values())
    vanished = [c for c in members["changes"] if c["why"] == "vanished"]
    result = {
        "samples_per_s_1": round(one, 1),
        "samples_per_s_3": round(three, 1),
        "scale_out_ratio": round(three / one, 3),
        "join_s": round(statistics.median(join), 3),
        "lost": trained.pending + trained.deleted + trained.unknown,
        "duplicated": trained.duplicated + generated.duplicated,
        "whole_run_restarts": sum(1 for r in restarts if not r.get("in_place")),
        "steps": len(metrics),
        "trained": trained.consumed,
        "expected": TOTAL * SAMPLES,
        "samples_per_s_2": round(rate(metrics, KILL + 1, SCALE_IN), 1),
        "samples_per_s_after_scale_in": round(rate(metrics, SCALE_IN + 1, TOTAL), 1),
        "join_s_each": out_answer["join_s"],
        "scale_out_command_s": round(scale_out_s, 3),
        "vanished": [n for c in vanished for n in c["left"]],
        "left": in_answer["gone"],
        "replicas_at_end": members["replicas"]["inference"],
    }
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
