"""Fault injection: SIGKILL a service mid-run; the run resumes from its last checkpoint and finishes, the
ledger shows every sample consumed exactly once, and a resumed trainer repeats the uninterrupted run."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshrl.dataplane.ledger import account
from tests.conftest import free_base_port
from tests.integration.grpo.test_grpo import RECIPE, REPO, rows, run

STEPS = 8
ON_FAILURE = [f"{g}.restart.mode=on-failure" for g in ("trainer", "rollout", "inference")]


def start(tmp_path: Path, *overrides: str, recipe: str = RECIPE) -> subprocess.Popen[str]:
    log = open(tmp_path / "run.log", "w")  # noqa: SIM115 (a file, not a pipe nobody drains while it runs)
    return subprocess.Popen(
        [sys.executable, "-m", "meshrl.cli", "run", recipe, f"base_port={free_base_port()}", *overrides],
        cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip


def steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def pid_of(run_dir: Path, victim: str) -> int:
    for pids in run_dir.glob("pids-*.json"):
        for name, pid in json.loads(pids.read_text()).items():
            if name.startswith(f"{victim}-"):
                return int(pid)
    raise AssertionError(f"no {victim} process in {run_dir}")


def kill(run_dir: Path, victim: str) -> int:
    pid = pid_of(run_dir, victim)
    os.kill(pid, signal.SIGKILL)
    return pid


def kill_repeatedly(
    proc: subprocess.Popen[str],
    run_dir: Path,
    victim: str,
    rng: random.Random,
    steps: range,
    times: int,
    *,
    within_s: float,
    timeout_s: float = 400,
) -> None:
    """SIGKILL `victim` `times` times: after each of as many steps drawn from `steps` (once the previous
    victim's successor runs), at a random moment within `within_s` seconds."""
    deadline = time.monotonic() + timeout_s
    killed = -1
    for at in sorted(rng.sample(steps, times)):
        while steps_done(run_dir) < at or pid_of(run_dir, victim) == killed:
            assert proc.poll() is None and time.monotonic() < deadline, (
                run_dir.parent / "run.log"
            ).read_text()[-3000:]
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, within_s))  # somewhere inside the next step
        killed = kill(run_dir, victim)


def common_args(model: Path) -> list[str]:
    return [f"*.model={model}", f"total_steps={STEPS}", "checkpoint_every=1", "rollout.eval_every=0"]


