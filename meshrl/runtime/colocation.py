"""Colocation: service groups that take turns on the same devices, by a token passed over the data plane.

A ring (`recipe.rings`; each member is handed it in its wiring, `Wiring.ring`) lists member groups,
each ON_DEMAND (asks for the devices when it has work) or FALLBACK (holds them whenever nobody else
asks; at most one per ring, typically inference). Its state is one partition, `ring.<id>.<launch>`,
where requests are rows and grants are columns:

    event    [kind, member, process, row]   a new row: REQUEST (a process wants the devices) or
                                            RELEASE (of the turn granted on request `row`)
    grant    [turn]    written on a request row when the token is its member's
    preempt  [turn]    written on a FALLBACK holder's request rows when an ON_DEMAND member asks

One process of the ring (the first process of its first member; it lives as long as the run) runs the
arbiter: a thread that reads the events in the order the data plane received them, writes grants and
preemptions, and deletes a turn's rows once it is released (the last turn's rows stay until the next
grant, so the partition always shows how many turns were granted: `meshrl status` reads it).
The token belongs to a member group, not a process: every process of the holder that asks while the
member holds it joins the turn, and the token moves on once all of them have released. The rule:

- a member's turn ends when all its processes have released;
- the next member is the first ON_DEMAND member with a pending request, in ring order after the last
  ON_DEMAND holder (round robin, so no member starves);
- the FALLBACK member gets the token only when no ON_DEMAND request is pending; while it holds the
  token and one arrives, its processes are asked to leave at their next safe point (`preempted`).

A process enters its turn with `with member.turn(): ...`: entering puts a request and waits for the
grant, then calls `restore()`; leaving calls `offload()` and writes the release. A FALLBACK process keeps
the token between turns until it is preempted (`hold()` / `yield_if_preempted()`). Services reach this
through `Service.device_turn()`, which is a no-op for a group that is in no ring.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from meshrl.dataplane import Client
from meshrl.planning.recipe import Scheduling
from meshrl.planning.wiring import Ring
from meshrl.schema import BY, EVENT, GRANT, PREEMPT, RELEASE, REQUEST, RING_CAPACITY, ring_partition

log = logging.getLogger("meshrl.runtime.colocation")

WATCH_S = 30.0


@dataclass(frozen=True)
class RingPlan:
    """What every process of a ring knows about it: the ring its members are handed by the planner
    (their wiring's `ring`), in this launch."""

    id: str
    members: tuple[str, ...]  # group ids in ring order
    modes: tuple[Scheduling, ...]
    processes: tuple[tuple[str, ...], ...]  # per member, its process names
    hybrid: bool = False  # members share one process per device: turns without offload
    launch: str = "0"  # the launch it belongs to (a resumed run restores the data plane, not the rings)

    @classmethod
    def of(cls, ring: Ring, launch: str) -> RingPlan:
        return cls(ring.id, ring.members, ring.modes, ring.processes, ring.hybrid, launch)

    @property
    def partition(self) -> str:
        """The ring's partition in this launch."""
        return ring_partition(self.id, self.launch)

    @property
    def arbiter(self) -> str:
        """The process that runs the arbiter."""
        return self.processes[0][0]

    @property
    def fallback(self) -> int | None:
        return next((i for i, m in enumerate(self.modes) if m is Scheduling.FALLBACK), None)


# -------------------------------------------------------------------------------------------------------
# the arbiter


@dataclass
class _Turn:
    member: int
    number: int
    rows: dict[int, str] = field(default_factory=dict)  # request row -> process, granted, not released
    left: set[str] = field(default_factory=set)  # processes that released in this turn (no rejoining)
    preempted: bool = False


class Arbiter:
    """Grants the ring's token by the rule in the module docstring. One per ring, on its own thread,
    reading every request and release in the order the data plane received them."""

    def __init__(self, plan: RingPlan, client: Client) -> None:
        self.plan = plan
        self.part = plan.partition
        self.client = client
        self.client.create_partition(self.part, RING_CAPACITY)
        self.pending: list[list[tuple[int, str]]] = [[] for _ in plan.members]  # FIFO per member
        self.turn: _Turn | None = None
        self.turns = 0
        self.last_on_demand = len(plan.members) - 1
        self.ended: list[int] = []  # rows of the last ended turn, deleted at the next grant
        self.spent: list[int] = []  # rows to delete after this batch's ack
        self.stop = threading.Event()
        self.error: BaseException | None = None
        # the last grants of a free token: (turn, member, members with requests pending, previous
        # ON_DEMAND holder), for tests and debugging
        self.history: collections.deque[tuple[int, int, tuple[int, ...], int]] = collections.deque(
            maxlen=4096
        )
        self.thread = threading.Thread(target=self._loop, name=f"ring-{plan.id}", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        try:
            while not self.stop.is_set():
                batch = self.client.claim(self.part, "arbiter", [EVENT], 256, timeout=1.0, lease=3600)
                if not batch:
                    continue
                for rid, (kind, member, _, ref), by in zip(
                    batch.ids.tolist(), batch.tensor(EVENT).tolist(), batch.meta_of(BY), strict=True
                ):
                    if kind == REQUEST:
                        self.pending[member].append((rid, str(by)))
                    elif self._released(ref, str(by)):
                        self.ended = [rid, ref]
                    else:
                        self.spent += [rid, ref]
                    self._decide()
                self.client.ack(batch)
                if self.spent:
                    self.client.delete(self.part, self.spent)
                    self.spent = []
        except BaseException as e:
            if not self.stop.is_set():
                log.exception("ring %s: arbiter failed", self.plan.id)
                self.error = e

    def _released(self, row: int, by: str) -> bool:
        """True if this release ended the turn."""
        turn = self.turn
        if turn is None or row not in turn.rows:  # a request given up before its grant (a member left)
            for queue in self.pending:
                queue[:] = [q for q in queue if q[0] != row]
            return False
        del turn.rows[row]
        turn.left.add(by)
        if not turn.rows:
            self.turn = None
        return self.turn is None

    def _decide(self) -> None:
        """Grant, let processes join, or preempt, after each event."""
        fallback = self.plan.fallback
        waiting = [m for m, q in enumerate(self.pending) if q and m != fallback]
        turn = self.turn
        if turn is not None:
            # processes of the holder that have not left this turn join it (a member's processes enter
            # together, e.g. trainer ranks), unless the turn is ending
            if not turn.preempted:
                joining = [(r, by) for r, by in self.pending[turn.member] if by not in turn.left]
                if joining:
                    self.pending[turn.member] = [q for q in self.pending[turn.member] if q not in joining]
                    self._grant(turn, joining)
            if turn.member == fallback and waiting and not turn.preempted:
                turn.preempted = True
                self._write(PREEMPT, list(turn.rows), turn.number)
            return
        previous = self.last_on_demand
        if waiting:
            n = len(self.plan.members)
            member = min(waiting, key=lambda m: (m - self.last_on_demand - 1) % n)
            self.last_on_demand = member
        elif fallback is not None and self.pending[fallback]:
            member = fallback
        else:
            return  # nobody asks: the token stays free
        asking = tuple(m for m, q in enumerate(self.pending) if q)
        self.history.append((self.turns + 1, member, asking, previous))
        self.turns += 1
        self.turn = _Turn(member, self.turns)
        self.spent += self.ended
        self.ended = []
        queue, self.pending[member] = self.pending[member], []
        self._grant(self.turn, queue)

    def _grant(self, turn: _Turn, queue: list[tuple[int, str]]) -> None:
        turn.rows.update(queue)
        self._write(GRANT, [rid for rid, _ in queue], turn.number)

    def _write(self, column: str, ids: list[int], turn: int) -> None:
        if ids:
            self.client.put(self.part, {column: torch.full((len(ids), 1), turn)}, ids=ids)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.client.close()


# -------------------------------------------------------------------------------------------------------
# a member process


class RingMember:
    """One process's side of a ring. `offload` / `restore` are the service's; both run on the caller's
    thread, inside the turn's boundaries."""

    def __init__(
        self,
        plan: RingPlan,
        process: str,
        connect: Callable[[str], Client],
        *,
        offload: Callable[[], None] = lambda: None,
        restore: Callable[[], None] = lambda: None,
    ) -> None:
        self.plan = plan
        self.process = process
        self.member = next(i for i, procs in enumerate(plan.processes) if process in procs)
        self.index = plan.processes[self.member].index(process)
        self.fallback = plan.modes[self.member] is Scheduling.FALLBACK
        self.part = plan.partition
        self.offload, self.restore = offload, restore
        self.arbiter = Arbiter(plan, connect(f"{process}-arbiter")) if plan.arbiter == process else None
        self.client = connect(f"{process}-ring")
        self.client.create_partition(self.part, RING_CAPACITY)
        self.granted: dict[int, threading.Event] = {}
        self.grants: set[int] = set()
        self.preempts: set[int] = set()  # rows preempted (possibly before this process saw the grant)
        self.preempt = threading.Event()
        self.on_preempt: Callable[[], None] = lambda: None
        self.row: int | None = None  # the request row of the turn this process is in
        self.cond = threading.Lock()
        self.stop = threading.Event()
        self.watchers = [
            threading.Thread(target=self._watch, args=(connect(f"{process}-grant"), GRANT), daemon=True),
            threading.Thread(target=self._watch, args=(connect(f"{process}-preempt"), PREEMPT), daemon=True),
        ]
        for t in self.watchers:
            t.start()
        self.wait_s = 0.0  # total time spent waiting for grants
        self.turns = 0

    def _watch(self, client: Client, column: str) -> None:
        consumer = f"{column}.{self.process}"
        try:
            while not self.stop.is_set():
                batch = client.claim(self.part, consumer, [EVENT, column], 256, timeout=1.0, lease=3600)
                if not batch:
                    continue
                mine = [rid for rid, by in zip(batch.ids.tolist(), batch.meta_of(BY), strict=True)
                        if by == self.process]  # fmt: skip
                client.ack(batch)
                with self.cond:
                    for rid in mine:
                        if column == GRANT:
                            self.grants.add(rid)
                            if rid in self.granted:
                                self.granted[rid].set()
                        else:
                            self.preempts.add(rid)
                            if rid == self.row:
                                self.preempt.set()
                                self.on_preempt()
        except Exception:
            if not self.stop.is_set():
                log.exception("ring %s: %s watcher of %s failed", self.plan.id, column, self.process)
        finally:
            client.close()

    # ---------------------------------------------------------------------------------------------------

    @property
    def holding(self) -> bool:
        return self.row is not None

    def acquire(self, timeout: float | None = None) -> float:
        """Ask for the token and wait for it; then restore. Returns the seconds waited."""
        assert self.row is None, "acquire() inside a turn"
        t0 = time.perf_counter()
        event = torch.tensor([[REQUEST, self.member, self.index, -1]])
        ids = self.client.put(self.part, {EVENT: event}, meta=[{BY: self.process}])
        rid = int(ids[0])
        granted = threading.Event()
        with self.cond:
            self.granted[rid] = granted
            if rid in self.grants:
                granted.set()
        deadline = None if timeout is None else time.monotonic() + timeout
        while not granted.wait(1.0):
            if self.stop.is_set():
                raise RuntimeError(f"ring {self.plan.id}: closed while waiting for a grant")
            if self.arbiter is not None and self.arbiter.error is not None:
                raise RuntimeError(f"ring {self.plan.id}: the arbiter failed") from self.arbiter.error
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"ring {self.plan.id}: no grant after {timeout}s")
        waited = time.perf_counter() - t0
        self.wait_s += waited
        self.turns += 1
        self.restore()  # before the turn is visible: a preemption can only take it once restored
        with self.cond:
            del self.granted[rid]
            self.grants.discard(rid)
            self.row = rid
            self.preempt.clear()
            if rid in self.preempts:
                self.preempt.set()
        if self.preempt.is_set():
            self.on_preempt()
        return waited

    def release(self) -> None:
        """Offload, then give the token back."""
        assert self.row is not None, "release() outside a turn"
        self.offload()
        with self.cond:
            rid, self.row = self.row, None
            self.preempt.clear()
            self.preempts.discard(rid)
        event = torch.tensor([[RELEASE, self.member, self.index, rid]])
        self.client.put(self.part, {EVENT: event}, meta=[{BY: self.process}])

    def acquire_async(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[float]:
        """`acquire` on a daemon thread, for asyncio services (an executor thread could outlive the loop
        waiting for a grant that never comes)."""
        future: asyncio.Future[float] = loop.create_future()

        def done(result: float | None, error: BaseException | None) -> None:
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(float(result or 0.0))

        def body() -> None:
            try:
                waited = self.acquire()
            except BaseException as e:
                loop.call_soon_threadsafe(done, None, e)
            else:
                loop.call_soon_threadsafe(done, waited, None)

        threading.Thread(target=body, name="ring-acquire", daemon=True).start()
        return future

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        """The devices for the body. ON_DEMAND: ask, run, give back. FALLBACK: keep the token after the
        body unless preempted (`yield_if_preempted` gives it back at the next safe point)."""
        if self.row is None:
            self.acquire()
        try:
            yield
        finally:
            if not self.fallback or self.preempt.is_set():
                self.release()

    def yield_if_preempted(self) -> bool:
        """A FALLBACK's safe point: give the token back if an ON_DEMAND member asked. True if it did."""
        if self.row is not None and self.preempt.is_set():
            self.release()
            return True
        return False

    def close(self) -> None:
        """Leave the ring: give the token back if held, withdraw a request still waiting."""
        self.stop.set()
        if self.row is not None:
            with contextlib.suppress(Exception):
                self.release()
        with self.cond:
            waiting = list(self.granted)
        for rid in waiting:
            event = torch.tensor([[RELEASE, self.member, self.index, rid]])
            with contextlib.suppress(Exception):
                self.client.put(self.part, {EVENT: event}, meta=[{BY: self.process}])
        for t in self.watchers:
            t.join(timeout=5)
        if self.arbiter is not None:
            self.arbiter.close()
        self.client.close()
