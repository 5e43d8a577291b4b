"""Configuration of the critic service."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshrl.engines.settings import MemoryConfig, OptimConfig
from meshrl.models.hub import missing
from meshrl.models.vision import disagreement
from meshrl.planning.config import ServiceConfig
from meshrl.planning.wiring import Read, Write
from meshrl.schema import IMAGE_MASK, IMAGES, PROMPT, RESPONSE, RETURNS, SAMPLES, SEGMENTS, VALID, VALUES

if TYPE_CHECKING:
    from meshrl.planning.recipe import RunSettings, ServiceGroup
    from meshrl.planning.wiring import Wiring

VALUES_CONSUMER = "critic-values"
TRAIN_CONSUMER = "critic"
IMAGE_COLUMNS = (IMAGES, IMAGE_MASK)
"""A vision-language model's prompts' pixels: its critic reads them too."""


@dataclass(frozen=True, kw_only=True)
class CriticConfig(ServiceConfig):
    """A value model with its own optimizer and weight version. It writes `values` (one per response
    token) for new samples and trains on the `returns` rollout computes from them (GAE)."""

    service = "meshrl.roles.critic.service:CriticService"
    stateful = True
    rejoins = True  # a restarted critic goes on from its progress, with the latest checkpoint's weights

    model: str
    """Initial weights: a causal LM (usually the policy; the value head starts fresh) or a saved critic.
    A vision-language model's critic is the model with a linear value head on its last hidden state
    (its vision tower frozen), saved as the model plus `value_head.safetensors`."""
    loader_kwargs: dict[str, Any] = field(default_factory=dict)
    optim: OptimConfig = OptimConfig()
    """AdamW and its learning-rate schedule."""
    memory: MemoryConfig = MemoryConfig()
    """Micro-batches of rows, precision, activation checkpointing."""
    mini_batches: int = 1
    """Optimizer steps per batch of samples (one critic version)."""
    epochs: int = 1
    """Optimizer steps over each mini-batch."""
    value_clip: float | None = 0.2
    """Clip of the value update around the values the advantages used (None: plain squared error)."""
    max_batch: int = 64
    """Rows per claim of new samples to compute values for."""
    save_final: bool = True
    """Save the critic (HF token-classification checkpoint) in <run_dir>/critic at the end."""
    threads: int = 0

    def validate(self) -> Iterator[str]:
        if self.mini_batches < 1 or self.epochs < 1:
            yield "mini_batches: mini_batches, epochs >= 1"
        if self.max_batch < 1:
            yield "max_batch: must be >= 1"
        if self.value_clip is not None and self.value_clip <= 0:
            yield "value_clip: must be > 0 (or None)"

    def reads(self) -> tuple[Read, ...]:
        return (
            # an agent's samples come in segments (meshrl/envs/trajectory.py)
            Read(
                "values",
                SAMPLES,
                (PROMPT, RESPONSE),
                consumer=VALUES_CONSUMER,
                optional=(SEGMENTS, *IMAGE_COLUMNS),
            ),
            Read(
                "train",
                SAMPLES,
                (PROMPT, RESPONSE, VALUES, RETURNS, VALID),
                consumer=TRAIN_CONSUMER,
                retains=True,
                optional=(SEGMENTS, *IMAGE_COLUMNS),
            ),
        )

    def writes(self) -> tuple[Write, ...]:
        return (Write("values", SAMPLES, (VALUES,)),)

    def check(self, run: RunSettings, group: ServiceGroup, wiring: Wiring) -> list[str]:
        problems = []
        if not Path(self.model).exists():
            problems.append(missing(self.model))
        elif why := disagreement(self.model, wiring.claim("values").columns):
            problems.append(why)
        if group.replicas != 1 or group.devices_per_replica > 1:
            problems.append("replicas/devices_per_replica: the critic runs as one replica on one device")
        if run.batch_size % self.mini_batches:
            problems.append(
                f"mini_batches: must divide the recipe's prompts_per_step x group_size ({run.batch_size})"
            )
        return problems
