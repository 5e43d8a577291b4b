"""`meshrl demo vlm`: watch a tiny vision-language model learn to read pictures by reinforcement, on CPU.

1. builds a random-init Idefics3 (the SmolVLM family: a small SigLIP vision tower, a pixel-shuffle
   connector and a Llama language model over the character tokenizer) with its processor
   (runs/vlm-base), locally;
2. gives it a short supervised warm start (runs/vlm-sft): `meshrl sft` on image chat rows of the
   shapes task's train split, each picture with the colour of its largest shape as the answer
   (runs/vlm-sft.jsonl);
3. runs `meshrl run recipes/grpo_vlm.py`: inference, rollout and trainer as separate processes, the
   pictures encoded once by rollout and read as pixels by inference and the trainer, synchronous GRPO;
4. prints greedy accuracy on the held-out pictures before and after (the run's own evaluation), and
   that of the same models with every picture blanked (`meshrl eval` on runs/vlm-blank.jsonl): near
   chance, so the answers come from the pictures.

The vision tower stays frozen as built (random features); the connector and the language model learn.
`--json`: progress goes to stderr and stdout gets one JSON object with the figures.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from meshrl.commands.demo import run_to_end

SFT_STEPS = 60
SFT_BATCH = 32
SFT_ARGS = ("--eval-fraction", "0", "memory.micro_batch=32", "optim.lr=3e-3", "optim.warmup_steps=2",
            "optim.schedule=cosine")  # fmt: skip
"""The warm start's settings: one pass over steps x 32 train pictures, a high learning rate (a ~1M
parameter model), cosine decay to 0 at the last step: it learns the answers' form and about half the
colours; GRPO has the rest to learn."""
STEPS = 120
RECIPE = "recipes/grpo_vlm.py"


def paths(root: Path, seed: int) -> dict[str, Path]:
    """The demo's folders and files under `root` (seed 0: runs/vlm-base, ...; else suffixed -seedN)."""
    tail = "" if seed == 0 else f"-seed{seed}"
    return {
        "base": root / f"vlm-base{tail}",
        "sft": root / f"vlm-sft{tail}",
        "run": root / f"grpo_vlm{tail}",
        "blank": root / "vlm-blank.jsonl",
    }


def warm_start(base: Path, out: Path, steps: int, *, seed: int, threads: int = 2) -> dict[str, Any]:
    """`meshrl sft` of `base` on steps x 32 demonstrations of the shapes train split (written next to
    `out`, as `<out>.jsonl`), saved to `out`; its figures. The caller's torch threads are kept."""
    import torch

    from meshrl.commands.sft import load, train
    from meshrl.tasks import shapes, write_jsonl

    data = out.parent / f"{out.name}.jsonl"
    write_jsonl(data, shapes.demonstrations(shapes.split()[0][: steps * SFT_BATCH]))
    before = torch.get_num_threads()
    try:
        argv = ["--model", str(base), "--data", str(data), "--out", str(out), "--steps", str(steps),
                "--batch", str(SFT_BATCH), "--seed", str(seed), "--threads", str(threads), *SFT_ARGS]  # fmt: skip
        result = train(load(argv))
    finally:
        torch.set_num_threads(before)
    assert result is not None  # one rank
    return result


