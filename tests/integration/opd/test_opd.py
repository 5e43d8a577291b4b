"""On-policy distillation through real services: a teacher adds its columns to the student's rows."""

from __future__ import annotations

import pytest

from meshrl.dataplane.ledger import account, written_before
from meshrl.roles.teacher.config import teacher_columns
from tests.integration.grpo.test_grpo import REPO, rows, run

OPD = str(REPO / "recipes" / "opd_arith.py")


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def test_student_learns_from_the_teacher_and_only_trains_on_scored_rows(tmp_path, weak_model, teacher_model):
    run_dir = tmp_path / "run"
    r = run(tmp_path, f"*.model={weak_model}", f"teacher.model={teacher_model}", f"run_dir={run_dir}",
            "total_steps=40", "rollout.eval_every=0", recipe=OPD)  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    m = rows(run_dir / "metrics.jsonl")
    assert [x["step"] for x in m] == list(range(40))
    reward = [x["reward_mean"] for x in m]
    agree = [x["teacher_agreement"] for x in m]
    kl = [x["teacher_kl"] for x in m]
    assert mean(reward[-10:]) >= mean(reward[:10]) + 0.08, reward
    assert mean(agree[-10:]) >= mean(agree[:10]) + 0.04, agree
    assert mean(kl[-10:]) < 0.8 * mean(kl[:10]), kl
    # the ledger: every row the trainer took had the teacher's columns written before, none twice
    acked, scored = written_before(run_dir / "ledger.jsonl", teacher_columns("teacher"))
    assert acked == scored == 40 * 128
    tally = account(run_dir / "ledger.jsonl")
    assert (tally.duplicated, tally.unknown) == (0, 0)
    assert account(run_dir / "ledger.jsonl", consumer="teacher").consumed >= acked


@pytest.mark.slow
def test_reverse_kl_advantage_variant_learns_too(tmp_path, weak_model, teacher_model):
    """The teacher's logprob minus the student's, per sampled token, as the only advantage."""
    run_dir = tmp_path / "run"
    r = run(tmp_path, f"*.model={weak_model}", f"teacher.model={teacher_model}", f"run_dir={run_dir}",
            "total_steps=60", "rollout.eval_every=0", "trainer.distill_coef=0", "trainer.pg_coef=0",
            "trainer.distill_advantage=1", recipe=OPD)  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    m = rows(run_dir / "metrics.jsonl")
    reverse = [x["teacher_reverse_kl"] for x in m]
    assert mean(reverse[-10:]) < 0.8 * mean(reverse[:10]), reverse
    assert mean([x["teacher_agreement"] for x in m[-10:]]) > mean([x["teacher_agreement"] for x in m[:10]])
