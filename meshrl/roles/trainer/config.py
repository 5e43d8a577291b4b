"""Configuration of the training service."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from meshrl.planning.config import Columns, ServiceConfig
from meshrl.schema import (
    ADVANTAGE,
    CHECKPOINT,
    GATE,
    GEN_BATCH,
    GEN_S,
    LOGPROBS,
    PROMPT,
    REF_LOGPROBS,
    RESPONSE,
    REWARD,
    SAMPLES,
    STEP,
    TOKEN_REWARDS,
    VALID,
    VERSION,
    teacher_columns,
)

if TYPE_CHECKING:
    from meshrl.planning.recipe import Recipe, ServiceGroup

KLEstimator = Literal["k1", "k2", "k3"]
Schedule = Literal["constant", "linear", "cosine"]


@dataclass(frozen=True, kw_only=True)
class SimTraining:
    """The simulated training engine (engine="sim"): time only, for pipeline benchmarks."""

    token_s: float = 25e-6
    """Seconds of simulated optimizer step per trained token."""


@dataclass(frozen=True, kw_only=True)
class Lora:
    """LoRA adapters (PEFT) instead of full fine-tuning: only they are trained and checkpointed."""

    rank: int = 0
    """Rank of each adapter; 0: full fine-tuning (no adapters)."""
    alpha: float = 32.0
    """Scale of the adapters' update: alpha / rank."""
    target_modules: tuple[str, ...] = ("all-linear",)
    """Module names (or suffixes) that get an adapter; "all-linear": every linear layer but the output."""
    dropout: float = 0.0
    """Dropout on the adapters' input (0 keeps the trainer's log-probs those inference samples with)."""
    save_merged: bool = False
    """The final save writes the adapter to <run_dir>/final, and with this also the merged model to
    <run_dir>/final/merged."""


