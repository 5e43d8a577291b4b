"""What `meshrl sft` takes: its own flags, and the trainer's settings sections as `section.field=value`.

    meshrl sft --model M --data D --out O --steps 300 --batch 32 \\
        optim.lr=3e-3 optim.warmup_steps=20 optim.schedule=linear memory.micro_batch=32 lora.rank=8

The flags are what only a supervised run has: the model, the rows, how long, the rows of a step, the
longest sequence, the held-out share. Everything about how a step is taken is one of the sections the
trainer's engine takes whole (meshrl/engines/settings.py: `optim`, `memory`, `lora`), addressed as
`meshrl run` addresses `trainer.optim.lr` without the `trainer.`, parsed by the same override parser
(meshrl/planning/overrides.py) and checked once, by the sections themselves. Every problem is listed,
each naming its flag or field; flags of earlier versions that set a section (`--lr`, `--precision`,
...) are refused with what replaced them. Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

from meshrl.engines.settings import LoraConfig, MemoryConfig, OptimConfig
from meshrl.planning.config import Config, RecipeError
from meshrl.planning.overrides import apply_overrides

SECTIONS: dict[str, Any] = {"optim": OptimConfig, "memory": MemoryConfig, "lora": LoraConfig}
"""The trainer's sections a supervised run uses (the policy loss's, `loss`, `kl`, `distill` and
`value`, have nothing to set: the objective is the next-token NLL)."""

OLD_FLAGS = {
    "--lr": "optim.lr",
    "--warmup": "optim.warmup_steps",
    "--schedule": "optim.schedule",
    "--weight-decay": "optim.weight_decay",
    "--micro-batch": "memory.micro_batch",
    "--pack-tokens": "memory.max_tokens_per_micro_batch",
    "--precision": "memory.precision",
    "--activation-checkpointing": "memory.activation_checkpointing",
    "--lora-rank": "lora.rank",
}
"""Flags of earlier versions, each with the section field that replaced it."""

SWITCHES = ("--activation-checkpointing",)
"""Old flags that took no value."""

MAX_PIXELS = 1024 * 1024
"""--max-pixels' default: meshrl/models/vision.py's DEFAULT_MAX_PIXELS (not imported: it imports torch)."""


class SettingsError(ValueError):
    """Arguments that cannot work: every problem, each naming its flag or field."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("; ".join(problems))


@dataclass(frozen=True, kw_only=True)
class SftSettings(Config):
    """The trainer's sections, with the defaults of a supervised run."""

    moved: ClassVar[dict[str, str]] = {
        **{f.name: f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in fields(cls)},
        "trainer": "the section's field without 'trainer.' (optim.lr=...)",
    }
    """A field named without its section (`lr=...`), or with meshrl run's `trainer.`: what to write."""
    optim: OptimConfig = OptimConfig(lr=2e-5, schedule="cosine")
    """AdamW and its schedule; optim.warmup_steps, unless set, is 3% of the steps."""
    memory: MemoryConfig = MemoryConfig(micro_batch=8)
    """Micro-batches of rows, or of packed samples (max_tokens_per_micro_batch); precision, unless set,
    bf16-mixed on a GPU and fp32 on CPU; activation checkpointing; logits in chunks."""
    lora: LoraConfig = LoraConfig(save_merged=True)
    """lora.rank > 0 trains adapters: the adapter goes to --out, the merged model to OUT/merged."""


