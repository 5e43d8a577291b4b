"""The settings the engines take whole, one section per component (torchtitan's way).

A service's config holds these sections as fields (`trainer.optim.lr`, `trainer.memory.precision`,
`inference.vllm.kv_cache_gb`) and hands each, whole, to the component that uses it: the optimizer and its
schedule (`OptimConfig`), how a step fits in memory (`MemoryConfig`), LoRA adapters (`LoraConfig`), what
a policy step minimises (`LossConfig`, `KLConfig`, `DistillConfig`, `ValueHeadConfig`, `MoEConfig`: the
FSDP engine's objective, `objective.py`), the generation engines' own settings, and the simulated engines'.
The trainer and the critic share the optimizer and memory sections; rollout's KL penalty in the reward
is a `KLConfig` too (`rollout.kl_penalty`), so a name means one thing wherever it appears.

Nothing here imports torch: recipes are planned in a process that never loads it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

from meshrl.planning.config import Config

Schedule = Literal["constant", "linear", "cosine"]
KLEstimator = Literal["k1", "k2", "k3"]


@dataclass(frozen=True, kw_only=True)
class OptimConfig(Config):
    """AdamW and its learning rate: warm-up, then constant, linear decay to 0 at the last step, or cosine."""

    lr: float = 1e-5
    schedule: Schedule = "constant"
    """Learning-rate schedule after warm-up: constant, linear (to 0 at the last step) or cosine."""
    warmup_steps: int = 0
    """Optimizer steps of linear warm-up from lr / warmup_steps."""
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0
    """Max global grad norm (0 disables clipping)."""

    def validate(self) -> Iterator[str]:
        if not self.lr > 0:
            yield f"lr: must be > 0, got {self.lr}"
        if self.warmup_steps < 0:
            yield f"warmup_steps: must be >= 0, got {self.warmup_steps}"
        if self.weight_decay < 0:
            yield f"weight_decay: must be >= 0, got {self.weight_decay}"
        if self.grad_clip < 0:
            yield f"grad_clip: must be >= 0 (0 disables clipping), got {self.grad_clip}"


@dataclass(frozen=True, kw_only=True)
class MemoryConfig(Config):
    """How a step fits in memory: micro-batches of rows or of tokens, the precision of the forward and
    backward, recomputed activations, logits a chunk of positions at a time."""

    micro_batch: int = 32
    """Rows per forward/backward; gradients accumulate over a mini-batch's micro-batches."""
    max_tokens_per_micro_batch: int | None = None
    """Fill micro-batches by tokens instead (micro_batch is then unused): several samples packed into
    each row (as wide as the longest sample), each attending only to itself, and as many rows per
    micro-batch as this many tokens hold. Padding goes, and the memory of a micro-batch is bounded by
    tokens whatever the lengths. Needs a per-token loss (loss.aggregation token-mean, loss.policy ppo)."""
    precision: Literal["fp32", "bf16-mixed"] = "fp32"
    """fp32, or bf16-mixed: float32 parameters, gradients and optimizer state (small updates are not
    rounded away), forward and backward in bfloat16, weights published to inference in bfloat16."""
    activation_checkpointing: bool = False
    """Keep only each decoder layer's input for the backward pass and recompute the rest: activation
    memory of one layer instead of all, for about one more forward pass of time."""
    logits_chunk: int = 1024
    """Positions whose logits exist at a time when computing the policy's log-probs and entropy from the
    last hidden state (recomputed in the backward pass); 0: the whole micro-batch's logits at once.
    Distillation always computes them whole (its top-k KL reads them)."""

    def validate(self) -> Iterator[str]:
        if self.micro_batch < 1:
            yield f"micro_batch: must be >= 1, got {self.micro_batch}"
        if self.max_tokens_per_micro_batch is not None and self.max_tokens_per_micro_batch < 1:
            yield f"max_tokens_per_micro_batch: must be >= 1 (or None: micro_batch rows), got {self.max_tokens_per_micro_batch}"
        if self.logits_chunk < 0:
            yield "logits_chunk: must be >= 0 (0: whole logits)"


@dataclass(frozen=True, kw_only=True)
class LoraConfig(Config):
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

    def validate(self) -> Iterator[str]:
        if self.rank < 0:
            yield f"rank: must be >= 0 (0: no adapters), got {self.rank}"
        if not self.alpha > 0:
            yield f"alpha: must be > 0, got {self.alpha}"
        if not 0 <= self.dropout < 1:
            yield f"dropout: must be in [0, 1), got {self.dropout}"


