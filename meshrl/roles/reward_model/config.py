"""Configuration of the reward-model service."""

from __future__ import annotations

from dataclasses import dataclass

from meshrl.planning.wiring import Write
from meshrl.roles.scorer_config import ScorerConfig
from meshrl.schema import RM_SCORE, SAMPLES


@dataclass(frozen=True, kw_only=True)
class RewardModelConfig(ScorerConfig):
    """An HF sequence-classification model (one label) that writes `rm_score` for every completion: its
    output at the last token of prompt + response. Rollout weighs it into the reward (the "rm" source of rollout.rewards).

    When the model's tokenizer is not the policy's, rows are decoded with the policy's tokenizer and
    re-encoded with the model's."""

    service = "meshrl.roles.reward_model.service:RewardModelService"

    policy: str | None = None
    """Path of the policy's tokenizer (default: the trainer's model)."""

    def writes(self) -> tuple[Write, ...]:
        return (Write("score", SAMPLES, (RM_SCORE,)),)

    def needs(self) -> dict[str, str]:
        if self.policy is None:
            return {"policy": "set policy= to the policy's tokenizer, or add a trainer group"}
        return {}
