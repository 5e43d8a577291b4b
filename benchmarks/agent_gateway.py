"""Agent programs through the endpoint against the same work through the environment service.

    python benchmarks/agent_gateway.py --json

Two runs of real services and data plane with simulated generation (4 inference replicas, batches of
up to 8, 1 ms per decoding step, lognormal turn lengths with median 30 tokens) and simulated tools
(lognormal waits, median 50 ms, 99th percentile ~2 s; 2-8 model turns per trajectory), one after the
other in this invocation: recipes/agent_sim.py (the environment service steps every trajectory, writing
turn rows itself) and recipes/agent_program_sim.py (the same work as an agent program calling the model
over HTTP: every call rendered by the endpoint, written as a row, answered as JSON, and the session's
calls joined into one sample afterwards).

- requests_per_s: the endpoint's calls per second, first trajectory start to last finish;
- added_latency_ms_p50, added_latency_ms_p99: per call, the program's time for the HTTP call less the
  time the endpoint waited from writing the row to having its answer (which a service writing the turn
  row itself waits too): HTTP both ways, rendering, parsing, the client;
- generation_busy: the share of the endpoint run's time the inference replicas spend generating;
- ratio_vs_env_service: trajectories per second through the endpoint / through the environment service
  (target >= 0.8); env_service_trajectories_per_s, trajectories_per_s beside it;
- segments_per_trajectory: sequences per trained sample (1.0: every call joined the one before).

Measured here (2 shared CPU cores, the default 12 steps: 1536 trajectories each run, 1 m 27 s in all),
with the simulated tool's 2.5 s timeout in both runs (meshrl/tasks/sim.py): requests_per_s 209.5,
added_latency_ms_p50 16.6, p99 478, generation_busy 0.89 (the environment service's run: 0.935),
ratio_vs_env_service 0.94 (41.5 against 44.0 trajectories/s), segments 1.0. Before that timeout the
drain behind the slowest tool call dominated both runs (generation_busy 0.77 and 0.74, ratio 1.04).
The added latency is mostly waiting for a CPU: on 2 cores the agents process (512 programs, the openai
client's parsing), the endpoint and 4 simulated replicas share them; the p99 is the end of the run,
when the last programs' calls queue behind the final batch.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ENV_RECIPE, PROGRAM_RECIPE = REPO / "recipes" / "agent_sim.py", REPO / "recipes" / "agent_program_sim.py"
REPLICAS = 4

AGENTS_LINE = re.compile(
    r"agents: (\{.*?\}); \d+ trajectories, \d+ turns, ([\d.]+) s from the first start to the last finish"
)
GEN_LINE = re.compile(r"([\d.]+) s busy over ([\d.]+) s from the first batch")


def run(recipe: Path, model: Path, work: Path, name: str, steps: int, *overrides: str) -> Path:
    run_dir = work / name
    cmd = [sys.executable, "-m", "meshrl.cli", "run", str(recipe), f"*.model={model}", f"run_dir={run_dir}",
           f"total_steps={steps}", *overrides]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=work)
    if proc.returncode != 0:
        raise SystemExit(f"the {name} run failed:\n{proc.stderr[-4000:]}")
    return run_dir / "logs"


def busy(logs: Path, span: float) -> float:
    found = [m for p in logs.glob("inference-*.log") if (m := GEN_LINE.search(p.read_text()))]
    return sum(float(m.group(1)) for m in found) / (REPLICAS * span)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--steps", type=int, default=12, help="training steps of 128 trajectories (each run)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="meshrl-agent-gateway-") as tmp:
        from meshrl.models.tiny import build_tiny_model

        work = Path(tmp)
        model = build_tiny_model(work / "model")  # only its tokenizer and chat template are used
        env_logs = run(ENV_RECIPE, model, work, "env", args.steps)
        (env,) = [m for p in env_logs.glob("agents-*.log") if (m := AGENTS_LINE.search(p.read_text()))]
        env_n, env_span = json.loads(env.group(1).replace("'", '"'))["finished"], float(env.group(2))
        record = work / "calls.jsonl"
        logs = run(PROGRAM_RECIPE, model, work, "endpoint", args.steps,
                   f'agents.args={{"record": "{record}"}}')  # fmt: skip
        (agents,) = [m for p in logs.glob("agents-*.log") if (m := AGENTS_LINE.search(p.read_text()))]
        counts, span = json.loads(agents.group(1).replace("'", '"')), float(agents.group(2))
        calls = [c for line in record.read_text().splitlines() for c in json.loads(line)]
        generation_busy, env_busy = busy(logs, span), busy(env_logs, env_span)
    added = sorted(1000 * (total - waited) for total, waited in calls)
    n = counts["finished"]
    result = {
        "requests_per_s": round(counts["turns"] / span, 1),
        "added_latency_ms_p50": round(statistics.median(added), 2),
        "added_latency_ms_p99": round(added[int(0.99 * (len(added) - 1))], 2),
        "generation_busy": round(generation_busy, 3),
        "ratio_vs_env_service": round((n / span) / (env_n / env_span), 3),
        "segments_per_trajectory": round(
            1 + counts.get("splits", 0) / max(n - counts.get("failed", 0), 1), 3
        ),
        "trajectories_per_s": round(n / span, 2),
        "env_service_trajectories_per_s": round(env_n / env_span, 2),
        "env_service_generation_busy": round(env_busy, 3),
        "trajectories": n,
        "failed": counts.get("failed", 0),
    }
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
