"""Configuration of the rollout service."""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from meshrl.recipe import Columns, ServiceConfig, require
from meshrl.roles import EVAL, GATE, SAMPLES

if TYPE_CHECKING:
    from meshrl.recipe import Recipe, ServiceGroup

ADVANTAGES = ("grpo", "dr_grpo", "rloo", "reinforce_pp")
BUILTIN_TASKS = {"arith": "meshrl.tasks.arith"}


@dataclass(frozen=True, kw_only=True)
class RolloutConfig(ServiceConfig):
    service = "meshrl.roles.rollout.service:RolloutService"

    model: str
    """Local path of the policy; rollout uses its tokenizer."""
    dataset: str = "arith"
    """A built-in task ("arith") or a local .jsonl / .json / .parquet file of prompt rows."""
    eval_dataset: str | None = None
    """Held-out rows: a file, or None for the built-in task's eval split (or no evaluation for files)."""
    prompt_field: str = "prompt"
    """Column of the dataset holding the prompt text."""
    chat_template: bool = False
    """Render prompts with the tokenizer's chat template (as one user message)."""
    reward: str = "meshrl.tasks.arith:reward"
    """Reward function `module:function(prompt, completion, row) -> float`."""
    prompts_per_step: int = 16
    group_size: int = 8
    """Completions per prompt (GRPO group)."""
    max_prompt_len: int = 64
    """Tokens; longer prompts are skipped and counted."""
    window: int | None = 1
    """Pacing: 1 = lock-step (sync), k = at most k steps ahead of the trainer, None = never wait."""
    advantage: str = "grpo"
    """How rewards become advantages: grpo, dr_grpo (no std scaling), rloo, reinforce_pp."""
    normalize_std: bool = True
    """GRPO: divide by the group's reward std (False is the Dr. GRPO variant)."""
    max_failed_fraction: float = 0.2
    """Stop the run when more than this fraction of samples could not be scored."""
    eval_every: int = 0
    """Evaluate (greedy and sampled accuracy) every this many weight versions; 0 = only before and after."""
    eval_samples: int = 1
    """Sampled completions per eval prompt (besides the greedy one)."""

    def __post_init__(self) -> None:
        require(self.prompts_per_step >= 1, "prompts_per_step", "must be >= 1")
        require(self.group_size >= 1, "group_size", "must be >= 1")
        require(self.window is None or self.window >= 1, "window", "must be >= 1 or None")
        require(self.advantage in ADVANTAGES, "advantage", f"{self.advantage!r} is not one of {ADVANTAGES}")
        require(0 <= self.max_failed_fraction <= 1, "max_failed_fraction", "must be in [0, 1]")
        require(":" in self.reward, "reward", f"{self.reward!r} must look like 'package.module:function'")

    @property
    def batch_size(self) -> int:
        return self.prompts_per_step * self.group_size

    def reads(self) -> Columns:
        return {SAMPLES: ("prompt", "response"), EVAL: ("prompt", "response"), GATE: ("version",)}

    def writes(self) -> Columns:
        return {SAMPLES: ("prompt", "reward", "advantage", "valid"), EVAL: ("prompt",)}

    def check(self, recipe: Recipe, group: ServiceGroup) -> list[str]:
        problems = []
        if not Path(self.model).exists():
            problems.append(f"model: path {self.model!r} does not exist (build or download the model first)")
        for name, value in (("dataset", self.dataset), ("eval_dataset", self.eval_dataset)):
            if value is not None and value not in BUILTIN_TASKS and not Path(value).is_file():
                problems.append(
                    f"{name}: {value!r} is neither a built-in task {sorted(BUILTIN_TASKS)} nor a file"
                )
        for name, value in (("dataset", self.dataset), ("eval_dataset", self.eval_dataset)):
            if value is not None and Path(value).is_file():
                fields = _first_row_fields(value)
                if fields is not None and self.prompt_field not in fields:
                    problems.append(
                        f"{name}: rows have no field {self.prompt_field!r} (fields: {sorted(fields)}); "
                        "set prompt_field"
                    )
        module, _, fn = self.reward.partition(":")
        try:
            if not callable(getattr(importlib.import_module(module), fn, None)):
                problems.append(f"reward: module {module!r} has no function {fn!r}")
        except ImportError as e:
            problems.append(f"reward: cannot import {module!r}: {e}")
        return problems


def _first_row_fields(path: str) -> set[str] | None:
    """Field names of a data file's first row (None when the format is not one we can peek into)."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return set(pq.read_schema(path).names)
    if path.endswith((".jsonl", ".json")):
        with open(path) as f:
            for line in f:
                if line.strip():
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError:
                        return None
                    return set(row) if isinstance(row, dict) else None
    return None
