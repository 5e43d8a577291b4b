"""`python -m meshrl.tasks.agent_calc --out FILE`: write tool-arithmetic demonstrations (JSONL chat rows)
for `meshrl sft`, the warm start of recipes/agent_calc.py."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from meshrl.tasks.agent_calc import TOOL_FRACTION, WARM_ROWS, demonstrations


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m meshrl.tasks.agent_calc", description=__doc__.split(":")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("-n", type=int, default=WARM_ROWS, help="conversations")
    ap.add_argument("--tool-fraction", type=float, default=TOOL_FRACTION, help="share that use the tool")
    ap.add_argument("--seed", type=int, default=2)
    args = ap.parse_args()
    rows = demonstrations(args.n, args.tool_fraction, args.seed)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} conversations in {args.out}")


if __name__ == "__main__":
    main()