@dataclass(frozen=True, kw_only=True)
class LossConfig(Config):
    """The policy-gradient loss of a step (`meshrl/algorithms/losses.py`)."""

    policy: Literal["ppo", "gspo"] = "ppo"
    """ppo (clipped ratio per token) or gspo (sequence-level ratio)."""
    aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    """How per-token losses become the step's: token-mean, seq-mean-token-mean or seq-mean-token-sum
    (normalised over the whole step)."""
    clip_low: float = 0.2
    clip_high: float = 0.2
    """Upper clip of the ratio; larger than clip_low is DAPO's clip-higher."""
    dual_clip: float | None = None
    """Dual-clip constant (> 1) bounding the loss of negative-advantage tokens."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus."""
    off_policy: Literal["none", "decoupled", "tis"] = "none"
    """How the loss treats samples from older weights: "none" (PPO ratio against the behaviour
    logprobs), "decoupled" (ratio against the trainer's own proximal policy, importance weight
    behaviour -> proximal truncated at is_cap) or "tis" (truncated importance sampling, no clipping)."""
    is_cap: float = 5.0
    """Truncation of importance weights (decoupled, tis)."""
    pg_coef: float = 1.0
    """Weight of the task advantage (the reward's policy gradient); see distill.advantage."""

    def validate(self) -> Iterator[str]:
        if self.dual_clip is not None and self.dual_clip <= 1:
            yield "dual_clip: must be > 1 (or None)"
        if self.is_cap <= 0:
            yield "is_cap: must be > 0"
        if self.entropy_coef < 0 or self.pg_coef < 0:
            yield "entropy_coef, pg_coef: must be >= 0"

    @property
    def per_token(self) -> bool:
        """Whether the loss is a sum over tokens, so that samples may be packed into rows."""
        return self.aggregation == "token-mean" and self.policy == "ppo"


@dataclass(frozen=True, kw_only=True)
class KLConfig(Config):
    """A KL(policy || reference) term and its coefficient, fixed or adaptive (Ziegler et al. 2019): in the
    trainer's loss (`trainer.kl`), or as a penalty in the reward (`rollout.kl_penalty`). Either needs a
    reference service writing `ref_logprobs`."""

    coef: float = 0.0
    """Its weight (0: off)."""
    target: float | None = None
    """Adapt coef towards this KL (per token in the loss, per sample in the reward); None: fixed."""
    horizon: int = 10000
    """Samples over which the adaptive coefficient moves by at most 20%."""
    estimator: KLEstimator = "k3"
    """Per-token KL estimator: k1, k2 or k3."""

    def validate(self) -> Iterator[str]:
        if self.coef < 0:
            yield "coef: must be >= 0"
        if self.target is not None and self.target <= 0:
            yield "target: must be > 0 (or None)"
        if self.horizon < 1:
            yield "horizon: must be >= 1"


@dataclass(frozen=True, kw_only=True)
class KLLossConfig(KLConfig):
    """The trainer's KL-to-reference term in the loss."""

    metric: bool = False
    """Read ref_logprobs and report kl_ref even when coef is 0 (e.g. the KL penalty is in the reward)."""

    @property
    def reads_reference(self) -> bool:
        return self.coef > 0 or self.metric


@dataclass(frozen=True, kw_only=True)
class DistillConfig(Config):
    """On-policy distillation from teacher services' columns (`meshrl/algorithms/distill.py`)."""

    teachers: dict[str, float] = field(default_factory=lambda: {"teacher": 1.0})
    """The teachers to learn from (their column prefix) and their weights. Read only when coef,
    advantage or metric asks for them."""
    coef: float = 0.0
    """Weight of the loss term forward-KL(teacher top-k || student) at every response token."""
    advantage: float = 0.0
    """Weight of the dense per-token advantage log p_teacher - log p_student (of the sampled token;
    a reverse-KL reward), added to loss.pg_coef times the task advantage."""
    floor: float = -20.0
    """Clamp of the student's logprobs in the forward KL: a token it rules out costs a bounded loss."""
    metric: bool = False
    """Read the teachers' columns and report KL / agreement even when coef and advantage are 0."""

    def validate(self) -> Iterator[str]:
        if min(self.coef, self.advantage) < 0:
            yield "coef, advantage: must be >= 0"
        if self.active and not (self.teachers and all(w > 0 for w in self.teachers.values())):
            yield f"teachers: {self.teachers!r}: distillation needs at least one teacher, each with a weight > 0"

    @property
    def active(self) -> bool:
        """Whether the trainer reads teacher columns."""
        return self.coef > 0 or self.advantage > 0 or self.metric


