"""A put that leaves alone the rows that already have the columns, or are gone: how every service that
adds a column writes it, so that a row handed out twice (after a crash or a resume) is written once."""

from __future__ import annotations

from typing import Any

from meshrl.dataplane.aio import AsyncClient
from meshrl.dataplane.batch import Ragged
from meshrl.dataplane.client import Client
from meshrl.dataplane.core import DataPlaneError


def put_missing(client: Client, partition: str, columns: dict[str, Any], ids: Any) -> int:
    """Put `columns` into rows `ids`, except into rows that already have them or are gone. Both happen to
    rows handed out again after they were written: by an earlier process of the same replica that died
    before its ack, or by a resumed run whose checkpoint caught the rows between this service's put and
    its ack (stateless services keep working while the data plane is snapshotted: the snapshot holds the
    column written and the claim open, and a restore makes such rows ready again). The rows' other
    consumers see the column meanwhile and may take them to the end, deleted once the last of them
    acknowledges. A frozen model (or seeded sampling) writes the same values: such rows need nothing
    more. Returns how many rows were left as they were."""
    try:
        client.put(partition, columns, ids=ids)
        return 0
    except DataPlaneError as e:
        if not _written_or_gone(e):
            raise
    kept = 0
    for k in range(len(ids)):  # rare (after a crash or a resume): row by row, the written or gone ones refuse
        try:
            client.put(partition, {c: _row(v, k) for c, v in columns.items()}, ids=ids[k : k + 1])
        except DataPlaneError as e:
            if not _written_or_gone(e):
                raise
            kept += 1
    return kept


async def put_missing_async(client: AsyncClient, partition: str, columns: dict[str, Any], ids: Any) -> int:
    """`put_missing` for asyncio services (inference keeps the completion a predecessor wrote)."""
    try:
        await client.put(partition, columns, ids=ids)
        return 0
    except DataPlaneError as e:
        if not _written_or_gone(e):
            raise
    kept = 0
    for k in range(len(ids)):
        try:
            await client.put(partition, {c: _row(v, k) for c, v in columns.items()}, ids=ids[k : k + 1])
        except DataPlaneError as e:
            if not _written_or_gone(e):
                raise
            kept += 1
    return kept


def _written_or_gone(e: DataPlaneError) -> bool:
    """A put refused for a row that has the column already (`conflict`) or no longer exists (the table's
    "unknown row ids": rows are only deleted once their consumers are done with them)."""
    return e.code == "conflict" or (e.code == "bad_request" and "unknown row ids" in str(e))


def _row(value: Any, k: int) -> Any:
    """Row k of a column as `put` takes it (a Ragged, a list of per-row tensors, or a tensor)."""
    if isinstance(value, Ragged):
        return Ragged.from_list([value[k]], dtype=value.values.dtype)
    return value[k : k + 1]
