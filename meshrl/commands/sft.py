"""`meshrl sft --data chats.jsonl`: supervised fine-tuning on chat data, with the trainer's engine.

    meshrl sft --model Qwen/Qwen2.5-0.5B-Instruct --data chats.jsonl --out sft-model --epochs 2

Rows hold OpenAI-style `messages` (and optional `tools`, handed to the chat template), or a `prompt` and
a `completion`; the loss is the mean negative log-likelihood of the assistant messages' (the
completion's) tokens alone (`chat_data.py`: the row formats and how the mask is found). Training is
the RL trainer's engine with a supervised objective (meshrl/engines/supervised.py): the same
micro-batching (rows, or samples packed by tokens), precision, activation checkpointing, LoRA,
AdamW with warm-up and cosine decay, gradient clipping and skipping of non-finite steps. A held-out
share of the rows (`--eval-fraction`) is scored before training, every `--eval-every` steps and at the
end. The result is a Hugging Face folder as a run's final model is (tokenizer and chat template
included), which `meshrl run recipe.py *.model=OUT` starts from (with LoRA: the adapter, and the
merged model in OUT/merged). Progress goes to stderr; stdout gets one JSON object with the figures.

Under torchrun (WORLD_SIZE > 1) every rank takes its share of each step's rows and the model is
sharded with FSDP, as the trainer's is; rank 0 reports and writes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from meshrl.commands.chat_data import DataError, Example, encode, read_rows, to_batch
from meshrl.planning.config import RecipeError


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="meshrl sft", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="model to start from (an HF folder or hub id)")
    ap.add_argument(
        "--data",
        required=True,
        help="rows (messages, or prompt and completion): a .jsonl file, or anything datasets opens",
    )
    ap.add_argument("--out", required=True, help="folder to write the trained model to")
    ap.add_argument("--epochs", type=float, default=1.0, help="passes over the training rows")
    ap.add_argument("--steps", type=int, help="optimizer steps (instead of --epochs)")
    ap.add_argument("--batch", type=int, default=32, help="sequences per optimizer step")
    ap.add_argument("--micro-batch", type=int, default=8, help="sequences per forward/backward")
    ap.add_argument("--pack-tokens", type=int, help="pack sequences into micro-batches of this many tokens")
    ap.add_argument("--lr", type=float, default=2e-5, help="peak learning rate (AdamW)")
    ap.add_argument("--warmup", type=int, help="warm-up steps (default: 3%% of the steps)")
    ap.add_argument("--schedule", choices=("constant", "linear", "cosine"), default="cosine")
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--max-len", type=int, default=2048, help="tokens per sequence; longer ones are cut")
    ap.add_argument("--eval-fraction", type=float, default=0.05, help="share of rows held out (0: none)")
    ap.add_argument("--eval-every", type=int, help="held-out loss every N steps (default: 10 times a run)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--precision", choices=("auto", "fp32", "bf16-mixed"), default="auto",
                    help="auto: bf16-mixed on a GPU, fp32 on CPU")  # fmt: skip
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank (0: full)")
    ap.add_argument("--threads", type=int, help="CPU threads of torch")
    return ap


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    try:
        _check(args)
        result = train(args)
    except (DataError, SettingsError, RecipeError) as e:  # RecipeError: the engine's sections' checks
        print(f"meshrl sft: error: {e}", file=sys.stderr)
        return 2
    if result is not None:
        print(json.dumps(result), flush=True)
    return 0


class SettingsError(ValueError):
    """An argument that cannot work (named in the message)."""


def _check(args: argparse.Namespace) -> None:
    problems = [
        f"--{name}: {why}"
        for name, bad, why in (
            ("batch", args.batch < 1, "must be >= 1"),
            ("micro-batch", args.micro_batch < 1, "must be >= 1"),
            ("pack-tokens", args.pack_tokens is not None and args.pack_tokens < 1, "must be >= 1"),
            ("lr", not args.lr > 0, "must be > 0"),
            ("warmup", args.warmup is not None and args.warmup < 0, "must be >= 0"),
            ("weight-decay", args.weight_decay < 0, "must be >= 0"),
            ("epochs", args.steps is None and not args.epochs > 0, "must be > 0"),
            ("steps", args.steps is not None and args.steps < 1, "must be >= 1"),
            ("max-len", args.max_len < 2, "must be >= 2"),
            ("eval-fraction", not 0 <= args.eval_fraction < 1, "must be in [0, 1)"),
            ("eval-every", args.eval_every is not None and args.eval_every < 1, "must be >= 1"),
            ("lora-rank", args.lora_rank < 0, "must be >= 0"),
        )
        if bad
    ]
    hub_id = re.fullmatch(r"[\w.-]+/[\w.-]+", args.model) is not None
    if not hub_id and not Path(args.model).expanduser().exists():
        problems.append(f"--model: no such path: {args.model!r}")
    if problems:
        raise SettingsError("; ".join(problems))


def split(examples: list[Example], fraction: float, seed: int) -> tuple[list[Example], list[Example]]:
    """(train, held out): a seeded shuffle, the held-out share from its end (at least one row when the
    share is not 0 and there are two rows or more)."""
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    held = 0 if fraction == 0 or len(order) < 2 else max(1, round(len(order) * fraction))
    cut = len(order) - held
    return [examples[i] for i in order[:cut]], [examples[i] for i in order[cut:]]


def batches(n: int, batch: int, steps: int, seed: int) -> Iterator[list[int]]:
    """`steps` batches of row indices: epochs in a fresh seeded order each, `batch` rows a step (the
    last batch of an epoch is smaller; a step never mixes epochs)."""
    rng = random.Random(seed + 1)
    done = 0
    while True:
        order = list(range(n))
        rng.shuffle(order)
        for start in range(0, n, batch):
            if done == steps:
                return
            yield order[start : start + batch]
            done += 1


@dataclass
class Ranks:
    """This process's place: rank and world size (torchrun's, else one rank), and its device."""

    rank: int
    world: int
    device: Any

    def log(self, text: str) -> None:
        """A progress line on stderr, from rank 0 only."""
        if self.rank == 0:
            print(text, file=sys.stderr, flush=True)


def ranks() -> Ranks:
    """Join torchrun's process group when started under it with several ranks (NCCL on GPUs, gloo on
    CPUs), as the trainer's FSDP needs; pick this rank's device."""
    import torch
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    return Ranks(dist.get_rank() if dist.is_initialized() else 0, world, device)


@dataclass
class Data:
    train: list[Example]
    held_out: list[Example]
    read: int
    """Rows read."""
    truncated: int
    """Rows cut at the maximum length."""
    dropped: int
    """Of those, rows left with no assistant token (not trained on)."""
    max_len: int


def load_data(args: argparse.Namespace, tokenizer: Any, model_config: Any) -> Data:
    """The rows encoded and cut at --max-len (or the model's positions, when fewer), split."""
    positions = getattr(model_config, "max_position_embeddings", None)
    max_len = min(args.max_len, positions) if positions else args.max_len
    examples = [encode(tokenizer, row, max_len) for row in read_rows(args.data)]
    kept = [e for e in examples if sum(e.mask[1:]) > 0]
    if not kept:
        raise DataError(f"{args.data}: no row keeps an assistant token within {max_len} tokens")
    train, held_out = split(kept, args.eval_fraction, args.seed)
    truncated = sum(e.truncated for e in examples)
    return Data(train, held_out, len(examples), truncated, len(examples) - len(kept), max_len)


def build_engine(args: argparse.Namespace, steps: int, device: Any) -> Any:
    """The trainer's engine with the supervised objective, as the arguments set it up."""
    import torch

    from meshrl.engines.settings import LoraConfig, MemoryConfig, OptimConfig
    from meshrl.engines.supervised import SupervisedEngine

    gpu = torch.device(device).type == "cuda"
    precision: Literal["fp32", "bf16-mixed"] = (
        args.precision if args.precision != "auto" else "bf16-mixed" if gpu else "fp32"
    )
    warmup = args.warmup if args.warmup is not None else math.ceil(0.03 * steps)
    memory = MemoryConfig(
        micro_batch=args.micro_batch, max_tokens_per_micro_batch=args.pack_tokens, precision=precision,
        activation_checkpointing=args.activation_checkpointing,
    )  # fmt: skip
    return SupervisedEngine(
        args.model,
        OptimConfig(lr=args.lr, schedule=args.schedule, warmup_steps=warmup, weight_decay=args.weight_decay),
        device=device,
        memory=memory,
        lora=LoraConfig(rank=args.lora_rank, save_merged=True) if args.lora_rank else None,
        total_steps=steps,
        seed=args.seed,
    )


def train(args: argparse.Namespace) -> dict[str, Any] | None:
    """Fine-tune as `args` say and save the model; the figures (None on ranks other than 0)."""
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, AutoTokenizer

    t_start = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    me = ranks()
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        model_config = AutoConfig.from_pretrained(args.model)
    except OSError as e:  # neither a model folder nor a hub id in the cache
        raise SettingsError(f"--model {args.model!r}: cannot load it: {e}") from e
    data = load_data(args, tokenizer, model_config)
    if len(data.train) < me.world:
        raise DataError(f"{args.data}: {len(data.train)} training rows for {me.world} ranks")
    steps = args.steps or max(1, math.ceil(math.ceil(len(data.train) / args.batch) * args.epochs))
    every = args.eval_every or max(1, steps // 10)
    engine = build_engine(args, steps, me.device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0

    def batch_of(rows: list[Example], fallback: Example) -> Any:
        """This rank's rows as the engine's batch; a rank without rows still joins the collective
        forwards, with a masked copy of `fallback`."""
        batch = to_batch(rows or [fallback], pad)
        if not rows:
            batch.mask &= False
        return batch

    def held_out_loss() -> float | None:
        if not data.held_out:
            return None
        mine, nll, tokens = data.held_out[me.rank :: me.world], 0.0, 0.0
        for start in range(0, max(len(mine), 1), args.batch):
            n, t = engine.supervised_loss(batch_of(mine[start : start + args.batch], data.held_out[0]))
            nll, tokens = nll + n, tokens + t
        return nll / max(tokens, 1.0)

    if data.max_len < args.max_len:
        me.log(f"--max-len {args.max_len} is past the model's positions: sequences cut at {data.max_len}")
    me.log(
        f"meshrl sft: {len(data.train)} training rows, {len(data.held_out)} held out, {data.truncated} "
        f"cut at {data.max_len} tokens ({data.dropped} of them left with no assistant token); {steps} "
        f"steps of {args.batch}, {me.world} rank(s), {engine.memory.precision} on {me.device.type}"
    )
    before = after = held_out_loss()
    me.log(f"step 0/{steps}  held-out loss {_fmt(before)}")
    losses: list[float] = []
    tokens_seen, skipped, t_train = 0, 0, time.perf_counter()
    for step, rows in enumerate(batches(len(data.train), args.batch, steps, args.seed), 1):
        batch = batch_of([data.train[i] for i in rows[me.rank :: me.world]], data.train[rows[0]])
        tokens_seen += int(engine.all_sum([float(batch.attention_mask.sum())])[0])
        out = engine.update_supervised(batch)
        losses.append(out["loss"])
        skipped += int(out["nan_skipped"])
        if step % every == 0 or step == steps:
            after = held_out_loss()
            rate = tokens_seen / max(time.perf_counter() - t_train, 1e-9)
            me.log(
                f"step {step}/{steps}  loss {out['loss']:.4f}  held-out loss {_fmt(after)}  "
                f"lr {out['lr']:.2e}  grad norm {out['grad_norm']:.3g}  {rate:.0f} tokens/s"
            )
    engine.save_pretrained(args.out, source=args.model)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    if me.rank != 0:
        return None
    return {
        "model": str(Path(args.out) / "merged") if args.lora_rank else args.out, "data": args.data,
        "steps": steps, "sequences": len(data.train), "held_out_sequences": len(data.held_out),
        "truncated": data.truncated, "dropped": data.dropped, "train_loss_first": losses[0],
        "train_loss_last": losses[-1], "held_out_loss_before": before, "held_out_loss_after": after,
        "nan_skipped": skipped, "tokens": tokens_seen, "wall_s": round(time.perf_counter() - t_start, 3),
    }  # fmt: skip


def _fmt(loss: float | None) -> str:
    return "-" if loss is None else f"{loss:.4f}"