@dataclass(frozen=True, kw_only=True)
class TrainerConfig(ServiceConfig):
    service = "meshrl.roles.trainer.service:TrainerService"

    model: str
    """Local path of the initial policy."""
    loader_kwargs: dict[str, Any] = field(default_factory=dict)
    """Passed to AutoModelForCausalLM.from_pretrained."""
    engine: Literal["fsdp", "sim"] = "fsdp"
    """Training engine: "fsdp" (FSDP2 over an HF causal LM) or "sim" (sleeps; pipeline benchmarks)."""
    sim: SimTraining = SimTraining()
    """Settings of the simulated engine."""
    lr: float = 1e-5
    schedule: Schedule = "constant"
    """Learning-rate schedule after warm-up: constant, linear (to 0 at the last step) or cosine."""
    warmup_steps: int = 0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0
    """Max global grad norm (0 disables clipping)."""
    mini_batches: int = 1
    """Mini-batches per training step (one weight version): the trainer claims a mini-batch of whole
    groups as soon as it is ready, takes an optimizer step on it, and publishes new weights after
    `mini_batches` of them. Later mini-batches are slightly off-policy; the loss accounts for it."""
    epochs: int = 1
    """Optimizer steps over each mini-batch (PPO epochs)."""
    off_policy: Literal["none", "decoupled", "tis"] = "none"
    """How the loss treats samples from older weights: "none" (PPO ratio against the behaviour
    logprobs), "decoupled" (ratio against the trainer's own proximal policy, importance weight
    behaviour -> proximal truncated at is_cap) or "tis" (truncated importance sampling, no clipping)."""
    is_cap: float = 5.0
    """Truncation of importance weights (decoupled, tis)."""
    max_staleness: int | None = None
    """Drop samples whose first token was generated more than this many versions ago (counted)."""
    micro_batch: int = 32
    """Rows per forward/backward; gradients accumulate over a mini-batch's micro-batches."""
    max_tokens_per_micro_batch: int | None = None
    """Fill micro-batches by tokens instead (micro_batch is then unused): several samples packed into
    each row (as wide as the longest sample), each attending only to itself, and as many rows per
    micro-batch as this many tokens hold. Padding goes, and the memory of a micro-batch is bounded by
    tokens whatever the lengths. Needs a per-token loss (loss_agg token-mean, policy_loss ppo)."""
    precision: Literal["fp32", "bf16-mixed"] = "fp32"
    """fp32, or bf16-mixed: float32 parameters, gradients and optimizer state (small updates are not
    rounded away), forward and backward in bfloat16, weights published to inference in bfloat16."""
    activation_checkpointing: bool = False
    """Keep only each decoder layer's input for the backward pass and recompute the rest: activation
    memory of one layer instead of all, for about one more forward pass of time."""
    lora: Lora = Lora()
    """LoRA: set lora.rank > 0 to train adapters; inference receives the merged weights."""
    logits_chunk: int = 1024
    """Positions whose logits exist at a time when computing the policy's log-probs and entropy from the
    last hidden state (recomputed in the backward pass); 0: the whole micro-batch's logits at once.
    Distillation always computes them whole (its top-k KL reads them)."""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    """token-mean, seq-mean-token-mean or seq-mean-token-sum (normalised over the whole step)."""
    policy_loss: Literal["ppo", "gspo"] = "ppo"
    """ppo (clipped ratio per token) or gspo (sequence-level ratio)."""
    clip_low: float = 0.2
    clip_high: float = 0.2
    """Upper clip of the ratio; larger than clip_low is DAPO's clip-higher."""
    dual_clip: float | None = None
    """Dual-clip constant (> 1) bounding the loss of negative-advantage tokens."""
    entropy_coef: float = 0.0
    kl_coef: float = 0.0
    """Weight of the KL-to-reference loss term (needs a reference service writing ref_logprobs)."""
    kl_target: float | None = None
    """Adapt kl_coef towards this per-token KL (Ziegler et al. 2019); None keeps it fixed."""
    kl_horizon: int = 10000
    """Samples over which the adaptive coefficient moves by at most 20%."""
    kl_metric: bool = False
    """Read ref_logprobs and report kl_ref even when kl_coef is 0 (e.g. the KL penalty is in the reward)."""
    kl_estimator: KLEstimator = "k3"
    teachers: dict[str, float] = field(default_factory=lambda: {"teacher": 1.0})
    """On-policy distillation: the teachers to learn from (their column prefix) and their weights.
    Read only when distill_coef, distill_advantage or distill_metric asks for them."""
    distill_coef: float = 0.0
    """Weight of the loss term forward-KL(teacher top-k || student) at every response token."""
    distill_advantage: float = 0.0
    """Weight of the dense per-token advantage log p_teacher - log p_student (of the sampled token;
    a reverse-KL reward), added to pg_coef times the task advantage."""
    pg_coef: float = 1.0
    """Weight of the task advantage (the reward's policy gradient) in the loss."""
    distill_floor: float = -20.0
    """Clamp of the student's logprobs in the forward KL: a token it rules out costs a bounded loss."""
    distill_metric: bool = False
    """Read the teachers' columns and report KL / agreement even when both coefficients are 0."""
    value_head: bool = False
    """Shared-backbone actor-critic (PPO without a critic model): a linear value head on the policy's
    last hidden state, trained with it by value_coef x the clipped value loss. The trainer then takes
    each mini-batch's values before updating on it and computes GAE advantages and returns itself, from
    the per-token rewards of a rollout with values="trainer" (with that rollout's gamma, lam, whiten).
    The head is saved as value_head.safetensors next to the final model. A critic with its own model
    and optimizer is the critic service instead."""
    value_coef: float = 0.5
    """Weight of the value loss in the actor-critic's loss."""
    value_clip: float | None = 0.2
    """Clip of the value update around the values the advantages used (None: plain squared error)."""
    inference: tuple[str, ...] = ("inference",)
    """Group ids of the inference services that receive each new weight version."""
    bucket_mb: int = 64
    """Weight broadcast bucket size."""
    max_nan_steps: int = 3
    """Consecutive steps with a non-finite loss or gradient after which the run stops."""
    save_final: bool = True
    """Save a Hugging Face checkpoint in <run_dir>/final at the end."""
    threads: int = 0
    """torch threads of each trainer process (0: leave the default)."""

    def validate(self) -> Iterator[str]:
        if self.lr <= 0:
            yield "lr: must be > 0"
        yield from self._memory_problems()
        if min(self.micro_batch, self.mini_batches, self.epochs) < 1:
            yield "micro_batch, mini_batches, epochs: must be >= 1"
        if self.is_cap <= 0:
            yield "is_cap: must be > 0"
        if self.max_staleness is not None and self.max_staleness < 0:
            yield "max_staleness: must be >= 0"
        if self.warmup_steps < 0:
            yield "warmup_steps: must be >= 0"
        if self.dual_clip is not None and self.dual_clip <= 1:
            yield "dual_clip: must be > 1 (or None)"
        if self.kl_coef < 0 or self.entropy_coef < 0:
            yield "kl_coef: coefficients must be >= 0"
        if self.kl_target is not None and self.kl_target <= 0:
            yield "kl_target: must be > 0 (or None)"
        if min(self.distill_coef, self.distill_advantage, self.pg_coef) < 0:
            yield "distill_coef: distill_coef, distill_advantage and pg_coef must be >= 0"
        if self.value_head and self.engine == "sim":
            yield "value_head: needs engine='fsdp'"
        if self.value_coef < 0:
            yield "value_coef: must be >= 0"
        if self.value_clip is not None and self.value_clip <= 0:
            yield "value_clip: must be > 0 (or None)"
        if self.distills and not (self.teachers and all(w > 0 for w in self.teachers.values())):
            yield f"teachers: {self.teachers!r}: distillation needs at least one teacher, each with a weight > 0"

    def _memory_problems(self) -> Iterator[str]:
        """Problems of the settings that fit a step in memory (precision, chunks, packing)."""
        if {"dtype", "torch_dtype"} & set(self.loader_kwargs):
            yield "loader_kwargs: the trainer's dtype is set by trainer.precision (fp32 or bf16-mixed)"
        if self.logits_chunk < 0:
            yield "logits_chunk: must be >= 0 (0: whole logits)"
        if self.lora.rank < 0 or self.lora.alpha <= 0 or not 0 <= self.lora.dropout < 1:
            yield "lora: rank must be >= 0, alpha > 0 and dropout in [0, 1)"
        if self.lora.rank and (self.value_head or self.engine != "fsdp"):
            yield "lora: adapters train the policy of the fsdp engine, without value_head"
        if self.max_tokens_per_micro_batch is None:
            return
        if self.max_tokens_per_micro_batch < 1:
            yield "max_tokens_per_micro_batch: must be >= 1 (or None: micro_batch rows)"
        if self.loss_agg != "token-mean" or self.policy_loss != "ppo":
            yield (
                "max_tokens_per_micro_batch: packing samples into rows needs a per-token loss: "
                "loss_agg='token-mean' and policy_loss='ppo' (or set it to None)"
            )

    @property
    def distills(self) -> bool:
        """Whether the trainer reads teacher columns."""
        return self.distill_coef > 0 or self.distill_advantage > 0 or self.distill_metric

    def columns(self) -> tuple[str, ...]:
        cols: tuple[str, ...] = (
            PROMPT, RESPONSE, LOGPROBS, VERSION, REWARD, TOKEN_REWARDS if self.value_head else ADVANTAGE, VALID,
            GEN_S, GEN_BATCH,
        )  # fmt: skip
        cols += (REF_LOGPROBS,) if self.kl_coef > 0 or self.kl_metric else ()
        for name in sorted(self.teachers) if self.distills else ():
            cols += teacher_columns(name)
        return cols

    def reads(self) -> Columns:
        return {SAMPLES: self.columns()}

    def writes(self) -> Columns:
        return {GATE: (VERSION,), CHECKPOINT: (STEP,)}

    def retention(self) -> Columns:
        return {SAMPLES: ("trainer",)}

    def publishes_adapters(self, recipe: Recipe) -> bool:
        """Whether publications carry the LoRA adapters alone (every inference group this trainer feeds
        runs vLLM, which applies adapters itself) rather than the base with them merged in."""
        engines = {getattr(g.config, "engine", None) for g in recipe.groups if g.id in self.inference}
        return self.lora.rank > 0 and engines == {"vllm"}

    def check(self, recipe: Recipe, group: ServiceGroup) -> list[str]:
        from meshrl.roles.inference.config import InferenceConfig
        from meshrl.roles.rollout.config import RolloutConfig

        problems = []
        if not Path(self.model).exists():
            problems.append(f"model: path {self.model!r} does not exist (build or download the model first)")
        if group.replicas != 1:
            problems.append("replicas: one trainer replica (scale it with devices_per_replica)")
        world = max(1, group.devices_per_replica)
        if recipe.prompts_per_step % (world * self.mini_batches):
            problems.append(
                f"mini_batches: the recipe's prompts_per_step ({recipe.prompts_per_step}) must divide into "
                f"{self.mini_batches} mini-batches of whole groups on each of {world} trainer rank(s)"
            )
        groups = {g.id: g for g in recipe.groups}
        for gid in self.inference:
            g = groups.get(gid)
            if g is None or not isinstance(g.config, InferenceConfig):
                problems.append(f"inference: {gid!r} is not an inference group of this recipe")
        for ring in recipe.rings:
            members = {m.group for m in ring.members}
            missing = [gid for gid in self.inference if gid not in members]
            if ring.hybrid and group.id in members and self.lora.rank:
                problems.append(f"lora: hybrid ring {ring.id!r} lends the trainer's model to inference; "
                                "it would generate with the adapters unmerged (publish to inference instead)")  # fmt: skip
            if ring.hybrid and group.id in members and missing:
                problems.append(
                    f"inference: {missing} must be in hybrid ring {ring.id!r} with the trainer (it publishes by "
                    "lending its model to the inference in its own process)"
                )
        rollouts = [g for g in recipe.groups if isinstance(g.config, RolloutConfig)]
        for g in rollouts:
            values = g.config.advantage == "gae" and g.config.values == "trainer"  # type: ignore[attr-defined]
            if self.value_head and not values:
                problems.append(
                    f"value_head: {g.id} computes its advantages itself; with the trainer's value head set "
                    f"{g.id}.advantage=gae and {g.id}.values=trainer"
                )
            if values and not self.value_head:
                problems.append(
                    f"value_head: {g.id}.values is 'trainer', so the trainer needs value_head=true"
                )
        if self.value_head and len(rollouts) != 1:
            problems.append("value_head: the actor-critic takes GAE settings from exactly one rollout group")
        return problems