def blank_accuracy(model: Path, data: Path, recipe: str, out: Path) -> float:
    """Greedy accuracy of `model` on the held-out pictures blanked (`meshrl eval`, its JSON in `out`)."""
    cmd = [sys.executable, "-m", "meshrl.cli", "eval", recipe, "--model", str(model),
           f"rollout.eval_dataset={data}", "rollout.eval_samples=0", "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise SystemExit(f"meshrl demo vlm: {' '.join(cmd[2:])} failed:\n{done.stderr[-3000:]}")
    return float(json.loads(out.read_text())["greedy_accuracy"])


def main(args: Any) -> int:
    """The demo's steps (see the module docstring) with `args` from `meshrl demo`'s parser."""
    t0 = time.perf_counter()
    log = sys.stderr if args.json else sys.stdout
    root, seed = Path(args.root), args.seed
    where = paths(root, seed)
    recipe = args.recipe or RECIPE
    if not Path(recipe).exists():
        print(f"meshrl demo vlm: recipe {recipe} not found (run from the repository root)", file=sys.stderr)
        return 2

    import torch

    torch.set_num_threads(2)
    from meshrl.models.tiny import build_tiny_vlm
    from meshrl.tasks import shapes, write_jsonl

    if not (where["base"] / "config.json").exists():
        print(f"[demo] building a tiny vision-language model in {where['base']}", file=log, flush=True)
        build_tiny_vlm(where["base"], seed=seed)
    sft_s = 0.0
    if not (where["sft"] / "config.json").exists():
        print(
            f"[demo] supervised warm start: meshrl sft, {args.sft_steps} steps -> {where['sft']}",
            file=log,
            flush=True,
        )
        result = warm_start(where["base"], where["sft"], args.sft_steps, seed=seed)
        sft_s = result["wall_s"]
        print(f"[demo] warm start done: loss {result['train_loss_first']:.3f} -> {result['train_loss_last']:.3f} "
              f"({sft_s:.0f} s)", file=log, flush=True)  # fmt: skip
    held_out = shapes.split()[1]
    write_jsonl(where["blank"], [shapes.blank(r) for r in held_out])

    cmd = [sys.executable, "-m", "meshrl.cli", "run", recipe, f"*.model={where['sft']}", f"run_dir={where['run']}",
           f"total_steps={args.steps}", f"seed={seed}"]  # fmt: skip
    print(f"[demo] {' '.join(cmd[2:])}", file=log, flush=True)
    t_run = time.perf_counter()
    code = run_to_end(cmd, stdout=log)
    if code != 0:
        return code
    run_s = time.perf_counter() - t_run
    print("[demo] held-out pictures blanked: meshrl eval of the warm start and of the run's final model",
          file=log, flush=True)  # fmt: skip
    blank_before = blank_accuracy(where["sft"], where["blank"], recipe, where["run"] / "blank-before.json")
    blank_after = blank_accuracy(where["run"], where["blank"], recipe, where["run"] / "blank-after.json")
    figures = summary(where["run"], blank_before, blank_after, shapes.chance(held_out))
    figures |= {"seed": seed, "steps": args.steps, "sft_steps": args.sft_steps, "sft_s": round(sft_s, 1),
                "run_s": round(run_s, 1), "wall_s": round(time.perf_counter() - t0, 1), "run_dir": str(where["run"])}  # fmt: skip
    if args.json:
        print(json.dumps(figures), flush=True)
    else:
        report(figures)
    return 0


def summary(run_dir: Path, blank_before: float, blank_after: float, chance: float) -> dict[str, Any]:
    """The run's figures: held-out greedy accuracy at its first and last evaluation, the blanked
    accuracies, chance, and the training reward per step."""
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines() if line]
    return {
        "before": evals[0]["greedy_accuracy"], "after": evals[-1]["greedy_accuracy"],
        "prompts": evals[-1]["prompts"], "blank_before": blank_before, "blank_after": blank_after,
        "chance": chance, "evals": {e["version"]: e["greedy_accuracy"] for e in evals},
        "reward": [round(m["reward_mean"], 4) for m in metrics],
    }  # fmt: skip


def report(f: dict[str, Any]) -> None:
    reward = f["reward"]
    print("\nreward per step (mean over the step's samples):")
    for i in range(0, len(reward), 10):
        print(
            f"  steps {i:>3}-{min(i + 9, len(reward) - 1):<3} "
            + " ".join(f"{r:.2f}" for r in reward[i : i + 10])
        )
    print(f"\nheld-out greedy accuracy, {f['prompts']} pictures   before   after")
    print(f"  the pictures                            {f['before']:.3f}    {f['after']:.3f}")
    print(f"  the pictures blanked                    {f['blank_before']:.3f}    {f['blank_after']:.3f}")
    print(f"  chance (the most common answer)         {f['chance']:.3f}")
    sft = f"warm start {f['sft_s']:.0f} s" if f["sft_s"] else "warm start already there"
    print(f"\nwall time {f['wall_s']:.0f} s ({sft}, GRPO run {f['run_s']:.0f} s)")
    print(f"run directory: {f['run_dir']} (metrics.jsonl, eval.jsonl, logs/, final/)")
