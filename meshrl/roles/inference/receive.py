"""How an inference replica takes in new weights while it generates.

A thread waits for the weight group's announcements (meshrl/runtime/weights.py) and loads each version
into the engine, under the lock generation holds for a batch:

- interrupt="finish": load directly if no batch is in progress; else receive without the lock, keeping
  the group's tensors (the trainer is never held up by a batch in progress; nothing writes them while
  they may be in use: `weights_shm.SLOTS`), then swap them in once the batch is done. An engine whose
  workers receive the weights themselves (vLLM) cannot stage here: its update waits for the batch in
  progress.
- interrupt="continue": ask the batch in progress to stop at its next token (`update_pending`), load
  the weights directly, and let the batch continue on them.

Generation may use a version as soon as every bucket is in, while the group's final barrier is still
under way. A version cut short (a replica of the group died) leaves the engine at version -1: nothing
is served until a complete version arrives.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from meshrl.engines.base import InferenceEngine
from meshrl.runtime.weights import GroupBroken, WeightGroup, one_thread

log = logging.getLogger("meshrl.inference")


class Receiver:
    """The engine's weights and version, shared by generation and the receiving thread."""

    def __init__(self, engine: InferenceEngine, *, continuing: bool, announce: Callable[[int], None]) -> None:
        """`continuing`: interrupt="continue"; `announce(version)`: a new version is in the engine (wake
        what waits for it)."""
        self.engine, self.continuing, self.on_version = engine, continuing, announce
        self.lock = threading.Lock()  # held by generation for a batch, and by a load
        self.update_pending = threading.Event()  # "continue": the batch in progress stops at its next token
        self.version_changed = threading.Condition()
        self.error: BaseException | None = None
        self.weights: WeightGroup | None = None

    def start(self, weights: WeightGroup) -> None:
        """Receive every version published to `weights` on a thread of its own."""
        self.weights = weights
        if not weights.formed:  # re-joining a running run: the engine's weights are not current
            self.engine.set_version(-1)
        threading.Thread(target=self.run, name="weights", daemon=True).start()

    def set_version(self, version: int) -> None:
        """The engine holds `version` now (a trainer in this very process updated the model it lends)."""
        with self.lock:
            self.engine.set_version(version)
        self.announce(version)

    def announce(self, version: int) -> None:
        with self.version_changed:
            self.version_changed.notify_all()
        self.on_version(version)

    def newer_than(self, version: int) -> bool:
        return self.engine.version > version or self.error is not None

    def wait_newer(self, version: int, timeout: float = 600) -> None:
        """Until the engine holds a version newer than `version` (raises if receiving failed)."""
        with self.version_changed:
            self.version_changed.wait_for(functools.partial(self.newer_than, version), timeout=timeout)
        if self.error is not None:
            raise RuntimeError("weight receiver failed") from self.error

    def run(self) -> None:
        """Thread: wait for each publication, then load it into the engine."""
        assert self.weights is not None
        try:
            while True:
                header = self.weights.wait()
                if header["version"] < 0:  # the trainer is done publishing
                    return
                t0 = time.perf_counter()
                try:
                    version = self.receive(header)
                except GroupBroken as e:  # another replica died; the version comes again once it is back
                    log.warning("weight group broke during version %d (%s)", header["version"], e)
                    continue
                level = (
                    logging.INFO if version % 50 == 0 else logging.DEBUG
                )  # 64 replicas x every step adds up
                log.log(level, "weights version %d applied in %.3fs", version, time.perf_counter() - t0)
        except BaseException as e:  # surfaced by the service's loop and by generation waiting for it
            self.error = e
            self.announce(self.engine.version)

    def receive(self, header: dict[str, Any]) -> int:
        """Load one announced version (see the module docstring for the two interrupt modes)."""
        assert self.weights is not None
        version = int(header["version"])
        if version == self.engine.version:  # sent again for a replica that re-joined: nothing new here
            return self.weights.receive(header, lambda named: None)
        if self.continuing:
            self.update_pending.set()
        # "continue" waits for the batch in progress to stop; "finish" loads directly only when no batch
        # is in progress (always, in lock-step), else stages a copy and swaps it in after the batch; an
        # engine whose workers receive the tensors themselves (no copy passes here) waits for the batch
        if not self.lock.acquire(blocking=self.continuing or self.weights.member is not None):
            staged: list[tuple[str, torch.Tensor]] = []
            self.weights.receive(header, staged.extend)  # the trainer is not held up
            with self.lock:
                self.engine.load_weights(staged)
                self.engine.set_version(version)
            self.announce(version)
            return version
        held = True

        def applied() -> None:  # every bucket is in: generate while the group's barrier completes
            nonlocal held
            self.engine.set_version(version)
            self.lock.release()
            held = False
            self.update_pending.clear()
            self.announce(version)

        def load(named: list[tuple[str, torch.Tensor]]) -> None:  # no batch in progress: the engine is ours
            with one_thread():
                self.engine.load_weights(named)

        try:
            return self.weights.receive(header, load, applied=applied)
        finally:
            if held:  # cut short: part old, part new; serve nothing until a complete version
                self.engine.set_version(-1)
                self.lock.release()
                self.update_pending.clear()
