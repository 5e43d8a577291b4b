"""`meshrl demo` (what `make run` runs): watch a tiny model learn arithmetic by reinforcement.

1. builds a ~1M-parameter model with a character tokenizer (runs/arith-base), locally;
2. gives it a short supervised warm start (runs/arith-sft): `meshrl sft` on the train split's problems
   with their answers (runs/arith-sft.jsonl), enough to answer in the right form and sometimes right;
3. runs `meshrl run recipes/grpo_arith.py`: inference, rollout and trainer as separate processes joined
   by the data plane, synchronous GRPO for 100 steps, with a progress bar;
4. prints the reward per step and greedy / sampled accuracy on held-out problems before and after.

`meshrl demo vlm` does the same for a vision-language model on generated pictures (demo_vlm.py).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

SFT_STEPS = 52
SFT_ARGS = ("--batch", "40", "--eval-fraction", "0", "memory.micro_batch=40", "optim.lr=3e-3",
            "optim.warmup_steps=10", "optim.schedule=cosine")  # fmt: skip
"""The warm start's settings: two steps an epoch over the 80 train problems, a high learning rate (a
~1M-parameter model), cosine decay to 0 at the last step; every problem trained on (the run's held-out
problems are what measure it)."""


def warm_start(base: Path, out: Path, steps: int = SFT_STEPS, *, seed: int = 0, threads: int = 1) -> dict:
    """`meshrl sft` of `base` on the arithmetic train split's demonstrations (written next to `out`, as
    `<out>.jsonl`), saved to `out`; its figures. The caller's torch threads are left as they were."""
    import torch

    from meshrl.commands.sft import load, train
    from meshrl.tasks import arith, write_jsonl

    data = out.parent / f"{out.name}.jsonl"
    write_jsonl(data, arith.demonstrations(arith.split()[0]))
    before = torch.get_num_threads()
    try:
        argv = ["--model", str(base), "--data", str(data), "--out", str(out), "--steps", str(steps),
                "--seed", str(seed), "--threads", str(threads), *SFT_ARGS]  # fmt: skip
        result = train(load(argv))
    finally:
        torch.set_num_threads(before)
    assert result is not None  # one rank
    return result


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="meshrl demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", nargs="?", choices=("arith", "vlm"), default="arith",
                    help="arith: a tiny model learns addition; vlm: a tiny vision-language model learns "
                    "to name the colour of the largest shape in a picture")  # fmt: skip
    ap.add_argument("--steps", type=int, help="GRPO steps (arith: 100, vlm: 120)")
    ap.add_argument("--sft-steps", type=int, help="supervised warm-start steps (arith: 52, vlm: 60)")
    ap.add_argument("--root", default="runs", help="where models and the run directory go")
    ap.add_argument("--recipe", help="arith: recipes/grpo_arith.py, vlm: recipes/grpo_vlm.py")
    ap.add_argument(
        "--seed", type=int, default=0, help="vlm: the model's, the warm start's and the run's seed"
    )
    ap.add_argument("--json", action="store_true", help="vlm: progress on stderr, one JSON object on stdout")
    args = ap.parse_args(argv)
    if args.mode == "vlm":
        from meshrl.commands import demo_vlm

        args.steps = demo_vlm.STEPS if args.steps is None else args.steps
        args.sft_steps = demo_vlm.SFT_STEPS if args.sft_steps is None else args.sft_steps
        return demo_vlm.main(args)
    if args.json or args.seed:
        ap.error("--json and --seed are the vlm mode's")
    args.steps = 100 if args.steps is None else args.steps
    args.sft_steps = SFT_STEPS if args.sft_steps is None else args.sft_steps
    args.recipe = args.recipe or "recipes/grpo_arith.py"
    root = Path(args.root)
    base, sft, run_dir = root / "arith-base", root / "arith-sft", root / "grpo_arith"
    if not Path(args.recipe).exists():
        print(f"meshrl demo: recipe {args.recipe} not found (run from the repository root)", file=sys.stderr)
        return 2

    import torch

    torch.set_num_threads(2)
    from meshrl.models.tiny import build_tiny_model

    if not (base / "config.json").exists():
        print(f"[demo] building a tiny model in {base}", flush=True)
        build_tiny_model(base)
    if not (sft / "config.json").exists():
        print(f"[demo] supervised warm start: meshrl sft, {args.sft_steps} steps -> {sft}", flush=True)
        result = warm_start(base, sft, args.sft_steps, threads=2)
        print(
            f"[demo] warm start done: loss {result['train_loss_first']:.3f} -> {result['train_loss_last']:.3f}"
        )
    cmd = [sys.executable, "-m", "meshrl.cli", "run", args.recipe, f"*.model={sft}", f"run_dir={run_dir}",
           f"total_steps={args.steps}"]  # fmt: skip
    print(f"[demo] {' '.join(cmd[2:])}", flush=True)
    code = run_to_end(cmd)
    if code != 0:
        return code
    report(run_dir)
    return 0


def run_to_end(cmd: list[str], stdout: Any = None) -> int:
    """Run `cmd` (a `meshrl run`) to its end and return its exit code; Ctrl-C reaches the run too, which
    stops every service and says so, so the demo waits for it rather than leaving it behind."""
    proc = subprocess.Popen(cmd, stdout=stdout)
    while True:
        try:
            return proc.wait()
        except KeyboardInterrupt:
            continue


def report(run_dir: Path) -> None:
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines() if line]
    print("\nreward per step (mean over the step's samples):")
    for i in range(0, len(metrics), 10):
        chunk = metrics[i : i + 10]
        print(
            f"  steps {chunk[0]['step']:>3}-{chunk[-1]['step']:<3} "
            + " ".join(f"{m['reward_mean']:.2f}" for m in chunk)
        )
    if evals:
        first, last = evals[0], evals[-1]
        print("\nheld-out accuracy (correct answers)   before   after")
        print(
            f"  greedy                             {first['greedy_accuracy']:.2f}     {last['greedy_accuracy']:.2f}"
        )
        print(
            f"  sampled (T=1)                      {first['sampled_accuracy']:.2f}     {last['sampled_accuracy']:.2f}"
        )
        if "sampled_stderr" in last:  # the sampled share counts many answers per problem: its spread
            print(
                f"  (sampled: {last['sampled_answers']} answers to {first['prompts']} problems, standard error "
                f"{first['sampled_stderr']:.2f} before, {last['sampled_stderr']:.2f} after; greedy: one each)"
            )
    n = min(10, len(metrics) // 2)
    if n:
        early = sum(m["reward_mean"] for m in metrics[:n]) / n
        late = sum(m["reward_mean"] for m in metrics[-n:]) / n
        print(f"\nmean reward, first {n} steps {early:.3f} -> last {n} steps {late:.3f}")
    print(f"run directory: {run_dir} (metrics.jsonl, eval.jsonl, logs/, final/)")
