"""Requests that wait at the controller, and the deadlines it keeps.

A claim that no ready rows can serve yet, and a put into a full partition, are parked: queued per
partition in arrival order and answered when the controller can serve them, or at their timeout. Clients
never poll. The deadlines of parked requests and of leases share one heap; when an entry comes due, one
whose request was answered meanwhile is skipped here, and the controller skips one whose lease was
acked or renewed.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from meshrl.dataplane import protocol as P
from meshrl.dataplane.rpc import Connection

MAX_WAIT_S = 86400.0
LeaseKey = tuple[str, str, int]  # (partition, consumer, claim id)


@dataclass
class Parked:
    conn: Connection
    rid: bytes
    msg: Any  # a Claim or a Put
    deadline: float
    done: bool = False


class Parking:
    def __init__(self) -> None:
        self.claims: dict[str, deque[Parked]] = {}
        self.puts: dict[str, deque[Parked]] = {}
        self.timers: list[tuple[float, int, Parked | LeaseKey]] = []  # (when, sequence, what)
        self._seq = 0

    def open(self, partition: str) -> None:
        self.claims[partition] = deque()
        self.puts[partition] = deque()

    def at(self, when: float, what: Parked | LeaseKey) -> None:
        self._seq += 1
        heapq.heappush(self.timers, (when, self._seq, what))

    def park(self, queue: deque[Parked], conn: Connection, rid: bytes, msg: Any, timeout: float) -> None:
        p = Parked(conn, rid, msg, time.monotonic() + min(max(timeout, 0.0), MAX_WAIT_S))
        queue.append(p)
        self.at(p.deadline, p)

    def timeout(self, longest: float) -> float:
        """How long the loop may wait for requests before the next deadline (at most `longest`)."""
        deadline = time.monotonic() + longest
        if self.timers:
            deadline = min(deadline, self.timers[0][0])
        return max(0.0, deadline - time.monotonic()) + 0.0005

    def serve_claims(self, partition: str, serve: Callable[[Parked], bool]) -> None:
        """Offer the partition's parked claims to `serve` in order (it answers those it can, and says so).
        A claim whose connection ended is dropped, which leaves the rows for the others."""
        queue = self.claims[partition]
        keep: deque[Parked] = deque()
        while queue:
            p = queue.popleft()
            if p.conn.closed or serve(p):
                p.done = True
            else:
                keep.append(p)
        self.claims[partition] = keep

    def next_put(self, partition: str, room: int) -> Parked | None:
        """The first parked put of the partition, taken off the queue, when `room` rows fit it."""
        queue = self.puts[partition]
        if not queue or queue[0].msg.n > room:
            return None
        p = queue.popleft()
        p.done = True
        return p

    def pop_due(self, now: float) -> Parked | LeaseKey | None:
        """The next deadline up to `now`, or None: a parked request, taken off its queue (answer it now),
        or a lease (check it is still held and was not renewed)."""
        while self.timers and self.timers[0][0] <= now:
            _, _, what = heapq.heappop(self.timers)
            if isinstance(what, Parked):
                if what.done:
                    continue
                what.done = True
                queues = self.claims if isinstance(what.msg, P.Claim) else self.puts
                queues[what.msg.partition].remove(what)
            return what
        return None


def full_message(part: Any, timeout: float) -> str:
    """Why a put into partition `part` gave up after waiting `timeout` seconds."""
    return (
        f"partition {part.name!r} is full ({part.rows}/{part.capacity} rows) and stayed full for "
        f"{timeout:.1f}s; a consumer must ack/delete rows (is the terminal consumer running?) or the "
        "partition needs a larger capacity"
    )
