"""Agent programs through the agents service's endpoint against the same work as an environment.

    python benchmarks/agent_gateway.py --json

Two runs of real services and data plane with simulated generation (4 inference replicas, batches of
up to 8, 1 ms per decoding step, lognormal turn lengths with median 30 tokens) and simulated tools
(lognormal waits, median 50 ms, 99th percentile ~2 s, timed out at 2.5 s; 2-8 model turns per
trajectory), one after the other in this invocation: recipes/agent_sim.py (an environment: the agents
service steps every trajectory between its call rows) and recipes/agent_program_sim.py (the same work as
an agent program calling the model through the OpenAI SDK: every call rendered by the endpoint, written
as a row, answered as JSON, and the session's calls joined into one sample at the end).

- requests_per_s: the endpoint's calls per second, first trajectory start to last finish;
- added_latency_ms_p50, added_latency_ms_p99: per call, the program's time for the SDK call less the
  time the endpoint waited from writing the row to having its answer (which an environment's call waits
  too): the SDK, the endpoint's routing, rendering and parsing (target p50 <= 50 ms);
- generation_busy: the share of the program run's time the inference replicas spend generating;
- ratio_vs_env_service: trajectories per second of the program / of the environment (target >= 0.9);
  env_service_trajectories_per_s, trajectories_per_s beside it;
- segments_per_trajectory: sequences per trained sample (1.0: every call joined the one before).

Measured here (2 CPU cores, the default 12 steps: 1536 trajectories each run), two invocations on a
quiet machine: ratio_vs_env_service 0.979 and 1.027 (42.4 / 43.3 and 44.2 / 43.1 trajectories/s),
added_latency_ms_p50 2.2 and 1.8, p99 210 and 137, generation_busy 0.917 and 0.945; with another
engineer's test suite sharing the cores (a stand-in for a slower machine): 0.962-1.031, p50 2.1-2.3 ms.
The program's calls reach the endpoint in-process (httpx's ASGI transport, no socket) and the process
leaves out the SDK's request transform (it re-walks every message of every request; the bytes sent are
the same). Before both, and with the endpoint a service of its own (DELIVERED marks, a second claim),
the same benchmark measured 0.47 with a p50 of 1.6 s here: the agents process was saturated.
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
