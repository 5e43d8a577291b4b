"""Configuration of the teacher service (on-policy distillation)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshrl.models import vocab
from meshrl.models.vision import disagreement
from meshrl.planning.wiring import Write
from meshrl.roles.scorer_config import ScorerConfig
from meshrl.schema import SAMPLES, teacher_columns

if TYPE_CHECKING:
    from meshrl.planning.recipe import RunSettings, ServiceGroup
    from meshrl.planning.wiring import Wiring


@dataclass(frozen=True, kw_only=True)
class TeacherConfig(ScorerConfig):
    """A frozen causal LM that scores the student's own samples: for every response token, its `top_k`
    most likely next tokens with their log-probabilities (full-vocabulary softmax under logits /
    temperature), and the log-probability of the token the student sampled. The trainer, whose claim
    lists these columns, distils from them (trainer.distill.coef, trainer.distill.advantage).

    Several teachers write distinct columns by `prefix`; the trainer weighs them (trainer.distill.teachers)."""

    service = "meshrl.roles.teacher.service:TeacherService"

    top_k: int = 8
    """Tokens kept per position."""
    prefix: str = "teacher"
    """Column prefix: {prefix}_topk_ids, {prefix}_topk_logprobs, {prefix}_logprobs."""
    token_chunk: int = 1024
    """Positions per top-k pass; with vocab_chunk, bounds the logits alive at once."""
    vocab_chunk: int = 16384
    """Vocabulary entries per top-k pass."""

    def validate(self) -> Iterator[str]:
        yield from super().validate()
        if self.top_k < 1:
            yield "top_k: must be >= 1"
        if self.token_chunk < 1 or self.vocab_chunk < 1:
            yield "token_chunk: chunks must be >= 1"
        if re.fullmatch(r"[a-z][a-z0-9_]*", self.prefix) is None:
            yield f"prefix: {self.prefix!r} must be lowercase letters, digits and _"

    def writes(self) -> tuple[Write, ...]:
        return (Write("score", SAMPLES, teacher_columns(self.prefix)),)

    def needs(self) -> dict[str, str]:
        return {"policy": "a teacher scores a trainer's samples: add a trainer group"}

    def check(self, run: RunSettings, group: ServiceGroup, wiring: Wiring) -> list[str]:
        problems = super().check(run, group, wiring)
        if run.temperature <= 0:
            problems.append("temperature: the recipe's must be > 0 for a teacher's distribution")
        if why := disagreement(self.model, wiring.claim("score").columns):
            problems.append(why)
        student = wiring.inputs.get("policy")
        if not problems and student is not None and (why := vocab.mismatch(self.model, student)) is not None:
            problems.append(f"model: {why}")
        return problems
