"""`meshrl queue serve`: run the data plane's controller and/or this host's storage server as a process.

    meshrl queue serve --controller tcp://127.0.0.1:5555                # controller + local storage
    meshrl queue serve --storage-only --controller tcp://HOST0:5555 --storage tcp://0.0.0.0:5556

Off-loopback endpoints need the run's secret in MESHRL_SECRET. `--ready-file` receives a JSON line once
both servers serve: the bound endpoints ("controller", "storage"; port 0 picks a free port) and, when
the controller runs here, its run id ("run": every segment of the run is named `meshrl-<run>-...`, and a
controller restored from a snapshot keeps the snapshot's id), so that a launcher can sweep what a run
left in shared memory. SIGTERM/SIGINT stop cleanly, and the storage server removes this run's segments
from shared memory on the way out. A storage server started with `--linger S` (a host that joined a
running run) outlives its launcher: if that dies, it serves the rows written on its host until the
run has read them, for up to S seconds. MESHRL_SHM_DIR sets the directory of this host's segments.

The signal handler does nothing: the kernel-level handler writes the signal's number to a pipe
(`signal.set_wakeup_fd`) that the main thread waits on. A handler must not take a lock: a second signal
arriving while the first handler holds one runs the handler again on the same thread, which then waits
for itself forever (seen with `threading.Event.set`: a controller orphaned by a SIGKILLed launcher got
its launcher's SIGTERM, then the parent-death SIGTERM, and hung for good).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import select
import signal
import socket
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any
from urllib.parse import urlparse

from meshrl.dataplane.controller import Controller
from meshrl.dataplane.ledger import Ledger
from meshrl.dataplane.shm import shm_directory
from meshrl.dataplane.storage import Storage
from meshrl.lifetime import die_with_parent

STOP = {signal.SIGTERM, signal.SIGINT}
LINGER = signal.SIGUSR1  # a lingering storage server's parent died (`--linger`)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="meshrl queue serve", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--controller", default="tcp://127.0.0.1:0", help="controller endpoint (bind, or connect)"
    )
    ap.add_argument("--storage", default="tcp://127.0.0.1:0", help="storage endpoint to bind")
    ap.add_argument("--advertise", default=None, help="storage endpoint other hosts connect to")
    ap.add_argument("--storage-only", action="store_true", help="run only this host's storage server")
    ap.add_argument("--no-storage", action="store_true", help="run only the controller")
    ap.add_argument("--shm-dir", default=shm_directory())
    ap.add_argument(
        "--linger",
        type=float,
        default=0.0,
        help="a storage server whose launcher dies serves the rows written on its host until the run has "
        "read them (their segments gone) or the controller is gone, up to this many seconds",
    )
    ap.add_argument("--restore", default=None, help="snapshot directory to restore from")
    ap.add_argument("--ready-file", default=None)
    ap.add_argument("--ledger", default=None, help="append the sample ledger to this file")
    ap.add_argument("--ledger-partitions", default="samples", help="comma-separated partitions to track")
    ap.add_argument("--log-level", default="INFO")
    args = ap.parse_args(argv)
    die_with_parent(LINGER if args.linger else signal.SIGTERM)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    secret = os.environ.get("MESHRL_SECRET") or None

    servers: list[Controller | Storage] = []
    ready: dict[str, str] = {}
    ledger: Ledger | None = None
    if not args.storage_only:
        ledger = Ledger(args.ledger, args.ledger_partitions.split(",")) if args.ledger else None
        ctl = Controller(
            args.controller, secret=secret, shm_dir=args.shm_dir, restore=args.restore, ledger=ledger
        )
        servers.append(ctl)
        ready["controller"] = ctl.endpoint
        ready["run"] = ctl.run
        threading.Thread(target=ctl.serve_forever, name="controller", daemon=True).start()
    if not args.no_storage:
        controller = ready.get("controller", args.controller)
        st = Storage(
            args.storage,
            controller,
            secret=secret,
            shm_dir=args.shm_dir,
            restore=args.restore,
            advertise=args.advertise,
        )
        servers.append(st)
        ready["storage"] = st.endpoint
        threading.Thread(target=st.serve_forever, name="storage", daemon=True).start()

    stop = _stop_signals()
    if args.ready_file:
        tmp = Path(args.ready_file + ".tmp")
        tmp.write_text(json.dumps(ready) + "\n")
        tmp.replace(args.ready_file)
    logging.getLogger("meshrl.queue").info("serving %s", ready)
    while True:  # blocks until a signal's number arrives
        got = set(os.read(stop, 64))
        if STOP & got:
            break
        if LINGER in got and servers and isinstance(servers[-1], Storage):
            _linger(servers[-1], args.controller, args.linger, stop)
            break
    for s in reversed(servers):  # storage first: it unlinks segments while the controller still answers
        s.stop()
    for t in threading.enumerate():
        if t.name in ("controller", "storage"):
            t.join(timeout=5)
    for s in servers:  # done by the storage thread unless it is stuck; nothing may stay in /dev/shm
        if isinstance(s, Storage):
            s.unlink_segments()
    if ledger is not None:  # written by the controller's close; again in case its thread is stuck
        ledger.flush()
    # Leave without interpreter teardown: ZMQ's exit hooks can wait on a context that a server thread
    # still holds (seen once under load as a 30 s hang after SIGTERM); everything is flushed above.
    logging.shutdown()
    os._exit(0)


def _stop_signals() -> int:
    """Route SIGTERM, SIGINT and LINGER to a pipe; returns its read end (see the module's docstring)."""
    r, w = os.pipe()
    os.set_blocking(w, False)  # the kernel-level handler must never block
    signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    for sig in (*STOP, LINGER):
        signal.signal(sig, _noted)
    return r


def _linger(storage: Storage, controller: str, seconds: float, stop: int) -> None:
    """The launcher of this storage server's host died (its processes with it): the rows they wrote
    are still the run's. Serve them until no segment of the run is left here, the controller stops
    answering (the run is over), `seconds` pass, or SIGTERM/SIGINT."""
    log = logging.getLogger("meshrl.queue")
    log.info("the launcher is gone: serving the rows written on this host until they are read")
    where = urlparse(controller)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(Path(storage.shm_dir).glob(f"meshrl-{storage.run}-*")):
            log.info("every row written here has been read")
            return
        try:
            socket.create_connection((where.hostname, where.port), timeout=2).close()
        except OSError:
            log.info("the controller is gone: the run is over")
            return
        if select.select([stop], [], [], 1.0)[0] and STOP & set(os.read(stop, 64)):
            return
    log.warning("rows written on this host were not all read within %.0f s", seconds)


def _noted(signum: int, frame: FrameType | None) -> None:
    """The Python-level handler, run on the main thread after the wakeup pipe got the signal: nothing
    is left to do, and it must take no lock."""


if __name__ == "__main__":
    main()


def start_controller(
    endpoint: str = "tcp://127.0.0.1:0", **kwargs: Any
) -> tuple[Controller, threading.Thread]:
    """Run a controller in a daemon thread of this process (tests, notebooks)."""
    ctl = Controller(endpoint, **kwargs)
    thread = threading.Thread(target=ctl.serve_forever, name="meshrl-controller", daemon=True)
    thread.start()
    return ctl, thread
