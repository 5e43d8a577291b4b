"""The tasks' demonstration writers (`python -m meshrl.tasks.agent_calc`, `python -m meshrl.tasks.calculator`):
JSONL chat rows for `meshrl sft`, and a clear error (exit 2, the cause) for arguments that cannot work."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def writer(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip


@pytest.mark.parametrize("module", ["meshrl.tasks.agent_calc", "meshrl.tasks.calculator"])
def test_writes_chat_rows_and_refuses_what_cannot_work(tmp_path: Path, module: str) -> None:
    out = tmp_path / "sub" / "demos.jsonl"
    r = writer(module, "--out", str(out), "-n", "6", "--tool-fraction", "1")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 6 and all(len(row["messages"]) >= 4 for row in rows)  # every one calls the tool
    for bad, cause in [
        (["-n", "0"], "-n must be >= 1"),
        (["--tool-fraction", "1.5"], "--tool-fraction in [0, 1]"),
    ]:
        r = writer(module, "--out", str(tmp_path / "bad.jsonl"), *bad)
        assert r.returncode == 2 and cause in r.stderr, r.stderr
    r = writer(module, "--out", str(out / "x.jsonl"))  # a file where a folder should be
    assert r.returncode == 2 and f"--out {out / 'x.jsonl'}:" in r.stderr, r.stderr
    assert not (tmp_path / "bad.jsonl").exists()
