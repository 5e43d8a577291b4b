"""Stopping a run from outside: Ctrl-C and SIGTERM on `meshrl run`, and what a killed launcher leaves in
shared memory (nothing)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.launch.test_launcher import COUNTER, assert_all_gone, free_port_base, wait_for_pids

SHM = Path("/dev/shm")


def start(tmp_path: Path, *overrides: str) -> subprocess.Popen[str]:
    """`meshrl run` of the counter recipe, slowed down, in a process group of its own (the terminal's
    foreground group, as far as a Ctrl-C is concerned)."""
    return subprocess.Popen(
        [sys.executable, "-m", "meshrl.cli", "run", COUNTER, f"run_dir={tmp_path / 'run'}",
         f"base_port={free_port_base()}", "consumer.delay_s=2", *overrides],
        cwd=tmp_path, stdout=open(tmp_path / "out.txt", "w"), stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip


def wait_until(what: str, done: object, proc: subprocess.Popen[str], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not done():  # type: ignore[operator]
        assert proc.poll() is None, (
            f"the run ended before {what}: {proc.stderr.read() if proc.stderr else ''}"
        )
        assert time.monotonic() < deadline, f"no {what} after {timeout}s"
        time.sleep(0.05)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_stops_every_process_with_one_line(tmp_path, sig):
    proc = start(tmp_path)
    wait_until(
        "services running", lambda: "service processes ready" in (tmp_path / "out.txt").read_text(), proc
    )
    pids = wait_for_pids(proc, tmp_path / "run", 5)
    os.killpg(proc.pid, sig)  # what a terminal does on Ctrl-C: the whole foreground process group
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err
    assert err == f"[meshrl] interrupted: stopped 2 services; run directory {tmp_path / 'run'}\n"
    assert_all_gone(pids)
    log = (tmp_path / "run" / "logs" / "consumer-0-1.log").read_text()
    assert "Traceback" not in log  # stopped, not failed


def test_ctrl_c_during_start_up_stops_what_was_started(tmp_path):
    proc = start(tmp_path)
    wait_until("a zygote", lambda: "zygote" in _pids(tmp_path), proc)
    os.killpg(proc.pid, signal.SIGINT)  # the zygote is importing, the data plane starting
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.startswith("[meshrl] interrupted: stopped ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    assert_all_gone(_pids(tmp_path))


def test_a_killed_launcher_leaves_no_segments(tmp_path):
    """SIGKILL the launcher and the storage server at once while rows are in flight: only the zygote's
    sweep (once its services are gone) can remove the run's shared-memory segments."""
    proc = start(tmp_path, "consumer.delay_s=5")
    pids = wait_for_pids(proc, tmp_path / "run", 5)
    mine = f"-producer-0-0-{pids['producer-0-0']}-"
    wait_until("segments", lambda: any(mine in f.name for f in SHM.iterdir()), proc)
    run = next(f.name for f in SHM.iterdir() if mine in f.name).split("-")[1]
    storage = next(pid for name, pid in pids.items() if name.startswith("storage-"))
    os.kill(proc.pid, signal.SIGKILL)
    os.kill(storage, signal.SIGKILL)
    proc.wait(timeout=10)
    assert_all_gone(pids)
    deadline = time.monotonic() + 10
    while (left := sorted(SHM.glob(f"meshrl-{run}-*"))) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left


def test_a_finished_run_leaves_no_segments(tmp_path):
    run_dir = tmp_path / "run"
    proc = start(tmp_path, "consumer.delay_s=0.02")  # 2 s of reading: long enough to see the segments
    pids = wait_for_pids(proc, run_dir, 5)
    mine = f"-producer-0-0-{pids['producer-0-0']}-"
    runs = set()
    while proc.poll() is None:
        runs |= {f.name.split("-")[1] for f in SHM.iterdir() if mine in f.name}
        time.sleep(0.01)
    assert proc.returncode == 0, proc.stderr.read() if proc.stderr else ""
    assert len(runs) == 1
    assert not list(SHM.glob(f"meshrl-{runs.pop()}-*"))


def _pids(tmp_path: Path) -> dict[str, int]:
    from tests.integration.launch.test_launcher import started_pids

    try:
        return started_pids(tmp_path / "run")
    except ValueError:  # being replaced
        return {}
