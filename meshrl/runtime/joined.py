"""`meshrl join ADDRESS [GROUP=N ...] [--devices N] [--secret-file F]`: a launcher on another host joins
a running run, runs the replicas the planner gives it, and leaves with them.

    meshrl join runs/pipeline_sim                       # the run's machine: its RUN_DIR/join.json
    meshrl join 10.0.0.5:41733 --secret-file secret --devices 2     # another host (dataplane.bind_all)

ADDRESS is the run's join endpoint (`RUN_DIR/join.json` on the run's host has it), or that run
directory itself on the same machine. Off the run's machine the run's secret is required (the file
`RUN_DIR/secret` of the run's host, copied here, or MESHRL_SECRET), and the recipe's paths (models,
data) must resolve here as they do there (it works in the lead's directory when that exists here).
Without GROUP=N the host's devices are filled with replicas of the first group that can grow and
receives weights (inference; one replica on a host without devices).

The lead launcher (`meshrl/runtime/hosts.py`) answers with the recipe's text, the membership and the
data plane's endpoint. This launcher starts a storage server when its host is new to the run (tensors
written here are read from it), a zygote, and the processes planned on its ranks; each time the
membership changes it starts or drains (SIGUSR2) the processes planned on its ranks, and it reports
each process that joined (its first generated row) or ended. SIGINT or SIGTERM: its processes are
drained, each leaving the run as with `meshrl scale`, its storage server serves the rows they wrote
until the run has read them, and it exits 0. Killed, its processes die with it and leave the run,
and its storage server lingers to serve their rows until the run has read them (`--linger`). A host
gone takes the rows written there and not read yet with its memory: the reader fails and the run
follows its restart policy. Two "hosts" on one machine (tests) need a directory of shared memory
each (MESHRL_SHM_DIR), as separate machines have. When the run ends (or its lead
launcher goes) it stops its processes and exits.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection
from pathlib import Path
from typing import Any

from meshrl.dataplane.shm import shm_directory
from meshrl.dataplane.wire import host_id
from meshrl.planning.members import Membership
from meshrl.planning.recipe import RecipeError, load_recipe
from meshrl.planning.topology import HEALTH, Device, Process, plan
from meshrl.runtime import ports
from meshrl.runtime.peers import my_address
from meshrl.runtime.supervise import Child, Interrupted, Signals, stop_all, sweep
from meshrl.runtime.zygote import Forker

USAGE = "usage: meshrl join ADDRESS|RUN_DIR [GROUP=N ...] [--devices N] [--secret-file FILE]"
DRAIN_S = 30.0  # as the lead's: a process still running after this long is stopped
LINGER_S = 120.0  # leaving: how long the host's storage waits for the run to read the rows written here


class HostLauncher:
    def __init__(self, conn: Connection, welcome: dict[str, Any], signals: Signals) -> None:
        self.conn, self.signals = conn, signals
        if os.path.isdir(welcome.get("cwd", "")):  # a shared file system: relative paths mean the same
            os.chdir(welcome["cwd"])
        self.rank = int(welcome["rank"])
        self.run_dir = Path(welcome["run_dir"])
        self.logs = self.run_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        # the run's recipe as its lead has it: the same text whatever is at that path here
        recipe_path = self.run_dir / f"recipe-{self.rank}.py"
        recipe_path.write_text(welcome["recipe"])
        overrides = list(welcome["overrides"])
        self.recipe = load_recipe(str(recipe_path), overrides)
        self.devices = [Device(int(r), str(h), int(lr)) for r, h, lr in welcome["devices"]]
        self.members = Membership.from_json(welcome["members"])
        self.ranks = next(h.ranks for h in self.members.hosts if h.rank == self.rank)
        # the run's settings from its lead; this host's own facts (its id, its shared memory) from here
        own = ("MESHRL_HOST_ID", "MESHRL_SHM_DIR", "MESHRL_LOG_LEVEL")
        self.env = {**{k: v for k, v in os.environ.items() if not k.startswith("MESHRL_") or k in own},
                    **welcome["env"], "MESHRL_RECIPE": str(recipe_path), "MESHRL_OVERRIDES": json.dumps(overrides),
                    "PYTHONUNBUFFERED": "1"}  # fmt: skip
        self.children: dict[str, Child] = {}
        self.draining: set[str] = set()
        self.ended: set[str] = set()  # ended while planned: not started again
        self.ran: set[str] = set()  # every process it started (their segments are named after them)
        self.joining: set[str] = set()
        self.plane: list[Child] = []
        self.zygote: Forker | None = None
        self.segments: tuple[str, str] | None = None

    def run(self) -> int:
        try:
            return self._run()
        except Interrupted:
            self._leave()
            return 0
        finally:
            stop_all(list(self.children.values()))
            if self.zygote is not None:
                self.zygote.stop()
            for c in self.plane:
                c.stop()
            if self.segments is not None and self.plane:  # what its processes left on this host
                for name in self.ran:
                    sweep(self.segments[0], f"{self.segments[1]}{name}-")
            with contextlib.suppress(OSError):
                self.conn.close()

    def _run(self) -> int:
        topology = plan(self.recipe, self.devices, self.members)
        mine = self._planned(self.members)
        busy = ports.taken({port: f"{p.name}'s port" for p in mine.values() for port in p.ports})
        if busy is not None:
            print(f"[meshrl] join: {busy}", file=sys.stderr, flush=True)
            return 1
        controller, secret = self.env["MESHRL_CONTROLLER"], self.env.get("MESHRL_SECRET")
        from meshrl.runtime.launch import _prepare_dataplane

        run, shm_dir = _prepare_dataplane(controller, secret, [])
        self.segments = (shm_directory(shm_dir), f"meshrl-{run}-")
        for host, rank, port in topology.storage:  # this host is new to the run: tensors written here
            if rank in self.ranks:
                Path(self.segments[0]).mkdir(parents=True, exist_ok=True)
                if any(Path(self.segments[0]).glob(f"{self.segments[1]}*")):  # not a host of its own
                    print(f"[meshrl] join: {self.segments[0]} holds the run's shared memory already: another "
                          "launcher of this machine runs there; give this one a directory of its own "
                          "(MESHRL_SHM_DIR) or the run's host id (MESHRL_HOST_ID)", file=sys.stderr, flush=True)  # fmt: skip
                    return 1
                self._storage(host, port, controller, secret, self.segments[0])
        groups = sorted({p.group for p in mine.values()})
        configs = [self.recipe.group(g).config for g in groups]
        modules = ["transformers", *sorted({m for c in configs for m in c.imports()})]
        models = sorted({m for c in configs if isinstance(m := getattr(c, "model", None), str)})
        self.zygote = Forker(
            self.logs / f"zygote-{self.rank}.log", self.env, modules, models, self.signals.check
        )
        self._reconcile()
        print(f"[meshrl] joined the run in {self.run_dir} as ranks {self.ranks.start}-{self.ranks.stop - 1}: "
              f"{', '.join(sorted(mine))}", flush=True)  # fmt: skip
        while True:
            self.signals.check()
            if self.zygote.process.poll() is not None:
                print("[meshrl] join: the zygote died; leaving the run", file=sys.stderr, flush=True)
                return 1
            try:
                while self.conn.poll(0):
                    said = json.loads(self.conn.recv_bytes())
                    if said.get("stop"):
                        return 0
                    self.members = Membership.from_json(said["members"])
                    self._reconcile()
            except (EOFError, OSError):  # the lead launcher is gone: so is the run
                print("[meshrl] join: the run's launcher is gone; stopping", flush=True)
                return 0
            self._report()
            time.sleep(0.1)

    def _planned(self, members: Membership) -> dict[str, Process]:
        topology = plan(self.recipe, self.devices, members)
        return {p.name: p for r in topology.replicas for p in r.processes if p.rank in self.ranks}

    def _reconcile(self) -> None:
        """Start the processes planned on this launcher's ranks; drain those no longer planned."""
        planned = self._planned(self.members)
        self.ended &= set(planned)
        env = {**self.env, "MESHRL_MEMBERS": json.dumps(self.members.to_json())}
        for name, p in planned.items():
            if name not in self.children and name not in self.ended:
                child = Child(name, [p.group, str(p.replica), str(p.worker)], self.logs / f"{name}.log", env,
                              p.ports[HEALTH], self.zygote)  # fmt: skip
                child.start()
                self.children[name] = child
                self.joining.add(name)
                self.ran.add(name)
        for name, child in self.children.items():
            if name not in planned and name not in self.draining:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.pid, signal.SIGUSR2)
                child.started = time.monotonic()  # the drain's clock
                self.draining.add(name)

    def _report(self, drained: bool = False) -> None:
        """Tell the lead which processes joined (an inference replica: its first generated row) and which
        ended; stop one that drains for too long."""
        for name, child in list(self.children.items()):
            code = child.poll()
            if code is None:
                if name in self.draining and time.monotonic() - child.started > DRAIN_S:
                    child.stop(grace=0)
                elif name in self.joining:
                    h = child.health(timeout=0.2)
                    if h is not None and h.get("state") == "running" and h.get("generated", 1) > 0:
                        self.joining.discard(name)
                        self._say({"joined": name, "time": time.time()})
                continue
            del self.children[name]
            self.joining.discard(name)
            self.draining.discard(name)
            self.ended.add(name)
            child.stop(grace=0)  # closes its log
            if code != 0 and not drained:
                print(f"[meshrl] {name} failed (exit code {code}); it leaves the run; last lines of "
                      f"{child.log_path}:\n{child.tail(10)}", file=sys.stderr, flush=True)  # fmt: skip
            self._say({"ended": name, "code": code, "drained": drained})

    def _leave(self) -> None:
        """Stopped (SIGINT/SIGTERM): drain every process, report each as it ends, up to DRAIN_S."""
        print(
            f"[meshrl] leaving the run: draining {', '.join(sorted(self.children)) or 'nothing'}", flush=True
        )
        for child in self.children.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGUSR2)
        deadline = time.monotonic() + DRAIN_S
        while self.children and time.monotonic() < deadline:
            self._report(drained=True)
            time.sleep(0.1)
        stop_all(list(self.children.values()))
        self._report(drained=True)
        self._linger()

    def _linger(self) -> None:
        """A host of its own: its storage server serves the rows its processes wrote until the run has
        consumed them (their segments are unlinked when their last row goes), up to LINGER_S."""
        if not self.plane or self.segments is None:
            return
        directory, prefix = self.segments
        deadline = time.monotonic() + LINGER_S
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                held = [
                    f for f in os.listdir(directory) if any(f.startswith(f"{prefix}{n}-") for n in self.ran)
                ]
                if not held:
                    return
            try:  # the run ending (or its launcher gone) frees them all
                if self.conn.poll(0.2) and json.loads(self.conn.recv_bytes()).get("stop"):
                    return
            except (EOFError, OSError):
                return
        print(f"[meshrl] join: rows written here were not all read within {LINGER_S:.0f}s; leaving anyway",
              file=sys.stderr, flush=True)  # fmt: skip

    def _storage(self, host: str, port: int, controller: str, secret: str | None, shm_dir: str) -> None:
        bind = "0.0.0.0" if self.recipe.dataplane.bind_all else "127.0.0.1"
        address = json.loads(self.env.get("MESHRL_ADDRESSES", "{}")).get(host, "127.0.0.1")
        ready = self.run_dir / f"storage-{host}.ready"
        ready.unlink(missing_ok=True)
        argv = [sys.executable, "-m", "meshrl.dataplane.serve", "--log-level", "INFO", "--storage-only",
                "--controller", controller, "--storage", f"tcp://{bind}:{port}",
                "--advertise", f"tcp://{address}:{port}", "--ready-file", str(ready), "--shm-dir", shm_dir,
                "--linger", str(LINGER_S)]  # fmt: skip
        env = {**self.env, **({"MESHRL_SECRET": secret} if secret else {})}
        child = Child(f"storage-{host}", argv, self.logs / f"storage-{host}.log", env)
        child.start()
        self.plane.append(child)
        deadline = time.monotonic() + 60
        while not ready.exists():
            self.signals.check()
            if child.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"storage-{host} did not start; last lines of {child.log_path}:\n{child.tail()}"
                )
            time.sleep(0.01)

    def _say(self, message: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):
            self.conn.send_bytes(json.dumps(message).encode())


