"""Configuration of the reference service."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshrl.planning.recipe import Columns
from meshrl.roles import SAMPLES
from meshrl.roles.scorer_config import ScorerConfig

if TYPE_CHECKING:
    from meshrl.planning.recipe import Recipe, ServiceGroup


@dataclass(frozen=True, kw_only=True)
class ReferenceConfig(ScorerConfig):
    """A frozen causal LM (usually the initial policy) that writes `ref_logprobs`: the log-probability of
    every response token, under logits / temperature like the trainer's."""

    service = "meshrl.roles.reference.service:ReferenceService"

    temperature: float = 1.0
    """Must equal the trainer's (checked)."""

    def writes(self) -> Columns:
        return {SAMPLES: ("ref_logprobs",)}

    def check(self, recipe: Recipe, group: ServiceGroup) -> list[str]:
        from meshrl.roles.trainer.config import TrainerConfig

        problems = super().check(recipe, group)
        for g in recipe.groups:
            if isinstance(g.config, TrainerConfig) and g.config.temperature != self.temperature:
                problems.append(
                    f"temperature: {self.temperature} differs from {g.id}.temperature {g.config.temperature}"
                )
        return problems