@pytest.fixture(scope="module")
def uninterrupted(arith_model, tmp_path_factory) -> list[dict]:
    """Per-step metrics of the run the killed ones are compared with (run once for every victim)."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    r = run(tmp, *common_args(arith_model), f"run_dir={tmp / 'run'}")
    assert r.returncode == 0, r.stderr[-3000:]
    return rows(tmp / "run" / "metrics.jsonl")


@pytest.mark.parametrize("victim", ["trainer", "rollout", "inference"])
def test_killed_service_resumes_with_nothing_lost_or_repeated(tmp_path, arith_model, uninterrupted, victim):
    common = common_args(arith_model)
    run_dir = tmp_path / "run"
    proc = start(tmp_path, *common, *ON_FAILURE, f"run_dir={run_dir}")
    at = random.Random(f"{victim}-7").randint(2, 5)  # seeded: the step after which the kill lands
    deadline = time.monotonic() + 300
    while steps_done(run_dir) < at:
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "run.log").read_text()[-3000:]
        time.sleep(0.05)
    kill(run_dir, victim)
    if victim == "trainer":  # and, at once, a replica its death breaks: the run restarts once, as a whole
        kill(run_dir, "inference")
    proc.wait(timeout=600)
    assert proc.returncode == 0, (tmp_path / "run.log").read_text()[-4000:]
    metrics = rows(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(STEPS))
    (restart,) = rows(run_dir / "restarts.jsonl")
    # an inference replica re-joins the running run (weight group re-formed, current version sent to
    # it), so does rollout (from the state it wrote ahead of each change); the trainer's failure
    # resumes the whole run from its checkpoint
    assert restart.get("in_place", False) == (victim != "trainer"), restart
    trainer_starts = (run_dir / "logs" / "trainer-0-1.log").read_text().count("==== start")
    assert trainer_starts == (2 if victim == "trainer" else 1)
    tally = account(run_dir / "ledger.jsonl")
    assert (tally.consumed, tally.pending, tally.duplicated, tally.unknown) == (STEPS * 128, 0, 0, 0), tally
    # bitwise on CPU: the resumed trainer loads the exact weights, optimizer state and step of the
    # checkpoint; a re-joined replica gets the exact weights of the version; inference seeds its
    # sampling from the rows' group sequence
    assert [m["loss"] for m in metrics] == [m["loss"] for m in uninterrupted]
    assert [m["reward_mean"] for m in metrics] == [m["reward_mean"] for m in uninterrupted]


def test_mixed_mini_batches_lose_and_repeat_nothing_when_the_trainer_is_killed(tmp_path, arith_model):
    """trainer.mix_groups: a step's rows are one claim, trained in random parts, each acknowledged by its
    rows; the trainer killed mid-run resumes from its checkpoint and every sample is consumed once."""
    run_dir = tmp_path / "run"
    proc = start(
        tmp_path, *common_args(arith_model), "trainer.mix_groups=true", *ON_FAILURE, f"run_dir={run_dir}"
    )
    deadline = time.monotonic() + 300
    while steps_done(run_dir) < 3:
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "run.log").read_text()[-3000:]
        time.sleep(0.05)
    kill(run_dir, "trainer")
    kill(run_dir, "inference")
    proc.wait(timeout=600)
    assert proc.returncode == 0, (tmp_path / "run.log").read_text()[-4000:]
    assert [m["step"] for m in rows(run_dir / "metrics.jsonl")] == list(range(STEPS))
    tally = account(run_dir / "ledger.jsonl")
    assert (tally.consumed, tally.pending, tally.duplicated, tally.unknown) == (STEPS * 128, 0, 0, 0), tally


def test_a_killed_reference_restarts_alone_and_the_run_goes_on(tmp_path, arith_model):
    """A frozen scorer re-joins the running run: only its process restarts (no checkpoint, no step
    repeated), and the rows it had claimed come back when its connection closes, not after its lease."""
    run_dir = tmp_path / "run"
    proc = start(tmp_path, f"*.model={arith_model}", f"total_steps={STEPS}", "rollout.eval_every=0",
                 "reference.restart.mode=on-failure", "reference.restart.backoff_s=0.5", f"run_dir={run_dir}",
                 recipe=str(REPO / "recipes" / "grpo_arith_kl.py"))  # fmt: skip
    deadline = time.monotonic() + 300
    while steps_done(run_dir) < 3:
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "run.log").read_text()[-3000:]
        time.sleep(0.05)
    kill(run_dir, "reference")
    proc.wait(timeout=600)
    assert proc.returncode == 0, (tmp_path / "run.log").read_text()[-4000:]
    metrics = rows(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(STEPS))
    assert max(m["time/step_s"] for m in metrics) < 60  # the claimed rows' lease is 300 s
    (restart,) = rows(run_dir / "restarts.jsonl")
    assert restart["in_place"] and restart["group"] == "reference", restart
    logs = run_dir / "logs"
    assert (logs / f"{restart['service']}.log").read_text().count("==== start") == 2
    assert (logs / "trainer-0-1.log").read_text().count("==== start") == 1
    tally = account(run_dir / "ledger.jsonl")
    assert (tally.consumed, tally.pending, tally.duplicated, tally.unknown) == (STEPS * 128, 0, 0, 0), tally


def test_a_port_in_use_names_the_service_and_the_port(tmp_path, arith_model):
    import socket

    from meshrl.planning.recipe import load_recipe
    from meshrl.planning.topology import HEALTH, Device, devices_needed, plan

    base = free_base_port()
    recipe = load_recipe(RECIPE, [f"*.model={arith_model}", f"base_port={base}"])
    topo = plan(recipe, [Device(i, "localhost", i) for i in range(devices_needed(recipe))])
    trainer = next(p for r in topo.replicas for p in r.processes if p.group == "trainer")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", trainer.ports[HEALTH]))
        taken.listen()
        r = subprocess.run(
            [sys.executable, "-m", "meshrl.cli", "run", RECIPE, f"base_port={base}", f"*.model={arith_model}",
             f"run_dir={tmp_path / 'run'}", "total_steps=2"],
            cwd=tmp_path, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
    # found before anything starts: one line naming the port, what it is for and who holds it
    assert r.returncode == 2
    message = rf"base_port: port {trainer.ports[HEALTH]} \({trainer.name}'s health endpoint\) is in use by pid {os.getpid()}"
    assert re.search(message, r.stderr), r.stderr[-3000:]
    assert "Traceback" not in r.stderr and not (tmp_path / "run" / "logs" / f"{trainer.name}.log").exists()


@pytest.mark.parametrize("variant", ["sync", "async-dapo"])
def test_rollout_killed_again_and_again_continues_in_place_exactly(tmp_path, arith_model, variant):
    """Rollout SIGKILLed three times at seeded random moments (mid-feed, mid-scoring, mid-evaluation:
    wherever it happens to be) restarts alone each time and continues from the state it wrote ahead of
    each change: every step runs, each sample is trained on once, each evaluation is recorded once, and
    (lock-step) the losses equal those of an uninterrupted run bit for bit. The second variant runs
    ahead of the trainer (window 2) and drops groups without signal (DAPO), so a successor also
    inherits refills owed and groups dropped but not yet deleted."""
    common = [
        f"*.model={arith_model}",
        f"total_steps={STEPS}",
        "rollout.eval_every=2",
        "rollout.eval_samples=1",
    ]
    if variant == "async-dapo":
        common += ["rollout.window=2", "rollout.dynamic_sampling=True"]
    run_dir = tmp_path / "run"
    proc = start(tmp_path, *common, "rollout.restart.mode=on-failure", "rollout.restart.max_restarts=3",
                 "rollout.restart.backoff_s=0.2", f"run_dir={run_dir}")  # fmt: skip
    kill_repeatedly(proc, run_dir, "rollout", random.Random(11), range(1, STEPS - 1), 3, within_s=0.15)
    proc.wait(timeout=600)
    assert proc.returncode == 0, (tmp_path / "run.log").read_text()[-4000:]
    restarts = rows(run_dir / "restarts.jsonl")
    assert [(r["group"], r["in_place"]) for r in restarts] == [("rollout", True)] * 3, restarts
    logs = run_dir / "logs"
    log = (logs / "rollout-0-0.log").read_text()
    # a kill may land while a successor is still starting (before it re-joins): then the next one does
    assert log.count("==== start") == 4 and log.count("re-joined the run") >= 1, log[-3000:]
    assert (logs / "trainer-0-1.log").read_text().count("==== start") == 1
    tally = account(run_dir / "ledger.jsonl")
    assert (tally.consumed, tally.pending, tally.duplicated, tally.unknown) == (STEPS * 128, 0, 0, 0), tally
    evals = [r["version"] for r in rows(run_dir / "eval.jsonl")]
    assert evals == [0, 2, 4, 6, 8], evals
    assert not list((run_dir / "rejoin").glob("*.json"))  # a finished rollout leaves no state behind
    if variant != "sync":  # which rows a step takes depends on timing once rollout runs ahead
        return
    reference = run(tmp_path, *common, f"run_dir={tmp_path / 'reference'}")
    assert reference.returncode == 0, reference.stderr[-3000:]
    expected = rows(tmp_path / "reference" / "metrics.jsonl")
    metrics = rows(run_dir / "metrics.jsonl")
    assert [m["loss"] for m in metrics] == [m["loss"] for m in expected]
    assert [m["reward_mean"] for m in metrics] == [m["reward_mean"] for m in expected]
    assert [r["greedy_accuracy"] for r in rows(run_dir / "eval.jsonl")] == [
        r["greedy_accuracy"] for r in rows(tmp_path / "reference" / "eval.jsonl")
    ]


def test_a_killed_critic_rejoins_in_place_with_the_latest_checkpoints_weights(tmp_path, arith_model):
    """The critic SIGKILLed twice at seeded random moments restarts alone each time: it goes on from the
    progress it wrote ahead of each change, with the weights and optimizer state of the run's latest
    checkpoint. Every step runs, each critic version is trained and recorded once, and each sample is
    valued, trained on by the critic and by the actor exactly once."""
    run_dir = tmp_path / "run"
    proc = start(tmp_path, f"*.model={arith_model}", f"total_steps={STEPS}", "checkpoint_every=2",
                 "rollout.eval_every=0", "critic.restart.mode=on-failure", "critic.restart.backoff_s=0.2",
                 f"run_dir={run_dir}", recipe=str(REPO / "recipes" / "ppo_arith.py"))  # fmt: skip
    kill_repeatedly(proc, run_dir, "critic", random.Random(5), range(2, STEPS - 1), 2, within_s=0.3)
    proc.wait(timeout=600)
    assert proc.returncode == 0, (tmp_path / "run.log").read_text()[-4000:]
    assert [m["step"] for m in rows(run_dir / "metrics.jsonl")] == list(range(STEPS))
    restarts = rows(run_dir / "restarts.jsonl")
    assert [(r["group"], r["in_place"]) for r in restarts] == [("critic", True)] * 2, restarts
    logs = run_dir / "logs"
    log = (logs / f"{restarts[0]['service']}.log").read_text()
    assert log.count("==== start") == 3 and log.count("re-joined the run at critic version") >= 1, log[-3000:]
    assert (logs / "trainer-0-1.log").read_text().count("==== start") == 1
    assert [c["version"] for c in rows(run_dir / "critic.jsonl")] == list(range(1, STEPS + 1))
    for consumer in ("trainer", "critic", "critic-values"):
        tally = account(run_dir / "ledger.jsonl", consumer=consumer)
        assert (tally.consumed, tally.pending, tally.duplicated, tally.unknown) == (STEPS * 128, 0, 0, 0), (
            consumer,
            tally,
        )
    assert not list((run_dir / "rejoin").glob("critic-*"))  # a finished critic leaves no state behind
