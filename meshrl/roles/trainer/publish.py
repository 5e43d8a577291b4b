"""The trainer's publication of new weights to inference, and the gate row that follows each version.

Rank 0 and every inference replica form the weight group (meshrl/runtime/weights.py). A publication
gathers the weights (a collective over the trainer's ranks), copies them and announces the version from
the training thread, so replicas start loading at once; the broadcast, the wait until every replica
has the version and the gate row run on a publisher thread, so training goes on meanwhile.
Publications stay in order: a new one waits for the previous one. An inference replica restarted on its
own asks to re-join; the last version is sent to it again, on the same thread. Inference in this very
process (a hybrid ring) generates with the trainer's own model: publishing to it is setting its version.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from meshrl.planning.topology import Process
from meshrl.planning.wiring import Peer
from meshrl.runtime import hybrid
from meshrl.runtime.service import ServiceContext
from meshrl.runtime.weights import WeightGroup
from meshrl.schema import FINAL, VERSION

log = logging.getLogger("meshrl.trainer")


def over_shared_memory(device: str, trainer: Process, receivers: Sequence[Peer]) -> bool:
    """Whether weights go through shared memory rather than a broadcast: every receiver on the trainer's
    host, and on CPU, or on a GPU with a receiver on the trainer's own GPU (`meshrl run --devices 0,0`:
    NCCL refuses two ranks on one device); between GPUs NCCL's broadcast is the faster path."""
    if any(p.host != trainer.host for p in receivers):
        return False
    return device == "cpu" or any(p.uses_device and p.local_rank == trainer.local_rank for p in receivers)


class Publisher:
    def __init__(self, ctx: ServiceContext, engine: Any, bucket_mb: int, pool: Any) -> None:
        """Publishes to the groups of the trainer's weight group (its wiring). `pool`: the shared-memory
        segment pool of the trainer's data-plane client (on CPU, a segment named like its own carries
        the weights to receivers on this host)."""
        inference = ctx.wiring.weights.receivers if ctx.wiring.weights is not None else ()
        self.ctx, self.engine, self.bucket_bytes = ctx, engine, bucket_mb << 20
        self.rank = ctx.process.worker
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="publisher")
        self.publish_s = 0.0  # the last publication's time on the publisher thread
        self.published: tuple[int, list[torch.Tensor] | None] | None = None  # rank 0: the last version sent
        self.queued: Future[None] | None = None  # the last task on the publisher (publication or re-send)
        self.lock = threading.Lock()
        self.gate = ctx.client(f"{ctx.name}-gate") if self.rank == 0 else None
        self.local = [s for s in (hybrid.peer(g) for g in inference) if s is not None]
        self.weights: WeightGroup | None = None
        if self.rank == 0 and not self.local:
            self.weights = self._group(pool)
            threading.Thread(target=self.watch_rejoins, name="rejoins", daemon=True).start()

    def _group(self, pool: Any) -> WeightGroup:
        ctx, link = self.ctx, self.ctx.wiring.weights
        assert link is not None and link.endpoint is not None, "the planner places every weight group"
        # through one shared-memory segment (in the data plane's directory, named like the trainer's own
        # segments, so it is cleaned up with them), the group only synchronising
        shm = None
        if pool is not None and over_shared_memory(ctx.device.type, ctx.process, link.receiving):
            shm = (pool.directory, f"{pool.prefix}-weights")
        host, port = link.endpoint.host, link.endpoint.port
        return WeightGroup(
            ctx.address(host),
            port,
            0,
            1 + len(link.members),
            device=str(ctx.device),
            shm=shm,
            members=link.members,
        )

    def publish(self, version: int, *, final: bool, gate: bool = True) -> float:
        """Publish the current weights as `version` and open the gate for it (every rank calls it: the
        gather is collective). Returns the seconds it took on this thread."""
        t0 = time.perf_counter()
        if self.local:
            for service in self.local:
                service.local_publish(version)
            if gate:
                self._gate(version, final)
            return time.perf_counter() - t0
        weights = self.engine.get_weights(self.bucket_bytes)
        if self.rank != 0:
            for _ in weights:  # take part in the gather
                pass
            return time.perf_counter() - t0
        assert self.weights is not None
        manifest = self.engine.manifest()
        with self.lock:  # a re-send asked for meanwhile queues behind this publication
            self.wait()  # the previous publication is complete (or raises its failure)
            self.published = None  # at most one copy of the weights waits here
            shared = self.weights.shm is not None  # copied into shared memory right here, in `post`
            copies: list[torch.Tensor] | None = (
                list(weights) if shared else [t.detach().clone() for t in weights]
            )
            # announced from this thread: a hand-off to the publisher first would wait for the GIL
            # while this thread goes on with the step's bookkeeping (2-3 ms per step measured here)
            self.weights.post(version, manifest, copies, bucket_bytes=self.bucket_bytes)
            if shared:
                copies = None  # the segment holds the version: no copy to keep
            self.queued = self.executor.submit(self._send, version, copies, final, gate)
        return time.perf_counter() - t0

    def wait(self) -> None:
        """Until the last publication is complete (its gate row written)."""
        if self.queued is not None:
            self.queued.result()

    def _gate(self, version: int, final: bool) -> None:
        assert self.gate is not None
        meta: list[Any] = [{FINAL: final, "step": version}]
        self.gate.put(self.ctx.wiring.partition("gate"), {VERSION: torch.tensor([version])}, meta=meta)

    def _send(self, version: int, tensors: list[torch.Tensor] | None, final: bool, gate: bool = True) -> None:
        """Publisher thread: the rest of the publication `publish` announced (the tensors are the copy,
        or None: staged in shared memory): the broadcast if any, the wait until every replica has the
        version, then the gate. What was sent stays for a replica that re-joins before the next version
        (the copy, or the segment)."""
        assert self.weights is not None
        t0 = time.perf_counter()
        self.weights.finish()
        self.published = (version, tensors)
        if gate:
            self._gate(version, final)
        self.publish_s = time.perf_counter() - t0

    def watch_rejoins(self) -> None:
        """Thread (rank 0): an inference replica restarted on its own, or new (`meshrl scale`), asks to
        join the weight group; send it the version already published, on the publisher thread, so it
        can serve at once (in lock-step the trainer may be waiting for the very samples that replica was
        generating). One that leaves is taken out at the next publication."""
        assert self.weights is not None
        asked = 0
        while True:
            asked += 1
            if "join" not in self.weights.wait_for_change(asked):
                continue
            with self.lock:
                try:
                    self.queued = self.executor.submit(self._resend, self.queued)
                except RuntimeError:  # the publisher has shut down: training is over
                    return

    def _resend(self, before: Future[None] | None) -> None:
        """Publisher thread: the last version again, to a group re-formed with the replicas that asked to
        join (unless a publication since took them in). A failure of the task before surfaces there."""
        assert self.weights is not None
        if before is not None:
            before.result()  # done already (one worker, in order): its failure must not be lost
        if self.published is None or not self.weights.changes_pending():
            return
        version, tensors = self.published
        log.info("sending weights version %d again for a re-joined inference replica", version)
        self.weights.send(version, self.engine.manifest(), tensors, bucket_bytes=self.bucket_bytes)

    def finish(self) -> None:
        """Training is over: the last publication completes, no more re-sends, the receivers are told."""
        self.wait()
        self.executor.shutdown(cancel_futures=True)
        if self.weights is not None:
            self.weights.close()

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
        if self.gate is not None:
            self.gate.close()
