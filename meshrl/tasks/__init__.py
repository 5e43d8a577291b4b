"""Tasks with programmatic rewards: prompts, reference answers and a scoring function per task."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any


def write_jsonl(path: str | Path, rows: Iterable[dict[str, Any]]) -> int:
    """Write `rows` to `path` as JSON lines (its folder made if needed); how many."""
    lines = [json.dumps(r) + "\n" for r in rows]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("".join(lines))
    return len(lines)


def demonstrations_main(
    prog: str, make: Callable[[int, float, int], list[dict[str, Any]]], n: int, tool_fraction: float
) -> None:
    """A task's demonstrations writer: `prog --out FILE [-n N] [--tool-fraction F] [--seed S]` writes
    `make(n, tool_fraction, seed)`, JSONL chat rows for `meshrl sft` (seed 2 by default: a task's runs
    train on seed 0 and evaluate on seed 1)."""
    ap = argparse.ArgumentParser(
        prog=prog, description="Write demonstrations (JSONL chat rows) for meshrl sft."
    )
    ap.add_argument("--out", required=True)
    ap.add_argument("-n", type=int, default=n, help="conversations")
    ap.add_argument("--tool-fraction", type=float, default=tool_fraction, help="share that call the tool")
    ap.add_argument("--seed", type=int, default=2)
    args = ap.parse_args()
    if args.n < 1 or not 0 <= args.tool_fraction <= 1:
        ap.error(f"-n must be >= 1 and --tool-fraction in [0, 1], not {args.n} and {args.tool_fraction}")
    try:
        count = write_jsonl(args.out, make(args.n, args.tool_fraction, args.seed))
    except OSError as e:
        ap.error(f"--out {args.out}: {e.strerror or e}")
    print(f"{count} conversations in {args.out}")
