"""What every service is: set-up, a run loop over the data plane, a health report.

A service process is started by its launcher as `python -m meshrl.runtime.worker`, which rebuilds the plan,
builds the service with its context and drives `setup()`, `run()`, `close()`. The context holds the
service's own config, its own wiring, the recipe-wide settings and its identity, never the whole
recipe or topology: isolation by construction. Services never call each other: they read and write
partitions of the data plane. The run ends when a service (normally the
trainer) writes a `finished` row into the `control` partition; every service watches for it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from meshrl.dataplane import AsyncClient, Client
from meshrl.dataplane.aio import WATCH_S
from meshrl.planning.config import ServiceConfig
from meshrl.planning.recipe import RunSettings
from meshrl.planning.topology import HEALTH, Process, Replica
from meshrl.planning.wiring import Wiring
from meshrl.schema import BY, CONTROL, EVENT, FAILED, FINISHED

if TYPE_CHECKING:
    from meshrl.runtime.colocation import RingMember


@dataclass(frozen=True, kw_only=True)
class ServiceContext:
    """What a service is handed, and all it knows of the run: its own config, its own wiring, the
    recipe-wide settings and its identity. Nothing of another group but what its wiring says (the planner
    resolves that: meshrl/planning/wiring.py, topology.py `placed`)."""

    config: ServiceConfig
    """Its group's config."""
    wiring: Wiring
    """Its group's part of the run's wiring: what it claims and where it writes, its weight group, the
    settings handed to it from other groups, its ring, the processes it reaches
    (meshrl/planning/wiring.py)."""
    run: RunSettings
    """The recipe-wide settings: seed, steps, batch shape, temperature, checkpoints, log."""
    replica: Replica
    """Its replica: group, index, processes (its own torch.distributed group)."""
    process: Process
    """Its process: worker index, host, device, ports."""
    run_dir: Path
    """The run directory (logs, metrics, checkpoints)."""
    controller: str
    """The data plane's controller endpoint."""
    secret: str | None
    """The run's secret for the data plane (None: a run on loopback only)."""
    health: Health
    """What its health endpoint reports."""
    single_host: bool = True
    """The whole run is on one host: every process is reached on loopback."""
    launch: str = "0"
    """This launch's id: state that must not outlive a launch (colocation rings, re-join files) is named
    by it."""
    resume: Path | None = None
    """The checkpoint this launch resumes from (None: a fresh start)."""
    addresses: dict[str, str] = field(default_factory=dict)
    """Host id -> the address other hosts reach it at (runs over several hosts)."""

    @property
    def name(self) -> str:
        return self.process.name

    @property
    def device(self) -> torch.device:
        if self.process.uses_device and torch.cuda.is_available():
            return torch.device("cuda", self.process.local_rank)
        return torch.device("cpu")

    def address(self, host: str) -> str:
        """Where other processes reach `host` (loopback when the whole run is on one host)."""
        if self.single_host:
            return "127.0.0.1"
        return self.addresses.get(host, host)

    def client(self, name: str | None = None) -> Client:
        return Client(self.controller, secret=self.secret, name=name or self.name)


@dataclass
class Health:
    """What a service reports on its loopback health endpoint (and `meshrl status` shows)."""

    service: str
    state: str = "starting"
    started: float = field(default_factory=time.time)
    info: dict[str, Any] = field(default_factory=dict)
    phase: str = "setting up"
    """What the service is doing now ("generating 64 rows", "training mini-batch 2/4", ...)."""
    phase_since: float = field(default_factory=time.time)

    def set_phase(self, text: str) -> None:
        if text != self.phase:
            self.phase, self.phase_since = text, time.time()

    def snapshot(self) -> dict[str, Any]:
        now = time.time()
        return {
            "service": self.service,
            "state": self.state,
            "pid": os.getpid(),
            "uptime_s": round(now - self.started, 1),
            "phase": self.phase,
            "phase_s": round(now - self.phase_since, 1),
            **self.info,
        }

    def serve(self, port: int) -> ThreadingHTTPServer:
        health = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = json.dumps(health.snapshot()).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        try:
            server = _HealthServer(("127.0.0.1", port), Handler)
        except OSError as e:
            raise OSError(f"{self.service}: cannot bind its health endpoint 127.0.0.1:{port}: {e}") from e
        threading.Thread(target=server.serve_forever, name="health", daemon=True).start()
        return server


class _HealthServer(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        """A prober that gave up before the answer (the launcher's probe times out while a service
        starts on a busy machine) is routine: no traceback in the service's log for it."""
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)


