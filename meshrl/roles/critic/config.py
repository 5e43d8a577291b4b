"""Configuration of the critic service."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshrl.models.hub import missing
from meshrl.planning.config import Columns, ServiceConfig
from meshrl.roles.trainer.config import Schedule
from meshrl.schema import CHECKPOINT_ACKS, PROMPT, RESPONSE, RETURNS, SAMPLES, STEP, VALID, VALUES

if TYPE_CHECKING:
    from meshrl.planning.recipe import Recipe, ServiceGroup

VALUES_CONSUMER = "critic-values"
TRAIN_CONSUMER = "critic"


@dataclass(frozen=True, kw_only=True)
class CriticConfig(ServiceConfig):
    """A value model with its own optimizer and weight version. It writes `values` (one per response
    token) for new samples and trains on the `returns` rollout computes from them (GAE)."""

    service = "meshrl.roles.critic.service:CriticService"
    stateful = True
    rejoins = True  # a restarted critic goes on from its progress, with the latest checkpoint's weights

    model: str
    """Initial weights: a causal LM (usually the policy; the value head starts fresh) or a saved critic."""
    loader_kwargs: dict[str, Any] = field(default_factory=dict)
    lr: float = 1e-5
    schedule: Schedule = "constant"
    warmup_steps: int = 0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0
    mini_batches: int = 1
    """Optimizer steps per batch of samples (one critic version)."""
    epochs: int = 1
    """Optimizer steps over each mini-batch."""
    micro_batch: int = 32
    """Rows per forward/backward."""
    value_clip: float | None = 0.2
    """Clip of the value update around the values the advantages used (None: plain squared error)."""
    max_batch: int = 64
    """Rows per claim of new samples to compute values for."""
    save_final: bool = True
    """Save the critic (HF token-classification checkpoint) in <run_dir>/critic at the end."""
    threads: int = 0

    def validate(self) -> Iterator[str]:
        if self.lr <= 0:
            yield "lr: must be > 0"
        if self.mini_batches < 1 or self.epochs < 1:
            yield "mini_batches: mini_batches, epochs >= 1"
        if self.micro_batch < 1 or self.max_batch < 1:
            yield "micro_batch: batch sizes must be >= 1"
        if self.value_clip is not None and self.value_clip <= 0:
            yield "value_clip: must be > 0 (or None)"

    def reads(self) -> Columns:
        return {SAMPLES: (PROMPT, RESPONSE, VALUES, RETURNS, VALID)}

    def writes(self) -> Columns:
        return {SAMPLES: (VALUES,), CHECKPOINT_ACKS: (STEP,)}

    def retention(self) -> Columns:
        return {SAMPLES: (TRAIN_CONSUMER,)}

    def check(self, recipe: Recipe, group: ServiceGroup) -> list[str]:
        from meshrl.roles.rollout.config import RolloutConfig

        problems = []
        if not Path(self.model).exists():
            problems.append(missing(self.model))
        if group.replicas != 1 or group.devices_per_replica > 1:
            problems.append("replicas/devices_per_replica: the critic runs as one replica on one device")
        if recipe.batch_size % self.mini_batches:
            problems.append(
                f"mini_batches: must divide the recipe's prompts_per_step x group_size ({recipe.batch_size})"
            )
        for g in recipe.groups:
            if isinstance(g.config, RolloutConfig):
                if g.config.advantage != "gae":
                    problems.append(
                        f"{g.id}.advantage is {g.config.advantage!r}: a critic is only used by 'gae'"
                    )
                elif g.config.values != "critic":
                    problems.append(
                        f"{g.id}.values is {g.config.values!r}: it does not read the critic's values"
                    )
        return problems
