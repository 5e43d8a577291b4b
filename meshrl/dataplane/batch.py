"""Column values as clients see them: dense tensors, ragged tensors, and claimed batches.

Writing: a column is a tensor [n, ...] (dense), a list of n tensors whose first dims differ (ragged), a
`Ragged`, or a list of n Python scalars. Reading: dense columns come back as one tensor [n, ...] and
ragged ones as `Ragged`; both are views on shared memory whenever the claimed rows are contiguous in one
segment, which is the common case (rows claimed in the order they were written).

Views stay valid until the rows are deleted: call `.clone()` on anything kept longer.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from meshrl.dataplane.protocol import Meta

warnings.filterwarnings("ignore", message="The given buffer is not writable")
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")

TORCH_DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}
# numpy dtypes with the same bytes, for copies and views (numpy has no bfloat16: its bits as int16)
NUMPY_DTYPES: dict[str, np.dtype] = {
    name: np.dtype("int16" if name == "bfloat16" else name) for name in TORCH_DTYPES
}


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's memory as a numpy array (bfloat16 as int16): numpy slicing and copying cost less
    per call than torch's, which matters for small puts and claims."""
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


def from_numpy(a: np.ndarray, dtype: str) -> torch.Tensor:
    t = torch.from_numpy(a)
    return t.view(torch.bfloat16) if dtype == "bfloat16" else t


