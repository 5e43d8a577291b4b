"""Weights packed into one byte buffer and read back as views, the way publications travel."""

from __future__ import annotations

import pytest
import torch

from meshrl.dataplane.batch import DTYPE_NAMES
from meshrl.runtime.weights_packing import buckets, nbytes, pack, reader, span, unpack


def test_mixed_dtypes_and_shapes_round_trip_bit_exact_through_every_bucket() -> None:
    g = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(4, 6, generator=g),
        torch.randn(3, generator=g).to(torch.bfloat16),
        torch.randn(5, 2, generator=g).to(torch.bfloat16),
        torch.randn((), generator=g),  # a scalar
        torch.randint(0, 9, (7,), generator=g),
        torch.randn(8, 3, generator=g).t(),  # not contiguous
        torch.randn(0, 4, generator=g),  # empty
        torch.randn(2, 2, generator=g),
    ]
    manifest = [(f"w{i}", tuple(t.shape), DTYPE_NAMES[t.dtype]) for i, t in enumerate(tensors)]
    for bucket_bytes in (1, 40, 1 << 20):  # a tensor per bucket, a few, all in one
        got = {}
        index = 0
        for size, members in buckets(manifest, bucket_bytes):
            assert members[0] == index and size >= sum(nbytes(*manifest[i][1:]) for i in members)
            buf = torch.empty(size, dtype=torch.uint8)
            pack(manifest, tensors, members, buf)
            got.update(unpack(manifest, members, buf))
            index = members[-1] + 1
        assert list(got) == [m[0] for m in manifest]
        for t, (name, _, _) in zip(tensors, manifest, strict=True):
            assert got[name].dtype == t.dtype and got[name].shape == t.shape
            assert torch.equal(_bytes(got[name]), _bytes(t))  # bit for bit
            assert got[name].data_ptr() % t.element_size() == 0  # aligned, whatever came before


def test_a_tensor_that_does_not_match_the_manifest_is_refused() -> None:
    manifest = [("w", (2, 2), "float32")]
    with pytest.raises(ValueError, match="manifest says"):
        pack(manifest, [torch.zeros(4)], [0], torch.empty(16, dtype=torch.uint8))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_buckets_in_one_segment_are_aligned_and_each_is_read_once_staged() -> None:
    """Shared memory holds a version's buckets back to back, each ALIGN-aligned (`reader`: the trainer
    writes through it, receivers read through it), and a receiver reads bucket k only once `ready(k)`
    returns: the trainer marks each bucket as it fills it, and the receivers copy behind it."""
    g = torch.Generator().manual_seed(1)
    tensors = [torch.randn(3, generator=g).to(torch.bfloat16), torch.randn(5, generator=g)] * 3
    manifest = [(f"w{i}", tuple(t.shape), DTYPE_NAMES[t.dtype]) for i, t in enumerate(tensors)]
    plan = buckets(manifest, 8)
    sizes = [size for size, _ in plan]
    assert len(plan) == 6 and span(sizes) > sum(sizes)  # a 6-byte bucket pads the next one's start
    segment = torch.zeros(span(sizes), dtype=torch.uint8)
    write = reader(segment)
    for size, members in plan:
        out = write(size)
        assert out.data_ptr() % 8 == 0
        pack(manifest, tensors, members, out)
    waited: list[int] = []
    read = reader(segment, waited.append)
    got = {}
    for k, (size, members) in enumerate(plan):
        got.update(unpack(manifest, members, read(size)))
        assert waited == list(range(k + 1))
    assert all(torch.equal(got[f"w{i}"], t) for i, t in enumerate(tensors))
