"""A data-plane client in its own process, driven by tests: `python dp_worker.py MODE ENDPOINT ...`.

Prints one JSON line per event so tests can follow it.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from meshrl.dataplane import Client


def main() -> None:
    mode, endpoint = sys.argv[1], sys.argv[2]
    c = Client(endpoint)
    if mode == "consume":  # consume PARTITION CONSUMER BATCH UNTIL_EMPTY_S
        part, consumer, n, idle = sys.argv[3], sys.argv[4], int(sys.argv[5]), float(sys.argv[6])
        got: list[list[int]] = []
        print(json.dumps({"ready": True}), flush=True)
        wait = 60.0  # for the first rows; after those, an idle gap this long means the producers are done
        while True:
            b = c.claim(part, consumer, ["x"], n, timeout=wait)
            wait = idle
            if not b:
                break
            got.extend([int(i), int(x)] for i, x in zip(b.ids, b["x"], strict=True))  # type: ignore[arg-type]
            c.ack(b)
        print(json.dumps({"pairs": got}), flush=True)
    elif mode == "claim_and_hang":  # claim_and_hang PARTITION CONSUMER N LEASE
        part, consumer, n, lease = sys.argv[3], sys.argv[4], int(sys.argv[5]), float(sys.argv[6])
        b = c.claim(part, consumer, ["x"], n, timeout=10, lease=lease)
        print(json.dumps({"claimed": [int(i) for i in b.ids]}), flush=True)
        time.sleep(3600)
    elif mode == "produce":  # produce PARTITION COUNT BATCH
        part, count, n = sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
        pairs: list[list[int]] = []
        for start in range(0, count, n):
            x = torch.arange(start, min(count, start + n))
            pairs.extend([int(i), int(v)] for i, v in zip(c.put(part, {"x": x}), x, strict=True))
        print(json.dumps({"pairs": pairs}), flush=True)
    c.close()


if __name__ == "__main__":
    main()
