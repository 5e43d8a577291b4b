"""Configuration of the training service: its own settings, and the sections the engine and the loss
take whole (meshrl/engines/settings.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from meshrl.engines.settings import (
    DistillConfig,
    KLLossConfig,
    LoraConfig,
    LossConfig,
    MemoryConfig,
    MoEConfig,
    OptimConfig,
    SimTraining,
    ValueHeadConfig,
)
from meshrl.models.vision import disagreement
from meshrl.planning.config import ServiceConfig
from meshrl.planning.wiring import Read, Write
from meshrl.schema import (
    ADVANTAGE,
    GATE,
    GEN_BATCH,
    GEN_S,
    IMAGE_MASK,
    IMAGES,
    LOGPROBS,
    LOSS_MASK,
    PROMPT,
    REF_LOGPROBS,
    RESPONSE,
    REWARD,
    SAMPLES,
    SEGMENTS,
    TOKEN_REWARDS,
    VALID,
    VERSION,
    teacher_columns,
)

if TYPE_CHECKING:
    from meshrl.planning.recipe import RunSettings, ServiceGroup
    from meshrl.planning.wiring import Wiring

_SECTIONS = {
    "optim": ("lr", "schedule", "warmup_steps", "weight_decay", "betas", "grad_clip"),
    "memory": ("micro_batch", "max_tokens_per_micro_batch", "precision", "activation_checkpointing",
               "logits_chunk"),
    "loss": ("clip_low", "clip_high", "dual_clip", "entropy_coef", "off_policy", "is_cap", "pg_coef"),
}  # fmt: skip
MOVED = {
    **{old: f"{section}.{old}" for section, names in _SECTIONS.items() for old in names},
    "loss_agg": "loss.aggregation",
    "policy_loss": "loss.policy",
    **{f"kl_{k}": f"kl.{k}" for k in ("coef", "target", "horizon", "estimator", "metric")},
    "teachers": "distill.teachers",
    **{f"distill_{k}": f"distill.{k}" for k in ("coef", "advantage", "floor", "metric")},
    "value_head": "value.head",
    "value_coef": "value.coef",
    "value_clip": "value.clip",
    "inference": "nothing here: inference groups name the trainer they follow (<inference group>.trainer)",
}
"""Fields of the flat trainer config of earlier versions, and where each went."""


@dataclass(frozen=True, kw_only=True)
class TrainerConfig(ServiceConfig):
    service = "meshrl.roles.trainer.service:TrainerService"
    moved: ClassVar[dict[str, str]] = MOVED
    publishes_weights = True
    takes_checkpoints = True

    model: str
    """Local path of the initial policy."""
    loader_kwargs: dict[str, Any] = field(default_factory=dict)
    """Passed to AutoModelForCausalLM.from_pretrained."""
    engine: Literal["fsdp", "sim"] = "fsdp"
    """Training engine: "fsdp" (FSDP2 over an HF causal LM) or "sim" (sleeps; pipeline benchmarks)."""
    sim: SimTraining = SimTraining()
    """Settings of the simulated engine."""
    optim: OptimConfig = OptimConfig()
    """AdamW and its learning-rate schedule."""
    memory: MemoryConfig = MemoryConfig()
    """Micro-batches (rows or tokens), precision, activation checkpointing, chunked logits."""
    lora: LoraConfig = LoraConfig()
    """LoRA: set lora.rank > 0 to train adapters; inference receives them merged (or alone, for vLLM)."""
    train_vision: bool = False
    """A vision-language model's vision tower trains too (by default it is frozen, and LoRA leaves it
    out; the connector between it and the language model trains)."""
    loss: LossConfig = LossConfig()
    """The policy loss: PPO clip or GSPO, aggregation, clipping, entropy bonus, off-policy correction."""
    kl: KLLossConfig = KLLossConfig()
    """The KL-to-reference term of the loss (needs a reference service writing ref_logprobs)."""
    distill: DistillConfig = DistillConfig()
    """On-policy distillation from teacher services."""
    value: ValueHeadConfig = ValueHeadConfig()
    """A value head on the policy (PPO's actor-critic without a critic service)."""
    moe: MoEConfig = MoEConfig()
    """A mixture of experts' routers: the auxiliary load-balancing loss (off unless moe.aux_loss_coef > 0)."""
    mini_batches: int = 1
    """Optimizer steps per training step (one weight version), each on a mini-batch of the step's
    samples; new weights are published after the last. Later mini-batches are slightly off-policy;
    the loss accounts for it."""
    mix_groups: bool = False
    """Draw mini-batches at random from the whole step's samples, each holding samples of every group (as
    TRL does): with Adam, every optimizer step then pushes on all of the step's prompts, and the training
    reward rises faster; on the demo the held-out accuracy did not (docs/architecture.md). False: each
    mini-batch is whole groups, trained as soon as they are scored (the first waits for its own groups
    only, not the whole step's)."""
    epochs: int = 1
    """Optimizer steps over each mini-batch (PPO epochs)."""
    max_staleness: int | None = None
    """Drop samples whose first token was generated more than this many versions ago (counted)."""
    bucket_mb: int = 64
    """Weight broadcast bucket size."""
    max_nan_steps: int = 3
    """Consecutive steps with a non-finite loss or gradient after which the run stops."""
    save_final: bool = True
    """Save a Hugging Face checkpoint in <run_dir>/final at the end."""
    threads: int = 0
    """torch threads of each trainer process (0: leave the default)."""

    def validate(self) -> Iterator[str]:
        if min(self.mini_batches, self.epochs) < 1:
            yield "mini_batches, epochs: must be >= 1"
        if self.max_staleness is not None and self.max_staleness < 0:
            yield "max_staleness: must be >= 0"
        if {"dtype", "torch_dtype"} & set(self.loader_kwargs):
            yield "loader_kwargs: the trainer's dtype is set by trainer.memory.precision (fp32 or bf16-mixed)"
        if self.value.head and self.engine == "sim":
            yield "value.head: needs engine='fsdp'"
        if self.moe.aux_loss_coef > 0 and self.engine != "fsdp":
            yield "moe.aux_loss_coef: needs engine='fsdp'"
        if self.lora.rank and (self.value.head or self.engine != "fsdp"):
            yield "lora: adapters train the policy of the fsdp engine, without value.head"
        if self.memory.max_tokens_per_micro_batch is not None and not self.loss.per_token:
            yield (
                "memory.max_tokens_per_micro_batch: packing samples into rows needs a per-token loss: "
                "loss.aggregation='token-mean' and loss.policy='ppo' (or set it to None)"
            )

    def columns(self) -> tuple[str, ...]:
        """What every trained row has."""
        cols: tuple[str, ...] = (
            PROMPT, RESPONSE, LOGPROBS, VERSION, REWARD, TOKEN_REWARDS if self.value.head else ADVANTAGE, VALID,
            GEN_S, GEN_BATCH,
        )  # fmt: skip
        cols += (REF_LOGPROBS,) if self.kl.reads_reference else ()
        for name in sorted(self.distill.teachers) if self.distill.active else ():
            cols += teacher_columns(name)
        return cols

    def reads(self) -> tuple[Read, ...]:
        # agents' trajectories carry a loss mask (the environment's tokens are not trained)
        return (
            Read(
                "train",
                SAMPLES,
                self.columns(),
                consumer="trainer",
                optional=(LOSS_MASK, SEGMENTS, IMAGES, IMAGE_MASK),
                retains=True,
            ),
        )

    def writes(self) -> tuple[Write, ...]:
        return (Write("gate", GATE, (VERSION,)),)

    def adapters(self) -> LoraConfig | None:
        return self.lora if self.lora.rank > 0 else None

    def needs(self) -> dict[str, str]:
        if self.value.head:
            return {
                "gae": "the value head computes GAE: set rollout.advantage=gae and rollout.values=trainer"
            }
        return {}

    def offers(self) -> dict[str, Any]:
        return {"policy": self.model}

    def check(self, run: RunSettings, group: ServiceGroup, wiring: Wiring) -> list[str]:
        problems = []
        if not Path(self.model).exists():
            problems.append(f"model: path {self.model!r} does not exist (build or download the model first)")
        if why := disagreement(self.model, wiring.claim("train").columns):
            problems.append(why)
        if group.replicas != 1:
            problems.append("replicas: one trainer replica (scale it with devices_per_replica)")
        if self.moe.aux_loss_coef > 0 and experts(self.model) == 0:
            problems.append(
                f"moe.aux_loss_coef: the model {self.model!r} is not a mixture of experts (its config.json "
                "names no experts): set it to 0"
            )
        world = max(1, group.devices_per_replica)
        if run.prompts_per_step % (world * self.mini_batches):
            problems.append(
                f"mini_batches: the recipe's prompts_per_step ({run.prompts_per_step}) must divide into "
                f"{self.mini_batches} mini-batches of whole groups on each of {world} trainer rank(s)"
            )
        return problems


def experts(model: str) -> int | None:
    """Experts per MoE layer that the model folder's config.json names (0: a dense model), or None when
    there is no config to read."""
    path = Path(model) / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    config = {**config, **(config.get("text_config") or {})}  # a vision-language model's language model
    return max(int(config.get(k) or 0) for k in ("num_experts", "num_local_experts", "n_routed_experts"))
