"""`meshrl run RECIPE [--devices N] [key=value ...]`: one host, one command.

Validates the recipe and plans it before anything starts (a bad recipe fails here with every problem
listed), then starts one launcher per device slot through torchrun. On CPU a device is a virtual slot.

When a service fails and its group's restart policy is "on-failure", the whole run is started again
from the latest complete checkpoint (or from the start if there is none yet), up to `max_restarts`
times per group with doubling back-off; each restart is appended to <run_dir>/restarts.jsonl.
`--resume` continues a stopped run from its latest checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from meshrl.planning.recipe import RecipeError, load_recipe
from meshrl.planning.topology import Device, devices_needed, plan
from meshrl.state import checkpoint as ckpt


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="meshrl run", description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe", help="recipe file (a Python file with recipe() -> Recipe)")
    ap.add_argument("--devices", type=int, default=None, help="device slots (default: what the recipe needs)")
    ap.add_argument(
        "--resume", action="store_true", help="continue from the run directory's latest checkpoint"
    )
    ap.add_argument("overrides", nargs="*", help="key=value, e.g. trainer.lr=1e-5 total_steps=50")
    args = ap.parse_intermixed_args(argv)
    t0 = time.time()
    try:
        recipe = load_recipe(args.recipe, args.overrides)
        n = args.devices or max(1, devices_needed(recipe))
        plan(recipe, [Device(r, "localhost", r) for r in range(n)])
    except RecipeError as e:
        print(f"meshrl run: {e}", file=sys.stderr)
        return 2
    run_dir = recipe.resolved_run_dir.resolve()
    resume = None
    if args.resume:
        resume = ckpt.latest(run_dir)
        if resume is None:
            print(f"meshrl run: --resume: {run_dir} has no complete checkpoint", file=sys.stderr)
            return 2
    restarts: dict[str, int] = {}
    while True:
        code = _launch(args, n, t0, resume)
        if code == 0:
            return 0
        group, service = _failed(run_dir)
        policy = recipe.group(group).restart if group in {g.id for g in recipe.groups} else None
        if policy is None or policy.mode != "on-failure" or restarts.get(group, 0) >= policy.max_restarts:
            return code
        delay = policy.backoff_s * 2 ** restarts.get(group, 0)
        restarts[group] = restarts.get(group, 0) + 1
        resume = ckpt.latest(run_dir)
        where = f"checkpoint {resume.name}" if resume else "the start (no checkpoint yet)"
        print(f"[meshrl] {service} failed; restart {restarts[group]}/{policy.max_restarts} of group {group} "
              f"in {delay:.1f}s, resuming from {where}", file=sys.stderr, flush=True)  # fmt: skip
        with open(run_dir / "restarts.jsonl", "a") as f:
            f.write(json.dumps({"time": time.time(), "service": service, "group": group,
                                "checkpoint": resume.name if resume else None}) + "\n")  # fmt: skip
        time.sleep(delay)


def _failed(run_dir: Path) -> tuple[str, str]:
    """(group, service) of the failure the launchers recorded, or ("", "") if none did."""
    try:
        failure = json.loads((run_dir / "failure.json").read_text())
        return str(failure.get("group") or ""), str(failure.get("service") or "")
    except (OSError, ValueError):
        return "", ""


def _launch(args: argparse.Namespace, n: int, t0: float, resume: Path | None) -> int:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={n}",
        "--max-restarts=0",
        "-m",
        "meshrl.runtime.launch",
        args.recipe,
        *args.overrides,
    ]
    env = {**os.environ, "MESHRL_T0": str(t0), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env.setdefault("TORCHELASTIC_ERROR_FILE", os.devnull)
    env.pop("MESHRL_RESUME", None)
    if resume is not None:
        env["MESHRL_RESUME"] = str(resume)
    proc = subprocess.Popen(cmd, env=env)

    def forward(signum: int, _frame: object) -> None:
        proc.send_signal(signum)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    return proc.wait()
