"""Supervised warm start: teach a model the arithmetic task's answer format before RL.

RL from a random model gets no reward to learn from, so the demo first fine-tunes the tiny model on
correct answers for a few steps, enough that it answers in the right form and is sometimes right,
and then hands over to GRPO to do the rest. This module is that fine-tuning: a short, CPU-sized
training loop over the arithmetic train split, plus `evaluate`, the greedy or sampled accuracy that
the demo and the tests report.

Each example is the prompt, the answer and ``<eos>``; the loss covers the answer and ``<eos>`` only.
Batches are drawn with replacement from the train split by a generator seeded with ``seed``. The
optimiser is AdamW; the learning rate rises linearly over ``warmup`` steps, then follows a cosine down
to zero at ``steps``, and gradients are clipped to norm ``max_grad_norm``. Measured on the tiny model,
both matter: at a constant 3e-3 without clipping, accuracy swings by tens of points between nearby
steps (loss spikes), so the end of a run was a matter of luck; with decay and clipping a run of a
given length ends at a repeatable accuracy, which is what a warm start needs.

For the tiny model at the defaults, a run of 50-60 steps ends with 25-60% greedy accuracy on the
train split (seeds 0-4), leaving RL room to improve; 100 steps give 74-96%, 200 steps about 100%.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from meshrl.engines.checkpoints import carry_over
from meshrl.tasks import arith

IGNORE = -100
"""Label value the loss skips (prompt and padding positions)."""


@dataclass(frozen=True, kw_only=True)
class SFTConfig:
    model: str
    """Checkpoint directory to start from (model and tokenizer, as `save_pretrained` writes them)."""
    out: str
    """Directory to save the trained model and its tokenizer to."""
    steps: int = 200
    """Optimiser steps."""
    batch_size: int = 64
    """Examples per step, drawn with replacement from the train split."""
    lr: float = 3e-3
    """Peak learning rate of AdamW."""
    warmup: int = 10
    """Steps over which the learning rate rises linearly to `lr`; a cosine decay to 0 follows."""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay."""
    max_grad_norm: float | None = 1.0
    """Clip the gradient to this global norm before each step (None: no clipping)."""
    seed: int = 0
    """Seeds the batch sampler (the train/eval split is the task's fixed one)."""
    eval_every: int = 50
    """Measure greedy accuracy (and call `log`) every this many steps, and after the last."""
    chat_template: bool = False
    """Wrap prompts in the tokenizer's chat template (user turn + generation prompt)."""

    def __post_init__(self) -> None:
        _require(Path(self.model).exists(), "model", f"no such path: {self.model!r}")
        _require(bool(self.out), "out", "must be a path")
        _require(self.steps >= 1, "steps", f"must be >= 1, got {self.steps}")
        _require(self.batch_size >= 1, "batch_size", f"must be >= 1, got {self.batch_size}")
        _require(self.lr > 0, "lr", f"must be > 0, got {self.lr}")
        _require(self.warmup >= 0, "warmup", f"must be >= 0, got {self.warmup}")
        _require(self.weight_decay >= 0, "weight_decay", f"must be >= 0, got {self.weight_decay}")
        _require(
            self.max_grad_norm is None or self.max_grad_norm > 0,
            "max_grad_norm",
            f"must be > 0 or None, got {self.max_grad_norm}",
        )
        _require(self.eval_every >= 1, "eval_every", f"must be >= 1, got {self.eval_every}")


def _require(ok: bool, field: str, why: str) -> None:
    if not ok:
        raise ValueError(f"SFTConfig.{field}: {why}")


