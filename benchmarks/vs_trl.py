"""meshrl against TRL's GRPOTrainer on the same work, side by side in one invocation.

    python benchmarks/vs_trl.py --json                  # the demo's task: tiny model, 16 x 8, 100 steps
    python benchmarks/vs_trl.py --task smollm --json    # grpo_smollm: SmolLM2-135M, 8 x 4, 64 tokens, 20 steps
    python benchmarks/vs_trl.py --trl-first --json      # the same, TRL's run first (the machine warms up)

Both sides start from the same model (the demo's supervised warm start, or SmolLM2-135M-Instruct) and get
what the recipe gives meshrl: its training rows (prompt text or the chat template with its system prompt)
in the order meshrl's feed draws them (TRL's `shuffle_dataset` off; checked at the end against the samples
meshrl logged, so step k of each side trains on the same prompts), its reward functions and weights (one
function per reward call, so both sides see the same weighted sum), prompts x samples per step,
temperature (no top-k / top-p), completion length, learning rate and schedule (meshrl's, warm-up
included: transformers' own spends the first step at lr 0), AdamW, gradient clipping, optimizer steps
per step (the recipe's `mini_batches`, micro-batches accumulated as the recipe's `memory.micro_batch`
says), the seed. TRL's other defaults stand (its "dapo" loss: a token mean over each optimizer step's
tokens, as meshrl's `token-mean`; group-std reward scaling, as meshrl's GRPO but with the sample std,
which scales every advantage of a group of 4 by 0.87; clip 0.2; no KL), except two it sets for GPUs that
would cost it time or precision on a CPU: `gradient_checkpointing` (off, as meshrl) and `bf16` (off: both
train in float32). TRL needs the `compare` extra (`pip install -e '.[compare]'`); the benchmark installs
it when missing.

meshrl runs as `meshrl run <recipe>` (its services as processes, no evaluation during the run); TRL in
one process (this script, `--trl-side`). Each side's model after training is saved and scored by the same
code, `meshrl eval` on the recipe's held-out rows, with `--eval-samples` sampled answers per row
(T = recipe temperature) and one greedy: the warm start too, once.

Keys: `meshrl_samples_per_s`, `trl_samples_per_s` (samples trained over the training loop's wall time:
meshrl's from its first step to its last, TRL's `train_runtime`; start-up and model loading are apart, in
`meshrl_wall_s` / `trl_wall_s`, each side's whole command), `ratio` (meshrl / TRL), `meshrl_step_s_median`,
`trl_step_s_median` (one step = one prompts x samples batch, generated and trained on),
`*_reward_first10` / `*_reward_last10` (mean reward of the first and last 10 steps),
`meshrl_heldout_after`, `trl_heldout_after`, `heldout_before` (share of correct sampled answers on the
held-out rows), `heldout_answers` (how many answers each of those counts), `heldout_stderr` (the binomial
standard error of one such share at the larger of the two: sqrt(p (1 - p) / answers)), and the greedy
accuracies (`*_greedy_after`, `greedy_before`, one answer per held-out row).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
TASKS = {
    "demo": {"recipe": "recipes/grpo_arith.py", "steps": 100},
    "smollm": {"recipe": "recipes/grpo_smollm.py", "steps": 20},
}


def log(msg: str) -> None:
    print(f"[vs_trl] {msg}", file=sys.stderr, flush=True)


def ensure_trl() -> None:
    try:
        import trl  # noqa: F401
    except ImportError:
        log("installing TRL (the compare extra)")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-e", f"{REPO}[compare]"], check=True)


def model_for(task: str, root: Path) -> Path:
    """The model both sides start from: the demo's warm start (built once under `root`) or SmolLM2."""
    if task == "smollm":
        path = REPO / "runs" / "smollm2-135m"
        if not (path / "config.json").exists():
            subprocess.run(
                [sys.executable, "-m", "meshrl.cli", "models", "smollm2-135m"], cwd=REPO, check=True
            )
        return path
    sft = root / "arith-sft"
    if not (sft / "config.json").exists():
        import torch

        from meshrl.commands.demo import SFT_STEPS, warm_start
        from meshrl.models.tiny import build_tiny_model

        torch.set_num_threads(2)
        log(f"building the tiny model and its warm start in {root}")
        warm_start(build_tiny_model(root / "arith-base"), sft, SFT_STEPS, threads=2)
    return sft


