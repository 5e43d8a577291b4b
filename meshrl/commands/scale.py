"""`meshrl scale RUN_DIR GROUP=N [GROUP=N ...]`: change the replica count of groups of a running run.

    meshrl scale runs/grpo_arith inference=3
    [meshrl] inference: 1 -> 3 replicas (joining: inference-1-0, inference-2-0)
    [meshrl] inference-1-0 joined 0.4 s after the request   # its first generated row
    ...

The run's launcher makes the change (meshrl/runtime/elastic.py) or refuses it in one line, and nothing
changes. The command waits until every joining replica has joined (an inference replica: generated its
first row; another: runs) and every leaving one has ended, up to `--timeout` seconds (0: not at all).
Exit code 0 when the change was made, 1 when it was refused or did not finish in time, 2 for a bad
command line.
"""

from __future__ import annotations

import fcntl
import json
import sys
import time
from pathlib import Path
from typing import Any

USAGE = "usage: meshrl scale RUN_DIR GROUP=N [GROUP=N ...] [--timeout S] [--json]"


def main(argv: list[str]) -> int:
    from meshrl.runtime.elastic import request

    args = list(argv)
    as_json = "--json" in args
    args = [a for a in args if a != "--json"]
    timeout = 120.0
    if "--timeout" in args:
        i = args.index("--timeout")
        try:
            timeout = float(args[i + 1])
        except (IndexError, ValueError):
            return _usage("--timeout takes a number of seconds")
        del args[i : i + 2]
    if len(args) < 2:
        return _usage("give a run directory and at least one GROUP=N")
    run_dir = Path(args[0])
    groups: dict[str, int] = {}
    for a in args[1:]:
        group, eq, n = a.partition("=")
        if not eq or not n.lstrip("-").isdigit():
            return _usage(f"{a!r} is not GROUP=N")
        groups[group] = int(n)
    if not running(run_dir):
        print(f"meshrl scale: no run is running in {run_dir}", file=sys.stderr)
        return 1
    answer = request(run_dir, groups)
    said: dict[str, Any] = {}
    shown: set[str] = set()
    deadline = time.monotonic() + max(timeout, 10.0)  # the answer itself comes within a second
    while time.monotonic() < deadline and running(run_dir):
        said = _read(answer) or said
        if said and not as_json:
            _show(said, shown)
        if said and (said.get("done") or timeout == 0):
            break
        time.sleep(0.1)
    if as_json:
        print(json.dumps(said or {"ok": False, "message": "no answer"}))
    if not said:
        print(f"meshrl scale: the run in {run_dir} did not answer", file=sys.stderr)
        return 1
    if said.get("ok") and not said.get("done") and timeout:
        print(f"meshrl scale: not finished after {timeout:.0f}s (see {answer})", file=sys.stderr)
        return 1
    return 0 if said.get("ok") and not said.get("failed") else 1


def running(run_dir: Path) -> bool:
    """Whether a launch holds `run_dir` (its lock, meshrl/runtime/ports.py)."""
    try:
        with open(run_dir / ".lock") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:
                return True
            return False
    except OSError:
        return False


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


def _show(said: dict[str, Any], shown: set[str]) -> None:
    if not said.get("ok"):
        if "refused" not in shown:
            shown.add("refused")
            print(f"[meshrl] refused: {said.get('message')}", flush=True)
        return
    if "change" not in shown and "message" in said:  # nothing to change
        shown.add("change")
        print(f"[meshrl] {said['message']}", flush=True)
    if "change" not in shown:
        shown.add("change")
        sizes = ", ".join(f"{g}: {a} -> {b} replicas" for g, (a, b) in said["replicas"].items())
        parts = [f"joining: {', '.join(said['joined'])}"] if said["joined"] else []
        parts += [f"leaving: {', '.join(said['left'])}"] if said["left"] else []
        print(f"[meshrl] {sizes}" + (f" ({'; '.join(parts)})" if parts else ""), flush=True)
    for name, s in said.get("join_s", {}).items():
        if name not in shown:
            shown.add(name)
            print(f"[meshrl] {name} joined {s:.1f} s after the request", flush=True)
    for name, code in said.get("failed", {}).items():
        if name not in shown:
            shown.add(name)
            print(
                f"[meshrl] {name} failed to join (exit code {code}); the run goes on without it", flush=True
            )
    for name in said.get("gone", []):
        if name not in shown:
            shown.add(name)
            print(f"[meshrl] {name} has left", flush=True)


def _usage(why: str) -> int:
    print(f"meshrl scale: {why}\n{USAGE}", file=sys.stderr)
    return 2
