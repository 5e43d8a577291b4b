"""A running run changes shape (real processes): `meshrl scale` grows and shrinks inference and agents
groups, a replica that vanishes where its group's restart.mode is "leave" leaves the run smaller, and
requests the run cannot honour are refused in one line; the ledger shows every sample generated and
trained exactly once."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from meshrl.dataplane.ledger import account
from tests.integration.fault.test_kill import pid_of, start, steps_done
from tests.integration.grpo.test_grpo import REPO, rows, run

SIM = str(REPO / "recipes" / "pipeline_sim.py")
KL = str(REPO / "recipes" / "grpo_arith_kl.py")
BATCH = 16 * 8
FAST = ["inference.replicas=1", "inference.restart.mode=leave", "rollout.window=1", "inference.max_batch=4",
        "inference.max_new_tokens=200", "inference.sim.token_s=0.001", "inference.sim.median_tokens=20",
        "inference.sim.sigma=0.25", "trainer.sim.token_s=2e-6"]  # fmt: skip


def scale(run_dir: Path, *asked: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "meshrl.cli", "scale", str(run_dir), *asked], capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=180,
    )  # fmt: skip


def wait_steps(proc: subprocess.Popen[str], run_dir: Path, n: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while steps_done(run_dir) < n:
        assert proc.poll() is None and time.monotonic() < deadline, (run_dir.parent / "run.log").read_text()[
            -3000:
        ]
        time.sleep(0.05)


def exactly_once(run_dir: Path, steps: int) -> None:
    trained = account(run_dir / "ledger.jsonl", "samples", "trainer")
    generated = account(run_dir / "ledger.jsonl", "samples", "inference")
    assert (trained.consumed, trained.pending, trained.duplicated, trained.unknown) == (
        steps * BATCH,
        0,
        0,
        0,
    ), trained
    assert generated.duplicated == 0, generated
    assert not (run_dir / "restarts.jsonl").exists()  # no restart, in place or whole


def test_inference_grows_shrinks_and_survives_a_vanished_replica(tmp_path: Path, tiny_model: Path) -> None:
    steps, run_dir = 14, tmp_path / "run"
    proc = start(
        tmp_path, f"*.model={tiny_model}", *FAST, f"total_steps={steps}", f"run_dir={run_dir}", recipe=SIM
    )
    try:
        wait_steps(proc, run_dir, 2)
        # refused, and nothing changes: one line each
        for asked, why in [
            (
                "trainer=2",
                "refused: trainer publishes the weights and takes the checkpoints: one replica, fixed at start",
            ),
            ("inference=0", "refused: inference: at least one replica (asked for 0)"),
            ("teacher=2", "refused: no group 'teacher' in this run (groups: rollout, inference, trainer)"),
        ]:
            r = scale(run_dir, asked)
            assert (r.returncode, r.stdout.strip()) == (1, f"[meshrl] {why}"), r
        assert scale(run_dir, "inference=two").returncode == 2
        r = scale(run_dir, "inference=1")
        assert (r.returncode, r.stdout.strip()) == (0, "[meshrl] no change: inference has 1"), r
        r = scale(run_dir, "inference=3")
        assert r.returncode == 0, r.stdout + r.stderr
        lines = r.stdout.splitlines()
        assert lines[0] == "[meshrl] inference: 1 -> 3 replicas (joining: inference-1-0, inference-2-0)"
        assert sorted(line.split(" joined ")[0] for line in lines[1:]) == [
            "[meshrl] inference-1-0",
            "[meshrl] inference-2-0",
        ]
        wait_steps(proc, run_dir, 6)
        os.kill(pid_of(run_dir, "inference-2"), signal.SIGKILL)  # not restarted: the run goes on with two
        wait_steps(proc, run_dir, 9)
        r = scale(run_dir, "inference=1")
        assert r.returncode == 0 and r.stdout.splitlines() == [
            "[meshrl] inference: 2 -> 1 replicas (leaving: inference-1-0)",
            "[meshrl] inference-1-0 has left",
        ], r.stdout + r.stderr
        assert proc.wait(timeout=300) == 0, (tmp_path / "run.log").read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert [m["step"] for m in rows(run_dir / "metrics.jsonl")] == list(range(steps))
    exactly_once(run_dir, steps)
    members = json.loads((run_dir / "members.json").read_text())
    assert members["replicas"]["inference"] == 1
    assert [(c["why"], c["replicas"], c["joined"], c["left"], c["gone"]) for c in members["changes"]] == [
        ("scale", {"inference": [1, 3]}, ["inference-1-0", "inference-2-0"], [], []),
        ("vanished", {"inference": [3, 2]}, [], ["inference-2-0"], ["inference-2-0"]),
        ("scale", {"inference": [2, 1]}, [], ["inference-1-0"], ["inference-1-0"]),
    ]
    assert all(s < 10 for s in members["changes"][0]["join_s"].values()), members["changes"][0]
    # each joined replica generated rows, with the current weights (the weight group took them in)
    for name in ("inference-1-0", "inference-2-0"):
        log = (run_dir / "logs" / f"{name}.log").read_text()
        assert "re-joining the weight group" in log
    (trainer,) = (run_dir / "logs").glob("trainer-0-*.log")
    epochs = [
        line.split("re-forms in ")[1] for line in trainer.read_text().splitlines() if "re-forms in" in line
    ]
    formed = [set(e.split(": ")[1].split(", ")) for e in epochs]  # in the order they asked to join
    assert {"inference-0", "inference-1", "inference-2"} in formed, epochs
    assert epochs[-1].endswith(": inference-0"), epochs  # the vanished and the drained one are out
    assert "inference-0-0" in json.loads((run_dir / "pids-0.json").read_text())  # the pids file follows
    # `meshrl status` shows the run's shape and every change (the dashboard shows the same lines)
    status = subprocess.run([sys.executable, "-m", "meshrl.cli", "status", str(run_dir)], capture_output=True,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60).stdout  # fmt: skip
    shape = status[status.index("replicas: ") :].splitlines()
    assert shape[0] == "replicas: rollout 1, inference 1, trainer 1; changes of the run's shape:", status
    assert re.fullmatch(
        r"  \S+  scale    inference 1 -> 3: joined inference-1-0 \(\d+\.\ds\), joined inference-2-0 \(\d+\.\ds\)",
        shape[1],
    )
    assert shape[2].endswith("vanished inference 3 -> 2: left inference-2-0 (exit code -9)"), shape
    assert shape[3].endswith("scale    inference 2 -> 1: left inference-1-0"), shape


def test_a_scale_request_without_a_running_run_says_so(tmp_path: Path) -> None:
    r = scale(tmp_path, "inference=2")
    assert (r.returncode, r.stderr.strip()) == (1, f"meshrl scale: no run is running in {tmp_path}")


def test_replicas_of_inference_and_the_reference_join_and_leave_a_training_run(
    tmp_path: Path, arith_model: Path
) -> None:
    """GRPO with a KL reference on the tiny model, two devices to spare: inference and the reference grow
    to two replicas each and shrink back while the run trains, each on a spare device. A joined inference
    replica holds the current weights before its first row, so its samples' behaviour KL is the run's
    usual one; every sample is generated and trained once. (Sampling is seeded by each row's identity,
    so the run often repeats the unchanged one bit for bit, here 4 times in 6; when groups become ready
    in another order, the trainer's mini-batches differ and so do the steps that follow.)"""
    steps = 24
    common = [f"*.model={arith_model}", f"total_steps={steps}", "rollout.eval_every=0", "--devices", "5",
              "inference.restart.mode=leave", "reference.restart.mode=leave"]  # fmt: skip
    (tmp_path / "plain").mkdir()
    plain = run(tmp_path / "plain", *common, f"run_dir={tmp_path / 'plain' / 'run'}", recipe=KL)
    assert plain.returncode == 0, plain.stderr[-3000:]
    run_dir = tmp_path / "run"
    proc = start(tmp_path, *common, f"run_dir={run_dir}", recipe=KL)
    try:
        wait_steps(proc, run_dir, 3)
        r = scale(run_dir, "reference=2", "inference=2")
        assert r.returncode == 0, r.stdout + r.stderr
        assert r.stdout.splitlines()[0] == (
            "[meshrl] reference: 1 -> 2 replicas, inference: 1 -> 2 replicas (joining: inference-1-4, reference-1-3)"
        )  # each on a device of its own: the two spare ones, in the order asked
        wait_steps(proc, run_dir, 8)
        assert scale(run_dir, "reference=1", "inference=1").returncode == 0
        assert proc.wait(timeout=300) == 0, (tmp_path / "run.log").read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    changed, same = rows(run_dir / "metrics.jsonl"), rows(tmp_path / "plain" / "run" / "metrics.jsonl")
    assert [m["step"] for m in changed] == [m["step"] for m in same] == list(range(steps))
    # generated with the weights the trainer expects: a joined replica on stale weights (say the initial
    # ones, kl_ref ~0.08 by then) would raise the behaviour KL of its samples 20-fold
    joined = [m["kl_behaviour"] for m in changed[4:8]]
    assert max(joined) <= 3 * max(m["kl_behaviour"] for m in same[4:8]) + 1e-3, (joined, same[4:8])
    exactly_once(run_dir, steps)
    assert "reference-1-3" not in (run_dir / "topology.json").read_text()  # rewritten: it has left


def join(run_dir: Path, *args: str, host: str = "second-host") -> subprocess.Popen[str]:
    """`meshrl join RUN_DIR ...` as a launcher of another host: a host id of its own, so its processes
    use the data plane's cross-host path (a storage server of its own, reads over TCP)."""
    shm = run_dir.parent / f"shm-{host}"  # its own shared memory, as another machine has
    env = {**os.environ, "PYTHONPATH": str(REPO), "MESHRL_HOST_ID": host, "MESHRL_SHM_DIR": str(shm)}
    cmd = [sys.executable, "-m", "meshrl.cli", "join", str(run_dir), *args]
    log = open(run_dir.parent / f"join-{host}.log", "w")  # noqa: SIM115 - the process holds it
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env, cwd=run_dir.parent)


