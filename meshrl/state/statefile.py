"""A service's progress, rewritten before every effect it has on the data plane, for a successor that
re-joins the run after the process was killed at any instant.

Two slot files, `<stem>.0.json` and `<stem>.1.json`, each rewritten in place with one `pwrite` of a
header (magic, sequence number, length, CRC-32) and the JSON text. Each write goes to the slot that
does not hold the latest state, so a write cut short by a kill leaves the other slot, the state before,
intact; the reader takes the valid slot with the highest sequence number. That is the right state: the
write comes before the effect it announces, so a torn write means the effect never happened.

Why not a temporary file and a rename: writing several times per training step, the rename cost about
1 ms each on this project's CI file system (overlay), on the critical path of a step. No fsync either:
the file must outlive the process, not the machine (a lost machine restarts the run from its
checkpoint).
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path
from typing import Any

MAGIC = b"MRS1"
HEADER = struct.Struct("<4sQII")  # magic, sequence number, length, crc32 of the JSON bytes


class StateFile:
    def __init__(self, stem: Path) -> None:
        self.paths = (stem.with_name(stem.name + ".0.json"), stem.with_name(stem.name + ".1.json"))
        self.seq = 0
        self._fds: list[int] | None = None

    def read(self) -> Any | None:
        """The latest complete state, or None if no slot holds one. Later writes follow it."""
        best: tuple[int, bytes] | None = None
        for path in self.paths:
            try:
                raw = path.read_bytes()
            except FileNotFoundError:
                continue
            if len(raw) < HEADER.size:
                continue
            magic, seq, length, crc = HEADER.unpack_from(raw)
            body = raw[HEADER.size : HEADER.size + length]
            if magic != MAGIC or len(body) != length or zlib.crc32(body) != crc:
                continue  # a write cut short
            if best is None or seq > best[0]:
                best = (seq, body)
        if best is None:
            return None
        self.seq = best[0]
        return json.loads(best[1])

    def write(self, state: Any) -> None:
        if self._fds is None:
            self.paths[0].parent.mkdir(parents=True, exist_ok=True)
            self._fds = [os.open(p, os.O_WRONLY | os.O_CREAT, 0o644) for p in self.paths]
        body = json.dumps(state).encode()
        self.seq += 1
        os.pwrite(
            self._fds[self.seq % 2], HEADER.pack(MAGIC, self.seq, len(body), zlib.crc32(body)) + body, 0
        )

    def remove(self) -> None:
        """The run is over: nothing to re-join."""
        if self._fds is not None:
            for fd in self._fds:
                os.close(fd)
            self._fds = None
        for path in self.paths:
            path.unlink(missing_ok=True)
