"""Wire messages of the data plane.

Every message is one msgpack frame decoded by msgspec into a typed struct, optionally followed by raw
tensor frames (storage reads only). Nothing on the wire is ever unpickled: a frame that does not decode
into one of the structs below is answered with an `Error` and the server keeps serving.

Index arrays (row ids, offsets, lengths) travel as raw little-endian int64/int32 bytes inside the
msgpack frame so that a 256-row batch costs a handful of bytes objects, not 256 Python objects.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec
import numpy as np

# Row metadata values: small scalars only.
MetaValue = int | float | str | bool | None
Meta = dict[str, MetaValue]

# dtypes allowed in columns. Names are torch's; numpy has no bfloat16, so tensors are built with torch.
DTYPES: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
}
MAX_COLUMNS = 63  # one bit per column in an int64 readiness mask
MAX_NDIM = 8
SEGMENT_NAME = re.compile(r"^meshrl-[A-Za-z0-9_.\-]{1,200}$")
NAME = re.compile(r"^[A-Za-z0-9_.:\-]{1,200}$")
MAX_KEY = 200  # characters of a put's idempotency key


class ProtocolError(ValueError):
    """A request that is well-formed msgpack but violates the protocol's rules."""


class TableError(Exception):
    """A request the controller's table refuses; `code` goes back as the `Error` reply's code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


# ---------------------------------------------------------------------------------------------------------
# shared pieces


class SegmentRef(msgspec.Struct, frozen=True):
    """A shared-memory segment holding the bytes of one write, on the host that wrote it."""

    name: str
    host: str
    size: int


class ColumnWrite(msgspec.Struct, frozen=True):
    """One column of a put: `nbytes` contiguous bytes at `offset` in the put's segment.

    Dense columns have one item of `shape` per row (`lengths` is None). Ragged columns have
    `lengths[i]` items of `shape` for row i, stored back to back.
    """

    name: str
    dtype: str
    shape: list[int]
    ragged: bool
    offset: int
    nbytes: int
    lengths: bytes | None = None


class ColumnRead(msgspec.Struct, frozen=True):
    """Where the requested rows of one column live: per row a segment index, byte offset, item count."""

    name: str
    dtype: str
    shape: list[int]
    ragged: bool
    segment: bytes  # int32 index into ClaimReply.segments, one per row
    offset: bytes  # int64 byte offset, one per row
    length: bytes  # int64 number of items (1 for dense columns), one per row


# ---------------------------------------------------------------------------------------------------------
# requests


class Hello(msgspec.Struct, tag="hello", frozen=True):
    client: str
    host: str
    pid: int
    role: str = "client"  # "client" or "storage"
    endpoint: str = ""  # storage servers: where remote readers reach them


class CreatePartition(msgspec.Struct, tag="create", frozen=True):
    partition: str
    capacity: int
    delete_when_acked_by: list[str] = []


class Put(msgspec.Struct, tag="put", frozen=True):
    client: str
    partition: str
    n: int
    segment: SegmentRef
    columns: list[ColumnWrite]
    ids: bytes | None = None
    meta: list[Meta] | None = None
    timeout: float = 30.0
    key: str | None = None  # idempotency key: a put repeated under the same key is applied once


class Claim(msgspec.Struct, tag="claim", frozen=True):
    partition: str
    consumer: str
    columns: list[str]
    n: int
    min_n: int = 1
    group_size: int | None = None
    timeout: float = 0.0
    lease: float = 60.0
    address: str | None = None  # only rows whose meta["to"] (addresses joined by commas) names this one


class Ack(msgspec.Struct, tag="ack", frozen=True):
    partition: str
    consumer: str
    claim: int
    reply: bool = True  # False: answer only on error (fire-and-forget acks of streaming consumers)
    ids: bytes | None = None  # only these rows of the claim (the others stay leased)


class Release(msgspec.Struct, tag="release", frozen=True):
    """Give a claim's rows back unprocessed (front of the queue)."""

    partition: str
    consumer: str
    claim: int


class Renew(msgspec.Struct, tag="renew", frozen=True):
    partition: str
    consumer: str
    claim: int
    lease: float


class Delete(msgspec.Struct, tag="delete", frozen=True):
    partition: str
    ids: bytes


class Status(msgspec.Struct, tag="status", frozen=True):
    pass


class Snapshot(msgspec.Struct, tag="snapshot", frozen=True):
    path: str


class Bye(msgspec.Struct, tag="bye", frozen=True):
    client: str


