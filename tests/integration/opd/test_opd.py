"""On-policy distillation through real services: a teacher adds its columns to the student's rows."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from meshrl.dataplane.ledger import account, written_before
from meshrl.observe.status import collect
from meshrl.schema import teacher_columns
from tests.conftest import free_base_port
from tests.integration.grpo.test_grpo import REPO, rows, run

OPD = str(REPO / "recipes" / "opd_arith.py")
OPD_COLOCATED = str(REPO / "recipes" / "opd_arith_colocated.py")


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
            "total_steps=60", "rollout.eval_every=0", "trainer.distill.coef=0", "trainer.loss.pg_coef=0",
            "trainer.distill.advantage=1", recipe=OPD)  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    m = rows(run_dir / "metrics.jsonl")
    reverse = [x["teacher_reverse_kl"] for x in m]
    assert mean(reverse[-10:]) < 0.8 * mean(reverse[:10]), reverse
    assert mean([x["teacher_agreement"] for x in m[-10:]]) > mean([x["teacher_agreement"] for x in m[:10]])


def run_watched(tmp_path: Path, run_dir: Path, *overrides: str, recipe: str) -> tuple[int, str, list[dict]]:
    """`meshrl run`, with `meshrl status` taken every 0.2 s while it runs: (exit code, stderr, snapshots)."""
    err = tmp_path / "run.err"
    with open(err, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "meshrl.cli", "run", recipe, f"base_port={free_base_port()}",
             f"run_dir={run_dir}", *overrides],
            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=stderr, env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
        snapshots: list[dict[str, Any]] = []
        try:
            deadline = time.monotonic() + 300
            while proc.poll() is None and time.monotonic() < deadline:
                if (run_dir / "dataplane.json").exists():
                    with contextlib.suppress(ValueError):  # a run file caught half-written
                        snapshots.append(collect(run_dir))
                time.sleep(0.2)
            code = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return code, err.read_text(), snapshots


def test_colocated_distillation_hands_the_devices_around_and_trains_only_on_scored_rows(
    tmp_path, weak_model, teacher_model
):
    """recipes/opd_arith_colocated.py: inference (FALLBACK), teacher and trainer (ON_DEMAND) take turns
    on one device slot. Every step runs, every row the trainer took was scored by the teacher, and
    `meshrl status` sees the token move and every member offload between its turns."""
    run_dir, steps = tmp_path / "run", 8
    code, stderr, snapshots = run_watched(
        tmp_path, run_dir, f"*.model={weak_model}", f"teacher.model={teacher_model}", f"total_steps={steps}",
        "rollout.eval_every=0", recipe=OPD_COLOCATED,
    )  # fmt: skip
    assert code == 0, stderr[-4000:]
    m = rows(run_dir / "metrics.jsonl")
    assert [x["step"] for x in m] == list(range(steps))
    assert all(x["time/ring_s"] >= 0 and x["teacher_kl"] >= 0 for x in m)
    acked, scored = written_before(run_dir / "ledger.jsonl", teacher_columns("teacher"))
    assert acked == scored == steps * 128
    tally = account(run_dir / "ledger.jsonl")
    assert (tally.consumed, tally.duplicated, tally.unknown) == (steps * 128, 0, 0)
    # hand-offs: each member had turns of its own (restored for it, offloaded after it; the first
    # offload is at joining), and the ring counted the turns it granted. The holder at any instant is
    # a sample, not a count, so the test reads the counters.
    counts: dict[str, dict[str, int]] = {}
    turns = 0
    for s in snapshots:
        for svc in s["services"]:
            c = counts.setdefault(svc["name"], {})
            for key in ("offloads", "restores"):
                c[key] = max(c.get(key, 0), svc["health"].get(key, 0))
        for ring in s["rings"]:
            turns = max(turns, ring["turns"])
    for name in ("inference-0-0", "teacher-0-0", "trainer-0-0"):
        c = counts.get(name, {})
        assert c.get("offloads", 0) >= 2 and c.get("restores", 0) >= 1, (counts, len(snapshots))
    assert turns >= 3, (turns, len(snapshots))
    sizes = {p.name: p.stat().st_size for p in (run_dir / "offload").iterdir()}
    assert min(sizes[f"{g}-0-0.bin"] for g in ("inference", "teacher", "trainer")) > 0, sizes