class Ragged:
    """n rows whose first dimension differs: `values` [sum(lengths), *shape] and `lengths` [n]."""

    def __init__(
        self, values: torch.Tensor, lengths: torch.Tensor | Sequence[int], *, check: bool = True
    ) -> None:
        """`check=False`: the caller vouches that the lengths sum to the rows of `values` (the client
        building a claimed batch from the controller's own bookkeeping)."""
        self.values = values
        self.lengths = torch.as_tensor(lengths, dtype=torch.int64)
        if check and int(self.lengths.sum()) != values.shape[0]:
            raise ValueError(
                f"lengths sum to {int(self.lengths.sum())} but values has {values.shape[0]} rows"
            )
        self._offsets: torch.Tensor | None = None
        self._bounds: list[int] | None = None

    @property
    def offsets(self) -> torch.Tensor:
        """[n + 1] start of each row in `values`, and the end (computed on first use)."""
        if self._offsets is None:
            self._offsets = torch.zeros(len(self.lengths) + 1, dtype=torch.int64)
            torch.cumsum(self.lengths, 0, out=self._offsets[1:])
        return self._offsets

    @classmethod
    def from_list(
        cls, rows: Sequence[torch.Tensor | Sequence[Any]], dtype: torch.dtype | None = None
    ) -> Ragged:
        tensors = [torch.as_tensor(r, dtype=dtype) for r in rows]
        if not tensors:
            raise ValueError("a ragged column needs at least one row")
        lengths = [t.shape[0] if t.dim() else 1 for t in tensors]
        values = torch.cat([t.reshape(-1, *t.shape[1:]) if t.dim() else t.reshape(1) for t in tensors])
        return cls(values, lengths)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> torch.Tensor:
        if self._bounds is None:  # plain ints: indexing a tensor twice per row costs more than the row
            self._bounds = self.offsets.tolist()
        if i < 0:
            i += len(self)
        return self.values[self._bounds[i] : self._bounds[i + 1]]

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (self[i] for i in range(len(self)))

    def tolist(self) -> list[torch.Tensor]:
        return list(self)

    def select(self, index: Sequence[int]) -> Ragged:
        """The rows `index`, in that order (a copy)."""
        rows = [self[i] for i in index]
        values = torch.cat(rows) if rows else self.values[:0]
        return Ragged(values, [r.shape[0] for r in rows], check=False)

    def padded(self, pad: float | int = 0, max_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """([n, width, *shape] right-padded values, [n, width] bool mask of real items).

        width is the longest row, or `max_len` (longer rows are cut).
        """
        n = len(self)
        width = (int(self.lengths.max()) if n else 0) if max_len is None else max_len
        out = torch.full((n, width, *self.values.shape[1:]), pad, dtype=self.values.dtype)
        mask = torch.arange(width)[None, :] < self.lengths[:, None]
        if width and self.values.shape[0]:
            rows = torch.repeat_interleave(torch.arange(n), self.lengths)
            cols = torch.arange(self.values.shape[0]) - torch.repeat_interleave(
                self.offsets[:-1], self.lengths
            )
            keep = cols < width
            out[rows[keep], cols[keep]] = self.values[keep]
        return out, mask

    def clone(self) -> Ragged:
        return Ragged(self.values.clone(), self.lengths.clone())

    def __repr__(self) -> str:
        return f"Ragged(n={len(self)}, dtype={self.values.dtype}, shape={tuple(self.values.shape[1:])})"


Value = torch.Tensor | Ragged


@dataclass
class Batch:
    """Rows claimed by one consumer: ids, metadata and the requested columns."""

    partition: str
    consumer: str
    claim: int
    ids: np.ndarray
    meta: list[Meta | None] | None
    columns: dict[str, Value]

    def __len__(self) -> int:
        return len(self.ids)

    def __bool__(self) -> bool:
        return len(self.ids) > 0

    def __getitem__(self, name: str) -> Value:
        return self.columns[name]

    def __contains__(self, name: str) -> bool:
        return name in self.columns

    def tensor(self, name: str) -> torch.Tensor:
        """A dense column as one tensor [n, ...]."""
        value = self.columns[name]
        if isinstance(value, Ragged):
            raise TypeError(f"column {name!r} is ragged; use batch.ragged({name!r})")
        return value

    def ragged(self, name: str) -> Ragged:
        """A ragged column (per-row lengths differ)."""
        value = self.columns[name]
        if not isinstance(value, Ragged):
            raise TypeError(f"column {name!r} is dense; use batch.tensor({name!r})")
        return value

    def select(self, index: Sequence[int]) -> Batch:
        """The rows `index` of this claim, in that order: a part of the same claim (acknowledge it with
        `client.ack(part, part.ids)`; the other rows stay claimed)."""
        cols = {
            k: v.select(index) if isinstance(v, Ragged) else v[list(index)] for k, v in self.columns.items()
        }
        meta = None if self.meta is None else [self.meta[i] for i in index]
        return Batch(self.partition, self.consumer, self.claim, self.ids[list(index)], meta, cols)

    def meta_of(self, key: str, default: Any = None) -> list[Any]:
        if self.meta is None:
            return [default] * len(self)
        return [default if m is None else m.get(key, default) for m in self.meta]


def normalise(value: Any) -> tuple[torch.Tensor, list[int] | None]:
    """A column value as (contiguous CPU values, per-row lengths for ragged columns or None)."""
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(value)
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            raise ValueError("a column needs one entry per row; got a 0-d tensor")
        return _cpu(value), None
    if isinstance(value, Ragged):
        return _cpu(value.values), value.lengths.tolist()
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError("empty column")
        if all(isinstance(v, (int, float, bool, np.generic)) for v in value):
            return torch.as_tensor(value), None
        if all(
            isinstance(v, torch.Tensor) and v.dim() for v in value
        ):  # the usual ragged put: no copy for one row
            return _cpu(value[0] if len(value) == 1 else torch.cat(list(value))), [v.shape[0] for v in value]
        r = Ragged.from_list(value)
        return r.values.contiguous(), r.lengths.tolist()
    raise TypeError(f"cannot write a column of type {type(value).__name__}")


def _cpu(t: torch.Tensor) -> torch.Tensor:
    """Contiguous, on the CPU, without autograd history (each skipped call saves microseconds per put)."""
    if t.requires_grad:
        t = t.detach()
    if not t.is_cpu:
        t = t.cpu()
    return t if t.is_contiguous() else t.contiguous()
