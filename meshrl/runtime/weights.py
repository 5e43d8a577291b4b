"""Versioned weight publication from the trainer to inference replicas over one broadcast group.

Trainer rank 0 is rank 0 of the group; inference replicas are ranks 1..N, in the epoch's order. The group is a
standalone torch.distributed process group (gloo on CPU, NCCL on GPU) with its own TCPStore on the
trainer's weight port, so it lives beside the trainer's FSDP group without touching it.

One publication: an announcement in the store (`pub/<n>`: version, the group's epoch, and the JSON
manifest of names, shapes, dtypes and bucket sizes), then the tensors packed into byte buckets of at
most `bucket_bytes` each (`weights_packing.py`: the layout), broadcast, so memory stays bounded
whatever the model size. When every receiver shares the trainer's host (CPU), the tensors go through
shared-memory segments instead, which receivers keep as their weights, and the barrier through the
store (`weights_shm.py`); an epoch with a member on another host (`meshrl join`) broadcasts the
segment's buckets. A final barrier tells the trainer that every replica has applied the version before
it opens the gate (and, with shared memory, that the slot before may be written again). Receivers sit
in `wait()` on a thread of their own, woken by the store the moment an announcement is written: no
polling. `close()` announces version -1 at the end of training.

This module is the group: its store, the announcements, the epochs and their process groups, re-joins
and the failures of members.

Members are replicas by name ("inference-1"), and the group changes while it runs. A replica that joins
(restarted, or new: `meshrl scale`) asks to join through the store (`change/<k>`: {"join": name}); one
gone for good (drained, or vanished where its group does not restart it) is declared so by its launcher
(`declare_left`). The trainer applies the changes in order at its next publication, or at once with
the version already published (its watcher), in a new epoch: the announcement lists the epoch's members
in rank order, and each builds a fresh process group under the epoch's store prefix. Receivers wait on
announcements, not collectives, so survivors never hang on a dead member: a collective that fails
raises `GroupBroken`, and they wait for the next announcement; the trainer's `send` waits until the
member is restarted or declared gone and sends the same version again (a member that joins during a
publication gets that version next).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from meshrl.dataplane.wire import host_id
from meshrl.runtime import ports
from meshrl.runtime.weights_packing import (
    Header,
    Manifest,
    broadcast_from_trainer,
    buckets,
    incoming,
    layout,
    one_thread,
    pack,
    process_group,
    reader,
    span,
)
from meshrl.runtime.weights_shm import SharedWeights, store_barrier

log = logging.getLogger("meshrl.runtime.weights")
POLL = timedelta(minutes=10)  # a store wait that times out logs a warning: wait long, then again


class GroupBroken(RuntimeError):
    """A collective of the weight group failed: a member died. The group re-forms in a new epoch."""


class Member(Protocol):
    """A receiver's place in the group held by other processes: an engine whose model lives in worker
    processes of its own (vLLM) takes the tensors there, so they never pass through the service. The
    worker joins each epoch's process group, reads every bucket (broadcast, or the trainer's shared
    memory) straight into its model, and takes part in the barrier; `WeightGroup` does the rest
    (announcements, epochs, the store's barrier with shared memory)."""

    def join(self, host: str, port: int, epoch: int, rank: int, world_size: int, timeout_s: float) -> None:
        """Build the epoch's process group (`process_group` under the store prefix `epoch<n>/`)."""

    def receive(self, header: Header) -> None:
        """Load the announced version (`incoming` gives its tensors)."""

    def barrier(self) -> None:
        """The process group's barrier."""

    def leave(self) -> None:
        """Abort the process group (after a failure)."""


class WeightGroup:
    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        *,
        timeout_s: float = 1800.0,
        device: str = "cpu",
        shm: tuple[str, str] | None = None,
        member: Member | None = None,
        name: str | None = None,
        members: Sequence[str] = (),
    ) -> None:
        """`shm` (rank 0, CPU, every receiver on this host): (directory, segment name) of the shared
        memory that carries the tensors instead of the broadcast; the announcement names it. `member`
        (receivers): the processes that receive the tensors in this one's place. `name`: a receiver's
        (its replica's); `members` (rank 0): theirs, in rank order as planned (default "rank<r>")."""
        self.host, self.port = host, port
        self.member = member
        self.shm = shm
        self.memory = SharedWeights(shm)  # the segment: rank 0's to fill, a receiver's mapping
        self.rank = rank
        self.world_size = world_size
        self.name = name or f"rank{rank}"
        self.members = list(members) or [f"rank{r}" for r in range(1, world_size)]  # rank 0: the epoch's
        self.device = torch.device(device)
        self.timeout = timedelta(seconds=timeout_s)
        if rank != 0:  # the trainer's store may not be up yet (a TCPStore client would back off)
            ports.wait_listening(host, port, timeout_s)
        self.store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=self.timeout)
        self.published = 0  # announcements made (rank 0) or read (receivers)
        self.epoch = 0
        self.pg: Any = None  # the epoch's process group (none with shared memory)
        self.formed = False  # this member has joined the current epoch
        self.changes = 0  # rank 0: joins and leaves taken into an epoch
        self.pending: tuple[Header, int, Sequence[torch.Tensor] | None] | None = None  # posted, unfinished
        self.watch_store: Any = None
        self.elsewhere: set[str] = set()  # rank 0: members off its host (not in shared memory's reach)
        if rank == 0:
            self.store.set("transport", "shm" if shm is not None else "broadcast")
        self.shared = self.store.get("transport") == b"shm"  # this epoch's; announced with each
        if rank != 0 and self.store.check(["formed"]):
            self._ask_to_join()
        else:
            self._form(0)
            if self.shared:  # no collective formed the group: the first members count themselves in
                if rank != 0 and self.store.add("arrived", 1) == world_size - 1:
                    self.store.set("all arrived", "1")
                if rank == 0 and world_size > 1:
                    _wait_key(self.store, "all arrived")
            if rank == 0:  # from now on a member that arrives is a restarted one
                self.store.set("formed", "1")

    # ---------------------------------------------------------------------------------------------------
    # the group, per epoch

    def _form(self, epoch: int) -> None:
        """Every member builds the epoch's process group (blocks until all have arrived). With shared
        memory there is none: the store carries the barrier too."""
        self.epoch = epoch
        self.pg = None
        if not self.shared and self.member is not None:
            timeout_s = self.timeout.total_seconds()
            self.member.join(self.host, self.port, epoch, self.rank, self.world_size, timeout_s)
        elif not self.shared:
            store = dist.PrefixStore(f"epoch{epoch}/", self.store)
            self.pg = process_group(store, self.rank, self.world_size, self.device, self.timeout)
        self.formed = True

    def _drop(self) -> None:
        """Give up the current group (after a failure): closing it frees members blocked on it."""
        pg, self.pg = self.pg, None
        if self.member is not None and self.formed and not self.shared:
            with contextlib.suppress(Exception):  # whatever state the member's group is in, it is gone
                self.member.leave()
        self.formed = False
        if pg is not None:
            try:
                pg.abort()
            except RuntimeError as e:  # aborting a broken group may complain; it is gone either way
                log.debug("weight group abort: %s", e)
            del pg  # the last reference: its connections close, and members blocked on them are freed

    def _collective(self, run: Callable[[], None]) -> None:
        try:
            run()
        except (RuntimeError, dist.DistBackendError) as e:
            # The failed call's frames hold the group. Only a group that is freed closes its connections
            # (abort does not), and a survivor blocked in the same collective with this member waits for
            # that, or for the group's timeout: cleared here, the group goes in `_drop` (seen: a survivor
            # stuck 60 s until its timeout while the traceback kept the trainer's old group alive).
            cause = str(e).splitlines()[0]
            traceback.clear_frames(e.__traceback__)
            self._drop()
            raise GroupBroken(f"weight group epoch {self.epoch}: {cause}") from e

    def _broadcast(self, tensor: torch.Tensor) -> None:
        self._collective(lambda: broadcast_from_trainer(self.pg, tensor))

    def _barrier(self) -> None:
        """Every member has got this far (a broadcast would only tell the root that it sent). With shared
        memory, through the store (`store_barrier`), where the trainer gives up when a replica asks to
        join or is declared gone (the one missing may be either)."""
        if self.world_size == 1:  # every receiver has left
            return
        if not self.shared:
            member = self.member
            self._collective(member.barrier if member is not None else lambda: self.pg.barrier().wait())
            return
        n = self.published
        if not store_barrier(
            self.store, n, self.rank, self.world_size, gone=self.changes_pending, timeout=self.timeout
        ):
            self._drop()
            raise GroupBroken(f"a receiver of publication {n} is gone (restarted or declared gone)")

    # ---------------------------------------------------------------------------------------------------
    # rank 0: publishing

    def send(
        self,
        version: int,
        manifest: Manifest,
        tensors: Sequence[torch.Tensor] | None,
        *,
        bucket_bytes: int = 64 << 20,
        rejoin_timeout_s: float = 600.0,
    ) -> int:
        """Rank 0: publish `tensors` (in manifest order): `post`, then `finish`. Returns the bytes."""
        self.post(version, manifest, tensors, bucket_bytes=bucket_bytes)
        return self.finish(rejoin_timeout_s=rejoin_timeout_s)

    def post(
        self,
        version: int,
        manifest: Manifest,
        tensors: Sequence[torch.Tensor] | None,
        *,
        bucket_bytes: int = 64 << 20,
    ) -> None:
        """Rank 0: announce a publication, taking in replicas that asked to join (a new epoch). With
        shared memory, `tensors` are copied into the next slot's segment here, bucket by bucket after
        the announcement, each marked staged as it lands (`staged/<n>/<k>` in the store), so the
        receivers take bucket k while bucket k+1 goes in; call it from the thread that computes (the
        copies run on one thread, `one_thread`). They may change once this returns (None: the last slot
        already holds this version). Over the broadcast they must stay until `finish` returns."""
        assert self.rank == 0 and self.pending is None
        changes = self.store.add("changes", 0)
        if not self.formed or changes > self.changes:  # a member joins or leaves (or the last epoch broke)
            self._next_epoch(changes)
        header: Header = {"version": version, "epoch": self.epoch, "members": list(self.members),
                          **layout(manifest, bucket_bytes)}  # fmt: skip
        if self.shm is None:
            self._announce(header)
            self.pending = (header, bucket_bytes, tensors)
            return
        # the segment holds every version; an epoch with a member elsewhere broadcasts it from there
        plan = buckets(manifest, bucket_bytes)
        segment = (
            self.memory.staging(span(size for size, _ in plan), self.epoch) if tensors is not None else None
        )
        if self.shared:
            header["shm"] = self.memory.path()
        self._announce(header)
        write = reader(segment) if segment is not None else None
        with one_thread():
            for k, (size, members) in enumerate(plan):
                if write is not None and tensors is not None:
                    pack(manifest, tensors, members, write(size))
                if self.shared:
                    self.store.set(f"staged/{self.published}/{k}", "")
        self.pending = (header, bucket_bytes, None)

    def finish(self, *, rejoin_timeout_s: float = 600.0) -> int:
        """Rank 0: the rest of the posted publication (the broadcast, the barrier). Returns the bytes.

        If a replica is lost meanwhile, waits up to `rejoin_timeout_s` for its restart to ask to join (or
        for its launcher to declare it gone), re-forms the group and sends the same version again."""
        while True:
            assert self.pending is not None
            header, bucket_bytes, tensors = self.pending
            plan = buckets(header["tensors"], header["bucket_bytes"])
            try:
                if not self.formed:
                    self._form(self.epoch)
                if tensors is not None:
                    manifest = header["tensors"]
                    for size, members in plan:
                        buf = torch.empty(size, dtype=torch.uint8, device=self.device)
                        pack(manifest, tensors, members, buf)
                        self._broadcast(buf)
                elif self.shm is not None and "shm" not in header:  # from the segment
                    read = reader(self.memory.staged(span(size for size, _ in plan)))
                    for size, _ in plan:
                        self._broadcast(read(size))
                self._barrier()  # with shared memory too: nobody reads the segment any more
                # every receiver has read the announcement: delete it (the barrier's few bytes stay); a
                # delete waits for the store's answer, so it happens here, off the training thread
                self.store.delete_key(f"pub/{self.published}")
                if "shm" in header:
                    for k in range(len(plan)):
                        self.store.delete_key(f"staged/{self.published}/{k}")
                self.pending = None
                return sum(b[0] for b in plan)
            except GroupBroken as e:
                version = header["version"]
                log.warning("weight publication of version %d lost a receiver (%s); waiting %.0fs for it "
                            "to re-join", version, e, rejoin_timeout_s)  # fmt: skip
                deadline = time.monotonic() + rejoin_timeout_s
                while not self.changes_pending() and time.monotonic() < deadline:
                    time.sleep(0.2)
                if not self.changes_pending():
                    raise TimeoutError(
                        f"an inference replica left the weight group during version {version} and did not "
                        f"re-join within {rejoin_timeout_s:.0f}s (its restart policy may not allow it)"
                    ) from e
                self.pending = None
                self.post(version, header["tensors"], tensors, bucket_bytes=bucket_bytes)

    def _announce(self, header: Header) -> None:
        """A `set` does not wait for the store's answer (waking dozens takes ms); `finish` deletes it."""
        self.published += 1
        self.store.set(f"pub/{self.published}", json.dumps(header))

    def _next_epoch(self, changes: int) -> None:
        """Rank 0: the next publication goes to a group re-formed in a new epoch, with the joins and
        leaves asked for since the last one, in order (a restarted member keeps its place)."""
        self._drop()
        self.epoch += 1
        for k in range(self.changes + 1, changes + 1):
            change = json.loads(self.store.get(f"change/{k}"))
            if "join" in change:
                if change["join"] not in self.members:
                    self.members.append(change["join"])
                if change.get("host", host_id()) != host_id():
                    self.elsewhere.add(change["join"])
                # where the joiner comes in: this epoch's first announcement
                self.store.set(f"change/{k}/go", json.dumps({"epoch": self.epoch, "pub": self.published + 1}))
            elif change["leave"] in self.members:
                self.members.remove(change["leave"])
                self.elsewhere.discard(change["leave"])
        self.changes = changes
        self.shared = self.shm is not None and not self.elsewhere
        self.world_size = 1 + len(self.members)
        log.info("weight group re-forms in epoch %d: %s", self.epoch, ", ".join(self.members) or "nobody")

    def changes_pending(self) -> bool:
        """Rank 0: a replica has asked to join, or was declared gone, since the current epoch formed."""
        return self.store.add("changes", 0) > self.changes

    def wait_for_change(self, k: int) -> dict[str, str]:
        """Rank 0, for one watcher thread: block until the k-th join or leave has been asked for, and
        return it ({"join": name} or {"leave": name}). On a store client of its own: a blocking wait
        holds its client, and `send` goes on meanwhile."""
        if self.watch_store is None:
            self.watch_store = dist.TCPStore(self.host, self.port, is_master=False, timeout=self.timeout)
        _wait_key(self.watch_store, f"change/{k}")
        return dict(json.loads(self.watch_store.get(f"change/{k}")))

    def close(self) -> None:
        """Rank 0: tell every receiver that no more versions will come (its `wait` returns version -1)."""
        assert self.rank == 0
        self._announce({"version": -1, "epoch": self.epoch})
        self.memory.unlink()

    # ---------------------------------------------------------------------------------------------------
    # ranks 1..N: receiving

    def _ask_to_join(self) -> None:
        """A restarted or new replica: the others formed the group already; ask the trainer to re-form
        it with this one (its rank comes with the epoch's first announcement)."""
        k = self.store.add("changes", 1)
        self.store.set(f"change/{k}", json.dumps({"join": self.name, "host": host_id()}))
        _wait_key(self.store, f"change/{k}/go")
        go = json.loads(self.store.get(f"change/{k}/go"))
        self.epoch, self.published = go["epoch"], go["pub"] - 1
        log.info("re-joining the weight group in epoch %d", self.epoch)

    def wait(self) -> Header:
        """Ranks 1..N: block until the next publication is announced. Returns its header for `receive`;
        version -1 means training is over."""
        key = f"pub/{self.published + 1}"
        _wait_key(self.store, key)
        header: Header = json.loads(self.store.get(key))
        self.published += 1
        if header["version"] >= 0 and (not self.formed or header["epoch"] != self.epoch):
            self._drop()
            members = header.get("members", self.members)
            if self.name not in members:
                raise RuntimeError(f"{self.name} was taken out of the weight group (declared gone)")
            self.rank, self.world_size = 1 + members.index(self.name), 1 + len(members)
            self.shared = "shm" in header  # every member on the trainer's host, or a broadcast
            self._form(header["epoch"])
        return header

    def receive(
        self,
        header: Header,
        apply: Callable[[list[tuple[str, torch.Tensor]]], None],
        *,
        applied: Callable[[], None] | None = None,
    ) -> int:
        """Ranks 1..N: the tensors `wait` announced, calling `apply` once per bucket (with a `member`, the
        member loads them instead). Returns the version. An engine may keep the tensors `apply` gets as
        its weights: nothing writes them while it may use them (`weights_shm.SLOTS`).

        Split from `wait` so a receiver can block for the next version without holding anything, then
        take its engine's lock only while weights actually change. `applied` is called once every
        bucket is in, before the final barrier: the version may be used while the others finish. Raises
        `GroupBroken` if a member died meanwhile (before `applied`: the version is incomplete here, and
        comes again in the next epoch).
        """
        if self.member is not None and self.shared:  # nothing collective: an error is an error
            for k in range(len(header["buckets"])):  # the member's processes read it once it is all in
                self._staged(k)
            self.member.receive(header)
        elif self.member is not None:
            self._collective(lambda: self.member.receive(header))  # type: ignore[union-attr]
        else:
            if "shm" in header:
                mapped = self.memory.mapped(header["shm"], span(header["buckets"]))
                read = reader(mapped, self._staged)
            else:
                read = self._received
            for named in incoming(header, read):
                apply(named)
        if applied is not None:
            applied()
        self._barrier()
        return int(header["version"])

    def _staged(self, k: int) -> None:
        """Until bucket k of the publication being received is in the shared memory."""
        _wait_key(self.store, f"staged/{self.published}/{k}")

    def _received(self, size: int) -> torch.Tensor:
        buf = torch.empty(size, dtype=torch.uint8, device=self.device)
        self._broadcast(buf)
        return buf


def declare_left(host: str, port: int, name: str, timeout_s: float = 10.0) -> None:
    """Receiver `name` of the group at (host, port) is gone for good (its launcher says so)."""
    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    k = store.add("changes", 1)
    store.set(f"change/{k}", json.dumps({"leave": name}))


def _wait_key(store: Any, key: str) -> None:
    """Block until `key` is in `store`, however long that takes."""
    while True:
        try:
            store.wait([key], POLL)
            return
        except dist.DistStoreError as e:
            if "timeout" not in str(e).lower():
                raise
