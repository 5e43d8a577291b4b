"""Synchronous vs asynchronous pipelines with simulated engines, against the ideal overlap.

    python benchmarks/pipeline_sim.py --json

Runs recipes/pipeline_sim.py (real services and data plane; inference and training replaced by sleeps)
with 16 inference replicas three times: window 1 (sync), window 2 and window None (fully async), then
once fully async with 64 replicas. Generation: lognormal response lengths (median 100 tokens, 99th
percentile ~10x, capped at 1000), 0.5 ms per decoding step of a replica's batch of 8; training: 25 us
per token, so that the synchronous trainer idles about half of the time.

- *_samples_per_s: samples trained per second of steady state (gate-to-gate), measured;
- ideal_speedup: the bottleneck stage's rate over the synchronous rate, from the simulated costs alone
  (expectations of the lognormal lengths computed numerically, no measurement);
- efficiency: measured fully-async speedup over sync divided by ideal_speedup;
- overhead_fraction_64: with 64 replicas (the trainer is the bottleneck), the share of the trainer's
  steady-state time not spent in its simulated step (claims, acks, weight publication, bookkeeping).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "pipeline_sim.py"
PROMPTS, GROUP, BATCH = 16, 8, 8
TOKEN_S, TRAIN_TOKEN_S, MEDIAN, SIGMA, CAP = 0.0005, 25e-6, 100.0, 1.0, 1000


def expected_max(n: int, draws: int = 20000) -> float:
    """E[max of n capped lognormal lengths], the way the simulated engine draws them."""
    rng = random.Random(0)
    mu = math.log(MEDIAN)
    total = 0.0
    for _ in range(draws // n + 1):
        total += max(max(1, min(CAP, round(rng.lognormvariate(mu, SIGMA)))) for _ in range(n))
    return total / (draws // n + 1)


def expected_length(draws: int = 200000) -> float:
    rng = random.Random(1)
    mu = math.log(MEDIAN)
    return sum(max(1, min(CAP, round(rng.lognormvariate(mu, SIGMA)))) for _ in range(draws)) / draws


def ideal(replicas: int) -> dict[str, float]:
    samples = PROMPTS * GROUP
    train_s = samples * expected_length() * TRAIN_TOKEN_S
    sync_step = expected_max(samples) * TOKEN_S + train_s  # every replica finishes, then training
    gen_rate = replicas * BATCH / (expected_max(BATCH) * TOKEN_S)
    train_rate = samples / train_s
    return {
        "sync": samples / sync_step,
        "async": min(gen_rate, train_rate),
        "generation_capacity": gen_rate,
        "training_capacity": train_rate,
    }


def run(model: Path, work: Path, name: str, replicas: int, window: str, steps: int, warmup: int) -> dict:
    run_dir = work / name
    cmd = [sys.executable, "-m", "meshrl.cli", "run", str(RECIPE), f"*.model={model}", f"run_dir={run_dir}",
           f"inference.replicas={replicas}", f"rollout.window={window}", f"total_steps={steps}"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=work)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-4000:]}")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    steady = metrics[warmup:]
    step_s = sum(m["time/step_s"] for m in steady)
    trained = sum(m["samples_per_s"] * m["time/step_s"] for m in steady)
    return {
        "samples_per_s": trained / step_s,
        "trainer_busy": sum(m["time/forward_backward_s"] for m in steady) / step_s,
        "staleness_max": max(m["staleness_max"] for m in metrics),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=4)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="meshrl-sim-") as tmp:
        from meshrl.models.tiny import build_tiny_model

        work = Path(tmp)
        model = build_tiny_model(work / "model")  # only its tokenizer is used
        sync = run(model, work, "sync", 16, "1", args.steps, args.warmup)
        async2 = run(model, work, "async2", 16, "2", args.steps, args.warmup)
        full = run(model, work, "async_full", 16, "None", args.steps, args.warmup)
        wide = run(model, work, "async_full_64", 64, "None", args.steps, args.warmup)
    expect = ideal(16)
    ideal_speedup = expect["async"] / expect["sync"]
    result = {
        "sync_samples_per_s": round(sync["samples_per_s"], 1),
        "async2_samples_per_s": round(async2["samples_per_s"], 1),
        "async_full_samples_per_s": round(full["samples_per_s"], 1),
        "ideal_speedup": round(ideal_speedup, 3),
        "efficiency": round(full["samples_per_s"] / sync["samples_per_s"] / ideal_speedup, 3),
        "overhead_fraction_64": round(1.0 - wide["trainer_busy"], 4),
        "ideal_sync_samples_per_s": round(expect["sync"], 1),
        "ideal_async_samples_per_s": round(expect["async"], 1),
        "async2_speedup": round(async2["samples_per_s"] / sync["samples_per_s"], 3),
        "trainer_busy_sync": round(sync["trainer_busy"], 3),
        "staleness_max": {
            "sync": sync["staleness_max"],
            "async2": async2["staleness_max"],
            "async_full": full["staleness_max"],
        },
    }
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
