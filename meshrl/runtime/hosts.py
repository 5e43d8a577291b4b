"""The lead launcher's side of launchers that join a running run from other hosts (`meshrl join`).

    meshrl join runs/pipeline_sim                         # on the run's machine: RUN_DIR/join.json
    meshrl join 10.0.0.5:41733 --secret-file secret inference=2 --devices 2   # from another host

The join endpoint's address is in `RUN_DIR/join.json`: loopback, unless the data plane binds every
interface (`dataplane.bind_all`, required for a host elsewhere). A connection proves the run's secret
(`multiprocessing.connection`'s challenge; a loopback run has a key of its own in that file). The
joining launcher (`meshrl/runtime/joined.py`) says its host, address, devices and the replicas it asks
for; the planner places them on its ranks (`meshrl/planning/members.py`, `join_host`), and the answer
holds what it needs to run them: the recipe's text, the membership, the data plane's endpoint and
secret. From then on the lead sends the membership after every change, and that launcher starts or
drains the processes planned on its ranks and reports each one that joined or ended. A process of
a joined launcher that fails is not restarted: its replica leaves the run. When the connection closes
(the launcher stopped, or its host died), every replica it ran leaves the run (`Elastic` does the
rest: the weight group, `members.json`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, Listener
from pathlib import Path
from typing import TYPE_CHECKING

from meshrl.dataplane.wire import new_secret
from meshrl.planning.members import Host, ScaleRefused, host_gone, join_host, without
from meshrl.planning.topology import Process, plan
from meshrl.state import checkpoint as ckpt

if TYPE_CHECKING:
    from meshrl.runtime.elastic import Elastic

log = logging.getLogger("meshrl.hosts")


@dataclass
class Remote:
    """A launcher that joined from another host: its connection and its place in the membership."""

    conn: Connection
    host: Host
    leaving: set[str]  # its processes drained by a change (not by their launcher's own stop)


class Hosts:
    def __init__(self, elastic: Elastic) -> None:
        self.elastic = elastic
        self.remotes: dict[int, Remote] = {}  # first rank -> a joined launcher
        self.arrivals: queue.Queue[Connection] = queue.Queue()
        self.listener = self._listen()

    def _listen(self) -> Listener:
        """The join endpoint, in `RUN_DIR/join.json`: loopback unless the data plane binds every
        interface; a joiner proves the run's secret (a key of its own in that file for a loopback run)."""
        launcher, bind_all = self.elastic.launcher, self.elastic.launcher.recipe.dataplane.bind_all
        key = launcher.env.get("MESHRL_SECRET") or new_secret()
        listener = Listener(("0.0.0.0" if bind_all else "127.0.0.1", 0), authkey=key.encode())
        host = (
            launcher.addresses.get(self.elastic.topology.controller_host, "127.0.0.1")
            if bind_all
            else "127.0.0.1"
        )
        info = {
            "address": f"{host}:{listener.address[1]}",
            **({} if "MESHRL_SECRET" in launcher.env else {"key": key}),
        }
        path = launcher.run_dir / "join.json"
        path.unlink(missing_ok=True)
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            json.dump(info, f)
        threading.Thread(target=self._accept, args=(listener,), name="joins", daemon=True).start()
        return listener

    def _accept(self, listener: Listener) -> None:
        from multiprocessing import AuthenticationError

        while True:
            try:
                self.arrivals.put(listener.accept())
            except (AuthenticationError, EOFError, ConnectionError) as e:
                log.warning("a launcher asking to join was turned away: %s", e)
            except OSError:  # closed: the launch is over
                return

    def close(self) -> None:
        """The launch is over: joined launchers stop their processes and leave."""
        if self.listener is not None:
            with contextlib.suppress(OSError):
                self.listener.close()
        for remote in self.remotes.values():
            with contextlib.suppress(OSError, ValueError):
                remote.conn.send_bytes(json.dumps({"stop": True}).encode())
                remote.conn.close()
        (self.elastic.launcher.run_dir / "join.json").unlink(missing_ok=True)

    def poll(self) -> None:
        while not self.arrivals.empty():
            self._welcome(self.arrivals.get())
        for remote in list(self.remotes.values()):
            self._hear(remote)

    def of(self, process: Process) -> Remote | None:
        return next((r for r in self.remotes.values() if process.rank in r.host.ranks), None)

    def _welcome(self, conn: Connection) -> None:
        """A launcher asks to join: plan its replicas, answer with what it needs to run them."""
        launcher, recipe = self.elastic.launcher, self.elastic.launcher.recipe
        try:
            if not conn.poll(10):
                raise ScaleRefused("no request within 10 s")
            hello = json.loads(conn.recv_bytes())
            groups = {str(g): int(n) for g, n in dict(hello.get("groups") or {}).items()}
            members, host = join_host(recipe, self.elastic.devices, self.elastic.members, str(hello["host"]),
                                      int(hello.get("devices", 0)), groups)  # fmt: skip
            try:
                topology = plan(recipe, self.elastic.devices, members)
            except ValueError as e:
                raise ScaleRefused(str(e).replace("\n", "; ")) from e
        except (ScaleRefused, OSError, EOFError, ValueError, KeyError, TypeError) as e:
            with contextlib.suppress(OSError, ValueError):
                conn.send_bytes(json.dumps({"ok": False, "message": str(e)}).encode())
                conn.close()
            print(f"[meshrl] join refused: {e}", flush=True)
            return
        launcher.addresses[host.name] = str(hello.get("address", "127.0.0.1"))
        before = {g.id: len(self.elastic.members.live(recipe, g.id)) for g in recipe.groups}
        old = {p.name for r in self.elastic.topology.replicas for p in r.processes}
        new = {p.name: p for r in topology.replicas for p in r.processes}
        joining = [n for n in new if n not in old]
        sizes = {
            g: (n, len(members.live(recipe, g)))
            for g, n in before.items()
            if len(members.live(recipe, g)) != n
        }
        self.elastic.members, self.elastic.topology = members, topology
        launcher.processes.update(new)
        change = self.elastic.change("host joined", sizes, joining, [])
        change["host"], change["asked_at"] = host.name, float(hello.get("time", time.time()))
        for name in joining:
            self.elastic.joining[name] = (change["asked_at"], change)
        env = {k: v for k, v in launcher.env.items() if k.startswith("MESHRL_") and k not in
               ("MESHRL_RECIPE", "MESHRL_HOST_ID", "MESHRL_RESUME", "MESHRL_MEMBERS")}  # fmt: skip
        env["MESHRL_ADDRESSES"] = json.dumps(launcher.addresses)
        welcome = {"ok": True, "rank": host.rank, "recipe": Path(launcher.recipe_path).read_text(),
                   "overrides": launcher.overrides, "devices": [[d.rank, d.host, d.local_rank] for d in self.elastic.devices],
                   "members": members.to_json(), "env": env, "run_dir": str(launcher.run_dir), "cwd": os.getcwd()}  # fmt: skip
        remote = Remote(conn, host, set())
        self.remotes[host.rank] = remote
        try:
            conn.send_bytes(json.dumps(welcome).encode())
        except OSError:
            self._host_gone(remote)
            return
        self.tell()
        self.elastic.save()
        summary = ", ".join(f"{g}: {a} -> {b} replicas" for g, (a, b) in sizes.items())
        print(f"[meshrl] host {host.name} joined (ranks {host.ranks.start}-{host.ranks.stop - 1}): {summary}",
              flush=True)  # fmt: skip

    def tell(self) -> None:
        """Every joined launcher gets the membership: it starts and drains the processes on its ranks."""
        message = json.dumps({"members": self.elastic.members.to_json()}).encode()
        for remote in list(self.remotes.values()):
            try:
                remote.conn.send_bytes(message)
            except OSError:
                self._host_gone(remote)

    def _hear(self, remote: Remote) -> None:
        """What a joined launcher reports: a process that joined or ended; its connection closed."""
        try:
            while remote.conn.poll(0):
                said = json.loads(remote.conn.recv_bytes())
                name = str(said.get("joined") or said.get("ended") or "")
                process = self.elastic.launcher.processes.get(name)
                if process is None:
                    continue
                if "joined" in said and name in self.elastic.joining:
                    asked_at, change = self.elastic.joining.pop(name)
                    change["join_s"][name] = round(float(said["time"]) - asked_at, 3)
                    self.elastic.save()
                elif "ended" in said:
                    self._remote_ended(remote, process, int(said["code"]), bool(said.get("drained")))
        except (EOFError, OSError):
            self._host_gone(remote)

    def _remote_ended(self, remote: Remote, process: Process, code: int, drained: bool) -> None:
        """A process of a joined launcher ended: drained by a change, or by its launcher's stop, or it
        failed (a joined replica is not restarted: it leaves)."""
        self.elastic.joining.pop(process.name, None)
        if process.name in remote.leaving:
            remote.leaving.discard(process.name)
            self.elastic.gone(None, process)
        elif code != 0 or drained:
            self._lose(remote, [process], "host leaving" if drained else "vanished", code)

    def _host_gone(self, remote: Remote) -> None:
        """A joined launcher's connection closed: its replicas still in the run leave it with it."""
        self.remotes.pop(remote.host.rank, None)
        with contextlib.suppress(OSError):
            remote.conn.close()
        rest = [p for r in self.elastic.topology.replicas for p in r.processes if p.rank in remote.host.ranks]
        self._lose(remote, rest, "host left", None)
        self.elastic.members = host_gone(self.elastic.launcher.recipe, self.elastic.members, remote.host.rank)
        self.elastic.topology = plan(self.elastic.launcher.recipe, self.elastic.devices, self.elastic.members)
        self.tell()
        self.elastic.save()
        print(f"[meshrl] host {remote.host.name} left the run", flush=True)

    def _lose(self, remote: Remote, processes: list[Process], why: str, code: int | None) -> None:
        """`processes` of joined launchers are gone: their replicas leave the run (its group's last: the
        run fails, as when a service fails)."""
        recipe, sizes = self.elastic.launcher.recipe, dict[str, list[int]]()
        for p in processes:
            live = self.elastic.members.live(recipe, p.group)
            if p.replica not in live:
                continue
            sizes.setdefault(p.group, [len(live), len(live)])[1] -= 1
            self.elastic.members = without(recipe, self.elastic.members, p.group, p.replica)
            if not self.elastic.members.live(recipe, p.group) and not self.elastic.failed:
                self.elastic.failed = f"{p.group} lost its last replica ({p.name}, {why})"
                failure = {"service": p.name, "group": p.group, "code": code, "rank": p.rank}
                ckpt.save_json(self.elastic.launcher.run_dir / "failure.json", failure)
                print(f"[meshrl] {self.elastic.failed}: the run cannot go on", file=sys.stderr, flush=True)
        if not sizes:
            return
        change = self.elastic.change(
            why, {g: (a, b) for g, (a, b) in sizes.items()}, [], [p.name for p in processes]
        )
        change["host"] = remote.host.name
        if code is not None:
            change["code"] = code
        for p in processes:
            self.elastic.gone(None, p)
        print(f"[meshrl] {', '.join(p.name for p in processes)}: {why}; the run goes on with "
              + ", ".join(f"{b} {g} replicas" for g, (_, b) in sizes.items()), flush=True)  # fmt: skip
