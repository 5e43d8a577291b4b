"""Offload and restore in place: tensors' bytes go to a file and their memory is freed; the same tensor
objects get their bytes back later.

What is moved is each distinct storage (so views and tied weights stay consistent), and the tensor
objects never change: modules, optimizers and anything else holding them keep working after a restore.
Freeing is `untyped_storage().resize_(0)`; on CPU the allocator is then asked to hand free pages back
to the operating system (malloc_trim), so the process's resident memory really drops. The file lives
in the page cache or on disk, outside the process. While offloaded, `write(name, tensor)` updates a
tensor's bytes in the file (an inference engine receiving new weights while another role holds the
devices); the next restore brings back the newest bytes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch


def trim_heap() -> None:
    """Return free heap pages to the OS (glibc); a no-op elsewhere."""
    name = ctypes.util.find_library("c")
    if name is None:
        return
    try:
        libc = ctypes.CDLL(name)
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _host_view(storage: torch.UntypedStorage) -> ctypes.Array[ctypes.c_char]:
    """The bytes of a CPU storage as a writable buffer for file I/O (numpy would pin the storage: a
    storage exported to numpy can no longer be resized)."""
    return (ctypes.c_char * storage.nbytes()).from_address(storage.data_ptr())


@dataclass
class _Entry:
    storage: torch.UntypedStorage
    nbytes: int
    offset: int  # in the file


class HostStore:
    """Tensors offloaded to one file (`path`); `offload`, then `restore`, any number of times."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.entries: list[_Entry] = []
        self.where: dict[str, tuple[int, int, int]] = {}  # name -> (entry, byte offset, nbytes)
        self.offloaded = False

    def offload(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Write every tensor's storage to the file and free it. Returns the bytes freed."""
        assert not self.offloaded, "already offloaded"
        self.entries, self.where = [], {}
        index: dict[int, int] = {}
        for name, t in named:
            if not t.untyped_storage().resizable():  # e.g. memory-mapped from a checkpoint: own it once
                t.data = t.detach().clone()
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if storage.nbytes() == 0:
                continue
            if key not in index:
                index[key] = len(self.entries)
                self.entries.append(_Entry(storage, storage.nbytes(), 0))
            if t.is_contiguous():
                at = int(t.storage_offset()) * t.element_size()
                self.where[name] = (index[key], at, int(t.numel()) * t.element_size())
        offset = 0
        with open(self.path, "wb") as f:
            for e in self.entries:
                e.offset = offset
                host = e.storage if e.storage.device.type == "cpu" else e.storage.cpu()
                f.write(_host_view(host))
                offset += e.nbytes
        freed = 0
        for e in self.entries:
            e.storage.resize_(0)
            freed += e.nbytes
        self.offloaded = True
        if any(e.storage.device.type == "cuda" for e in self.entries):
            torch.cuda.empty_cache()
        trim_heap()
        return freed

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """While offloaded: replace the bytes of the tensor offloaded under `name`."""
        assert self.offloaded, "write() is for offloaded tensors"
        if name not in self.where:
            raise KeyError(f"{name!r} was not offloaded (or is not contiguous)")
        entry, at, nbytes = self.where[name]
        data = tensor.detach().contiguous().cpu().clone()
        if data.numel() * data.element_size() != nbytes:
            raise ValueError(f"{name}: {data.numel() * data.element_size()} bytes for a tensor of {nbytes}")
        with open(self.path, "r+b") as f:
            f.seek(self.entries[entry].offset + at)
            f.write(_host_view(data.untyped_storage()))

    def restore(self) -> int:
        """Give every storage its bytes back, in place. Returns the bytes restored."""
        assert self.offloaded, "not offloaded"
        with open(self.path, "rb") as f:
            for e in self.entries:
                e.storage.resize_(e.nbytes)
                f.seek(e.offset)
                if e.storage.device.type == "cpu":
                    f.readinto(_host_view(e.storage))
                else:
                    staging = torch.empty(e.nbytes, dtype=torch.uint8)
                    f.readinto(_host_view(staging.untyped_storage()))
                    e.storage.copy_(staging.untyped_storage())
        self.offloaded = False
        return sum(e.nbytes for e in self.entries)

    def close(self) -> None:
        self.path.unlink(missing_ok=True)
