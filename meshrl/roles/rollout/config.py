"""Configuration of the rollout service."""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Literal

from meshrl.columns import (
    ADVANTAGE,
    CHECKPOINT_ACKS,
    EVAL,
    GATE,
    LOGPROBS,
    PROMPT,
    REF_LOGPROBS,
    RESPONSE,
    RETURNS,
    REWARD,
    RM_SCORE,
    SAMPLES,
    STEP,
    TOKEN_REWARDS,
    VALID,
    VALUES,
    VERSION,
)
from meshrl.models.hub import missing
from meshrl.planning.config import Columns, ServiceConfig

if TYPE_CHECKING:
    from meshrl.planning.recipe import Recipe, ServiceGroup

BUILTIN_TASKS = {"arith": "meshrl.tasks.arith"}


@dataclass(frozen=True, kw_only=True)
class RolloutConfig(ServiceConfig):
    service = "meshrl.roles.rollout.service:RolloutService"
    moved: ClassVar[dict[str, str]] = {
        "reward": 'rewards={"module:function": 1.0} (several weighted functions, TRL\'s way)',
        "reward_weight": 'rewards={"module:function": <weight>}',
    }
    stateful = True
    rejoins = True  # a restarted replica continues from the state its predecessor wrote ahead of each change

    model: str
    """Local path of the policy; rollout uses its tokenizer."""
    dataset: str = "arith"
    """A built-in task ("arith"), a local .jsonl / .json / .parquet / .csv file, a local dataset
    directory, or a hub dataset name: anything `datasets.load_dataset` opens (see dataset_config,
    dataset_split, streaming)."""
    dataset_config: str | None = None
    """The dataset's configuration (load_dataset's `name`, e.g. "main" for gsm8k)."""
    dataset_split: str = "train"
    """The split trained on (a local file has only "train")."""
    eval_dataset: str | None = None
    """Held-out rows, named as `dataset` is (None: the built-in task's eval split, or no evaluation)."""
    eval_split: str = "test"
    """The split of eval_dataset evaluated on (a local file has only "train", used whatever this says)."""
    streaming: bool = False
    """Stream a hub dataset instead of downloading it whole; only its first max_rows rows are read."""
    max_rows: int | None = None
    """Read at most this many rows of each dataset (None: all)."""
    prompt_field: str = "prompt"
    """Column holding the prompt: a string, or a list of chat messages ({"role", "content"}: TRL's
    conversational format, always rendered with the chat template)."""
    system_prompt: str | None = None
    """A system message put before each prompt (needs the chat template)."""
    chat_template: bool = False
    """Render string prompts with the tokenizer's chat template (as one user message)."""
    rewards: dict[str, float] = field(default_factory=lambda: {"meshrl.tasks.arith:reward": 1.0})
    """Reward functions by import path, with their weights: `{"pkg.mod:fn": 1.0, ...}`. Batched
    `fn(prompts, completions, **columns) -> list[float | None]` (TRL's signature) or per sample
    `fn(prompt, completion, row) -> float | None`, sync or async (see rewards.py). Built in:
    meshrl.rewards:math_answer, meshrl.rewards:answer_format. Weight 0: logged and evaluated only."""
    rm_weight: float = 0.0
    """Weight of the reward model's `rm_score` (> 0 needs a reward-model service)."""
    max_prompt_len: int = 512
    """Tokens, the chat template and system prompt included; longer prompts are skipped and counted,
    and the run stops when most are."""
    window: int | None = 1
    """Pacing: 1 = lock-step (sync), k = at most k steps ahead of the trainer, None = never wait."""
    advantage: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "gae"] = "grpo"
    """How rewards become advantages: grpo, dr_grpo (no std scaling), rloo, reinforce_pp, or gae (per
    token, from values: see `values`)."""
    values: Literal["critic", "trainer"] = "critic"
    """Where gae's values come from: "critic" (a critic service writes `values`; rollout computes the
    advantages and writes `returns` too) or "trainer" (the trainer's value head, trainer.value_head:
    rollout writes the per-token rewards `token_rewards`, and the trainer computes values, advantages
    and returns with this config's gamma, lam and whiten)."""
    normalize_std: bool = True
    """GRPO: divide by the group's reward std (False is the Dr. GRPO variant)."""
    gamma: float = 1.0
    """GAE discount."""
    lam: float = 0.95
    """GAE lambda."""
    whiten: bool = True
    """GAE: normalise advantages to zero mean, unit std over the batch's tokens (rollout then scores a
    whole batch at once, as it does for reinforce_pp)."""
    kl_in_reward: float = 0.0
    """Coefficient of a KL(behaviour || reference) penalty in the reward (needs a reference service):
    per token for gae, summed over the response for the outcome estimators."""
    kl_target: float | None = None
    """Adapt kl_in_reward towards this KL per sample (Ziegler et al. 2019); None keeps it fixed."""
    kl_horizon: int = 10000
    """Samples over which the adaptive coefficient moves by at most 20%."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    """Per-token KL estimator of the penalty: k1, k2 or k3."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards all agree (no learning signal) and draw new prompts instead."""
    max_filtered_fraction: float = 0.9
    """Stop the run when dynamic sampling drops more than this fraction of the groups drawn."""
    overlong_max_len: int | None = None
    """DAPO's soft overlong penalty: responses longer than overlong_max_len - overlong_buffer tokens lose
    up to overlong_penalty reward, linearly, reaching it at overlong_max_len."""
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    max_failed_fraction: float = 0.2
    """Stop the run when more than this fraction of samples could not be scored."""
    eval_every: int = 0
    """Evaluate (greedy and sampled accuracy) every this many weight versions; 0 = only before and after."""
    eval_samples: int = 1
    """Sampled completions per eval prompt (besides the greedy one)."""

    def validate(self) -> Iterator[str]:
        if self.window is not None and self.window < 1:
            yield "window: must be >= 1 or None"
        if not 0 <= self.max_failed_fraction <= 1:
            yield "max_failed_fraction: must be in [0, 1]"
        yield from self._reward_problems()
        if self.streaming and self.max_rows is None:
            yield "streaming: needs max_rows (how many rows of the stream to read)"
        if self.max_prompt_len < 1:
            yield "max_prompt_len: must be >= 1"
        if self.values == "trainer" and self.advantage != "gae":
            yield "values: 'trainer' is for advantage=gae"
        if self.kl_in_reward < 0:
            yield "kl_in_reward: must be >= 0"
        if self.kl_target is not None and self.kl_target <= 0:
            yield "kl_target: must be > 0 (or None)"
        if not 0 < self.max_filtered_fraction <= 1:
            yield "max_filtered_fraction: must be in (0, 1]"
        if self.overlong_max_len is not None and not 0 <= self.overlong_buffer <= self.overlong_max_len:
            yield "overlong_buffer: must be between 0 and overlong_max_len"

    def _reward_problems(self) -> Iterator[str]:
        from meshrl.roles.rollout.rewards import metric_name

        for spec, weight in self.rewards.items():
            if ":" not in spec:
                yield f"rewards: {spec!r} must look like 'package.module:function'"
            if not isinstance(weight, (int, float)) or weight < 0:
                yield f"rewards: the weight of {spec!r} must be a number >= 0"
        names = [metric_name(s) for s in self.rewards]
        for name in sorted({n for n in names if names.count(n) > 1}):
            yield f"rewards: two functions named {name!r}; their metrics would mix (wrap one under another name)"
        if not (any(w > 0 for w in self.rewards.values()) or self.rm_weight > 0):
            yield "rewards: nothing to train on: give a reward function a weight > 0, or set rm_weight > 0"

    def score_columns(self) -> tuple[str, ...]:
        """What a row needs before rollout can score it: the completion, and whatever the reward and
        advantage take from other services."""
        cols: tuple[str, ...] = (PROMPT, RESPONSE)
        if self.rm_weight > 0:
            cols += (RM_SCORE,)
        if self.kl_in_reward > 0:
            cols += (LOGPROBS, REF_LOGPROBS)
        if self.advantage == "gae" and self.values == "critic":
            cols += (VALUES,)
        return cols

    @property
    def advantage_columns(self) -> tuple[str, ...]:
        """What scoring writes besides `reward` and `valid`."""
        if self.advantage != "gae":
            return (ADVANTAGE,)
        return (ADVANTAGE, RETURNS) if self.values == "critic" else (TOKEN_REWARDS,)

    def reads(self) -> Columns:
        return {SAMPLES: self.score_columns(), EVAL: (PROMPT, RESPONSE), GATE: (VERSION,)}

    def writes(self) -> Columns:
        return {
            SAMPLES: (PROMPT, REWARD, *self.advantage_columns, VALID),
            EVAL: (PROMPT,),
            CHECKPOINT_ACKS: (STEP,),
        }

    def check(self, recipe: Recipe, group: ServiceGroup) -> list[str]:
        problems = []
        if not Path(self.model).exists():
            problems.append(missing(self.model))
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
        for spec in self.rewards:
            module, _, fn = spec.partition(":")
            try:
                if not callable(getattr(importlib.import_module(module), fn, None)):
                    problems.append(f"rewards: module {module!r} has no function {fn!r}")
            except ImportError as e:
                problems.append(f"rewards: cannot import {module!r}: {e}")
        if self.dynamic_sampling:
            # filtered groups are deleted: no other service may still be writing into them
            mine = set(self.score_columns())
            for g in recipe.groups:
                if g.config is self:
                    continue
                written = g.config.writes().get(SAMPLES, ())
                late = [c for c in written if c not in mine]
                if late and RESPONSE not in written:  # inference writes all its columns at once
                    problems.append(
                        f"dynamic_sampling: {g.id} writes {late} into rows that rollout may delete before it "
                        "is done; dynamic sampling works with services whose columns rollout reads"
                    )
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
