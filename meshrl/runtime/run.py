"""`meshrl run RECIPE [--devices N | --devices 0,0,...] [key=value ...]`: one host, one command.

Validates the recipe and plans it before anything starts (a bad recipe fails here with every problem
listed), then runs the launcher in this process, owning every device slot of the host (on CPU a device
is a virtual slot): no torchrun, and no torch in this process (the launch's zygote imports it).
`--devices N` gives the host N device slots, slot i on GPU i; `--devices 0,0` names each slot's GPU, so
that two slots can share one (inference and trainer side by side on a single large GPU; give vLLM a
`inference.vllm.gpu_memory_fraction` that leaves the trainer room).

When a service fails and its group's restart policy is "on-failure", the whole run is started again
from the latest complete checkpoint (or from the start if there is none yet), up to `max_restarts`
times per group with doubling back-off; each restart is appended to <run_dir>/restarts.jsonl.
`--resume` continues a stopped run from its latest checkpoint. A recipe that leaves `base_port` unset
takes a free range of ports on this host (meshrl/runtime/ports.py), so several runs share a machine. Ctrl-C (SIGINT) or SIGTERM stops every
process of the run gracefully, prints one line and exits 130 (143).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from meshrl.dataplane.wire import host_id
from meshrl.planning import prepare
from meshrl.planning.config import RecipeError
from meshrl.planning.topology import Device
from meshrl.runtime import ports
from meshrl.runtime.launch import Interrupted, Launcher, Signals
from meshrl.runtime.peers import Alone
from meshrl.state import checkpoint as ckpt


def main(argv: list[str]) -> int:
    t0 = time.time()
    signals = Signals()  # from here on a Ctrl-C stops the run cleanly, at any point
    ap = argparse.ArgumentParser(prog="meshrl run", description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe", help="recipe file (a Python file with recipe() -> Recipe)")
    ap.add_argument(
        "--devices", type=_device_slots, default=None,
        help="device slots: a count, or each slot's GPU index (0,0: two slots on GPU 0); default: what the "
        "recipe needs",
    )  # fmt: skip
    ap.add_argument(
        "--resume", action="store_true", help="continue from the run directory's latest checkpoint"
    )
    ap.add_argument("overrides", nargs="*", help="key=value, e.g. trainer.optim.lr=1e-5 total_steps=50")
    args = ap.parse_intermixed_args(argv)
    try:
        recipe, topology = prepare(args.recipe, args.overrides, _devices(args))
        devices = list(topology.devices)
        if recipe.base_port is None:  # free ports on this host, recorded as an input of the plan
            args.overrides.append(f"base_port={ports.free_base(topology, devices[0].host)}")
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
    # the services' torch threads: each sets its own; one by default (and a single-threaded zygote)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s launcher %(levelname)s %(message)s")
    launcher: Launcher | None = None
    try:
        restarts: dict[str, int] = {}
        while True:
            signals.check()
            launcher = Launcher(args.recipe, args.overrides, devices, Alone(), signals, t0=t0, resume=resume)
            code = launcher.run()
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
            signals.sleep(delay)
    except RecipeError as e:
        print(f"meshrl run: {e}", file=sys.stderr)
        return 2
    except Interrupted as e:
        stopped = launcher.stopped if launcher is not None else 0
        print(f"[meshrl] interrupted: stopped {stopped} services; run directory {run_dir}",
              file=sys.stderr, flush=True)  # fmt: skip
        return 128 + e.signum


def _device_slots(text: str) -> list[int]:
    """`--devices`: "N" -> GPUs [0, ..., N-1]; "0,0,1" -> those GPUs, one per slot."""
    try:
        gpus = list(range(int(text))) if "," not in text else [int(g) for g in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"a count or comma-separated GPU indices, not {text!r}") from None
    if not gpus or min(gpus) < 0:
        raise argparse.ArgumentTypeError(f"at least one slot, GPU indices >= 0, not {text!r}")
    return gpus


def _devices(args: argparse.Namespace) -> list[Device] | None:
    """The host's device slots: as asked for (slot r on GPU args.devices[r]), else (None) as many as the
    recipe needs."""
    if args.devices is None:
        return None
    return [Device(r, host_id(), gpu) for r, gpu in enumerate(args.devices)]


def _failed(run_dir: Path) -> tuple[str, str]:
    """(group, service) of the failure the launcher recorded, or ("", "") if none did."""
    try:
        failure = json.loads((run_dir / "failure.json").read_text())
        return str(failure.get("group") or ""), str(failure.get("service") or "")
    except (OSError, ValueError):
        return "", ""