class Service:
    """Base class. Subclasses implement `run()` (and usually `setup()`)."""

    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx
        self.log = logging.getLogger(f"meshrl.{ctx.replica.group}")
        self._control: Client | None = None
        self._checked = 0.0
        self._finished = False
        self.ring: RingMember | None = None

    def setup(self) -> None:
        """Load models, connect, declare what this service consumes. Runs before the service is ready."""

    def phase(self, text: str) -> None:
        """Say what the service is doing now: its health endpoint reports it with how long it has been
        at it (`meshrl status`, the dashboard, the launcher's progress line)."""
        self.ctx.health.set_phase(text)

    def run(self) -> None:
        raise NotImplementedError

    def leave(self) -> None:
        """SIGUSR2: this replica leaves the run (`meshrl scale` drains it). By default it ends at once and
        the rows it claimed come back when its connection closes; a service that can finish its work
        in progress first (inference: the batch it generates) overrides this."""
        raise SystemExit(0)

    def close(self) -> None:
        if self.ring is not None:
            self.ring.close()
        if self._control is not None:
            self._control.close()

    # ---------------------------------------------------------------------------------------------------
    # colocation (meshrl/runtime/colocation.py)

    def offload(self) -> None:
        """Release device (on CPU: resident) memory; called when this service leaves its device turn."""

    def restore(self) -> None:
        """Undo `offload`; called when this service gets the devices back."""

    def join_ring(self) -> None:
        """After setup: if this service's group is in a colocation ring, take part in it, starting with
        memory offloaded (the devices are the ring's, not this service's)."""
        from meshrl.runtime.colocation import RingMember, RingPlan

        ring = self.ctx.wiring.ring
        if ring is None:
            return
        self.ring = RingMember(
            RingPlan.of(ring, self.ctx.launch), self.ctx.name, self.ctx.client,
            offload=self._offload, restore=self._restore,
        )  # fmt: skip
        self._offload()

    def device_turn(self) -> contextlib.AbstractContextManager[None]:
        """Wrap device work in it: a no-op unless the service shares its devices in a ring; then it waits
        for the ring's token (and restores) on entry and offloads and passes the token on exit."""
        return self.ring.turn() if self.ring is not None else contextlib.nullcontext()

    def _offload(self) -> None:
        if self.ring is None or self.ring.plan.hybrid:  # one process: nothing to hand over
            return
        rss = _rss_mb()
        t0 = time.perf_counter()
        self.offload()
        info = self.ctx.health.info
        info["offloads"] = info.get("offloads", 0) + 1
        info["offload_s"] = round(time.perf_counter() - t0, 4)
        info["rss_drop_mb"] = round(rss - _rss_mb(), 1)

    def _restore(self) -> None:
        if self.ring is None or self.ring.plan.hybrid:
            return
        t0 = time.perf_counter()
        self.restore()
        info = self.ctx.health.info
        info["restores"] = info.get("restores", 0) + 1
        info["restore_s"] = round(time.perf_counter() - t0, 4)

    # ---------------------------------------------------------------------------------------------------
    # run state

    def control(self) -> Client:
        if self._control is None:
            self._control = self.ctx.client(f"{self.ctx.name}-control")
        return self._control

    def finished(self, every: float = 0.5) -> bool:
        """True once some service announced the end of the run (checked at most every `every` seconds)."""
        if self._finished:
            return True
        now = time.monotonic()
        if now - self._checked < every:
            return False
        self._checked = now
        batch = self.control().claim(CONTROL, self.ctx.name, [EVENT], 16)
        if batch:
            events: list[int] = batch.tensor(EVENT).tolist()
            self.control().ack(batch)
            if FAILED in events:
                by = batch.meta_of(BY)
                raise RuntimeError(f"the run was stopped by a failure in {by[events.index(FAILED)]}")
            self._finished = FINISHED in events
        return self._finished

    async def watch_run(self, client: AsyncClient) -> None:
        """Asyncio services: returns once the run is over (raises if a service failed).

        A claim parked at the controller, woken by the control row itself: no polling, so a thousand
        idle replicas cost nothing. Use instead of `finished()`, not with it (they share a consumer).
        """
        while True:
            batch = await client.claim(CONTROL, self.ctx.name, [EVENT], 16, timeout=WATCH_S)
            if not batch:
                continue
            events: list[int] = batch.tensor(EVENT).tolist()
            by = batch.meta_of(BY)
            await client.ack(batch)
            if FAILED in events:
                raise RuntimeError(f"the run was stopped by a failure in {by[events.index(FAILED)]}")
            if FINISHED in events:
                self._finished = True
                return

    def finish_run(self) -> None:
        """Announce that training is over: every service of the run exits."""
        self.control().put(CONTROL, {EVENT: torch.tensor([FINISHED])}, meta=[{BY: self.ctx.name}])
        self._finished = True


def _rss_mb() -> float:
    import psutil

    return float(psutil.Process().memory_info().rss) / 2**20


def health_port(process: Process) -> int:
    return process.ports[HEALTH]
