"""A running run changes shape: the launcher's side of `meshrl scale` and of replicas that leave.

    meshrl scale runs/grpo_arith inference=3            # one line back: what changes, or why it cannot

`meshrl scale` writes a request into `RUN_DIR/scale/` and waits for its answer there. The launcher takes
requests between its checks of the services (`Elastic.poll`): the planner's pure functions
(`meshrl/planning/members.py`) give the new membership, or the one line that says why not, and the
launcher starts the processes of the replicas that join (with the membership in their environment, so
they plan the same run) and drains those that leave: SIGUSR2 (`Service.leave`: an inference replica
finishes the batch it generates and hands back the rows it parked; another ends at once, and what it
claimed comes back when its connection closes; killed after DRAIN_S), and once it has ended, it is
declared gone to the weight group (`meshrl.runtime.weights.declare_left`). A joining inference replica asks the trainer to join
the weight group and takes rows once it holds the current version; the answer reports when it
generated its first row (`join_s`, from the request). A replica that fails in a group whose
`restart.mode` is "leave" goes the same way, unless it was its group's last.

A launcher on another host joins through the lead's join endpoint (`RUN_DIR/join.json`: its address;
a connection proves the run's secret, `multiprocessing.connection`'s challenge): `meshrl join`
(`meshrl/runtime/joined.py`) says its host, address, devices and the replicas it asks for; the lead
plans them onto its ranks (`join_host`) and answers with what the launcher needs to run them (the
recipe's text, the membership, the data plane's endpoint and secret). From then on the lead sends the
membership after every change and that launcher starts or drains the processes planned on its ranks;
it reports each one that joins or ends. When its connection closes (it stopped, or its host died),
its replicas leave the run as above.

The lead launcher keeps the membership and every change in `RUN_DIR/members.json` and rewrites
`topology.json` (what `meshrl status` and the dashboard show). A run of several torchrun launchers
does not change shape yet: its requests are refused. A run restarted as a whole starts from the
recipe's shape.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshrl.planning.members import Membership, ScaleRefused, scale, without
from meshrl.planning.topology import HEALTH, Process, Topology, plan
from meshrl.runtime import ports
from meshrl.runtime.hosts import Hosts
from meshrl.runtime.supervise import Child
from meshrl.state import checkpoint as ckpt

if TYPE_CHECKING:
    from meshrl.runtime.launch import Launcher

log = logging.getLogger("meshrl.elastic")
DRAIN_S = 30.0  # a leaving replica that has not ended after this long is killed (its claims come back)
POLL_S = 0.2


class Elastic:
    def __init__(self, launcher: Launcher, topology: Topology) -> None:
        self.launcher = launcher
        self.topology = topology
        self.devices = topology.devices  # the recipe's (joined hosts add theirs in the membership)
        self.members = Membership()  # a launch starts with the recipe's shape
        self.requests = launcher.run_dir / "scale"
        self.requests.mkdir(exist_ok=True)
        self.changes: list[dict[str, Any]] = []
        self.leaving: dict[str, Child] = {}
        self.joining: dict[str, tuple[float, dict[str, Any]]] = {}  # name -> (asked at, its change)
        self.answers: dict[int, Path] = {}  # id of a change -> its answer file
        self.failed: str | None = None  # a group lost its last replica with a host that went
        self.next_poll = 0.0
        self.hosts = Hosts(self) if launcher.peers.size == 1 else None  # `meshrl join`
        self.save()

    def close(self) -> None:
        """The launch is over: joined launchers stop their processes and leave."""
        if self.hosts is not None:
            self.hosts.close()

    # ---------------------------------------------------------------------------------------------------
    # what the launcher calls

    def poll(self) -> list[Child]:
        """Take the requests, finish the joins and departures; returns the processes it started."""
        now = time.monotonic()
        if now < self.next_poll:
            return []
        self.next_poll = now + POLL_S
        started: list[Child] = []
        for request in sorted(self.requests.glob("*.request.json")):
            started += self._take(request)
        if self.hosts is not None:
            self.hosts.poll()
        for child in list(self.leaving.values()):
            if child.poll() is None and time.monotonic() - child.started > DRAIN_S:
                child.stop(grace=0)
        self._joins()
        return started

    def ended(self, child: Child, code: int) -> bool:
        """`child` has ended: True when that is a departure (it was drained, or it failed in a group
        whose restart.mode is "leave" and others of its group go on), which the run survives."""
        process = self.launcher.processes.get(child.name)
        if process is None:
            return False
        if child.name in self.leaving:
            del self.leaving[child.name]
            self.gone(child, process)
            return True
        group = self.launcher.recipe.group(process.group)
        joined = self.joining.pop(child.name, None) if code else None
        failed_join = joined is not None  # a scale-out that did not take: the run goes on without it
        if joined is not None:
            joined[1].setdefault("failed", {})[child.name] = code
        if code == 0 or (group.restart.mode != "leave" and not failed_join):
            return False
        if self.members.live(self.launcher.recipe, process.group) == [process.replica]:
            return False  # its group's last replica: the run cannot go on
        before = len(self.members.live(self.launcher.recipe, process.group))
        self.members = without(self.launcher.recipe, self.members, process.group, process.replica)
        why = "failed to join" if failed_join else "vanished"
        change = self.change(why, {process.group: (before, before - 1)}, [], [child.name])
        change["code"] = code
        print(f"[meshrl] {child.name} {'failed to join' if failed_join else 'failed'} (exit code {code}); the run "
              f"goes on with {before - 1} {process.group} replicas; last lines of {child.log_path}:\n"
              f"{child.tail(10)}", flush=True)  # fmt: skip
        self.gone(child, process)
        return True

    # ---------------------------------------------------------------------------------------------------
    # requests

    def _take(self, request: Path) -> list[Child]:
        answer = request.with_name(request.name.replace(".request.json", ".answer.json"))
        try:
            asked = json.loads(request.read_text())
        except (OSError, ValueError) as e:
            asked = {"error": f"unreadable request: {e}"}
        request.unlink(missing_ok=True)
        try:
            return self._apply(asked, answer)
        except ScaleRefused as e:
            ckpt.save_json(answer, {"ok": False, "done": True, "message": str(e)})
            print(f"[meshrl] scale refused: {e}", flush=True)
            return []

    def _apply(self, asked: dict[str, Any], answer: Path) -> list[Child]:
        launcher, recipe = self.launcher, self.launcher.recipe
        if "error" in asked:
            raise ScaleRefused(asked["error"])
        if launcher.peers.size > 1:
            raise ScaleRefused("a run of several launchers cannot change shape yet (one host, `meshrl run`)")
        groups = {str(g): int(n) for g, n in dict(asked.get("groups", {})).items()}
        if not groups:
            raise ScaleRefused("nothing asked: give GROUP=N")
        members = self.members
        for group, n in groups.items():
            members = scale(recipe, members.ranks(self.devices), members, group, n)
        try:
            topology = plan(recipe, self.devices, members)
        except ValueError as e:  # RecipeError: its lines joined
            raise ScaleRefused(str(e).replace("\n", "; ")) from e
        old = {p.name for r in self.topology.replicas for p in r.processes}
        new = {p.name: p for r in topology.replicas for p in r.processes}
        joining = [p for name, p in new.items() if name not in old]
        leaving = [c for c in launcher.children if c.name in old - set(new)]
        leaving_names = sorted(old - set(new))
        if not joining and not leaving_names:
            sizes_now = ", ".join(f"{g} has {n}" for g, n in groups.items())
            ckpt.save_json(answer, {"ok": True, "done": True, "message": f"no change: {sizes_now}"})
            return []
        if busy := sorted(p.name for p in joining if p.name in self.leaving):
            raise ScaleRefused(f"{', '.join(busy)} still leaving: ask again once it has left")
        here = [p for p in joining if self.remote(p) is None]
        taken = ports.taken({port: f"{p.name}'s port" for p in here for port in p.ports})
        if taken is not None:
            raise ScaleRefused(f"cannot start a new replica: {taken}")
        sizes = {g: (len(self.members.live(recipe, g)), n) for g, n in groups.items()}
        self.members, self.topology = members, topology
        for remote in self.hosts.remotes.values() if self.hosts is not None else ():  # drained there
            remote.leaving |= {n for n in leaving_names if launcher.processes[n].rank in remote.host.ranks}
        change = self.change("scale", sizes, [p.name for p in joining], leaving_names)
        change["asked_at"] = float(asked.get("time", time.time()))
        self.answers[len(self.changes)] = answer
        launcher.processes.update(new)
        started = [self._start(p) for p in here]
        if self.hosts is not None:
            self.hosts.tell()  # the joined launchers start and drain theirs
        for p in joining:
            self.joining[p.name] = (change["asked_at"], change)
        for c in leaving:
            with contextlib.suppress(ProcessLookupError):
                os.kill(c.pid, signal.SIGUSR2)  # drained: it finishes or hands back what it holds
            c.started = time.monotonic()  # the drain's clock
            self.leaving[c.name] = c
        launcher.write_pids()
        self.save()
        summary = ", ".join(f"{g}: {a} -> {b} replicas" for g, (a, b) in sizes.items())
        print(f"[meshrl] scale: {summary}", flush=True)
        return started

    def _start(self, p: Process) -> Child:
        launcher = self.launcher
        env = {**launcher.env, "MESHRL_MEMBERS": json.dumps(self.members.to_json())}
        child = Child(p.name, [p.group, str(p.replica), str(p.worker)], launcher.logs / f"{p.name}.log", env,
                      p.ports[HEALTH], launcher.zygote)  # fmt: skip
        child.start()
        launcher.children.append(child)
        return child

    # ---------------------------------------------------------------------------------------------------
    # joins and departures

    def _joins(self) -> None:
        """A replica has joined once it has generated its first row (inference), or once it runs."""
        children = {c.name: c for c in self.launcher.children}
        for name, (asked_at, change) in list(self.joining.items()):
            child = children.get(name)
            h = child.health(timeout=0.2) if child is not None else None
            if child is None:
                if self.remote(self.launcher.processes[name]) is None:  # else: its launcher reports
                    del self.joining[name]
            elif (
                child.poll() is None
                and h is not None
                and h.get("state") == "running"
                and h.get("generated", 1) > 0
            ):
                change["join_s"][name] = round(time.time() - asked_at, 3)
                del self.joining[name]
                self.save()

    def remote(self, process: Process) -> Any:
        """The joined launcher that runs `process` (None: this one)."""
        return self.hosts.of(process) if self.hosts is not None else None

    def gone(self, child: Child | None, process: Process) -> None:
        """`process` has ended for good (`child`: here): out of the run's processes, out of its weight
        group."""
        launcher = self.launcher
        if child is not None:
            if child in launcher.children:
                launcher.children.remove(child)
            child.stop(grace=0)  # closes its log
        for change in self.changes:
            if process.name in change["left"] and process.name not in change["gone"]:
                change["gone"].append(process.name)
        link = launcher.topology.wiring[process.group].weights
        if link is not None and link.endpoint is not None and process.group in link.receivers:
            host = "127.0.0.1" if launcher.topology.single_host else launcher.addresses[link.endpoint.host]
            name = f"{process.group}-{process.replica}"
            threading.Thread(target=_declare_left, args=(host, link.endpoint.port, name), daemon=True).start()
        self.topology = plan(launcher.recipe, self.devices, self.members)
        self.save()

    def change(
        self, why: str, sizes: dict[str, tuple[int, int]], joined: list[str], left: list[str]
    ) -> dict[str, Any]:
        change = {"time": time.time(), "why": why, "replicas": {g: list(n) for g, n in sizes.items()},
                  "joined": joined, "left": left, "gone": [], "join_s": {}}  # fmt: skip
        self.changes.append(change)
        return change

    def save(self) -> None:
        recipe = self.launcher.recipe
        live = {g.id: len(self.members.live(recipe, g.id)) for g in recipe.groups}
        run_dir = self.launcher.run_dir
        ckpt.save_json(run_dir / "members.json",
                       {"replicas": live, "members": self.members.to_json(), "changes": self.changes})  # fmt: skip
        with contextlib.suppress(OSError):
            (run_dir / "topology.json").write_text(
                json.dumps(asdict(self.topology), indent=2, default=str) + "\n"
            )
        for k, answer in list(self.answers.items()):
            change = self.changes[k - 1]
            done = set(change["join_s"]) | set(change["gone"])
            finished = not any(n in self.joining for n in change["joined"]) and set(change["left"]) <= done
            ckpt.save_json(answer, {"ok": True, "done": finished, **change})
            if finished:
                del self.answers[k]


def _declare_left(host: str, port: int, name: str) -> None:
    from meshrl.runtime.weights import declare_left  # torch: only once a replica leaves

    try:
        declare_left(host, port, name)
    except Exception as e:  # the trainer is gone (the run is ending): nobody waits for this replica
        log.info("could not declare %s gone to the weight group: %s", name, e)


def request(run_dir: Path, groups: dict[str, int]) -> Path:
    """`meshrl scale`: write a request; returns the answer's path."""
    directory = run_dir / "scale"
    directory.mkdir(exist_ok=True)
    stem = f"{time.time_ns()}-{os.getpid()}"
    ckpt.save_json(directory / f"{stem}.request.json", {"groups": groups, "time": time.time()})
    return directory / f"{stem}.answer.json"
