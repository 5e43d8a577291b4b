"""Full tensors out of the FSDP engine's shards, to publish the weights to inference.

Under FSDP2 each rank holds a dim-0 shard (torch.chunk layout) of every parameter; inference needs the
whole tensors. Gathering them one by one would cost a collective per parameter, so consecutive
parameters of one dtype are gathered a bucket at a time (up to `bucket_bytes`), each with a single
all-gather of the shards laid end to end: a few collectives per model, memory bounded by the bucket.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.distributed as dist


def full_tensors(params: list[torch.Tensor], world: int, bucket_bytes: int) -> Iterator[torch.Tensor]:
    """The full tensors of `params` in order. Collective over the `world` ranks: every rank iterates it
    (with one rank nothing is sharded: the parameters themselves)."""
    with torch.no_grad():
        if world == 1:
            for p in params:
                yield (p.to_local() if hasattr(p, "to_local") else p).detach()
            return
        bucket: list[torch.Tensor] = []
        size = 0
        for p in params:
            if bucket and (size + p.numel() * p.element_size() > bucket_bytes or p.dtype != bucket[0].dtype):
                yield from _gather(bucket, world)
                bucket, size = [], 0
            bucket.append(p)
            size += p.numel() * p.element_size()
        if bucket:
            yield from _gather(bucket, world)


def _gather(params: list[torch.Tensor], world: int) -> list[torch.Tensor]:
    """Full tensors of dim-0-sharded parameters of one dtype with one all-gather."""
    pieces, layout = [], []
    for p in params:
        local = p.to_local()  # type: ignore[attr-defined]
        chunk = -(-p.shape[0] // world)
        padded = torch.zeros((chunk, *p.shape[1:]), dtype=p.dtype, device=local.device)
        padded[: local.shape[0]] = local
        pieces.append(padded.reshape(-1))
        layout.append((p.shape, chunk))
    flat = torch.cat(pieces)
    out = torch.empty(world * flat.numel(), dtype=flat.dtype, device=flat.device)
    dist.all_gather_into_tensor(out, flat)
    grid = out.view(world, -1)
    full, offset = [], 0
    for shape, chunk in layout:
        n = chunk * math.prod(shape[1:])
        full.append(grid[:, offset : offset + n].reshape(world * chunk, *shape[1:])[: shape[0]])
        offset += n
    return full