@dataclass(frozen=True, kw_only=True)
class ValueHeadConfig(Config):
    """Shared-backbone actor-critic (PPO without a critic model): a linear value head on the policy's
    last hidden state, trained with it by coef x the clipped value loss. The trainer then takes each
    mini-batch's values before updating on it and computes GAE advantages and returns itself, from the
    per-token rewards of a rollout with values="trainer" (with that rollout's gamma, lam, whiten). The
    head is saved as value_head.safetensors next to the final model. A critic with its own model and
    optimizer is the critic service instead."""

    head: bool = False
    """Train a value head on the policy."""
    coef: float = 0.5
    """Weight of the value loss in the actor-critic's loss."""
    clip: float | None = 0.2
    """Clip of the value update around the values the advantages used (None: plain squared error)."""

    def validate(self) -> Iterator[str]:
        if self.coef < 0:
            yield "coef: must be >= 0"
        if self.clip is not None and self.clip <= 0:
            yield "clip: must be > 0 (or None)"


@dataclass(frozen=True, kw_only=True)
class MoEConfig(Config):
    """A mixture of experts' routers in the policy step (`meshrl/engines/experts.py`). The expert load
    (tokens per expert, the busiest expert over the mean) is reported for every such model; the
    auxiliary loss only on request."""

    aux_loss_coef: float = 0.0
    """Weight of the routers' load-balancing loss (the Switch Transformer's, averaged over MoE layers:
    1 when the tokens spread evenly over the experts, up to experts / top-k when the same top-k take
    them all), added to the policy loss; 0: off. Needs a mixture of experts."""

    def validate(self) -> Iterator[str]:
        if self.aux_loss_coef < 0:
            yield f"aux_loss_coef: must be >= 0 (0: off), got {self.aux_loss_coef}"


@dataclass(frozen=True)
class GAESettings:
    """GAE's discount and lambda, and whether advantages are whitened: what the trainer's value head
    takes from the rollout that writes per-token rewards for it."""

    gamma: float
    lam: float
    whiten: bool


# ---------------------------------------------------------------------------------------------------------
# generation engines


INSTALL = {
    "vllm": "pip install 'meshrl[vllm]' (then: pip uninstall -y torchvision torchaudio torchcodec)",
    "sglang": "pip install 'meshrl[sglang]'",
}
"""How to install the optional generation engines."""


def installed(engine: str) -> bool:
    """Whether the package of optional engine `engine` ("vllm", "sglang") can be imported (not importing it)."""
    import importlib.util

    return importlib.util.find_spec(engine) is not None


@dataclass(frozen=True, kw_only=True)
class VLLMSettings(Config):
    """Settings of the vLLM engine (engine="vllm")."""

    kv_cache_gb: float = 1.0
    """KV cache size on CPU (VLLM_CPU_KVCACHE_SPACE); on GPU vLLM sizes it from free memory."""
    gpu_memory_fraction: float = 0.9
    """On GPU, the share of the GPU's memory vLLM may take for weights, activations and KV cache (its
    `gpu_memory_utilization`); lower it when another slot shares the GPU (`meshrl run --devices 0,0`)."""
    max_model_len: int | None = None
    """Longest prompt + completion (None: the model's own limit)."""

    def validate(self) -> Iterator[str]:
        if not 0 < self.gpu_memory_fraction <= 1:
            yield "gpu_memory_fraction: must be in (0, 1]"


@dataclass(frozen=True, kw_only=True)
class SGLangSettings(Config):
    """Settings of the SGLang engine (engine="sglang", GPU only)."""

    mem_fraction: float = 0.8
    """Share of the GPU's memory SGLang takes for weights and KV cache (its `mem_fraction_static`)."""
    max_model_len: int | None = None
    """Longest prompt + completion (None: the model's own limit)."""


# ---------------------------------------------------------------------------------------------------------
# simulated engines (benchmarks: time only)


@dataclass(frozen=True, kw_only=True)
class SimGeneration(Config):
    """The simulated generation engine (engine="sim"): time only, for pipeline benchmarks."""

    token_s: float = 0.0005
    """Seconds per decoding step of a batch."""
    median_tokens: float = 100.0
    """Median response length."""
    sigma: float = 1.0
    """Spread of the lognormal length distribution (1.0: the 99th percentile is ~10x the median)."""


@dataclass(frozen=True, kw_only=True)
class SimTraining(Config):
    """The simulated training engine (engine="sim"): time only, for pipeline benchmarks."""

    token_s: float = 25e-6
    """Seconds of simulated optimizer step per trained token."""
