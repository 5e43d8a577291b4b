"""A launcher's peers: the other launchers of the run (none on one host, `meshrl run`; one per device
under torchrun, gathering their devices, addresses and the run's secret over gloo, the only place a
launcher imports torch), and the address other hosts reach this one at."""

from __future__ import annotations

import json
import os
import socket
from datetime import timedelta
from typing import Any


class Alone:
    """The peers of a launcher that owns every rank of a single-host run: none."""

    size = 1

    def gather(self, obj: Any) -> list[Any]:
        return [obj]

    def barrier(self) -> None:
        pass


class Gloo:
    """Launchers started by torchrun, one per rank: their collectives, over gloo."""

    def __init__(self) -> None:
        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=timedelta(days=7))
        self.dist = dist
        self.size = dist.get_world_size()

    def barrier(self) -> None:
        self.dist.barrier()

    def gather(self, obj: Any) -> list[Any]:
        import torch

        data = json.dumps(obj).encode()
        size = torch.tensor([len(data)])
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        self.dist.all_gather(sizes, size)
        width = int(max(s.item() for s in sizes))
        buf = torch.zeros(width, dtype=torch.uint8)
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.zeros(width, dtype=torch.uint8) for _ in range(self.size)]
        self.dist.all_gather(out, buf)
        return [json.loads(bytes(o[: int(s.item())].tolist())) for o, s in zip(out, sizes, strict=True)]


def my_address(toward: str | None = None) -> str:
    """The address other hosts reach this one at: the interface that routes to `toward` (default: the
    rendezvous host)."""
    master = toward or os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master, 9))
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"