def prompt_text(tokenizer: PreTrainedTokenizerBase, prompt: str, *, chat_template: bool) -> str:
    """The text the model sees before its answer: the bare prompt, or a chat user turn."""
    if not chat_template:
        return prompt
    messages = [{"role": "user", "content": prompt}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert isinstance(text, str)
    return text


def _ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode_example(
    tokenizer: PreTrainedTokenizerBase, row: dict, *, chat_template: bool
) -> tuple[list[int], list[int]]:
    """(prompt ids, target ids) of one row; the target is the answer followed by EOS."""
    prompt = _ids(tokenizer, prompt_text(tokenizer, row["prompt"], chat_template=chat_template))
    return prompt, [*_ids(tokenizer, row["answer"]), tokenizer.eos_token_id]


def collate(examples: Sequence[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` (targets only; rest `IGNORE`)."""
    width = max(len(p) + len(t) for p, t in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    for i, (prompt, target) in enumerate(examples):
        n = len(prompt) + len(target)
        ids[i, :n] = torch.tensor(prompt + target)
        mask[i, :n] = 1
        labels[i, len(prompt) : n] = torch.tensor(target)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def warmup_cosine(warmup: int, steps: int) -> Callable[[int], float]:
    """Learning-rate multiplier of optimiser step `i` (from 0) of `steps`.

    Linear warm-up ``(i + 1) / warmup`` for the first `warmup` steps, then a half cosine from 1 that
    would reach 0 at step `steps`.
    """

    def factor(i: int) -> float:
        if i < warmup:
            return (i + 1) / warmup
        done = (i - warmup) / max(1, steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, done)))

    return factor


@torch.no_grad()
def _decode_loop(
    model: PreTrainedModel,
    prompts: torch.Tensor,
    eos_id: int,
    max_new_tokens: int,
    gen: torch.Generator | None,
) -> list[list[int]]:
    """New tokens for equal-length `prompts` (no padding), each cut before its first EOS.

    Sampling (``gen`` given) is at temperature 1 over the full vocabulary. The prompts are tiny, so the
    whole sequence is re-run each step instead of keeping a cache.
    """
    seqs = prompts
    done = torch.zeros(len(prompts), dtype=torch.bool, device=prompts.device)
    for _ in range(max_new_tokens):
        logits = model(input_ids=seqs, use_cache=False).logits[:, -1, :].float()
        if gen is None:
            nxt = logits.argmax(dim=-1)
        else:
            nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen).squeeze(1)
        nxt = torch.where(done, torch.full_like(nxt, eos_id), nxt)
        seqs = torch.cat([seqs, nxt[:, None]], dim=1)
        done |= nxt == eos_id
        if bool(done.all()):
            break
    out = []
    for row in seqs[:, prompts.shape[1] :].tolist():
        out.append(row[: row.index(eos_id)] if eos_id in row else row)
    return out


def generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    *,
    greedy: bool = True,
    seed: int = 0,
    max_new_tokens: int = 4,
) -> list[str]:
    """Completions of `prompts` (already formatted), without the EOS; batched by prompt length."""
    eos_id = tokenizer.eos_token_id
    device = next(model.parameters()).device
    gen = None if greedy else torch.Generator(device=device).manual_seed(seed)
    encoded = [_ids(tokenizer, p) for p in prompts]
    by_length: dict[int, list[int]] = {}
    for i, ids in enumerate(encoded):
        by_length.setdefault(len(ids), []).append(i)
    completions = [""] * len(prompts)
    was_training = model.training
    model.eval()
    try:
        for length in sorted(by_length):
            idx = by_length[length]
            batch = torch.tensor([encoded[i] for i in idx], dtype=torch.long, device=device)
            for i, new in zip(idx, _decode_loop(model, batch, eos_id, max_new_tokens, gen), strict=True):
                text = tokenizer.decode(new, skip_special_tokens=False)
                assert isinstance(text, str)
                completions[i] = text
    finally:
        model.train(was_training)
    return completions


def evaluate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: list[dict],
    *,
    greedy: bool = True,
    samples: int = 1,
    seed: int = 0,
    chat_template: bool = False,
    max_new_tokens: int = 4,
) -> float:
    """Mean `arith.reward` over `samples` generations per row (greedy, or sampled at temperature 1)."""
    if not rows or samples < 1:
        raise ValueError("evaluate: needs at least one row and one sample")
    repeated = [row for row in rows for _ in range(samples)]
    prompts = [prompt_text(tokenizer, row["prompt"], chat_template=chat_template) for row in repeated]
    completions = generate(model, tokenizer, prompts, greedy=greedy, seed=seed, max_new_tokens=max_new_tokens)
    scores = [arith.reward(p, c, row) for p, c, row in zip(prompts, completions, repeated, strict=True)]
    return sum(scores) / len(scores)


def load(path: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Model (float32, CPU) and tokenizer of a checkpoint directory."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


def _optimiser(
    model: PreTrainedModel, cfg: SFTConfig
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(cfg.warmup, cfg.steps))


def train(cfg: SFTConfig, log: Callable[[dict], None] | None = None) -> dict:
    """Fine-tune ``cfg.model`` on the arithmetic train split, save it to ``cfg.out``, return metrics.

    `log` receives ``{"step", "loss", "lr", "train_greedy", "eval_greedy", "elapsed_s"}`` every
    ``eval_every`` steps and after the last: that step's loss and learning rate, the accuracies after
    it. The returned dict holds ``loss_first`` and ``loss_last`` (losses of the first and last steps),
    the greedy accuracies ``train_greedy_before``, ``eval_greedy_before``, ``train_greedy_after`` and
    ``eval_greedy_after``, and ``elapsed_s``.
    """
    start = time.monotonic()
    model, tokenizer = load(cfg.model)
    train_rows, eval_rows = arith.split()
    examples = [encode_example(tokenizer, r, chat_template=cfg.chat_template) for r in train_rows]

    def accuracy(rows: list[dict]) -> float:
        return evaluate(model, tokenizer, rows, chat_template=cfg.chat_template)

    result: dict[str, Any] = {
        "train_greedy_before": accuracy(train_rows),
        "eval_greedy_before": accuracy(eval_rows),
    }
    opt, sched = _optimiser(model, cfg)
    gen = torch.Generator().manual_seed(cfg.seed)
    model.train()
    for step in range(1, cfg.steps + 1):
        picks = torch.randint(len(examples), (cfg.batch_size,), generator=gen).tolist()
        loss = model(**collate([examples[i] for i in picks], tokenizer.pad_token_id)).loss
        lr = opt.param_groups[0]["lr"]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        opt.step()
        sched.step()
        result.setdefault("loss_first", loss.item())
        result["loss_last"] = loss.item()
        if step % cfg.eval_every == 0 or step == cfg.steps:
            result["train_greedy_after"] = accuracy(train_rows)
            result["eval_greedy_after"] = accuracy(eval_rows)
            if log is not None:
                log(
                    {
                        "step": step,
                        "loss": loss.item(),
                        "lr": lr,
                        "train_greedy": result["train_greedy_after"],
                        "eval_greedy": result["eval_greedy_after"],
                        "elapsed_s": time.monotonic() - start,
                    }
                )
    model.config.use_cache = True
    model.save_pretrained(cfg.out)
    carry_over(cfg.model, cfg.out)  # the start's generation config, tokenizer files, chat template
    result["elapsed_s"] = time.monotonic() - start
    return result


def _print_progress(row: dict) -> None:
    print(
        f"step {row['step']:>5}  loss {row['loss']:.4f}  lr {row['lr']:.2e}  "
        f"greedy train {row['train_greedy']:.0%}  eval {row['eval_greedy']:.0%}  "
        f"({row['elapsed_s']:.1f}s)",
        flush=True,
    )


def main(argv: list[str]) -> int:
    """``meshrl sft --model PATH --out PATH [...]``: warm-start a model on arithmetic and save it."""
    parser = argparse.ArgumentParser(prog="meshrl sft", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="checkpoint directory to start from")
    parser.add_argument("--out", required=True, help="directory to save the trained checkpoint to")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="0 turns clipping off")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--chat-template", action="store_true", help="wrap prompts in the chat template")
    args = parser.parse_args(argv)
    try:
        cfg = SFTConfig(
            model=args.model,
            out=args.out,
            steps=args.steps,
            lr=args.lr,
            batch_size=args.batch_size,
            warmup=args.warmup,
            weight_decay=args.weight_decay,
            max_grad_norm=args.max_grad_norm or None,
            seed=args.seed,
            eval_every=args.eval_every,
            chat_template=args.chat_template,
        )
    except ValueError as e:
        print(f"meshrl sft: error: {e}", file=sys.stderr)
        return 2
    result = train(cfg, log=_print_progress)
    print(
        f"greedy accuracy  train {result['train_greedy_before']:.0%} -> {result['train_greedy_after']:.0%}  "
        f"eval {result['eval_greedy_before']:.0%} -> {result['eval_greedy_after']:.0%}  "
        f"loss {result['loss_first']:.4f} -> {result['loss_last']:.4f}  ({result['elapsed_s']:.1f}s)"
    )
    print(f"saved to {cfg.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
