"""Versioned weight publication from the trainer to inference replicas over one broadcast group.

Trainer rank 0 is rank 0 of the group; inference replicas are ranks 1..N, in plan order. The group is a
standalone torch.distributed process group (gloo on CPU, NCCL on GPU) with its own TCPStore on the
trainer's weight port, so it lives beside the trainer's FSDP group without touching it.

One publication: a header (version, manifest length, and the JSON manifest of names, shapes, dtypes and
bucket sizes when it fits in 16 KiB), then the tensors packed into byte buckets of at most `bucket_bytes` each, so memory
stays bounded whatever the model size. A final barrier tells the trainer that every replica has
applied the version before it opens the gate. Receivers sit in `wait()` on a thread of their own, so
a publication starts the moment the trainer sends it; `close()` releases them at the end of training. Receivers sit in `wait()` on a thread of their own, so a
publication starts the moment the trainer sends it: no announcement, no polling.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from meshrl.dataplane.batch import DTYPE_NAMES, TORCH_DTYPES

log = logging.getLogger("meshrl.weights")
Manifest = list[tuple[str, tuple[int, ...], str]]
HEADER_BYTES = 16 << 10  # version, manifest length, and the manifest when it fits


class WeightGroup:
    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        *,
        timeout_s: float = 1800.0,
        device: str = "cpu",
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(device)
        timeout = timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
        self.pg: Any
        if self.device.type == "cuda":
            self.pg = dist.ProcessGroupNCCL(self.store, rank, world_size, dist.ProcessGroupNCCL.Options())
        else:
            self.pg = dist.ProcessGroupGloo(self.store, rank, world_size, timeout)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        self.pg.broadcast([tensor], opts).wait()

    def _barrier(self) -> None:
        """Every member has got this far (a broadcast would only tell the root that it sent)."""
        self.pg.barrier().wait()

    def send(
        self,
        version: int,
        manifest: Manifest,
        tensors: Iterator[torch.Tensor],
        *,
        bucket_bytes: int = 64 << 20,
    ) -> int:
        """Rank 0: publish `tensors` (in manifest order). Returns the bytes sent."""
        assert self.rank == 0
        plan = _buckets(manifest, bucket_bytes)
        meta = json.dumps({"tensors": manifest, "buckets": [b[0] for b in plan]}).encode()
        self._broadcast(_header(version, meta).to(self.device))
        if len(meta) > HEADER_BYTES - 16:  # big manifests take a second broadcast
            rest = bytearray(meta[HEADER_BYTES - 16 :])
            self._broadcast(torch.frombuffer(rest, dtype=torch.uint8).to(self.device))
        sent = 0
        for size, members in plan:
            buf = torch.empty(size, dtype=torch.uint8, device=self.device)
            offset = 0
            for index in members:
                t = next(tensors)
                name, shape, dtype = manifest[index]
                if tuple(t.shape) != tuple(shape) or DTYPE_NAMES[t.dtype] != dtype:
                    raise ValueError(
                        f"tensor {name}: got {tuple(t.shape)} {t.dtype}, manifest says {shape} {dtype}"
                    )
                raw = t.detach().contiguous().view(-1).view(torch.uint8)
                buf[offset : offset + raw.numel()].copy_(raw)
                offset += raw.numel()
            self._broadcast(buf)
            sent += size
        self._barrier()
        return sent

    def close(self) -> None:
        """Rank 0: tell every receiver that no more versions will come (its `wait` returns version -1).

        Receivers that already left (the run is over) are no error.
        """
        assert self.rank == 0
        try:
            self._broadcast(_header(-1, b"").to(self.device))
        except RuntimeError as e:
            log.info("weight receivers already gone: %s", str(e).splitlines()[0])

    def wait(self) -> tuple[int, bytes]:
        """Ranks 1..N: block until the next publication starts. Returns its header for `receive`."""
        head = torch.zeros(HEADER_BYTES, dtype=torch.uint8, device=self.device)
        self._broadcast(head)
        data = head.cpu().numpy().tobytes()
        version, length = torch.frombuffer(bytearray(data[:16]), dtype=torch.int64).tolist()
        meta = data[16 : 16 + min(length, HEADER_BYTES - 16)]
        if length > len(meta):
            rest = torch.empty(length - len(meta), dtype=torch.uint8, device=self.device)
            self._broadcast(rest)
            meta += rest.cpu().numpy().tobytes()
        return int(version), meta

    def receive(
        self, header: tuple[int, bytes], apply: Callable[[list[tuple[str, torch.Tensor]]], None]
    ) -> int:
        """Ranks 1..N: the rest of the publication `wait` announced, calling `apply` once per bucket.

        Returns the version. Split from `wait` so a receiver can block for the next version without
        holding anything, then take its engine's lock only while weights actually change.
        """
        version, raw_meta = header
        meta = json.loads(raw_meta)
        manifest: Manifest = [(n, tuple(s), d) for n, s, d in meta["tensors"]]
        index = 0
        for size in meta["buckets"]:
            buf = torch.empty(size, dtype=torch.uint8, device=self.device)
            self._broadcast(buf)
            offset, named = 0, []
            while offset < size:
                name, shape, dtype = manifest[index]
                n = _nbytes(shape, dtype)
                named.append((name, buf[offset : offset + n].view(TORCH_DTYPES[dtype]).view(shape)))
                offset += n
                index += 1
            apply(named)
        self._barrier()
        return version


def _header(version: int, meta: bytes) -> torch.Tensor:
    head = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    head[:16] = torch.tensor([version, len(meta)], dtype=torch.int64).view(torch.uint8)
    inline = meta[: HEADER_BYTES - 16]
    if inline:
        head[16 : 16 + len(inline)] = torch.frombuffer(bytearray(inline), dtype=torch.uint8)
    return head


def _nbytes(shape: Iterable[int], dtype: str) -> int:
    n = TORCH_DTYPES[dtype].itemsize
    for d in shape:
        n *= d
    return n


def _buckets(manifest: Manifest, bucket_bytes: int) -> list[tuple[int, list[int]]]:
    """Consecutive tensors grouped into buckets of at most bucket_bytes (a bigger tensor gets its own)."""
    out: list[tuple[int, list[int]]] = []
    size, members = 0, list[int]()
    for i, (_, shape, dtype) in enumerate(manifest):
        n = _nbytes(shape, dtype)
        if members and size + n > bucket_bytes:
            out.append((size, members))
            size, members = 0, []
        size += n
        members.append(i)
    if members:
        out.append((size, members))
    return out
