"""The lead launcher follows the run's files and feeds what watches the run: the terminal progress line
and the experiment trackers (`trackers.py`).

The services write their rows to files in the run directory (the trainer metrics.jsonl and
samples.jsonl, rollout eval.jsonl, the critic critic.jsonl); a thread of the lead launcher reads the
new lines once a second and hands them on. Trackers are therefore one run on one step axis whatever
the number of services and hosts, cost the services nothing, and one that blocks or fails holds up
nothing but itself. The step axis is the weight version (steps trained so far) every row carries.

A resumed run cuts its files back to its checkpoint and writes those steps again: a tracker gets each
step of each file once (what it was sent is kept in <run_dir>/trackers.json), the progress line shows
them again.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from meshrl.observe.trackers import Ids, Tracker, open_trackers
from meshrl.schema import CHECKPOINT, CONTROL, GATE

log = logging.getLogger("meshrl.follow")

SOURCES = {
    "metrics.jsonl": "train",
    "rewards.jsonl": "train",  # rollout's mean of each reward function: train/reward/<function>
    "eval.jsonl": "eval",
    "critic.jsonl": "critic",
}
"""Files of scalar rows and the prefix of their names in a tracker (train/reward_mean, ...)."""
SAMPLES = "samples.jsonl"
PROBE_S = 5.0
PHASES_S = 5.0
"""How often the services' phases are asked for (their health endpoints, on this host)."""


NO_SIGNAL_STEPS = 3
"""Steps in a row in which no group's rewards differ before a run says it learns nothing."""


def no_signal_advice(steps: int) -> str:
    """What a run whose groups' rewards have all agreed for `steps` steps is told (the trainer's log and
    the progress line say the same)."""
    return (
        f"no reward variance for {steps} steps: every group's completions got the same reward, so no "
        "advantage and nothing to learn; try a warm start or an easier task (accuracy near 0), more "
        "completions per prompt (group_size), a higher temperature, or rollout.dynamic_sampling=true"
    )


def is_signal(partition: str) -> bool:
    """Whether a partition carries control signals (run events, checkpoints, gates, colocation rings)
    rather than work: its rows waiting are not a backlog."""
    return partition in (CONTROL, CHECKPOINT, GATE) or partition.startswith("ring.")


def backlog(status: Any) -> dict[str, float]:
    """Tracker scalars of the data plane's status (a StatusReply): rows ready and claimed per consumer
    of each work partition (control signals left out)."""
    out: dict[str, float] = {}
    for p in status.partitions:
        if is_signal(p.name):
            continue
        for c in p.consumers:
            out[f"dataplane/{p.name}/{c.name}/ready"] = float(c.ready)
            out[f"dataplane/{p.name}/{c.name}/claimed"] = float(c.claimed)
    return out


class Tail:
    """The complete lines a file gained since the last read, parsed; starts over when the file was cut
    back (a resumed run rewrites it from its checkpoint)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset = path, 0

    def read(self) -> list[dict[str, Any]]:
        try:
            if self.path.stat().st_size < self.offset:
                self.offset = 0
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        end = data.rfind(b"\n") + 1  # a line being written is read when it is complete
        self.offset += end
        rows = []
        for line in data[:end].splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                log.warning("%s: a line that is not JSON skipped", self.path.name)
        return rows


def step_of(row: dict[str, Any]) -> int:
    """The row's place on the step axis: the weight version it was measured at."""
    return int(row.get("version", row.get("step", 0)))


def scalars(prefix: str, row: dict[str, Any]) -> dict[str, float]:
    return {
        f"{prefix}/{k}": float(v)
        for k, v in row.items()
        if k not in ("step", "version", "time") and isinstance(v, int | float) and not isinstance(v, bool)
    }