def test_a_second_launcher_joins_with_inference_and_leaves(tmp_path: Path, tiny_model: Path) -> None:
    """A launcher standing for another host joins the running run with two inference replicas, which
    take rows at once; stopped (SIGTERM), it drains them, serves the rows they wrote until the run has
    read them, and leaves. A second one joins (the planner's default: one inference replica) and stays
    to the run's end. A third is killed (SIGKILL): its replica leaves the run, and its host's storage
    server serves the rows it wrote until they are read. Every sample is generated and trained once;
    each "host" has shared memory of its own."""
    steps, run_dir = 50, tmp_path / "run"  # the joins and leaves below take ~30 steps on a busy machine
    proc = start(
        tmp_path, f"*.model={tiny_model}", *FAST, f"total_steps={steps}", f"run_dir={run_dir}", recipe=SIM
    )
    joiners: list[subprocess.Popen[str]] = []
    try:
        wait_steps(proc, run_dir, 2)
        (tmp_path / "wrong").write_text("not-the-secret")
        address = json.loads((run_dir / "join.json").read_text())["address"]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        asked = [  # at once: the run goes on meanwhile, and the joins below need steps left
            (["127.0.0.1:1"], env),
            ([address, "--secret-file", str(tmp_path / "wrong")], env),
            ([str(run_dir), "trainer=1"], {**env, "MESHRL_HOST_ID": "h3"}),
        ]
        cmd = [sys.executable, "-m", "meshrl.cli", "join"]
        procs = [subprocess.Popen(cmd + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e)
                 for args, e in asked]  # fmt: skip
        bad, wrong, refused = [(*p.communicate(timeout=60), p.returncode) for p in procs]
        assert bad[2] == 1 and "the run's secret is required" in bad[1], bad
        assert (wrong[2], wrong[1].strip()) == (
            1,
            f"meshrl join: {address} turned the secret down (not this run's)",
        ), wrong
        assert (refused[2], refused[1].strip()) == (
            1,
            "meshrl join: refused: trainer publishes the weights and takes the checkpoints: one replica, "
            "fixed at start",
        ), refused
        joiners.append(join(run_dir, "inference=2"))
        wait_for(lambda: len(changes(run_dir)) >= 1 and len(changes(run_dir)[0]["join_s"]) == 2, proc)
        wait_steps(proc, run_dir, steps_done(run_dir) + 2)
        joiners[0].send_signal(signal.SIGTERM)
        assert joiners[0].wait(timeout=120) == 0, (tmp_path / "join-second-host.log").read_text()[-3000:]
        wait_for(lambda: len(changes(run_dir)) >= 3, proc)
        joiners.append(join(run_dir, host="third-host"))  # no GROUP=N: one inference replica
        wait_for(lambda: len(changes(run_dir)) >= 4 and changes(run_dir)[3]["join_s"], proc)
        joiners.append(join(run_dir, host="fourth-host"))
        wait_for(lambda: len(changes(run_dir)) >= 5 and changes(run_dir)[4]["join_s"], proc)
        wait_steps(proc, run_dir, steps_done(run_dir) + 1)
        joiners[2].kill()  # its processes die with it; its storage serves their rows until they are read
        wait_for(lambda: len(changes(run_dir)) >= 6, proc)
        assert proc.wait(timeout=300) == 0, (tmp_path / "run.log").read_text()[-4000:]
        assert joiners[1].wait(timeout=60) == 0  # the run ended: so does the launcher that joined it
    finally:
        for p in [proc, *joiners]:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [m["step"] for m in rows(run_dir / "metrics.jsonl")] == list(range(steps))
    exactly_once(run_dir, steps)
    done = changes(run_dir)
    assert [(c["why"], c["replicas"], sorted(c["joined"]), c.get("host")) for c in done] == [
        ("host joined", {"inference": [1, 3]}, ["inference-1-1", "inference-2-1"], "second-host"),
        ("host leaving", {"inference": [3, 2]}, [], "second-host"),
        ("host leaving", {"inference": [2, 1]}, [], "second-host"),
        ("host joined", {"inference": [1, 2]}, ["inference-1-1"], "third-host"),  # ranks and ports reused
        ("host joined", {"inference": [2, 3]}, ["inference-2-2"], "fourth-host"),
        ("host left", {"inference": [3, 2]}, [], "fourth-host"),  # killed: its replica left with it
    ], done
    assert sorted(n for c in done[1:3] for n in c["gone"]) == ["inference-1-1", "inference-2-1"]
    assert all(s < 10 for c in done for s in c["join_s"].values()), done
    assert (run_dir / "logs" / "storage-second-host.log").exists()  # the new host's own storage server
    status = subprocess.run([sys.executable, "-m", "meshrl.cli", "status", str(run_dir)], capture_output=True,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60).stdout  # fmt: skip
    shape = status[status.index("replicas: ") :].splitlines()
    assert shape[0].endswith("inference 2, trainer 1; hosts joined: third-host; changes of the run's shape:")
    # the killed launcher's storage server lingered, and ended once its rows were read or the run was over
    log = run_dir / "logs" / "storage-fourth-host.log"
    ended = ("every row written here has been read", "the controller is gone: the run is over")
    deadline = time.monotonic() + 60
    while not any(e in log.read_text() for e in ended):
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)
    assert "the launcher is gone" in log.read_text()
    assert re.fullmatch(r"  \S+  host joined second-host inference 1 -> 3: joined inference-1-1 \(\d+\.\ds\), "
                        r"joined inference-2-1 \(\d+\.\ds\)", shape[1]), shape  # fmt: skip
    for name in ("inference-1-1", "inference-2-1"):
        log = (run_dir / "logs" / f"{name}.log").read_text()
        assert "re-joining the weight group" in log, log[-2000:]
    generated = account(run_dir / "ledger.jsonl", "samples", "inference")
    assert generated.duplicated == 0


def changes(run_dir: Path) -> list[dict]:
    try:
        return list(json.loads((run_dir / "members.json").read_text())["changes"])
    except (OSError, ValueError):
        return []


def wait_for(ready, proc: subprocess.Popen[str], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None and time.monotonic() < deadline, "timed out"
        time.sleep(0.1)
