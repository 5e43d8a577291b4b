"""Configuration of the teacher service (on-policy distillation)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshrl.planning.config import Columns
from meshrl.roles.scorer_config import ScorerConfig
from meshrl.schema import SAMPLES, teacher_columns

if TYPE_CHECKING:
    from meshrl.planning.recipe import Recipe, ServiceGroup


@dataclass(frozen=True, kw_only=True)
class TeacherConfig(ScorerConfig):
    """A frozen causal LM that scores the student's own samples: for every response token, its `top_k`
    most likely next tokens with their log-probabilities (full-vocabulary softmax under logits /
    temperature), and the log-probability of the token the student sampled. The trainer, whose claim
    lists these columns, distils from them (trainer.distill_coef, trainer.distill_advantage).

    Several teachers write distinct columns by `prefix`; the trainer weighs them (trainer.teachers)."""

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

    def writes(self) -> Columns:
        return {SAMPLES: teacher_columns(self.prefix)}

    def check(self, recipe: Recipe, group: ServiceGroup) -> list[str]:
        from meshrl.roles.trainer.config import TrainerConfig

        problems = super().check(recipe, group)
        if recipe.temperature <= 0:
            problems.append("temperature: the recipe's must be > 0 for a teacher's distribution")
        for g in recipe.groups:
            if not isinstance(g.config, TrainerConfig):
                continue
            if not problems:
                problems += tokenizer_mismatch(self.model, g.config.model, g.id)
        return problems


def tokenizer_mismatch(teacher: str, student: str, student_group: str) -> list[str]:
    """Problems if the teacher's tokenizer does not map text to the same ids as the student's: the
    teacher's top-k ids index the student's vocabulary, so they must be one tokenizer."""
    from transformers import AutoTokenizer

    try:
        t, s = AutoTokenizer.from_pretrained(teacher), AutoTokenizer.from_pretrained(student)
    except Exception as e:  # reported as a recipe problem
        return [f"model: cannot load the teacher's or the student's tokenizer: {e}"]
    tv, sv = t.get_vocab(), s.get_vocab()
    if tv != sv:
        only_t, only_s = sorted(set(tv) - set(sv))[:5], sorted(set(sv) - set(tv))[:5]
        moved = sorted(k for k in set(tv) & set(sv) if tv[k] != sv[k])[:5]
        return [
            f"model: the teacher's tokenizer ({len(tv)} tokens) differs from {student_group}'s "
            f"({len(sv)} tokens): only in the teacher {only_t}, only in the student {only_s}, "
            f"different ids {moved}; distillation needs one vocabulary"
        ]
    if (t.eos_token_id, t.pad_token_id) != (s.eos_token_id, s.pad_token_id):
        return [
            f"model: the teacher's eos/pad ids {(t.eos_token_id, t.pad_token_id)} differ from "
            f"{student_group}'s {(s.eos_token_id, s.pad_token_id)}"
        ]
    return []
