"""Configuration of the training service."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshrl.planning.recipe import Columns, ServiceConfig, require
from meshrl.roles import GATE, SAMPLES
from meshrl.state.checkpoint import CHECKPOINT

if TYPE_CHECKING:
    from meshrl.planning.recipe import Recipe, ServiceGroup

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
SCHEDULES = ("constant", "linear", "cosine")
POLICY_LOSSES = ("ppo", "gspo")
OFF_POLICY = ("none", "decoupled", "tis")


@dataclass(frozen=True, kw_only=True)
class SimTraining:
    """The simulated training engine (engine="sim"): time only, for pipeline benchmarks."""

    token_s: float = 25e-6
    """Seconds of simulated optimizer step per trained token."""


@dataclass(frozen=True, kw_only=True)
class TrainerConfig(ServiceConfig):
    service = "meshrl.roles.trainer.service:TrainerService"

    model: str
    """Local path of the initial policy."""
    loader_kwargs: dict[str, Any] = field(default_factory=dict)
    """Passed to AutoModelForCausalLM.from_pretrained."""
    engine: str = "fsdp"
    """Training engine: "fsdp" (FSDP2 over an HF causal LM) or "sim" (sleeps; pipeline benchmarks)."""
    sim: SimTraining = SimTraining()
    """Settings of the simulated engine."""
    prompts_per_step: int = 16
    """Must equal the rollout's."""
    group_size: int = 8
    """Must equal the rollout's."""
    temperature: float = 1.0
    """Sampling temperature of the inference service: logprobs are taken under logits / temperature."""
    lr: float = 1e-5
    schedule: str = "constant"
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
    off_policy: str = "none"
    """How the loss treats samples from older weights: "none" (PPO ratio against the behaviour
    logprobs), "decoupled" (ratio against the trainer's own proximal policy, importance weight
    behaviour -> proximal truncated at is_cap) or "tis" (truncated importance sampling, no clipping)."""
    is_cap: float = 5.0
    """Truncation of importance weights (decoupled, tis)."""
    max_staleness: int | None = None
    """Drop samples whose first token was generated more than this many versions ago (counted)."""
    micro_batch: int = 32
    """Rows per forward/backward; gradients accumulate over a mini-batch's micro-batches."""
    loss_agg: str = "token-mean"
    """token-mean, seq-mean-token-mean or seq-mean-token-sum (normalised over the whole step)."""
    policy_loss: str = "ppo"
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
    kl_estimator: str = "k3"
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

    def __post_init__(self) -> None:
        require(self.lr > 0, "lr", "must be > 0")
        require(self.engine in ("fsdp", "sim"), "engine", f"{self.engine!r} is not 'fsdp' or 'sim'")
        require(self.schedule in SCHEDULES, "schedule", f"{self.schedule!r} is not one of {SCHEDULES}")
        require(self.loss_agg in AGGREGATIONS, "loss_agg", f"{self.loss_agg!r} is not one of {AGGREGATIONS}")
        require(
            self.policy_loss in POLICY_LOSSES, "policy_loss", f"{self.policy_loss!r} not in {POLICY_LOSSES}"
        )
        require(self.micro_batch >= 1, "micro_batch", "must be >= 1")
        require(self.mini_batches >= 1, "mini_batches", "must be >= 1")
        require(self.epochs >= 1, "epochs", "must be >= 1")
        require(
            self.off_policy in OFF_POLICY, "off_policy", f"{self.off_policy!r} is not one of {OFF_POLICY}"
        )
        require(self.is_cap > 0, "is_cap", "must be > 0")
        require(self.max_staleness is None or self.max_staleness >= 0, "max_staleness", "must be >= 0")
        require(self.warmup_steps >= 0, "warmup_steps", "must be >= 0")
        require(self.kl_estimator in ("k1", "k2", "k3"), "kl_estimator", "must be k1, k2 or k3")
        require(self.dual_clip is None or self.dual_clip > 1, "dual_clip", "must be > 1 (or None)")
        require(self.kl_coef >= 0 and self.entropy_coef >= 0, "kl_coef", "coefficients must be >= 0")
        require(self.kl_target is None or self.kl_target > 0, "kl_target", "must be > 0 (or None)")
        require(
            min(self.distill_coef, self.distill_advantage, self.pg_coef) >= 0, "distill_coef",
            "distill_coef, distill_advantage and pg_coef must be >= 0",
        )  # fmt: skip
        require(not (self.value_head and self.engine == "sim"), "value_head", "needs engine='fsdp'")
        require(self.value_coef >= 0, "value_coef", "must be >= 0")
        require(self.value_clip is None or self.value_clip > 0, "value_clip", "must be > 0 (or None)")
        require(
            not self.distills or (bool(self.teachers) and all(w > 0 for w in self.teachers.values())),
            "teachers",
            f"{self.teachers!r}: distillation needs at least one teacher, each with a weight > 0",
        )

    @property
    def distills(self) -> bool:
        """Whether the trainer reads teacher columns."""
        return self.distill_coef > 0 or self.distill_advantage > 0 or self.distill_metric

    @property
    def batch_size(self) -> int:
        return self.prompts_per_step * self.group_size

    def columns(self) -> tuple[str, ...]:
        from meshrl.roles.teacher.config import teacher_columns

        cols: tuple[str, ...] = (
            "prompt",
            "response",
            "logprobs",
            "version",
            "reward",
            "token_rewards" if self.value_head else "advantage",
            "valid",
            "gen_s",
            "gen_batch",
        )
        cols += ("ref_logprobs",) if self.kl_coef > 0 or self.kl_metric else ()
        for name in sorted(self.teachers) if self.distills else ():
            cols += teacher_columns(name)
        return cols

    def reads(self) -> Columns:
        return {SAMPLES: self.columns()}

    def writes(self) -> Columns:
        return {GATE: ("version",), CHECKPOINT: ("step",)}

    def retention(self) -> Columns:
        return {SAMPLES: ("trainer",)}

    def check(self, recipe: Recipe, group: ServiceGroup) -> list[str]:
        from meshrl.roles.inference.config import InferenceConfig
        from meshrl.roles.rollout.config import RolloutConfig

        problems = []
        if not Path(self.model).exists():
            problems.append(f"model: path {self.model!r} does not exist (build or download the model first)")
        if group.replicas != 1:
            problems.append("replicas: one trainer replica (scale it with devices_per_replica)")
        world = max(1, group.devices_per_replica)
        if self.prompts_per_step % world:
            problems.append(
                f"prompts_per_step: {self.prompts_per_step} must divide among {world} trainer ranks"
            )
        groups = {g.id: g for g in recipe.groups}
        for gid in self.inference:
            g = groups.get(gid)
            if g is None or not isinstance(g.config, InferenceConfig):
                problems.append(f"inference: {gid!r} is not an inference group of this recipe")
            elif g.config.temperature != self.temperature:
                problems.append(
                    f"temperature: {self.temperature} differs from {gid}.temperature {g.config.temperature}; "
                    "logprobs would not match the sampling distribution"
                )
        for ring in recipe.rings:
            members = {m.group for m in ring.members}
            missing = [gid for gid in self.inference if gid not in members]
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
        for g in recipe.groups:
            if isinstance(g.config, RolloutConfig) and (g.config.prompts_per_step, g.config.group_size) != (
                self.prompts_per_step,
                self.group_size,
            ):
                problems.append(
                    f"prompts_per_step/group_size: ({self.prompts_per_step}, {self.group_size}) differ from "
                    f"{g.id}'s ({g.config.prompts_per_step}, {g.config.group_size})"
                )
        return problems
