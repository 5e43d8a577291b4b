"""`meshrl run` and `torchrun ... -m meshrl launch` with real processes on CPU."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tests.conftest import free_base_port

REPO = Path(__file__).resolve().parents[3]
COUNTER = str(REPO / "recipes" / "counter.py")


def meshrl(
    *args: str, cwd: Path, timeout: float = 180, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "meshrl.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def started_pids(run_dir: Path) -> dict[str, int]:
    pids: dict[str, int] = {}
    for f in run_dir.glob("pids-*.json"):
        pids.update(json.loads(f.read_text()))
    return pids


def assert_all_gone(pids: dict[str, int] | list[int]) -> None:
    items = pids.items() if isinstance(pids, dict) else [(str(p), p) for p in pids]
    deadline = time.monotonic() + 10
    alive = []
    while time.monotonic() < deadline:
        alive = [
            (n, p)
            for n, p in items
            if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
        ]
        if not alive:
            return
        time.sleep(0.1)
    raise AssertionError(f"processes left behind: {alive}")


def free_port_base() -> int:
    """A base port whose run ports are free now (a bare random base could land on a live connection's
    ephemeral port: seen once as a launcher failing to start in CI)."""
    return free_base_port()


def test_counter_runs_to_completion_and_leaves_nothing_behind(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "meshrl.cli",
            "run",
            COUNTER,
            f"run_dir={run_dir}",
            f"base_port={free_port_base()}",
            "consumer.delay_s=0.3",
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen: set[int] = set()
    status = None
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            seen |= {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            break
        if status is None and (run_dir / "dataplane.json").exists() and len(started_pids(run_dir)) >= 4:
            time.sleep(1.0)
            st = meshrl("status", str(run_dir), cwd=tmp_path)
            if st.returncode == 0 and "running" in st.stdout:
                status = st.stdout
        time.sleep(0.1)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "service processes ready in" in out and "run finished" in out
    assert status is not None, "meshrl status never showed the running services"
    assert "producer-0-0" in status and "consumer-0-1" in status and "counter" in status
    assert "consumer: " in status
    for name in ("config.json", "topology.json", "logs/controller.log", "logs/producer-0-0.log"):
        assert (run_dir / name).exists(), name
    assert "read all 200 rows exactly once" in (run_dir / "logs" / "consumer-0-1.log").read_text()
    pids = started_pids(run_dir)
    assert {"controller", "storage-" + socket.gethostname(), "producer-0-0", "consumer-0-1"} <= set(pids)
    assert_all_gone(pids)
    assert_all_gone(sorted(seen))


def test_services_die_with_a_launcher_killed_by_sigkill(tmp_path):
    """The services are children of the launch's zygote, the zygote and the data-plane servers children
    of the launcher (the `meshrl run` process): SIGKILL it, and the kernel tells the children their
    parent died; the zygote stops its own."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshrl.cli", "run", COUNTER, f"run_dir={run_dir}", f"base_port={free_port_base()}",
         "consumer.delay_s=5"],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    pids = wait_for_pids(proc, run_dir, 5)
    zygote = pids["zygote"]
    assert {psutil.Process(pids[s]).ppid() for s in ("producer-0-0", "consumer-0-1")} == {zygote}
    assert {psutil.Process(pids[s]).ppid() for s in ("zygote", "controller")} == {proc.pid}
    assert len(os.listdir(f"/proc/{zygote}/task")) == 1  # it forks: no other thread may hold a lock
    os.kill(proc.pid, 9)
    assert_all_gone(pids)  # nobody is left to stop them: the kernel tells them their parent died
    proc.wait(timeout=60)


def test_a_killed_zygote_fails_the_run_and_leaves_nothing_behind(tmp_path):
    run_dir = tmp_path / "run"
    r = subprocess.Popen(
        [sys.executable, "-m", "meshrl.cli", "run", COUNTER, f"run_dir={run_dir}", f"base_port={free_port_base()}",
         "consumer.delay_s=5"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    pids = wait_for_pids(r, run_dir, 5)
    os.kill(pids["zygote"], 9)
    _, err = r.communicate(timeout=120)
    assert r.returncode == 1 and "service zygote failed (exit code -9" in err, err
    assert_all_gone(pids)


def wait_for_pids(proc: subprocess.Popen, run_dir: Path, n: int) -> dict[str, int]:
    """The run's pids once `n` processes are in its pids files."""
    deadline = time.monotonic() + 120
    while len(started_pids(run_dir)) < n:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    return started_pids(run_dir)


def test_a_failing_service_stops_the_run_with_its_traceback(tmp_path):
    run_dir = tmp_path / "run"
    r = meshrl("run", COUNTER, f"run_dir={run_dir}", f"base_port={free_port_base()}", "consumer.fail_after=20",
               cwd=tmp_path)  # fmt: skip
    assert r.returncode != 0
    assert "service consumer-0-1 failed (exit code 1" in r.stderr
    assert "RuntimeError: counter consumer failing on purpose after" in r.stderr
    assert "Traceback" in r.stderr
    assert_all_gone(started_pids(run_dir))


def test_a_bad_recipe_fails_before_anything_starts(tmp_path):
    r = meshrl("run", COUNTER, "consumer.expect=lots", cwd=tmp_path)
    assert r.returncode == 2 and "override 'consumer.expect=lots'" in r.stderr
    r = meshrl("run", COUNTER, "--devices", "3", cwd=tmp_path)
    assert r.returncode == 2 and "3 devices but the recipe uses 2" in r.stderr
    r = meshrl("run", COUNTER, "--devices", "0,0,1", cwd=tmp_path)  # three slots (two sharing GPU 0)
    assert r.returncode == 2 and "3 devices but the recipe uses 2" in r.stderr
    r = meshrl("run", COUNTER, "--devices", "0,x", cwd=tmp_path)
    assert r.returncode == 2 and "a count or comma-separated GPU indices, not '0,x'" in r.stderr
    r = meshrl("run", str(tmp_path / "missing.py"), cwd=tmp_path)
    assert r.returncode == 2 and "does not exist" in r.stderr
    assert not (tmp_path / "runs").exists()


def test_two_torchrun_nodes_form_one_run(tmp_path):
    run_dir = tmp_path / "run"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        rdzv = s.getsockname()[1]
    base = free_port_base()
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
               f"--node-rank={node}", "--master-addr=127.0.0.1", f"--master-port={rdzv}",
               "-m", "meshrl", "launch", COUNTER, f"run_dir={run_dir}", f"base_port={base}"]  # fmt: skip
        procs.append(
            subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n----\n".join(e[-3000:] for _, e in outs)
    assert "run finished" in outs[0][0]
    pids = started_pids(run_dir)
    assert {"producer-0-0", "consumer-0-1"} <= set(pids)  # one service on each node's launcher
    assert json.loads((run_dir / "pids-0.json").read_text()).keys() >= {"controller", "producer-0-0"}
    assert "consumer-0-1" in json.loads((run_dir / "pids-1.json").read_text())
    assert_all_gone(pids)