def configs(recipe: str, model: Path, steps: int, seed: int) -> tuple[Any, Any, Any, Any]:
    """The recipe at `model`, `steps` and `seed`: (recipe, rollout, inference, trainer configs)."""
    from meshrl.planning import prepare

    rec, _ = prepare(str(REPO / recipe), [f"*.model={model}", f"total_steps={steps}", f"seed={seed}"])
    by_id = {g.id: g.config for g in rec.groups}
    return rec, by_id["rollout"], by_id["inference"], by_id["trainer"]


# --- meshrl ------------------------------------------------------------------------------------------


def run_meshrl(recipe: str, model: Path, steps: int, seed: int, run_dir: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "meshrl.cli", "run", str(REPO / recipe), f"*.model={model}",
           f"run_dir={run_dir}", f"total_steps={steps}", f"seed={seed}", "rollout.eval_size=0"]  # fmt: skip
    log("meshrl: " + " ".join(cmd[2:]))
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"meshrl run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    if len(lines) != steps:
        raise SystemExit(f"meshrl: {len(lines)} metrics lines for {steps} steps")
    step_s = [m["time/step_s"] for m in lines]
    samples = sum(m["samples"] for m in lines)
    return {
        "samples": samples, "train_s": sum(step_s), "step_s": step_s, "wall_s": wall,
        "rewards": [m["reward_mean"] for m in lines], "final": run_dir / "final",
    }  # fmt: skip


# --- TRL ---------------------------------------------------------------------------------------------


class Rewards:
    """The recipe's reward functions as one TRL reward function: their weighted sum (a function's None
    counts 0, as TRL's nansum does), each call's rewards and time kept (TRL calls it once a step)."""

    __name__ = "reward"

    def __init__(self, specs: dict[str, float]) -> None:
        from meshrl.roles.rollout.reward_functions import load

        self.functions = [(f.fn, f.weight, f.batched) for f in load(specs)]  # imported as rollout does
        self.calls: list[tuple[float, list[float]]] = []
        self.prompts: list[list[str]] = []  # each call's prompts, their text (a chat's last message)

    def __call__(self, prompts: list[Any], completions: list[Any], **columns: Any) -> list[float]:
        texts = [p[-1]["content"] if isinstance(p, list) else str(p) for p in prompts]
        self.prompts.append(list(dict.fromkeys(texts)))
        total = [0.0] * len(completions)
        for fn, weight, batched in self.functions:
            if batched:
                values = fn(prompts, completions, **columns)
            else:
                n = len(completions)  # TRL passes more than the rows' columns (its state, the ids)
                listed = {k: v for k, v in columns.items() if isinstance(v, list) and len(v) == n}
                rows = [{k: v[i] for k, v in listed.items()} for i in range(n)]
                values = [fn(p, c, r) for p, c, r in zip(prompts, completions, rows, strict=True)]
            total = [t + weight * (v or 0.0) for t, v in zip(total, values, strict=True)]
        self.calls.append((time.perf_counter(), total))
        return total