class Read(msgspec.Struct, tag="read", frozen=True):
    """To a storage server: send back these byte ranges, one raw frame each."""

    ranges: list[tuple[str, int, int]]  # (segment name, offset, nbytes)


class Unlink(msgspec.Struct, tag="unlink", frozen=True):
    """To a storage server: these segments hold no live row any more."""

    names: list[str]


class Save(msgspec.Struct, tag="save", frozen=True):
    """To a storage server: copy these segments into `path` (part of a snapshot)."""

    path: str
    names: list[str]


Request = (
    Hello
    | CreatePartition
    | Put
    | Claim
    | Ack
    | Release
    | Renew
    | Delete
    | Status
    | Snapshot
    | Bye
    | Read
    | Unlink
    | Save
)


# ---------------------------------------------------------------------------------------------------------
# replies


class Ok(msgspec.Struct, tag="ok", frozen=True):
    n: int = 0


class Error(msgspec.Struct, tag="error", frozen=True):
    code: str  # bad_request | unknown_partition | full | expired | conflict | internal
    message: str


class HelloReply(msgspec.Struct, tag="hello_reply", frozen=True):
    run: str  # token that prefixes every segment name of this run
    shm_dir: str
    storages: dict[str, str]  # host -> endpoint
    host: str = ""  # the controller's host
    local: str = ""  # where clients on that host reach the controller more cheaply (a Unix socket)


class PutReply(msgspec.Struct, tag="put_reply", frozen=True):
    ids: bytes
    released: list[str] = []  # this client's segments that no live row references any more


class ClaimReply(msgspec.Struct, tag="claim_reply", frozen=True):
    claim: int
    ids: bytes
    segments: list[SegmentRef]
    columns: list[ColumnRead]
    meta: list[Meta | None] | None = None


class ConsumerStatus(msgspec.Struct, frozen=True):
    name: str
    columns: list[str]
    ready: int
    claimed: int
    acked: int


class PartitionStatus(msgspec.Struct, frozen=True):
    name: str
    capacity: int
    rows: int
    columns: dict[str, int]
    consumers: list[ConsumerStatus]
    oldest_age_s: float
    waiting_puts: int
    waiting_claims: int


class StatusReply(msgspec.Struct, tag="status_reply", frozen=True):
    partitions: list[PartitionStatus]
    segments: int
    clients: int
    uptime_s: float


class ReadReply(msgspec.Struct, tag="read_reply", frozen=True):
    nbytes: list[int]


Reply = Ok | Error | HelloReply | PutReply | ClaimReply | StatusReply | ReadReply

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_request(frame: bytes | memoryview) -> Any:
    return _request_decoder.decode(frame)


def decode_reply(frame: bytes | memoryview) -> Any:
    return _reply_decoder.decode(frame)


# ---------------------------------------------------------------------------------------------------------
# validation helpers shared by servers


def int64s(data: bytes | None, what: str) -> np.ndarray:
    if data is None or len(data) % 8:
        raise ProtocolError(f"{what}: expected int64 bytes, got {0 if data is None else len(data)} bytes")
    return np.frombuffer(data, dtype="<i8")


def check_name(name: str, what: str) -> str:
    if not NAME.match(name):
        raise ProtocolError(f"{what} {name!r} must match {NAME.pattern}")
    return name


def check_segment_name(name: str) -> str:
    if not SEGMENT_NAME.match(name):
        raise ProtocolError(f"segment name {name!r} must match {SEGMENT_NAME.pattern}")
    return name


def item_bytes(dtype: str, shape: list[int]) -> int:
    """Bytes of one item (one row of a dense column, one element along dim 0 of a ragged one)."""
    if dtype not in DTYPES:
        raise ProtocolError(f"dtype {dtype!r} not supported; use one of {sorted(DTYPES)}")
    if len(shape) > MAX_NDIM:
        raise ProtocolError(f"shape {shape} invalid: at most {MAX_NDIM} non-negative dims")
    size = DTYPES[dtype]
    for d in shape:
        if d < 0 or d > 1 << 31:
            raise ProtocolError(f"shape {shape} invalid: at most {MAX_NDIM} non-negative dims")
        size *= d
    return size


def positive_seconds(x: float, what: str) -> float:
    """`x` if it is a sensible number of seconds (a lease, a timeout), else a ProtocolError."""
    if not x > 0 or x > 86400 * 365:
        raise ProtocolError(f"{what} must be a positive number of seconds, got {x}")
    return x


def empty_claim() -> ClaimReply:
    return ClaimReply(claim=0, ids=b"", segments=[], columns=[])
