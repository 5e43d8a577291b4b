"""`meshrl sft --data chats.jsonl`: supervised fine-tuning on chat data, with the trainer's engine.

    meshrl sft --model Qwen/Qwen2.5-0.5B-Instruct --data chats.jsonl --out sft-model --epochs 2 \
        optim.lr=1e-5 memory.precision=bf16-mixed lora.rank=16

Rows hold OpenAI-style `messages` (and optional `tools`, handed to the chat template), or a `prompt` and
a `completion`; a vision-language model's rows may hold images (image parts in the messages, or an
`images` field for their `{"type": "image"}` placeholders: the model's processor encodes them, and the
vision tower stays frozen unless --train-vision); the loss is the mean negative log-likelihood of the assistant messages' (the
completion's) tokens alone (`chat_data.py`: the row formats and how the mask is found). Training is
the RL trainer's engine with a supervised objective (meshrl/engines/supervised.py), set up by the
trainer's own sections, `optim`, `memory` and `lora`, as `section.field=value` (`sft_config.py`: the
flags, the sections and sft's defaults): the same micro-batching (rows, or samples packed by tokens),
precision, activation checkpointing, LoRA, AdamW with warm-up and a schedule, gradient clipping and
skipping of non-finite steps. A held-out share of the rows (`--eval-fraction`) is scored before
training, every `--eval-every` steps and at the end. The result is a Hugging Face folder as a run's
final model is (tokenizer and chat template included), which `meshrl run recipe.py *.model=OUT`
starts from (with LoRA: the adapter, and the merged model in OUT/merged). Progress goes to stderr;
stdout gets one JSON object with the figures.

Under torchrun (WORLD_SIZE > 1) every rank takes its share of each step's rows and the model is
sharded with FSDP, as the trainer's is; rank 0 reports and writes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshrl.commands.chat_data import DataError, Example, encode, read_rows, to_batch
from meshrl.commands.sft_config import SettingsError, SftConfig, SftSettings, load


def main(argv: list[str]) -> int:
    try:
        result = train(load(argv))
    except SettingsError as e:
        for problem in e.problems:
            print(f"meshrl sft: error: {problem}", file=sys.stderr)
        return 2
    except DataError as e:
        print(f"meshrl sft: error: {e}", file=sys.stderr)
        return 2
    if result is not None:
        print(json.dumps(result), flush=True)
    return 0


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


def load_data(config: SftConfig, tokenizer: Any, model_config: Any) -> Data:
    """The rows encoded and cut at --max-len (or the model's positions, when fewer), split. Rows with
    images are encoded by a vision-language model's processor."""
    text_config = getattr(model_config, "text_config", None) or model_config
    positions = getattr(text_config, "max_position_embeddings", None)
    max_len = min(config.max_len, positions) if positions else config.max_len
    processor = image_processor(config.model, model_config)
    examples = [
        encode(tokenizer, row, max_len, processor=processor, max_pixels=config.max_pixels)
        for row in read_rows(config.data)
    ]
    kept = [e for e in examples if sum(e.mask[1:]) > 0]
    if not kept:
        raise DataError(f"{config.data}: no row keeps an assistant token within {max_len} tokens")
    train, held_out = split(kept, config.eval_fraction, config.seed)
    truncated = sum(e.truncated for e in examples)
    return Data(train, held_out, len(examples), truncated, len(examples) - len(kept), max_len)


def image_processor(model: str, model_config: Any) -> Any:
    """A vision-language model's processor (None for a text model)."""
    if getattr(model_config, "vision_config", None) is None:
        return None
    from meshrl.models import vision

    problem = vision.check_model(model) if Path(model).is_dir() else None
    if problem is not None:
        raise SettingsError([f"--model {problem}"])
    return vision.load_processor(model)


def engine_settings(config: SftConfig, steps: int, gpu: bool) -> SftSettings:
    """The sections as the engine takes them: optim.warmup_steps and memory.precision, where the command
    line leaves them unset, from the run (3% of the steps; bf16-mixed on a GPU, fp32 on CPU)."""
    optim, memory = config.settings.optim, config.settings.memory
    if "optim.warmup_steps" not in config.given:
        optim = dataclasses.replace(optim, warmup_steps=math.ceil(0.03 * steps))
    if "memory.precision" not in config.given:
        memory = dataclasses.replace(memory, precision="bf16-mixed" if gpu else "fp32")
    return dataclasses.replace(config.settings, optim=optim, memory=memory)


def build_engine(config: SftConfig, steps: int, device: Any) -> Any:
    """The trainer's engine with the supervised objective, set up by the sections."""
    import torch

    from meshrl.engines.supervised import SupervisedEngine

    settings = engine_settings(config, steps, torch.device(device).type == "cuda")
    return SupervisedEngine(
        config.model, settings.optim, device=device, memory=settings.memory, lora=settings.lora,
        total_steps=steps, seed=config.seed, train_vision=config.train_vision,
    )  # fmt: skip


@dataclass
class Scorer:
    """This rank's share of rows as the engine's batches, and the held-out loss."""

    engine: Any
    data: Data
    me: Ranks
    pad: int
    batch: int
    """Sequences per held-out forward (every rank's together)."""

    def batch_of(self, rows: list[Example], fallback: Example) -> Any:
        """This rank's rows as the engine's batch; a rank without rows still joins the collective
        forwards, with a masked copy of `fallback`."""
        batch = to_batch(rows or [fallback], self.pad)
        if not rows:
            batch.mask &= False
        return batch

    def held_out_loss(self) -> float | None:
        """Mean NLL per token of the held-out rows (None without any). Collective."""
        held_out, me = self.data.held_out, self.me
        if not held_out:
            return None
        mine, nll, tokens = held_out[me.rank :: me.world], 0.0, 0.0
        for start in range(0, max(len(mine), 1), self.batch):
            n, t = self.engine.supervised_loss(self.batch_of(mine[start : start + self.batch], held_out[0]))
            nll, tokens = nll + n, tokens + t
        return nll / max(tokens, 1.0)


def train(config: SftConfig) -> dict[str, Any] | None:
    """Fine-tune as `config` says and save the model; the figures (None on ranks other than 0)."""
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, AutoTokenizer

    t_start = time.perf_counter()
    if config.threads:
        torch.set_num_threads(config.threads)
    me = ranks()
    try:
        tokenizer = AutoTokenizer.from_pretrained(config.model)
        model_config = AutoConfig.from_pretrained(config.model)
    except OSError as e:  # neither a model folder nor a hub id in the cache
        raise SettingsError([f"--model {config.model!r}: cannot load it: {e}"]) from e
    data = load_data(config, tokenizer, model_config)
    if len(data.train) < me.world:
        raise DataError(f"{config.data}: {len(data.train)} training rows for {me.world} ranks")
    steps = config.steps or max(1, math.ceil(math.ceil(len(data.train) / config.batch) * config.epochs))
    engine = build_engine(config, steps, me.device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0
    scorer = Scorer(engine, data, me, pad, config.batch)
    if data.max_len < config.max_len:
        me.log(f"--max-len {config.max_len} is past the model's positions: sequences cut at {data.max_len}")
    me.log(
        f"meshrl sft: {len(data.train)} training rows, {len(data.held_out)} held out, {data.truncated} "
        f"cut at {data.max_len} tokens ({data.dropped} of them left with no assistant token); {steps} "
        f"steps of {config.batch}, {me.world} rank(s), {engine.memory.precision} on {me.device.type}"
    )
    figures = fit(config, scorer, steps)
    engine.save_pretrained(config.out, source=config.model)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    if me.rank != 0:
        return None
    merged = engine.lora is not None and engine.lora.save_merged
    return {
        "model": str(Path(config.out) / "merged") if merged else config.out, "data": config.data,
        "steps": steps, "sequences": len(data.train), "held_out_sequences": len(data.held_out),
        "truncated": data.truncated, "dropped": data.dropped, **figures,
        "wall_s": round(time.perf_counter() - t_start, 3),
    }  # fmt: skip


def fit(config: SftConfig, scorer: Scorer, steps: int) -> dict[str, Any]:
    """`steps` optimizer steps over the training rows, the held-out loss every --eval-every; the figures."""
    engine, data, me = scorer.engine, scorer.data, scorer.me
    every = config.eval_every or max(1, steps // 10)
    before = after = scorer.held_out_loss()
    me.log(f"step 0/{steps}  held-out loss {_fmt(before)}")
    losses: list[float] = []
    tokens_seen, skipped, t_train = 0, 0, time.perf_counter()
    for step, rows in enumerate(batches(len(data.train), config.batch, steps, config.seed), 1):
        batch = scorer.batch_of([data.train[i] for i in rows[me.rank :: me.world]], data.train[rows[0]])
        tokens_seen += int(engine.all_sum([float(batch.attention_mask.sum())])[0])
        out = engine.update_supervised(batch)
        losses.append(out["loss"])
        skipped += int(out["nan_skipped"])
        if step % every == 0 or step == steps:
            after = scorer.held_out_loss()
            rate = tokens_seen / max(time.perf_counter() - t_train, 1e-9)
            me.log(
                f"step {step}/{steps}  loss {out['loss']:.4f}  held-out loss {_fmt(after)}  "
                f"lr {out['lr']:.2e}  grad norm {out['grad_norm']:.3g}  {rate:.0f} tokens/s"
            )
    return {
        "train_loss_first": losses[0], "train_loss_last": losses[-1], "held_out_loss_before": before,
        "held_out_loss_after": after, "nan_skipped": skipped, "tokens": tokens_seen,
    }  # fmt: skip


def _fmt(loss: float | None) -> str:
    return "-" if loss is None else f"{loss:.4f}"
