"""A full disk while checkpointing: the run stops with the cause, the checkpoint before stays whole,
and the run resumes from it. The disk is a small tmpfs mounted on the checkpoint directory (root only:
the test skips where mounting is not allowed)."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshrl.state import checkpoint as ckpt
from tests.integration.grpo.test_grpo import rows, run


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """<tmp>/run/checkpoints on a 15 MiB filesystem: one checkpoint of the tiny run (~9.7 MiB) fits,
    a second one does not."""
    where = tmp_path / "run" / "checkpoints"
    where.mkdir(parents=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=15m", "tmpfs", str(where)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_full_disk_while_checkpointing_keeps_the_previous_checkpoint(tmp_path, arith_model, small_disk):
    common = [f"*.model={arith_model}", f"run_dir={tmp_path / 'run'}", "checkpoint_every=1", "keep_checkpoints=2",
              "rollout.eval_every=0"]  # fmt: skip
    r = run(tmp_path, *common, "total_steps=4")
    assert r.returncode != 0
    message = "checkpoint 2 could not be written to .* MB free there: a full disk fails like this.*The checkpoint before, step-00000001, is intact"
    assert re.search(message, r.stderr), r.stderr[-3000:]
    latest = ckpt.latest(tmp_path / "run")
    assert latest is not None and latest.name == "step-00000001"
    assert not list(small_disk.glob(".tmp-*")), "the failed checkpoint's partial files must go"
    # the checkpoint before is whole: the run resumes from it (and, with no checkpoint left to write
    # before its end, finishes)
    r = run(tmp_path, "--resume", *common, "total_steps=2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert [m["step"] for m in rows(tmp_path / "run" / "metrics.jsonl")] == [0, 1]
