"""Snapshot and restore of the data plane: controller metadata plus every live segment's bytes.

`save` runs inside the controller's loop, so no request interleaves with it: each host's storage server
copies its live segments into `<dir>/segments/<host>/`, then the controller writes `<dir>/controller.msgpack`
last (its presence marks a complete snapshot). Claims in flight are not saved: on restore their rows are
ready again, so a consumer that died between claim and ack loses nothing; the idempotency keys of the latest
puts are kept, so a producer that repeats a put the snapshot holds gets the same rows. Everything is msgpack; no pickle.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from meshrl.dataplane import protocol as P
from meshrl.dataplane.consumers import ACKED, CLAIMED, NOT_READY, PARTIAL, READY
from meshrl.dataplane.slots import FreeSlots
from meshrl.dataplane.table import Partition

if TYPE_CHECKING:
    from meshrl.dataplane.controller import Controller

FORMAT = 1
CONTROLLER_FILE = "controller.msgpack"
LEDGER_FILE = "ledger.json"


class ColumnState(msgspec.Struct):
    name: str
    dtype: str | None
    shape: list[int]
    ragged: bool
    segment: bytes  # int32 index into ControllerState.segments per row, -1 where absent
    offset: bytes
    length: bytes


class ConsumerState(msgspec.Struct):
    name: str
    columns: list[str]
    group_size: int | None
    state: bytes  # int8 per row
    address: str | None = None


class PartitionState(msgspec.Struct):
    name: str
    capacity: int
    delete_when_acked_by: list[str]
    ids: bytes
    group: bytes
    meta: list[P.Meta | None]
    columns: list[ColumnState]
    consumers: list[ConsumerState]


class ControllerState(msgspec.Struct):
    format: int
    run: str
    next_id: int
    next_claim: int
    segments: list[P.SegmentRef]
    partitions: list[PartitionState]
    put_keys: list[tuple[str, bytes]] = []
    """The idempotency keys of the latest puts and their ids, oldest first: a producer that repeats a put
    the snapshot holds (its acknowledgement came later) gets the rows it made, not new ones."""


def save(ctl: Controller, path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    live: dict[int, int] = {}  # controller segment index -> position in the snapshot's list
    refs: list[P.SegmentRef] = []
    parts = []
    for part in ctl.partitions.values():
        slots = np.flatnonzero(part.row_id >= 0)
        slots = slots[np.argsort(part.row_id[slots], kind="stable")]
        cols = []
        for col in part.columns.values():
            has = ((part.mask[slots] >> col.bit) & 1) == 1
            seg = np.full(len(slots), -1, dtype=np.int32)
            for k, s in enumerate(col.seg[slots].tolist()):
                if has[k]:
                    if s not in live:
                        live[s] = len(refs)
                        refs.append(ctl.segments.ref(s))
                    seg[k] = live[s]
            cols.append(
                ColumnState(
                    col.name,
                    col.dtype,
                    col.shape,
                    col.ragged,
                    seg.tobytes(),
                    col.off[slots].astype("<i8").tobytes(),
                    col.length[slots].astype("<i8").tobytes(),
                )
            )
        consumers = []
        for c in part.consumers.values():
            st = c.state[slots].copy()
            st[(st == CLAIMED) | (st == PARTIAL)] = READY
            consumers.append(
                ConsumerState(c.name, c.columns, c.group_size, st.astype(np.int8).tobytes(), c.address)
            )
        parts.append(
            PartitionState(
                part.name,
                part.capacity,
                part.delete_when_acked_by,
                part.row_id[slots].astype("<i8").tobytes(),
                part.group[slots].astype("<i8").tobytes(),
                [part.meta[s] for s in slots.tolist()],
                cols,
                consumers,
            )
        )
    by_host: dict[str, list[str]] = {}
    for ref in refs:
        by_host.setdefault(ref.host, []).append(ref.name)
    for host, names in by_host.items():
        reply = ctl.storage.call(host, P.Save(str(path / "segments" / host), names))
        if isinstance(reply, P.Error):
            raise RuntimeError(f"storage on {host} failed to save segments: {reply.message}")
    state = ControllerState(
        FORMAT, ctl.run, ctl.next_id, ctl.next_claim, refs, parts, list(ctl.put_keys.items())
    )
    if ctl.ledger is not None:  # the ledger's length at this instant: a restore cuts it back to here
        (path / LEDGER_FILE).write_text(json.dumps({"offset": ctl.ledger.offset()}))
    tmp = path / (CONTROLLER_FILE + ".tmp")
    with open(tmp, "wb") as f:
        f.write(msgspec.msgpack.encode(state))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path / CONTROLLER_FILE)


def load_controller(ctl: Controller, path: Path) -> set[str]:
    """Rebuild `ctl`'s tables from a snapshot. Returns the hosts whose storage must restore segments."""
    file = path / CONTROLLER_FILE
    if not file.exists():
        raise FileNotFoundError(f"{path} holds no complete data-plane snapshot ({CONTROLLER_FILE} missing)")
    state = msgspec.msgpack.decode(file.read_bytes(), type=ControllerState)
    if state.format != FORMAT:
        raise ValueError(f"snapshot format {state.format} is not {FORMAT}")
    ctl.run = state.run
    if ctl.ledger is not None and (path / LEDGER_FILE).exists():
        ctl.ledger.truncate(int(json.loads((path / LEDGER_FILE).read_text())["offset"]))
    ctl.next_id = state.next_id
    ctl.next_claim = state.next_claim
    ctl.put_keys.clear()
    ctl.put_keys.update(state.put_keys)
    ctl.segments.restore(state.segments)
    for ps in state.partitions:
        _load_partition(ctl, ps)
    return {ref.host for ref in state.segments}


def _load_partition(ctl: Controller, ps: PartitionState) -> None:
    part = Partition(ps.name, ps.capacity, ps.delete_when_acked_by)
    ctl.partitions[ps.name] = part
    ctl.parking.open(ps.name)
    ids = np.frombuffer(ps.ids, dtype="<i8")
    n = len(ids)
    slots = np.arange(n, dtype=np.int64)
    part.free = FreeSlots(part.capacity, used=n)
    part.row_id[slots] = ids
    part.group[slots] = np.frombuffer(ps.group, dtype="<i8")
    part.created[slots] = time.monotonic()
    part.meta[:n] = ps.meta
    part.meta_rows = sum(1 for m in ps.meta if m is not None)
    order = np.argsort(ids, kind="stable")
    part.index.add(ids[order], slots[order], part.row_id)
    for cs in ps.columns:
        col = part.declare(cs.name)
        if cs.dtype is not None:
            col.dtype, col.shape, col.ragged = cs.dtype, cs.shape, cs.ragged
            col.item = P.item_bytes(cs.dtype, cs.shape)
        seg = np.frombuffer(cs.segment, dtype=np.int32)
        has = seg >= 0
        part.mask[slots[has]] |= 1 << col.bit
        col.seg[:n] = np.where(has, seg, 0)
        col.off[:n] = np.frombuffer(cs.offset, dtype="<i8")
        col.length[:n] = np.frombuffer(cs.length, dtype="<i8")
        for s in seg[has].tolist():
            ctl.segments.info[s].refs += 1
    for cons in ps.consumers:
        c = part.add_consumer(cons.name, cons.columns, cons.group_size, cons.address)
        st = np.frombuffer(cons.state, dtype=np.int8)
        c.state[:n] = np.where(st == ACKED, ACKED, NOT_READY)
        c.mark_ready(slots[st == READY])