@dataclass(frozen=True, kw_only=True)
class SftConfig(Config):
    """A run of `meshrl sft`: its own flags (checked here), the sections (checked by themselves)."""

    model: str
    """The model to start from: an HF folder or a hub id."""
    data: str
    """The rows: a .jsonl file, or anything `datasets` opens."""
    out: str
    """The folder the trained model goes to."""
    epochs: float = 1.0
    """Passes over the training rows (unless steps is set)."""
    steps: int | None = None
    """Optimizer steps, instead of epochs."""
    batch: int = 32
    """Sequences per optimizer step (every rank's together)."""
    max_len: int = 2048
    """Tokens per sequence; longer ones are cut."""
    eval_fraction: float = 0.05
    """Share of the rows held out (0: none)."""
    eval_every: int | None = None
    """Held-out loss every this many steps (None: ten times a run)."""
    seed: int = 0
    """Seed of the split, the batches' order and the engine."""
    threads: int | None = None
    """CPU threads of torch (None: torch's default)."""
    max_pixels: int = MAX_PIXELS
    """Rows with images (a vision-language model): an image with more pixels (width x height, as
    decoded) is an error naming its row."""
    train_vision: bool = False
    """A vision-language model's vision tower trains too (by default it is frozen, as in a run)."""
    settings: SftSettings = SftSettings()
    """The trainer's sections."""
    given: frozenset[str] = frozenset()
    """The section fields set on the command line (`optim.lr`, ...): the others take the run's defaults."""

    def validate(self) -> Iterator[str]:
        for name, bad, why in (
            ("batch", self.batch < 1, "must be >= 1"),
            ("epochs", self.steps is None and not self.epochs > 0, "must be > 0"),
            ("steps", self.steps is not None and self.steps < 1, "must be >= 1"),
            ("max-len", self.max_len < 2, "must be >= 2"),
            ("eval-fraction", not 0 <= self.eval_fraction < 1, "must be in [0, 1)"),
            ("eval-every", self.eval_every is not None and self.eval_every < 1, "must be >= 1"),
            ("max-pixels", self.max_pixels < 1, "must be >= 1"),
        ):
            if bad:
                yield f"--{name}: {why}"
        hub_id = re.fullmatch(r"[\w.-]+/[\w.-]+", self.model) is not None
        if not hub_id and not Path(self.model).expanduser().exists():
            yield f"--model: no such path: {self.model!r}"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="meshrl sft", description="Supervised fine-tuning with the trainer's engine.", allow_abbrev=False,
        epilog="settings: the trainer's sections as section.field=value (optim.lr=3e-3, "
        "memory.precision=bf16-mixed, memory.max_tokens_per_micro_batch=4096, lora.rank=8; "
        "meshrl/engines/settings.py)",
    )  # fmt: skip
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
    ap.add_argument("--max-len", type=int, default=2048, help="tokens per sequence; longer ones are cut")
    ap.add_argument("--eval-fraction", type=float, default=0.05, help="share of rows held out (0: none)")
    ap.add_argument("--eval-every", type=int, help="held-out loss every N steps (default: 10 times a run)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, help="CPU threads of torch")
    ap.add_argument("--max-pixels", type=int, default=MAX_PIXELS,
                    help="largest image (width x height) of a row with images")  # fmt: skip
    ap.add_argument("--train-vision", action="store_true",
                    help="a vision-language model's vision tower trains too (frozen by default)")  # fmt: skip
    ap.add_argument("settings", nargs="*", metavar="section.field=value", help="e.g. optim.lr=3e-3")
    return ap


def load(argv: list[str]) -> SftConfig:
    """The run `argv` asks for; SettingsError lists every problem (argparse exits on a malformed flag)."""
    argv, problems = old_flags(argv)
    args = parser().parse_intermixed_args(argv)
    overrides: list[str] = args.settings
    settings, bad = apply_overrides(SftSettings(), overrides)
    problems += bad
    given = frozenset(item.partition("=")[0] for item in overrides)
    try:
        config = SftConfig(**{**vars(args), "settings": settings, "given": given})
    except RecipeError as e:
        problems += e.problems
    if problems:
        raise SettingsError(problems)
    return config


def old_flags(argv: list[str]) -> tuple[list[str], list[str]]:
    """(`argv` without the flags of earlier versions and their values, a line for each saying what
    replaced it)."""
    rest: list[str] = []
    problems: list[str] = []
    i = 0
    while i < len(argv):
        flag, eq, value = argv[i].partition("=")
        i += 1
        if flag not in OLD_FLAGS:
            rest.append(argv[i - 1])
            continue
        if not eq and flag not in SWITCHES and i < len(argv) and not argv[i].startswith("--"):
            value = argv[i]
            i += 1
        key = OLD_FLAGS[flag]
        if flag == "--precision" and value == "auto":
            problems.append(f"{flag} has moved: leave {key} unset (bf16-mixed on a GPU, fp32 on CPU)")
            continue
        value = "true" if flag in SWITCHES else value or "VALUE"
        problems.append(f"{flag} has moved: write {key}={value}")
    return rest, problems