def trl_side(spec: dict[str, Any]) -> dict[str, Any]:
    """One TRL GRPOTrainer run of the recipe (in this process); its figures, its model saved."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from meshrl.engines.optim import lr_factor
    from meshrl.roles.rollout.data import load_rows
    from meshrl.roles.rollout.feed import feed_seed, passes

    rec, rollout, inference, trainer = configs(
        spec["recipe"], Path(spec["model"]), spec["steps"], spec["seed"]
    )
    torch.set_num_threads(max(trainer.threads, inference.threads) or torch.get_num_threads())
    train_rows, _ = load_rows(rollout)
    # the prompts meshrl's feed draws, in its order; TRL takes them as they come (shuffle_dataset=False)
    drawn = itertools.chain.from_iterable(passes(len(train_rows), feed_seed(rec.seed, 0)))
    rows = []
    for r in (train_rows[i] for i in itertools.islice(drawn, spec["steps"] * rec.prompts_per_step)):
        prompt = r[rollout.prompt_field]
        if rollout.system_prompt is not None or rollout.chat_template:
            prompt = [{"role": "user", "content": str(prompt)}]
            if rollout.system_prompt is not None:
                prompt.insert(0, {"role": "system", "content": rollout.system_prompt})
        rows.append(
            {"prompt": prompt, **{k: v for k, v in r.items() if k not in ("prompt", "metadata", "_line")}}
        )
    per_step = rec.prompts_per_step * rec.group_size
    mini = per_step // trainer.mini_batches
    accumulate = max(1, math.ceil(mini / trainer.memory.micro_batch))
    if mini % accumulate:
        raise SystemExit(f"TRL: a mini-batch of {mini} does not split into {accumulate} equal micro-batches")
    opt = trainer.optim

    class Trainer(GRPOTrainer):
        def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
            """The recipe's schedule as meshrl's trainer computes it (its warm-up starts at lr /
            warmup_steps, where transformers' starts at 0: one step without an update)."""
            if self.lr_scheduler is None:
                self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
                    optimizer or self.optimizer, lambda step: lr_factor(step, opt, num_training_steps)
                )
            return self.lr_scheduler

    args = GRPOConfig(
        output_dir=spec["out"], use_cpu=True, seed=rec.seed, bf16=False, gradient_checkpointing=False,
        per_device_train_batch_size=mini // accumulate, gradient_accumulation_steps=accumulate,
        steps_per_generation=trainer.mini_batches * accumulate, num_generations=rec.group_size,
        max_steps=spec["steps"] * trainer.mini_batches, max_completion_length=inference.max_new_tokens,
        temperature=rec.temperature, learning_rate=opt.lr, weight_decay=opt.weight_decay, adam_beta1=opt.betas[0],
        adam_beta2=opt.betas[1], max_grad_norm=opt.grad_clip, report_to="none", logging_steps=10**6,
        save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, shuffle_dataset=False,
    )  # fmt: skip
    reward = Rewards(dict(rollout.rewards))
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    trainer_ = Trainer(
        model=model, reward_funcs=reward, args=args, train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
    )  # fmt: skip

    class Ended(TrainerCallback):
        at = 0.0

        def on_train_end(self, *a: Any, **k: Any) -> None:
            Ended.at = time.perf_counter()

    trainer_.add_callback(Ended())
    out = trainer_.train()
    trainer_.save_model(str(Path(spec["out"]) / "final"))
    tokenizer.save_pretrained(str(Path(spec["out"]) / "final"))
    times = [t for t, _ in reward.calls] + [Ended.at]
    rewards = [[round(x, 4) for x in r] for _, r in reward.calls]
    (Path(spec["out"]) / "rewards.json").write_text(json.dumps(rewards))  # per step, as meshrl's samples
    return {
        "samples": per_step * len(reward.calls), "train_s": float(out.metrics["train_runtime"]),
        "step_s": [b - a for a, b in itertools.pairwise(times)],
        "rewards": [statistics.fmean(r) for _, r in reward.calls], "prompts": reward.prompts,
        "chat": isinstance(rows[0]["prompt"], list),
    }  # fmt: skip


def run_trl(recipe: str, model: Path, steps: int, seed: int, out: Path) -> dict[str, Any]:
    spec = {"recipe": recipe, "model": str(model), "steps": steps, "seed": seed, "out": str(out)}
    log(f"TRL: GRPOTrainer, {steps} steps -> {out}")
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    cmd = [sys.executable, __file__, "--trl-side", json.dumps(spec)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"TRL run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if len(result["rewards"]) != steps:
        raise SystemExit(f"TRL: {len(result['rewards'])} reward calls for {steps} steps")
    return {**result, "wall_s": time.perf_counter() - started, "final": out / "final"}


def check_same_prompts(run_dir: Path, trl_prompts: list[list[str]], chat: bool) -> None:
    """Both sides trained on the same prompts at each step: every sample meshrl logged (samples.jsonl, a
    few a step) has one of the prompts TRL's reward function saw at that step (the text, or in a chat
    rendered by the template, its message)."""

    def same(text: str, prompt: str) -> bool:
        return prompt == text or (chat and text in prompt)

    logged = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines() if x.strip()]
    wrong = [r["step"] for r in logged if not any(same(t, r["prompt"]) for t in trl_prompts[r["step"]])]
    if wrong or {r["step"] for r in logged} != set(range(len(trl_prompts))):
        raise SystemExit(f"the sides' prompts differ (steps {sorted(set(wrong))} of {len(trl_prompts)})")


# --- scoring -----------------------------------------------------------------------------------------


