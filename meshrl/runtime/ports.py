"""What a run holds on its host, checked before it starts: its run directory (one run at a time) and
its ports (free ones for a run whose recipe names none; a one-line error naming the owner when a port
the recipe named is taken).

Every port of a run follows from its base (meshrl/planning/topology.py). A single-host `meshrl run`
whose recipe leaves `base_port` unset takes a base whose whole range is free on this host, and adds it
to the run's overrides: the plan stays a pure function of its inputs (every service process computes
the same one), and config.json records the base. Launchers over several hosts must agree on it without
talking first, so they use `base_port` or its default. Bases are drawn below Linux's ephemeral range
(32768 and up), where any outgoing connection may take a port at any moment.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import socket
import time
from collections.abc import Iterable
from pathlib import Path
from typing import IO

from meshrl.planning.config import RecipeError
from meshrl.planning.topology import Topology

RANGE = (20000, 32000)
"""Where free bases are drawn from."""


KINDS = ("health endpoint", "rendezvous port", "weight-group port", "HTTP port")
"""What each of a process's ports is for (meshrl/planning/topology.py: HEALTH, MASTER, WEIGHTS, HTTP)."""


def host_ports(topology: Topology, host: str, ranks: Iterable[int] | None = None) -> dict[int, str]:
    """The ports a run binds on `host` (of the launchers of `ranks`, default all), each with what it is
    for: the controller's when it runs there, the storage server's, every process's."""
    mine = set(ranks) if ranks is not None else {d.rank for d in topology.devices} | {0}
    out = {}
    if topology.controller_host == host and 0 in mine:
        out[topology.controller_port] = "the data plane's controller"
    out.update(
        {port: "the data plane's storage" for h, rank, port in topology.storage if h == host and rank in mine}
    )
    for r in topology.replicas:
        for p in r.processes:
            if p.host == host and p.rank in mine:
                out.update({port: f"{p.name}'s {kind}" for port, kind in zip(p.ports, KINDS, strict=True)})
    return dict(sorted(out.items()))


def free_base(topology: Topology, host: str, rng: random.Random | None = None) -> int:
    """A base port at which every port of the run's range on `host` is free now (the topology was
    planned with some base; the run's ports keep their offsets from it)."""
    offsets = [p - topology.controller_port for p in host_ports(topology, host)]
    span = max(offsets) + 1
    rng = rng or random.Random()
    for _ in range(200):
        base = rng.randrange(RANGE[0], RANGE[1] - span)
        if all(is_free(base + k) for k in offsets):
            return base
    raise RuntimeError(f"no free range of {span} ports in {RANGE[0]}..{RANGE[1]} on this host")


def is_free(port: int) -> bool:
    """Whether a server can bind `port` now (as the run's servers do: address reuse on, so a port in
    TIME_WAIT after an earlier run counts as free; one that something listens on does not)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def taken(ports: dict[int, str]) -> str | None:
    """A one-line description of the first of `ports` (port -> what it is for) that is in use (None: all
    free), naming the meshrl run that holds it when it is one."""
    for port, what in ports.items():
        if not is_free(port):
            return f"port {port} ({what}) is in use by {owner(port)}"
    return None


def owner(port: int) -> str:
    """Who listens on `port`: "the meshrl run in RUN_DIR (pid P)", "pid P (NAME)", or "another program"
    when the system does not say (another user's process)."""
    import psutil

    with contextlib.suppress(psutil.Error, OSError):
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
                proc = psutil.Process(conn.pid)
                run_dir = _run_dir(proc)
                if run_dir is not None:
                    return f"the meshrl run in {run_dir} (pid {conn.pid})"
                return f"pid {conn.pid} ({proc.name()})"
    return "another program"


def _run_dir(proc: object) -> str | None:
    """The run directory of a meshrl process (its MESHRL_RUN_DIR), else None."""
    import psutil

    assert isinstance(proc, psutil.Process)
    with contextlib.suppress(psutil.Error, OSError):
        found = proc.environ().get("MESHRL_RUN_DIR")
        if found:
            return str(Path(found))
    return None


def lock_run_dir(run_dir: Path) -> IO[str]:
    """Hold `run_dir` for this launch (released when the process ends, however it ends): a second run
    into the same directory would remove the first one's checkpoints and ledger."""
    f = open(run_dir / ".lock", "a+")  # noqa: SIM115 (held open for the launch)
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise RecipeError(
            [f"run_dir: {run_dir} is in use by the meshrl run of pid {holder}; give this run another run_dir"]
        ) from None
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))
    f.flush()
    return f


def wait_listening(host: str, port: int, timeout_s: float) -> None:
    """Until something accepts connections at (host, port), looking every 10 ms, for at most `timeout_s`
    seconds. A torch TCPStore client that finds no server there backs off for most of a second before
    it tries again (0.65 s seen here): a service started beside the one whose store it joins waits here
    instead (start-up: the trainer's weight store, which inference joins)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=1.0).close()
            return
        except OSError:
            time.sleep(0.01)
