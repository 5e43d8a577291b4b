"""`meshrl run RECIPE [--devices N] [key=value ...]`: one host, one command.

Validates the recipe and plans it before anything starts (a bad recipe fails here with every problem
listed), then starts one launcher per device slot through torchrun. On CPU a device is a virtual slot.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

from meshrl.recipe import RecipeError, load_recipe
from meshrl.topology import Device, devices_needed, plan


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="meshrl run", description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe", help="recipe file (a Python file with recipe() -> Recipe)")
    ap.add_argument("--devices", type=int, default=None, help="device slots (default: what the recipe needs)")
    ap.add_argument("overrides", nargs="*", help="key=value, e.g. trainer.lr=1e-5 total_steps=50")
    args = ap.parse_args(argv)
    t0 = time.time()
    try:
        recipe = load_recipe(args.recipe, args.overrides)
        n = args.devices or max(1, devices_needed(recipe))
        plan(recipe, [Device(r, "localhost", r) for r in range(n)])
    except RecipeError as e:
        print(f"meshrl run: {e}", file=sys.stderr)
        return 2
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={n}",
        "--max-restarts=0",
        "-m",
        "meshrl.launch",
        args.recipe,
        *args.overrides,
    ]
    env = {**os.environ, "MESHRL_T0": str(t0), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env.setdefault("TORCHELASTIC_ERROR_FILE", os.devnull)
    proc = subprocess.Popen(cmd, env=env)

    def forward(signum: int, _frame: object) -> None:
        proc.send_signal(signum)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    return proc.wait()