class Follower:
    """Reads the run's files and feeds `progress` and the trackers, on a thread of its own (`start`,
    `stop`) or by `poll` calls."""

    def __init__(
        self,
        run_dir: Path,
        trackers: list[Tracker],
        progress: Progress | None,
        probe: Callable[[], dict[str, float]] | None = None,
        phases: Callable[[], dict[str, tuple[str, float]]] | None = None,
    ) -> None:
        """`probe`: scalars of the live run (the data plane's backlog), sent to the trackers every
        PROBE_S seconds at the latest step the trainer reported. `phases`: what each service is doing and
        for how long (their health endpoints), for the progress line."""
        self.run_dir, self.trackers, self.progress, self.probe = run_dir, trackers, progress, probe
        self.phases, self.phased = phases, 0.0
        self.probed = 0.0
        self.tails = {name: Tail(run_dir / name) for name in [*SOURCES, SAMPLES]}
        self.sent = Ids(run_dir / "trackers.json")
        self.done = {name: int(self.sent.get(f"sent:{name}") or -1) for name in self.tails}
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None

    @classmethod
    def for_run(
        cls,
        run_dir: Path,
        config: dict[str, Any],
        log_cfg: Any,
        total_steps: int,
        probe: Callable[[], dict[str, float]] | None = None,
        phases: Callable[[], dict[str, tuple[str, float]]] | None = None,
    ) -> Follower:
        trackers = open_trackers(log_cfg, run_dir, config)
        return cls(run_dir, trackers, Progress(total_steps), probe if trackers else None, phases)

    def poll(self) -> None:
        self._read_files()
        if (
            self.progress is not None
            and self.phases is not None
            and time.monotonic() - self.phased >= PHASES_S
        ):
            self.phased = time.monotonic()
            try:
                self.progress.tick(self.phases())
            except Exception as e:  # the line goes on without the phases
                log.warning("no service phases for the progress line: %s", e)
                self.phases = None
        if self.probe is not None and time.monotonic() - self.probed >= PROBE_S:
            self.probed = time.monotonic()
            try:
                values = self.probe()
            except Exception as e:
                log.warning("no data-plane metrics for the trackers: %s", e)
                self.probe = None
                return
            for tracker in self.trackers:
                tracker.scalars(max(self.done["metrics.jsonl"], 0), values)

    def _read_files(self) -> None:
        for name, tail in self.tails.items():
            rows = tail.read()
            if name == "metrics.jsonl" and rows and self.progress is not None:
                self.progress.update(rows)
            fresh = [r for r in rows if step_of(r) > self.done[name]]
            if not fresh or not self.trackers:
                continue
            if name == SAMPLES:
                by_step: dict[int, list[dict[str, Any]]] = {}
                for r in fresh:
                    by_step.setdefault(step_of(r), []).append(r)
                for tracker in self.trackers:
                    for step, batch in by_step.items():
                        tracker.samples(step, batch)
            else:
                for tracker in self.trackers:
                    for r in fresh:
                        tracker.scalars(step_of(r), scalars(SOURCES[name], r))
            self.done[name] = max(step_of(r) for r in fresh)
            self.sent.set(f"sent:{name}", str(self.done[name]))

    def start(self) -> Follower:
        self.thread = threading.Thread(target=self._loop, name="follow", daemon=True)
        self.thread.start()
        return self

    def _loop(self) -> None:
        while not self.stopping.wait(1.0):
            self.poll()

    def stop(self) -> None:
        """The last lines, then the trackers closed."""
        self.stopping.set()
        if self.thread is not None:
            self.thread.join()
        self.poll()
        for tracker in self.trackers:
            tracker.close()
        if self.progress is not None:
            self.progress.close()


class Progress:
    """Training progress from the trainer's metrics rows and the services' phases: on a terminal one line
    redrawn in place; otherwise (CI, a log file) a plain line every 10 steps and at least every
    `every_s` seconds. Each says the step, reward, loss, samples/s and time left (from the median
    step), what each service is doing and for how long, and, when no group's rewards have differed for
    a few steps, that the run learns nothing and what to try."""

    def __init__(self, total: int, out: TextIO | None = None, every_s: float = 30.0) -> None:
        self.total, self.every_s = total, every_s
        self.out = out or sys.stderr
        self.tty = self.out.isatty()
        self.steps_s: deque[float] = deque(maxlen=10)
        self.drawn = False
        self.row: dict[str, Any] | None = None
        self.services: dict[str, tuple[str, float]] = {}
        self.quiet = 0  # steps in a row without reward variance
        self.shown = time.monotonic()

    def update(self, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            self.steps_s.append(float(row.get("time/step_s", 0.0)))
            self.quiet = self.quiet + 1 if float(row.get("no_signal_fraction", 0.0)) >= 0.999 else 0
            self.row = row
            done = int(row["step"]) + 1
            if self.tty or done % 10 == 0 or done == self.total:
                self._show()

    def tick(self, services: dict[str, tuple[str, float]]) -> None:
        """The services' phases now: redrawn on a terminal, a line when `every_s` passed without one."""
        self.services = services
        if self.tty or time.monotonic() - self.shown >= self.every_s:
            self._show()

    def line(self) -> str:
        row, done = self.row or {}, int((self.row or {}).get("step", -1)) + 1
        if self.steps_s:
            step_s = sorted(self.steps_s)[len(self.steps_s) // 2]  # the median
            eta = f"ETA {_duration(step_s * (self.total - done))}"
        else:
            eta = "ETA after the first step"
        text = f"step {done}/{self.total}  {eta}"
        if row:
            text += (f"  reward {row.get('reward_mean', 0.0):.3f}  loss {row.get('loss', 0.0):.4f}  "
                     f"{row.get('samples_per_s', 0.0):.1f} samples/s")  # fmt: skip
        if self.services:
            text += "  |  " + "; ".join(
                f"{name}: {phase} ({_duration(s)})" for name, (phase, s) in self.services.items()
            )
        if self.quiet >= NO_SIGNAL_STEPS:
            text += f"  |  ! {no_signal_advice(self.quiet)}"
        return text

    def _show(self) -> None:
        self.shown = time.monotonic()
        if self.tty:
            self.out.write(f"\r\x1b[K[meshrl] {self.line()}")
            self.drawn = True
        else:
            self.out.write(f"[meshrl] {self.line()}\n")
        self.out.flush()

    def close(self) -> None:
        if self.drawn:
            self.out.write("\n")
            self.out.flush()
            self.drawn = False


def _duration(seconds: float) -> str:
    s = round(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
