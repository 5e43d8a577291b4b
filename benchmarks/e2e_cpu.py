"""End-to-end CPU benchmark: a real run of a recipe through `meshrl run`, measured from the outside.

    python benchmarks/e2e_cpu.py --json                      # recipes/grpo_arith.py, 40 steps
    python benchmarks/e2e_cpu.py --steps 100 --prompts 64 --json
    python benchmarks/e2e_cpu.py --recipe ppo_arith --json  # + critic and reference services
    python benchmarks/e2e_cpu.py --recipe opd_arith --json  # + a teacher (on-policy distillation)
    python benchmarks/e2e_cpu.py --engine vllm --json      # vLLM generating (needs the vllm extra), and
                                                           # the HF engine on the same recipe as baseline
    python benchmarks/e2e_cpu.py --sinks --json            # every tracker on (TensorBoard, W&B offline,
                                                           # MLflow), and the run with none as baseline
    python benchmarks/e2e_cpu.py --recipe grpo_smollm --steps 10 --json   # a real model (SmolLM2-135M)
    python benchmarks/e2e_cpu.py --eval-cost --json        # evaluating every 5 versions vs never, same run
    python benchmarks/e2e_cpu.py --recipe grpo_smollm --async-vs-sync --json   # grpo_smollm_async vs it

Builds the tiny model and its supervised warm start (as `make run` does; for a recipe with a teacher,
also the teacher: a longer supervised run of `--teacher-sft-steps`), or for a recipe on a real model
fetches that (`meshrl models`, cached), runs the recipe as separate
processes, samples the resident memory of the whole process tree every 0.2 s, and reads the trainer's
metrics.jsonl. Steady state excludes the first `--warmup` steps.

- samples_per_s: samples trained per second of steady-state wall time;
- median_step_s: median time between gate rows;
- startup_s: from the command to every service ready (printed by the launcher);
- reward_first10 / reward_last10: mean reward of the first and last 10 steps;
- peak_rss_mb: peak of the summed RSS of every process of the run (shared pages counted per process;
  peak_pss_mb counts them once);
- overhead_fraction: share of steady-state step time outside generation, forward/backward and
  optimizer steps (queue traffic, weight sync, waiting, bookkeeping);
- teacher_agreement_first10 / _last10 (recipes with a teacher): share of response tokens where the
  student's most likely token is the teacher's, first and last 10 steps; teacher_kl_first10 / _last10
  the forward KL from the teacher's top-k;
- heldout_greedy_before / _after, heldout_sampled_before / _after: the run's first and last
  evaluation (eval.jsonl);
- value_loss_first10 / _last10 (a critic service or a trainer value head), explained_variance_first10 /
  _last10 (value head).

With `--eval-cost` the recipe runs twice in the invocation, evaluating every 5 versions and never:
step_s_eval_every_5, step_s_no_eval (medians) and eval_step_ratio, their ratio (an evaluation off the
critical path costs ~nothing in lock-step: inference generates it while the trainer trains). With
`--async-vs-sync` (a recipe with an `_async` variant) both run: sync_median_step_s,
async_median_step_s, async_speedup (sync / async seconds per step), and each run's held-out greedy
accuracy gain (sync_heldout_gain, async_heldout_gain: after - before).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from meshrl.commands.demo import SFT_STEPS

REPO = Path(__file__).resolve().parent.parent


def build_models(root: Path, sft_steps: int, teacher_steps: int = 0) -> tuple[Path, Path | None]:
    """(the student / policy, the teacher if `teacher_steps`)."""
    import torch

    from meshrl.commands.demo import warm_start
    from meshrl.models.tiny import build_tiny_model

    torch.set_num_threads(2)
    base = build_tiny_model(root / "base")
    warm_start(base, root / "sft", sft_steps, threads=2)
    if not teacher_steps:
        return root / "sft", None
    warm_start(base, root / "teacher", teacher_steps, threads=2)
    return root / "sft", root / "teacher"


REAL_MODELS = {"grpo_smollm": "smollm2-135m", "grpo_smollm_async": "smollm2-135m"}
"""Recipes that train a real pretrained model instead of the tiny one: the `meshrl models` name."""


def real_model(root: Path, name: str) -> Path:
    from meshrl.models.fetch import main as models

    models([name, "--out", str(root / name)])
    return root / name


def teacher_groups(recipe: str) -> list[str]:
    from meshrl.planning.recipe import load_recipe
    from meshrl.roles.teacher.config import TeacherConfig

    r = load_recipe(REPO / "recipes" / f"{recipe}.py")
    return [g.id for g in r.groups if isinstance(g.config, TeacherConfig)]


class MemoryWatch:
    """Peak summed RSS / PSS of a process and all its descendants."""

    def __init__(self, pid: int) -> None:
        self.root = psutil.Process(pid)
        self.peak_rss = self.peak_pss = 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.done.is_set():
            rss = pss = 0
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.NoSuchProcess:
                break
            for p in procs:
                try:
                    info = p.memory_full_info()
                    rss += info.rss
                    pss += getattr(info, "pss", info.rss)
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    pass
            self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)
            self.done.wait(0.2)

    def stop(self) -> None:
        self.done.set()
        self.thread.join()


def run(
    args: argparse.Namespace, model: Path, run_dir: Path, teacher: Path | None = None
) -> dict[str, object]:
    overrides = [f"*.model={model}", f"run_dir={run_dir}", f"total_steps={args.steps}"]
    overrides += [f"{gid}.model={teacher}" for gid in teacher_groups(args.recipe)] if teacher else []
    if args.engine != "hf":
        overrides.append(f"inference.engine={args.engine}")
    if args.window != "1":
        overrides.append(f"rollout.window={args.window}")
    if args.prompts:
        overrides.append(f"prompts_per_step={args.prompts}")
    overrides += args.set
    if args.sinks:
        overrides += ["log.tensorboard=true", "log.wandb.project=e2e-cpu", "log.wandb.mode=offline",
                      "log.mlflow.experiment=e2e-cpu"]  # fmt: skip
    cmd = [sys.executable, "-m", "meshrl.cli", "run", str(REPO / "recipes" / f"{args.recipe}.py"), *overrides]
    t0 = time.time()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=run_dir.parent
    )
    watch = MemoryWatch(proc.pid)
    out, err = proc.communicate()
    watch.stop()
    wall = time.time() - t0
    if proc.returncode != 0:
        raise SystemExit(f"run failed ({proc.returncode}):\n{err[-4000:]}")
    ready = re.search(r"service processes ready in ([0-9.]+)s", out)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    steady = metrics[min(args.warmup, len(metrics) - 1) :]  # a short run (--steps 5): its last steps
    step_s = sum(m["time/step_s"] for m in steady)
    compute = sum(m["time/generate_s"] + m["time/forward_backward_s"] + m["time/optimizer_s"] for m in steady)
    samples = sum(m["samples_per_s"] * m["time/step_s"] for m in steady)
    return {
        "samples_per_s": round(samples / step_s, 1),
        "median_step_s": round(statistics.median(m["time/step_s"] for m in steady), 4),
        "startup_s": float(ready.group(1)) if ready else None,
        **first_last(metrics, "reward_mean", "reward"),
        "peak_rss_mb": round(watch.peak_rss / 2**20, 1),
        "peak_pss_mb": round(watch.peak_pss / 2**20, 1),
        "overhead_fraction": round(max(0.0, 1.0 - compute / step_s), 4),
        "time_split_s": {
            k: round(statistics.median(m[f"time/{k}_s"] for m in steady), 4)
            for k in ("generate", "forward_backward", "optimizer", "sync", "wait")
        },
        **critic_figures(run_dir, args.warmup),
        **value_head_figures(metrics),
        **teacher_figures(metrics),
        **heldout_figures(run_dir),
        "steps": len(metrics),
        "wall_s": round(wall, 1),
        "recipe": args.recipe,
        "window": args.window,
        "engine": args.engine,
        "prompts_per_step": args.prompts or "recipe default",
    }


def heldout_figures(run_dir: Path) -> dict[str, object]:
    """Greedy and sampled held-out accuracy (and reward) at the run's first and last evaluation."""
    path = run_dir / "eval.jsonl"
    evals = [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []
    if not evals:
        return {}
    out: dict[str, object] = {}
    for when, e in (("before", evals[0]), ("after", evals[-1])):
        for kind in ("greedy", "sampled"):
            if f"{kind}_accuracy" in e:  # by the recipe's correctness check
                out[f"heldout_{kind}_{when}"] = round(e[f"{kind}_accuracy"], 4)
            out[f"heldout_{kind}_reward_{when}"] = round(e[f"{kind}_reward"], 4)
    return out


def critic_figures(run_dir: Path, warmup: int) -> dict[str, object]:
    """For recipes with a critic: its median step time (busy) and value loss at the start and end."""
    path = run_dir / "critic.jsonl"
    if not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line]
    busy = [r["time/forward_backward_s"] + r["time/optimizer_s"] for r in rows[warmup:]]
    return {
        "critic_busy_s": round(statistics.median(busy), 4) if busy else None,
        **first_last(rows, "value_loss"),
    }