def main(argv: list[str]) -> int:
    args = list(argv)
    options: dict[str, str] = {}
    for flag in ("--devices", "--secret-file"):
        if flag in args:
            i = args.index(flag)
            if i + 1 >= len(args):
                return _usage(f"{flag} takes a value")
            options[flag] = args[i + 1]
            del args[i : i + 2]
    if not args or args[0].startswith("-"):
        return _usage("give the run's join address (or its run directory on this machine)")
    groups: dict[str, int] = {}
    for a in args[1:]:
        group, eq, n = a.partition("=")
        if not eq or not n.isdigit():
            return _usage(f"{a!r} is not GROUP=N")
        groups[group] = int(n)
    if not options.get("--devices", "0").isdigit():
        return _usage(f"--devices takes a count, not {options['--devices']!r}")
    devices = int(options.get("--devices", "0"))
    try:
        address, key = _endpoint(args[0], options.get("--secret-file"))
    except (ValueError, OSError) as e:  # a bad address, an unreadable secret file
        print(f"meshrl join: {e}", file=sys.stderr)
        return 1
    logging.basicConfig(level=logging.INFO, format="%(asctime)s join %(levelname)s %(message)s")
    host, _, port = address.rpartition(":")
    try:
        conn = Client((host, int(port)), authkey=key.encode())
    except (ConnectionRefusedError, OSError) as e:
        print(f"meshrl join: no run answers at {address} ({e}); a run that hosts elsewhere join needs "
              "dataplane.bind_all=true", file=sys.stderr)  # fmt: skip
        return 1
    except AuthenticationError:
        print(f"meshrl join: {address} turned the secret down (not this run's)", file=sys.stderr)
        return 1
    signals = Signals()
    hello = {"host": host_id(), "address": my_address(host), "devices": devices, "groups": groups,
             "time": time.time()}  # fmt: skip
    conn.send_bytes(json.dumps(hello).encode())
    welcome = json.loads(conn.recv_bytes())
    if not welcome.get("ok"):
        print(f"meshrl join: refused: {welcome.get('message')}", file=sys.stderr)
        return 1
    try:
        return HostLauncher(conn, welcome, signals).run()
    except RecipeError as e:
        print(f"meshrl join: {e}", file=sys.stderr)
        return 2


def _endpoint(where: str, secret_file: str | None) -> tuple[str, str]:
    """(address, key) of the join endpoint named by `where`: an address, or a run directory here."""
    run_dir = Path(where)
    if run_dir.is_dir():
        info_path = run_dir / "join.json"
        if not info_path.exists():
            raise ValueError(f"no run is running in {run_dir} (it has no join.json)")
        info = json.loads(info_path.read_text())
        key = info.get("key") or (run_dir / "secret").read_text().strip()
        return str(info["address"]), str(key)
    if ":" not in where:
        raise ValueError(f"{where!r} is neither HOST:PORT nor a run directory")
    if secret_file:
        return where, Path(secret_file).read_text().strip()
    if os.environ.get("MESHRL_SECRET"):
        return where, os.environ["MESHRL_SECRET"]
    raise ValueError("the run's secret is required: --secret-file (RUN_DIR/secret on the run's host) or "
                     "MESHRL_SECRET")  # fmt: skip


def _usage(why: str) -> int:
    print(f"meshrl join: {why}\n{USAGE}", file=sys.stderr)
    return 2
