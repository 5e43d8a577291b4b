"""Offload to a file and restore in place: same tensor objects, same bytes, memory really released."""

from __future__ import annotations

import torch

from meshrl.runtime.offload import HostStore


def test_offload_frees_storages_and_restore_brings_back_the_same_tensors(tmp_path):
    big = torch.randn(64, 1024)
    view = big[3:5]  # shares big's storage
    other = torch.arange(10, dtype=torch.int64)
    want = (big.clone(), other.clone())
    store = HostStore(tmp_path / "x.bin")
    moved = store.offload([("big", big), ("view", view), ("other", other)])
    assert moved == big.numel() * 4 + other.numel() * 8  # the shared storage once
    assert big.untyped_storage().nbytes() == 0 and other.untyped_storage().nbytes() == 0
    assert store.restore() == moved
    assert torch.equal(big, want[0]) and torch.equal(other, want[1])
    assert (
        torch.equal(view, want[0][3:5])
        and view.untyped_storage().data_ptr() == big.untyped_storage().data_ptr()
    )


def test_writes_while_offloaded_are_what_restore_brings_back(tmp_path):
    lin = torch.nn.Linear(8, 4)
    store = HostStore(tmp_path / "w.bin")
    store.offload(lin.named_parameters())
    new = torch.full((4, 8), 0.5)
    store.write("weight", new)
    store.restore()
    assert torch.equal(lin.weight.detach(), new)
    out = lin(torch.ones(1, 8))  # the module works on the restored tensors, gradients included
    out.sum().backward()
    assert lin.weight.grad is not None


def test_memory_mapped_tensors_are_owned_before_they_are_freed(tmp_path):
    path = tmp_path / "m.bin"
    torch.arange(16, dtype=torch.float32).numpy().tofile(path)
    mapped = torch.from_file(str(path), shared=False, size=16, dtype=torch.float32)
    t = torch.nn.Parameter(mapped)
    store = HostStore(tmp_path / "s.bin")
    store.offload([("p", t)])
    store.restore()
    assert torch.equal(t.detach(), torch.arange(16, dtype=torch.float32))