def first_last(rows: list[dict], key: str, name: str | None = None) -> dict[str, float]:
    """`<name>_first10` and `<name>_last10`: the mean of `key` over the first and the last 10 rows."""
    values = [r[key] for r in rows]
    return {
        f"{name or key}_first10": round(sum(values[:10]) / len(values[:10]), 4),
        f"{name or key}_last10": round(sum(values[-10:]) / len(values[-10:]), 4),
    }


def value_head_figures(metrics: list[dict]) -> dict[str, object]:
    """For recipes whose trainer has a value head: value loss and explained variance, first and last 10."""
    if "value_loss" not in metrics[0]:
        return {}
    return {**first_last(metrics, "value_loss"), **first_last(metrics, "explained_variance")}


def teacher_figures(metrics: list[dict]) -> dict[str, object]:
    """For recipes with a teacher: the student's agreement with it and KL to it, first and last 10."""
    if "teacher_agreement" not in metrics[0]:
        return {}
    return {**first_last(metrics, "teacher_agreement"), **first_last(metrics, "teacher_kl")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--recipe", default="grpo_arith", help="a recipe under recipes/ (without .py)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the steady state")
    ap.add_argument("--window", default="1", help="rollout pacing window: 1, k, or None")
    ap.add_argument("--prompts", type=int, default=0, help="prompts per step (0: the recipe's)")
    ap.add_argument(
        "--engine", default="hf", help="inference engine: hf or vllm (then hf runs too, as baseline)"
    )
    ap.add_argument("--sft-steps", type=int, default=SFT_STEPS)
    ap.add_argument("--teacher-sft-steps", type=int, default=150, help="for recipes with a teacher")
    ap.add_argument("--set", action="append", default=[], help="extra key=value overrides")
    ap.add_argument("--sinks", action="store_true", help="every experiment tracker on; baseline: none")
    ap.add_argument("--eval-cost", action="store_true", help="eval_every=5 vs no evaluation, same invocation")
    ap.add_argument("--async-vs-sync", action="store_true", help="the recipe's _async variant vs the recipe")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="meshrl-e2e-") as tmp:
        root = Path(tmp)
        teachers = teacher_groups(args.recipe)
        if args.recipe in REAL_MODELS:
            model, teacher = real_model(root / "models", REAL_MODELS[args.recipe]), None
        else:
            model, teacher = build_models(
                root / "models", args.sft_steps, args.teacher_sft_steps if teachers else 0
            )
        os.makedirs(root / "work", exist_ok=True)
        result = run(args, model, root / "work" / "run", teacher)
        if args.engine != "hf":  # the HF engine on the same recipe and models, in this same invocation
            base = run(
                argparse.Namespace(**{**vars(args), "engine": "hf"}), model, root / "work" / "hf", teacher
            )
            result["baseline_hf"] = {k: base[k] for k in ("samples_per_s", "median_step_s", "startup_s",
                                                          "reward_first10", "reward_last10", "peak_rss_mb")}  # fmt: skip
            result["ratio_vs_hf"] = round(float(result["samples_per_s"]) / float(base["samples_per_s"]), 3)  # type: ignore[arg-type]
        if args.sinks:  # the same run without trackers, in this same invocation
            base = run(
                argparse.Namespace(**{**vars(args), "sinks": False}), model, root / "work" / "plain", teacher
            )
            result["baseline_no_sinks"] = {k: base[k] for k in ("samples_per_s", "median_step_s", "overhead_fraction",
                                                                "peak_rss_mb")}  # fmt: skip
            result["sinks_overhead_delta"] = round(
                float(result["overhead_fraction"]) - float(base["overhead_fraction"]), 4
            )  # type: ignore[arg-type]
        if args.eval_cost:  # evaluating every 5 versions vs never, in this same invocation
            quiet = run(argparse.Namespace(**{**vars(args), "set": [*args.set, "rollout.eval_every=0"]}), model,
                        root / "work" / "quiet", teacher)  # fmt: skip
            every = run(argparse.Namespace(**{**vars(args), "set": [*args.set, "rollout.eval_every=5"]}), model,
                        root / "work" / "every5", teacher)  # fmt: skip
            result["step_s_no_eval"], result["step_s_eval_every_5"] = (
                quiet["median_step_s"],
                every["median_step_s"],
            )
            result["eval_step_ratio"] = round(
                float(every["median_step_s"]) / float(quiet["median_step_s"]), 3
            )  # type: ignore[arg-type]
        if args.async_vs_sync:  # the recipe's bounded-async variant, in this same invocation
            fast = run(argparse.Namespace(**{**vars(args), "recipe": f"{args.recipe}_async"}), model,
                       root / "work" / "async", teacher)  # fmt: skip
            result["sync_median_step_s"], result["async_median_step_s"] = (
                result["median_step_s"],
                fast["median_step_s"],
            )
            result["async_speedup"] = round(float(result["median_step_s"]) / float(fast["median_step_s"]), 3)  # type: ignore[arg-type]
            for name, r in (("sync", result), ("async", fast)):
                if "heldout_greedy_after" in r:
                    result[f"{name}_heldout_gain"] = round(
                        float(r["heldout_greedy_after"]) - float(r["heldout_greedy_before"]), 4
                    )  # type: ignore[arg-type]
            result["async"] = {
                k: fast[k] for k in ("samples_per_s", "median_step_s", "reward_first10", "reward_last10")
            }
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
