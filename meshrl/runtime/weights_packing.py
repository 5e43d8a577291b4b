"""The byte layout a weight version travels in, on both ends of the weight group (`weights.py`).

Broadcasting tensor by tensor would cost a collective each, and a shared-memory segment is one block of
bytes anyway, so a version travels as byte buckets: consecutive tensors in manifest order, at most
`bucket_bytes` each (a bigger tensor gets its own). In a bucket each run
of tensors of one dtype starts ALIGN-aligned, so a view of any dtype is aligned whatever came before it
(a bfloat16 tensor of odd length followed by a float32 one). The layout is a function of the manifest
and the bucket size alone: the announcement carries both (`layout`), and a receiver recomputes the
buckets and checks their sizes against the trainer's (`incoming`).

The trainer copies tensors in (`pack`), receivers take named views out (`unpack`), each with one
operation per run of one dtype rather than per tensor; the copies on either end run on one torch thread
(`one_thread`). Over the broadcast, the buckets go from the trainer (rank 0) over a standalone process
group (`process_group`, `broadcast_from_trainer`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from meshrl.dataplane.batch import DTYPE_NAMES, TORCH_DTYPES

Manifest = list[tuple[str, tuple[int, ...], str]]
Header = dict[str, Any]  # an announcement: version, epoch, and the `layout` (tensors, buckets)
ALIGN = 8  # byte alignment of each run of one dtype in a bucket


def layout(manifest: Manifest, bucket_bytes: int) -> Header:
    """The announcement's description of a version's bytes: what `incoming` reads back."""
    return {
        "tensors": manifest,
        "bucket_bytes": bucket_bytes,
        "buckets": [b[0] for b in buckets(manifest, bucket_bytes)],
    }


def incoming(header: Header, read: Callable[[int], torch.Tensor]) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The tensors of an announced publication, one bucket at a time, as named views of the bucket bytes
    that `read(size)` gives (received by broadcast, or the next slice of the shared memory). Lazy: a
    consumer that takes them as they come holds one bucket at a time."""
    manifest: Manifest = [(n, tuple(s), d) for n, s, d in header["tensors"]]
    plan = buckets(manifest, header["bucket_bytes"])
    if [size for size, _ in plan] != header["buckets"]:
        raise RuntimeError("weight publication: bucket layout differs from the trainer's (another version?)")
    for size, members in plan:
        yield unpack(manifest, members, read(size))


def reader(shared: torch.Tensor, ready: Callable[[int], None] | None = None) -> Callable[[int], torch.Tensor]:
    """`read` for `incoming` over one shared-memory version: its buckets as consecutive ALIGN-aligned
    slices (views: the consumer copies what it keeps before the group's barrier). `ready(k)` blocks
    until bucket k is staged (the trainer fills the segment while the receivers read it). The trainer
    writes through the same slices."""
    start, k = 0, 0

    def read(size: int) -> torch.Tensor:
        nonlocal start, k
        if ready is not None:
            ready(k)
        k += 1
        start = _align(start) + size
        return shared[start - size : start]

    return read


def span(sizes: Iterable[int]) -> int:
    """The bytes of buckets of `sizes` laid out as `reader` reads them."""
    end = 0
    for size in sizes:
        end = _align(end) + size
    return end


def buckets(manifest: Manifest, bucket_bytes: int) -> list[tuple[int, list[int]]]:
    """Consecutive tensors grouped into buckets of at most bucket_bytes in the `_runs` layout (a bigger
    tensor gets its own): (bucket bytes, tensors)."""
    out: list[tuple[int, list[int]]] = []
    members: list[int] = []
    size, last = 0, None
    for i, (_, shape, dtype) in enumerate(manifest):
        grown = (size if dtype == last else _align(size)) + nbytes(shape, dtype)
        if members and grown > bucket_bytes:
            out.append((size, members))
            members, grown = [], nbytes(shape, dtype)
        members.append(i)
        size, last = grown, dtype
    if members:
        out.append((size, members))
    return out


def pack(
    manifest: Manifest, tensors: Sequence[torch.Tensor], members: Sequence[int], out: torch.Tensor
) -> None:
    """Copy tensors `members` (consecutive, in manifest order) into the bytes `out` in the bucket layout
    (`_runs`), checking each: one concatenation per run, not a copy per tensor (3x cheaper for 50 small
    tensors). Tensors on another device (a GPU trainer's, into shared memory) are copied over first."""
    for index in members:
        t = tensors[index]
        name, shape, dtype = manifest[index]
        if tuple(t.shape) != tuple(shape) or DTYPE_NAMES[t.dtype] != dtype:
            raise ValueError(f"tensor {name}: got {tuple(t.shape)} {t.dtype}, manifest says {shape} {dtype}")
    for start, size, run in _runs(manifest, members):
        raw = [tensors[i].detach().reshape(-1).view(torch.uint8).to(out.device) for i in run]
        torch.cat(raw, out=out[start : start + size])


def unpack(manifest: Manifest, members: Sequence[int], buf: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Tensors `members` of the bytes `buf` (a bucket packed by `pack`) as named views: one split per
    run, not three view operations per tensor (half the cost for 50 tensors)."""
    out: list[tuple[str, torch.Tensor]] = []
    for start, size, run in _runs(manifest, members):
        flat = buf[start : start + size].view(TORCH_DTYPES[manifest[run[0]][2]])
        counts = [math.prod(manifest[i][1]) for i in run]
        out += [
            (manifest[i][0], t.view(manifest[i][1])) for i, t in zip(run, flat.split(counts), strict=True)
        ]
    return out


def _runs(manifest: Manifest, members: Sequence[int]) -> list[tuple[int, int, list[int]]]:
    """The bucket layout: (byte offset, bytes, tensors) of each run of consecutive tensors of one dtype,
    back to back within the run, each run starting ALIGN-aligned."""
    runs: list[tuple[int, int, list[int]]] = []
    start = size = 0
    run: list[int] = []
    last = None
    for i in members:
        _, shape, dtype = manifest[i]
        if dtype != last:
            if run:
                runs.append((start, size - start, run))
            start = size = _align(size)
            run, last = [], dtype
        run.append(i)
        size += nbytes(shape, dtype)
    if run:
        runs.append((start, size - start, run))
    return runs


def nbytes(shape: Iterable[int], dtype: str) -> int:
    n = TORCH_DTYPES[dtype].itemsize
    for d in shape:
        n *= d
    return n


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread meanwhile, for copies of weights by the one thread using torch at the time.

    Copying a few MB, a second thread gains nothing; on a busy machine each parallel copy waits for its
    worker to be scheduled, and the worker then spins, keeping a core from the process at the other end
    (2 cores, a 3.4 MB model: publication to loaded weights 2.7-3.8 ms -> 1.3-1.9 ms)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def process_group(store: Any, rank: int, world_size: int, device: torch.device, timeout: timedelta) -> Any:
    """A standalone process group over `store`: NCCL on GPU, gloo otherwise (not the default group, so it
    lives beside a trainer's FSDP group or an engine's own)."""
    if device.type == "cuda":
        return dist.ProcessGroupNCCL(store, rank, world_size, dist.ProcessGroupNCCL.Options())
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


def broadcast_from_trainer(pg: Any, tensor: torch.Tensor) -> None:
    """Broadcast `tensor` from rank 0 (the trainer) over the standalone group `pg`, and wait for it."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    pg.broadcast([tensor], opts).wait()
