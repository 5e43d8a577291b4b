"""Chaos soak test: a GRPO run on CPU whose services are SIGKILLed at random, N times.

    python benchmarks/chaos.py --kills 20 --json

Runs recipes/grpo_arith.py (checkpoint every step, every group restarting on failure) and, after each
resumed incarnation has trained at least one more step, kills a random service process (trainer,
rollout or inference; seeded). The run must still finish every planned step. Reads the sample ledger
at the end.

- kills: processes killed; resumes: restarts recorded in <run_dir>/restarts.jsonl;
- steps_completed: lines in metrics.jsonl (target: every planned step);
- lost / duplicated: samples produced but never consumed by the trainer / consumed more than once,
  from the ledger (target 0 / 0);
- max_rss_mb_growth: peak summed RSS of the run's processes in the last incarnations minus that of the
  first (a leak across restarts would show here);
- wall_s, steps.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_cpu import REPO, SFT_STEPS, build_models

from meshrl.dataplane.ledger import account

VICTIMS = ("trainer", "rollout", "inference")


def tree_rss(proc: psutil.Process) -> int:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return total


def steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def restarts(run_dir: Path) -> int:
    path = run_dir / "restarts.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def victim_pid(run_dir: Path, victim: str) -> int | None:
    for pids in run_dir.glob("pids-*.json"):
        try:
            entries = json.loads(pids.read_text())
        except ValueError:
            continue
        for name, pid in entries.items():
            if name.startswith(f"{victim}-") and psutil.pid_exists(pid):
                return int(pid)
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--steps", type=int, default=0, help="planned steps (default: 3 per kill + 10)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    steps = args.steps or 3 * args.kills + 10
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="meshrl-chaos-") as tmp:
        root = Path(tmp)
        model, _ = build_models(root / "models", SFT_STEPS)
        run_dir = root / "run"
        restart = [f"{g}.restart.{k}" for g in VICTIMS for k in ("mode=on-failure", f"max_restarts={args.kills}",
                                                                  "backoff_s=0.2")]  # fmt: skip
        cmd = [sys.executable, "-m", "meshrl.cli", "run", str(REPO / "recipes" / "grpo_arith.py"),
               f"*.model={model}", f"run_dir={run_dir}", f"total_steps={steps}", "checkpoint_every=1",
               "rollout.eval_every=0", *restart]  # fmt: skip
        t0 = time.time()
        log = open(root / "run.log", "w")  # noqa: SIM115 (a file, not a pipe: 20 tracebacks overflow a pipe)
        proc = subprocess.Popen(cmd, cwd=root, stdout=log, stderr=subprocess.STDOUT, text=True)
        watch = psutil.Process(proc.pid)
        peaks: list[int] = [0]
        kills, last_kill_step, incarnation = 0, -1, 0
        while proc.poll() is None:
            if restarts(run_dir) != incarnation:
                incarnation = restarts(run_dir)
                peaks.append(0)
            peaks[-1] = max(peaks[-1], tree_rss(watch))
            done = steps_done(run_dir)
            if kills < args.kills and done > last_kill_step + 1 and done < steps - 1:
                victim = rng.choice(VICTIMS)
                pid = victim_pid(run_dir, victim)
                if pid is not None:
                    time.sleep(rng.uniform(0.0, 0.3))  # anywhere inside a step
                    try:
                        os.kill(pid, signal.SIGKILL)
                        kills += 1
                        last_kill_step = done
                    except ProcessLookupError:
                        pass
            time.sleep(0.1)
        proc.wait()
        log.close()
        wall = time.time() - t0
        if proc.returncode != 0:
            raise SystemExit(f"the run failed ({proc.returncode}):\n{(root / 'run.log').read_text()[-4000:]}")
        tally = account(run_dir / "ledger.jsonl")
        first = peaks[0] or peaks[1]
        result = {
            "kills": kills,
            "resumes": restarts(run_dir),
            "steps_completed": steps_done(run_dir),
            "steps": steps,
            "lost": tally.pending,
            "duplicated": tally.duplicated,
            "consumed": tally.consumed,
            "max_rss_mb_growth": round((max(peaks[-3:]) - first) / 2**20, 1),
            "wall_s": round(wall, 1),
        }
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
