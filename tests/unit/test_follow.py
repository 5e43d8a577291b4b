"""The lead launcher's follower: new lines of the run's files to trackers and the progress line."""

from __future__ import annotations

import io
import json
import logging

from meshrl.observe.follow import Follower, Progress
from meshrl.observe.trackers import Guarded


class Recorder:
    def __init__(self) -> None:
        self.scalars_seen: list[tuple[int, dict]] = []
        self.samples_seen: list[tuple[int, int]] = []
        self.closed = False

    def scalars(self, step, values):
        self.scalars_seen.append((step, dict(values)))

    def samples(self, step, rows):
        self.samples_seen.append((step, len(rows)))

    def close(self):
        self.closed = True


class Broken(Recorder):
    def scalars(self, step, values):
        raise OSError("No space left on device")


def write(path, rows, mode="a"):
    with open(path, mode) as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def test_each_step_reaches_a_tracker_once_even_when_a_resumed_run_writes_it_again(tmp_path):
    rec = Recorder()
    follower = Follower(tmp_path, [rec], None)
    write(tmp_path / "metrics.jsonl", [{"step": s, "version": s + 1, "loss": 0.1 * s} for s in range(3)])
    write(tmp_path / "samples.jsonl", [{"step": 0, "version": 1, "prompt": "p"}] * 2)
    with open(tmp_path / "eval.jsonl", "a") as f:
        f.write(
            json.dumps({"version": 2, "greedy_accuracy": 0.5}) + "\n" + '{"version": 4, "gre'
        )  # half a line
    follower.poll()
    assert [s for s, _ in rec.scalars_seen] == [1, 2, 3, 2]
    assert rec.scalars_seen[1] == (2, {"train/loss": 0.1})
    assert rec.scalars_seen[3] == (2, {"eval/greedy_accuracy": 0.5}) and rec.samples_seen == [(1, 2)]
    with open(tmp_path / "eval.jsonl", "a") as f:
        f.write('edy_accuracy": 0.75}\n')  # the rest of the line
    # a resume from the checkpoint after step 1: the file is cut back, steps 2 and 3 are trained again
    write(
        tmp_path / "metrics.jsonl", [{"step": s, "version": s + 1, "loss": 1.0} for s in range(1)], mode="w"
    )
    write(tmp_path / "metrics.jsonl", [{"step": s, "version": s + 1, "loss": 1.0} for s in range(1, 5)])
    follower = Follower(tmp_path, [rec], None)  # a new launch reads the files from the start
    follower.poll()
    assert [s for s, _ in rec.scalars_seen[4:]] == [4, 5, 4]
    follower.stop()
    assert rec.closed


def test_a_failing_tracker_is_dropped_with_one_warning_and_the_others_go_on(tmp_path, caplog):
    rec = Recorder()
    follower = Follower(tmp_path, [Guarded("broken", Broken()), rec], None)
    with caplog.at_level(logging.WARNING):
        for s in range(3):
            write(tmp_path / "metrics.jsonl", [{"step": s, "version": s + 1, "loss": 0.0}])
            follower.poll()
    assert len(rec.scalars_seen) == 3
    assert [r.getMessage() for r in caplog.records] == [
        "tracker broken failed (OSError: No space left on device); the run goes on without it"
    ]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_one_line_on_a_terminal_and_every_tenth_step_elsewhere():
    rows = [{"step": s, "reward_mean": 0.5, "loss": 0.25, "samples_per_s": 100.0, "time/step_s": 2.0}
            for s in range(20)]  # fmt: skip
    tty, log = Terminal(), io.StringIO()
    for out in (tty, log):
        progress = Progress(40, out)
        progress.update(rows)
        progress.close()
    assert tty.getvalue().count("\r\x1b[K") == 20 and tty.getvalue().endswith("\n")
    assert "step 20/40  ETA 0m40s  reward 0.500  loss 0.2500  100.0 samples/s" in tty.getvalue()
    assert log.getvalue().splitlines() == [
        "[meshrl] step 10/40  ETA 1m00s  reward 0.500  loss 0.2500  100.0 samples/s",
        "[meshrl] step 20/40  ETA 0m40s  reward 0.500  loss 0.2500  100.0 samples/s",
    ]


def test_a_slow_run_says_what_each_service_is_doing_at_least_every_30_s(monkeypatch):
    """Between steps (minutes each on a real model) the line comes every 30 s at the latest, with each
    service's phase and how long it has been at it; before the first step it says so."""
    clock = [1000.0]
    monkeypatch.setattr("meshrl.observe.follow.time.monotonic", lambda: clock[0])
    log = io.StringIO()
    progress = Progress(30, log)
    phases = {"trainer-0-1": ("waiting for mini-batch 1/2 of step 1 (generation, scoring)", 12.0),
              "inference-0-0": ("generating 64 prompt rows with version 0", 12.0)}  # fmt: skip
    progress.tick(phases)  # a second after the start: nothing yet
    clock[0] += 31
    progress.tick(phases)
    clock[0] += 5
    progress.tick(phases)  # 5 s later: not again
    assert log.getvalue().splitlines() == [
        "[meshrl] step 0/30  ETA after the first step  |  trainer-0-1: waiting for mini-batch 1/2 of step 1 "
        "(generation, scoring) (0m12s); inference-0-0: generating 64 prompt rows with version 0 (0m12s)"
    ]


def test_a_run_without_reward_variance_says_so_with_what_to_try():
    log = io.StringIO()
    progress = Progress(30, log)
    flat = [{"step": s, "reward_mean": 0.0, "loss": 0.0, "samples_per_s": 1.0, "time/step_s": 60.0,
             "no_signal_fraction": 1.0} for s in range(10)]  # fmt: skip
    progress.update(flat)
    assert "no reward variance for 10 steps" in log.getvalue() and "group_size" in log.getvalue()
    progress.update([{**flat[0], "step": 10, "no_signal_fraction": 0.5}])
    assert "no reward variance" not in progress.line()


def test_each_reward_functions_mean_joins_its_step_for_the_dashboard():
    from meshrl.observe.dashboard import with_rewards
    from meshrl.observe.follow import SOURCES

    metrics = [{"step": 0, "reward_mean": 0.5}, {"step": 1, "reward_mean": 0.7}]
    rewards = [{"step": 1, "scored": 32, "reward/math_answer": 0.25}]
    joined = with_rewards(metrics, rewards)
    assert joined == [metrics[0], {"step": 1, "reward_mean": 0.7, "scored": 32, "reward/math_answer": 0.25}]
    assert SOURCES["rewards.jsonl"] == "train"  # trackers: train/reward/math_answer