def evaluate(recipe: str, model: Path, samples: int, out: Path) -> dict[str, Any]:
    """`meshrl eval` of `model` on the recipe's held-out rows: greedy and `samples` sampled answers each."""
    cmd = [sys.executable, "-m", "meshrl.cli", "eval", str(REPO / recipe), "--model", str(model),
           "--out", str(out), f"rollout.eval_samples={samples}"]  # fmt: skip
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def mean(xs: list[float]) -> float:
    return round(statistics.fmean(xs), 4)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", choices=sorted(TASKS), default="demo")
    ap.add_argument("--steps", type=int, help="steps each side (demo: 100, smollm: 20)")
    ap.add_argument("--seed", type=int, default=0, help="both sides' seed (the recipe's `seed`)")
    ap.add_argument("--eval-samples", type=int, default=10, help="sampled answers per held-out row")
    ap.add_argument("--trl-first", action="store_true", help="run TRL before meshrl")
    ap.add_argument("--root", default=str(REPO / "runs" / "vs_trl"))
    ap.add_argument("--json", action="store_true", help="print one JSON object (progress on stderr)")
    ap.add_argument("--trl-side", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.trl_side:
        print(json.dumps(trl_side(json.loads(args.trl_side))))
        return 0
    ensure_trl()
    task = TASKS[args.task]
    recipe, steps = task["recipe"], args.steps or task["steps"]
    root = Path(args.root) / f"{args.task}-{args.seed}"
    root.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    model = model_for(args.task, Path(args.root))
    results: dict[str, dict[str, Any]] = {}
    order = ("trl", "meshrl") if args.trl_first else ("meshrl", "trl")
    for side in order:
        shutil.rmtree(root / side, ignore_errors=True)  # each side starts afresh (a run directory resumes)
        if side == "meshrl":
            results[side] = run_meshrl(recipe, model, steps, args.seed, root / "meshrl")
        else:
            results[side] = run_trl(recipe, model, steps, args.seed, root / "trl")
        r = results[side]
        log(f"{side}: {r['samples'] / r['train_s']:.1f} samples/s, reward {mean(r['rewards'][:10])} -> "
            f"{mean(r['rewards'][-10:])}")  # fmt: skip
    check_same_prompts(root / "meshrl", results["trl"]["prompts"], results["trl"]["chat"])
    log(f"scoring the warm start and both models: greedy + {args.eval_samples} sampled answers per row")
    before = evaluate(recipe, model, args.eval_samples, root / "eval_before.json")
    scores = {
        s: evaluate(recipe, results[s]["final"], args.eval_samples, root / f"eval_{s}.json") for s in order
    }
    answers = int(before["prompts"]) * args.eval_samples
    worst = max(scores[s]["sampled_accuracy"] for s in order)
    m, t = results["meshrl"], results["trl"]
    out = {
        "task": args.task, "steps": steps, "seed": args.seed, "order": list(order),
        "meshrl_samples_per_s": round(m["samples"] / m["train_s"], 2),
        "trl_samples_per_s": round(t["samples"] / t["train_s"], 2),
        "ratio": round((m["samples"] / m["train_s"]) / (t["samples"] / t["train_s"]), 3),
        "meshrl_step_s_median": round(statistics.median(m["step_s"]), 4),
        "trl_step_s_median": round(statistics.median(t["step_s"]), 4),
        "meshrl_reward_first10": mean(m["rewards"][:10]), "meshrl_reward_last10": mean(m["rewards"][-10:]),
        "trl_reward_first10": mean(t["rewards"][:10]), "trl_reward_last10": mean(t["rewards"][-10:]),
        "heldout_before": before["sampled_accuracy"],
        "meshrl_heldout_after": scores["meshrl"]["sampled_accuracy"],
        "trl_heldout_after": scores["trl"]["sampled_accuracy"],
        "heldout_answers": answers,
        "heldout_stderr": round(math.sqrt(worst * (1 - worst) / answers), 4),
        "greedy_before": before["greedy_accuracy"],
        "meshrl_greedy_after": scores["meshrl"]["greedy_accuracy"],
        "trl_greedy_after": scores["trl"]["greedy_accuracy"],
        "meshrl_wall_s": round(m["wall_s"], 1), "trl_wall_s": round(t["wall_s"], 1),
    }  # fmt: skip
    print(json.dumps(out) if args.json else json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
