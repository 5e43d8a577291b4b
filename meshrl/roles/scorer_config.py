"""The configuration the frozen scoring services share (reference, reward model, teacher), apart from
their service code (`meshrl/roles/scorer.py`): planning a recipe imports configs, and must not import
torch."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshrl.models.hub import missing
from meshrl.planning.config import ServiceConfig
from meshrl.planning.wiring import Read
from meshrl.schema import IMAGE_MASK, IMAGES, PROMPT, RESPONSE, SAMPLES, SEGMENTS

if TYPE_CHECKING:
    from meshrl.planning.recipe import RunSettings, ServiceGroup
    from meshrl.planning.wiring import Wiring


@dataclass(frozen=True, kw_only=True)
class ScorerConfig(ServiceConfig):
    rejoins = True  # frozen: a restarted replica just claims rows again

    model: str
    """Local path of the frozen model."""
    loader_kwargs: dict[str, Any] = field(default_factory=dict)
    """Passed to from_pretrained."""
    max_batch: int = 64
    """Rows per claim."""
    max_tokens: int = 8192
    """Padded tokens per forward (rows are sorted by length and packed up to this budget)."""
    threads: int = 0
    """torch threads (0: leave the default)."""

    def validate(self) -> Iterator[str]:
        if self.max_batch < 1:
            yield "max_batch: must be >= 1"
        if self.max_tokens < 1:
            yield "max_tokens: must be >= 1"

    def reads(self) -> tuple[Read, ...]:
        # an agent's samples come in segments (meshrl/envs/trajectory.py)
        return (Read("score", SAMPLES, (PROMPT, RESPONSE), optional=(SEGMENTS, IMAGES, IMAGE_MASK)),)

    def check(self, run: RunSettings, group: ServiceGroup, wiring: Wiring) -> list[str]:
        problems = []
        if not Path(self.model).exists():
            problems.append(missing(self.model))
        if group.devices_per_replica > 1:
            problems.append("devices_per_replica: a scoring replica runs on one device (add replicas)")
        return problems
