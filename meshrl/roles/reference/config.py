"""Configuration of the reference service."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshrl.models.vision import disagreement
from meshrl.planning.wiring import Write
from meshrl.roles.scorer_config import ScorerConfig
from meshrl.schema import REF_LOGPROBS, SAMPLES

if TYPE_CHECKING:
    from meshrl.planning.recipe import RunSettings, ServiceGroup
    from meshrl.planning.wiring import Wiring


@dataclass(frozen=True, kw_only=True)
class ReferenceConfig(ScorerConfig):
    """A frozen causal LM (usually the initial policy) that writes `ref_logprobs`: the log-probability of
    every response token, under logits / the recipe's temperature, like the trainer's."""

    service = "meshrl.roles.reference.service:ReferenceService"

    def writes(self) -> tuple[Write, ...]:
        return (Write("score", SAMPLES, (REF_LOGPROBS,)),)

    def check(self, run: RunSettings, group: ServiceGroup, wiring: Wiring) -> list[str]:
        why = disagreement(self.model, wiring.claim("score").columns)
        return super().check(run, group, wiring) + ([why] if why else [])
