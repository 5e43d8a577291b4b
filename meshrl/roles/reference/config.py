"""Configuration of the reference service."""

from __future__ import annotations

from dataclasses import dataclass

from meshrl.planning.wiring import Write
from meshrl.roles.scorer_config import ScorerConfig
from meshrl.schema import REF_LOGPROBS, SAMPLES


@dataclass(frozen=True, kw_only=True)
class ReferenceConfig(ScorerConfig):
    """A frozen causal LM (usually the initial policy) that writes `ref_logprobs`: the log-probability of
    every response token, under logits / the recipe's temperature, like the trainer's."""

    service = "meshrl.roles.reference.service:ReferenceService"

    def writes(self) -> tuple[Write, ...]:
        return (Write("score", SAMPLES, (REF_LOGPROBS,)),)
