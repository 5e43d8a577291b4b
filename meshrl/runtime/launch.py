"""The launcher: starts the processes of a run on its host, waits until they are ready, supervises them.

    meshrl run recipes/grpo_arith.py                    # one host: one launcher, in the meshrl run process
    torchrun --nnodes 4 --nproc-per-node 8 ... -m meshrl launch recipes/grpo_math.py [key=value ...]

A launcher serves the device ranks it owns: every rank of the host under `meshrl run`; its own rank
under torchrun, one launcher per device, the launchers gathering their devices, addresses and the run's
secret over gloo (the only place a launcher imports torch). Every launcher computes the same plan, the
launcher of rank 0 starts the controller, each host's first launcher its storage server, and each
launcher a zygote (`meshrl/runtime/zygote.py`) that imports torch and the services' modules while the
data plane starts and then forks the launcher's service processes. A service that fails stops the run:
its launcher prints which service failed with the tail of its traceback and exits non-zero (which makes
torchrun stop the other launchers), or restarts just that process if its group re-joins (in place).
SIGINT or SIGTERM stops every process gracefully. When a launch ends, its processes gone, the launcher
that ran the host's storage removes the run's shared-memory segments left on the host (or, if that
launcher was killed, its zygote does).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from meshrl.dataplane.rpc_client import Wire
from meshrl.dataplane.wire import host_id, new_secret, write_secret
from meshrl.observe.follow import Follower, backlog
from meshrl.observe.status import health
from meshrl.planning.recipe import Recipe, RecipeError, load_recipe, to_jsonable
from meshrl.planning.topology import HEALTH, Device, Topology, cohosts, plan, run_partitions
from meshrl.runtime import ports
from meshrl.runtime.elastic import Elastic
from meshrl.runtime.peers import Alone, Gloo, my_address
from meshrl.runtime.supervise import Child, Interrupted, Signals, stop_all, sweep, wait_ready
from meshrl.runtime.zygote import Forker, ZygoteDied
from meshrl.schema import BY, CONTROL, EVENT, FAILED
from meshrl.state import checkpoint as ckpt

log = logging.getLogger("meshrl.launch")


class Launcher:
    def __init__(
        self,
        recipe_path: str,
        overrides: list[str],
        devices: list[Device],
        peers: Alone | Gloo,
        signals: Signals,
        *,
        t0: float,
        resume: Path | None = None,
    ) -> None:
        self.recipe_path = str(Path(recipe_path).resolve())
        self.overrides = overrides
        self.owned = devices
        self.ranks = {d.rank for d in devices}
        self.lead = 0 in self.ranks  # rank 0's launcher: the controller, the run files, the progress
        self.peers = peers
        self.signals = signals
        self.t0 = t0
        self.resume = resume
        self.children: list[Child] = []
        self.plane: list[Child] = []
        self.zygote: Forker | None = None
        self.segments: tuple[str, str] | None = None  # (directory, "meshrl-<run>-"): swept at the end
        self.stopping = False
        self.stopped = 0  # services that were running when the launch was stopped
        self.rejoined: dict[str, int] = {}  # in-place restarts per group
        self.lock: Any = None  # the run directory's lock, held for the launch (lead only)

    def run(self) -> int:
        """Run the launch to its end: 0 when training finished, non-zero when a service failed; raises
        Interrupted on SIGINT/SIGTERM. Every process it started is gone when it returns or raises."""
        try:
            return self._run()
        finally:
            self.shutdown()

    def _run(self) -> int:
        recipe = self.recipe = load_recipe(self.recipe_path, self.overrides)
        mine = {"devices": [[d.rank, d.host, d.local_rank] for d in self.owned], "address": my_address()}
        gathered: list[Any] = self.peers.gather(mine)
        devices = sorted((Device(int(r), str(h), int(lr)) for g in gathered for r, h, lr in g["devices"]),
                         key=lambda d: d.rank)  # fmt: skip
        address = {str(h): str(g["address"]) for g in reversed(gathered) for _, h, _ in g["devices"]}
        self.topology = topology = plan(recipe, devices)  # the recipe's shape (a restart starts from it)
        self.addresses = address
        self.run_dir = recipe.resolved_run_dir.resolve()
        self.logs = self.run_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        # before anything is started or removed: the run directory and the ports are this run's
        if self.lead:
            self.lock = ports.lock_run_dir(self.run_dir)
        host = self.owned[0].host if self.owned else topology.controller_host
        busy = ports.taken(ports.host_ports(topology, host, self.ranks))
        if busy is not None:  # one line, not a traceback from a server that could not bind
            raise RecipeError([f"base_port: {busy}; set another base_port, or leave it unset (free ports)"])
        if not topology.single_host and not recipe.dataplane.bind_all:
            raise RecipeError(
                ["dataplane.bind_all: a run over several hosts must set it (the secret protects it)"]
            )
        if self.lead:
            (self.run_dir / "failure.json").unlink(missing_ok=True)
            if self.resume is None:  # a fresh start: nothing of an earlier run may be resumed or counted
                shutil.rmtree(ckpt.root(self.run_dir), ignore_errors=True)
                (self.run_dir / "ledger.jsonl").unlink(missing_ok=True)
                (self.run_dir / "trackers.json").unlink(missing_ok=True)  # new tracker runs
            self._write_run_files(recipe, topology)
        self.processes = {p.name: p for r in topology.replicas for p in r.processes}
        # this launch's id (the lead's): state that must not outlive a launch (colocation rings) is named
        # by it, so a resumed run never reads the rings of the processes it replaces
        need_secret = not topology.single_host or recipe.dataplane.bind_all
        facts = self.peers.gather(
            {"secret": new_secret() if need_secret else "", "launch": os.urandom(4).hex()}
            if self.lead
            else {}
        )[0]
        secret = str(facts["secret"]) or None
        if secret:
            write_secret(self.run_dir / "secret", secret)
        controller = self._controller(recipe, topology, address)
        env = self._service_env(recipe, devices, controller, secret)
        env.update(MESHRL_ADDRESSES=json.dumps(address), MESHRL_LAUNCH=str(facts["launch"]))
        self.env = env
        self._start_zygote(topology, env)  # its imports overlap the data plane's start
        zygote = [self.zygote.process] if self.zygote is not None else []
        try:
            self._start_dataplane(recipe, topology, address, secret, controller)
            self._start_services(recipe, topology, env)
        except ZygoteDied:
            return self._fail(zygote[0], controller, secret)
        failed = wait_ready([*zygote, *self.children], timeout=900, check=self.signals.check)
        if failed is not None:
            return self._fail(failed, controller, secret)
        self.peers.barrier()
        if self.lead:
            print(f"[meshrl] {len(self.processes)} service processes ready in {time.time() - self.t0:.1f}s "
                  f"(run dir {self.run_dir})", flush=True)  # fmt: skip
        code = self._supervise(controller, secret)
        if code:
            return code
        self.peers.barrier()  # every launcher's services are done before the data plane goes away
        self.shutdown()
        if self.lead:
            print(f"[meshrl] run finished in {time.time() - self.t0:.1f}s", flush=True)
        return 0

    def _write_run_files(self, recipe: Recipe, topology: Topology) -> None:
        config = {"recipe_file": self.recipe_path, "overrides": self.overrides, "recipe": to_jsonable(recipe)}
        (self.run_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (self.run_dir / "topology.json").write_text(
            json.dumps(asdict(topology), indent=2, default=str) + "\n"
        )

    def _controller(self, recipe: Recipe, topology: Topology, address: dict[str, str]) -> str:
        if not topology.single_host or recipe.dataplane.bind_all:
            return f"tcp://{address[topology.controller_host]}:{topology.controller_port}"
        return topology.controller_endpoint(recipe.dataplane.bind_all)

    def _start_zygote(self, topology: Topology, env: dict[str, str]) -> None:
        """The parent of this launcher's services: it imports torch, transformers, the services' modules
        and their models' modeling code now, and forks each service once the data plane is up."""
        groups = {p.group for p in self.processes.values() if p.rank in self.ranks}
        if not groups:
            return
        configs = [self.recipe.group(g).config for g in sorted(groups)]
        modules = ["transformers", *sorted({m for c in configs for m in c.imports()})]
        models = sorted({m for c in configs if isinstance(m := getattr(c, "model", None), str)})
        self.zygote = Forker(self.logs / "zygote.log", env, modules, models, check=self.signals.check)

    def _start_dataplane(
        self, recipe: Recipe, topology: Topology, address: dict[str, str], secret: str | None, controller: str
    ) -> None:
        bind_host = "0.0.0.0" if recipe.dataplane.bind_all else "127.0.0.1"
        env = {
            **os.environ,
            **({"MESHRL_SECRET": secret} if secret else {}),
            "MESHRL_RUN_DIR": str(self.run_dir),
        }
        serve = [sys.executable, "-m", "meshrl.dataplane.serve", "--log-level", "INFO"]
        if self.resume is not None:
            serve += ["--restore", str(self.resume / "dataplane")]
        started: list[tuple[Child, Path]] = []
        if self.lead:
            ready = self.run_dir / "controller.ready"
            ready.unlink(missing_ok=True)
            bind = f"tcp://{bind_host}:{topology.controller_port}"
            args = ["--no-storage", "--controller", bind, "--ready-file", str(ready),
                    "--ledger", str(self.run_dir / "ledger.jsonl"), "--ledger-partitions", "samples,calls"]  # fmt: skip
            started.append((Child("controller", [*serve, *args], self.logs / "controller.log", env), ready))
        storage = [(host, port) for host, rank, port in topology.storage if rank in self.ranks]
        for host, port in storage:  # storage servers wait for the controller themselves
            ready = self.run_dir / f"storage-{host}.ready"
            ready.unlink(missing_ok=True)
            args = ["--storage-only", "--controller", controller, "--storage", f"tcp://{bind_host}:{port}",
                    "--advertise", f"tcp://{address[host]}:{port}", "--ready-file", str(ready)]  # fmt: skip
            started.append(
                (Child(f"storage-{host}", [*serve, *args], self.logs / f"storage-{host}.log", env), ready)
            )
        for child, _ in started:
            child.start()
            self.plane.append(child)
        self.write_pids()
        for child, ready in started:
            self._wait_file(child, ready)
        self.peers.barrier()
        if self.lead:
            (self.run_dir / "dataplane.json").write_text(json.dumps({"controller": controller}) + "\n")
        if self.lead or storage:
            partitions = run_partitions(recipe, topology) if self.lead else []
            run, shm_dir = _prepare_dataplane(controller, secret, partitions)
            if storage:  # this launcher's host: what is left of the run there is removed at the end
                self.segments = (shm_dir, f"meshrl-{run}-")
                if self.zygote is not None:
                    self.zygote.sweep(*self.segments)
        self.peers.barrier()

    def _wait_file(self, child: Child, ready: Path) -> None:
        deadline = time.monotonic() + 60
        while not ready.exists():
            self.signals.check()
            if child.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"{child.name} did not start; last lines of {child.log_path}:\n{child.tail()}"
                )
            time.sleep(0.01)

    def _service_env(
        self, recipe: Recipe, devices: list[Device], controller: str, secret: str | None
    ) -> dict[str, str]:
        torchrun = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                    "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE"}  # fmt: skip
        # a service's own torch.distributed group is not the launchers': drop what torchrun set for us
        env = {k: v for k, v in os.environ.items() if k not in torchrun and not k.startswith("TORCHELASTIC_")}
        env.pop("MESHRL_RESUME", None)
        env.update(
            MESHRL_RECIPE=self.recipe_path,
            MESHRL_OVERRIDES=json.dumps(self.overrides),
            MESHRL_DEVICES=json.dumps([[d.rank, d.host, d.local_rank] for d in devices]),
            MESHRL_RUN_DIR=str(self.run_dir),
            MESHRL_CONTROLLER=controller,
            PYTHONUNBUFFERED="1",
        )
        if self.resume is not None:
            env["MESHRL_RESUME"] = str(self.resume)
        if secret:
            env["MESHRL_SECRET"] = secret
        return env

    def _start_services(self, recipe: Recipe, topology: Topology, env: dict[str, str]) -> None:
        hosts = cohosts(recipe, topology)
        for p in self.processes.values():
            if p.rank not in self.ranks or p.name not in hosts:
                continue  # another launcher's, or runs inside another process (a hybrid ring)
            args = [str(x) for q in hosts[p.name] for x in (q.group, q.replica, q.worker)]
            child = Child(p.name, args, self.logs / f"{p.name}.log", env, p.ports[HEALTH], self.zygote)
            self.children.append(child)
            child.start()
        self.write_pids()

    def write_pids(self) -> None:
        zygote = [self.zygote.process] if self.zygote is not None else []
        pids = {c.name: c.pid for c in [*self.plane, *zygote, *self.children] if c.pid}
        # replaced whole on each in-place restart: a reader never sees half a file
        ckpt.save_json(self.run_dir / f"pids-{min(self.ranks)}.json", pids)

    def _supervise(self, controller: str, secret: str | None) -> int:
        running = list(self.children)
        elastic = Elastic(self, self.topology) if self.lead else None
        follower = None
        if self.lead:  # the progress line and the experiment trackers, from the run's files
            config = json.loads((self.run_dir / "config.json").read_text())
            plane = Wire(controller, secret, f"launcher-{os.getpid()}.follow", timeout=5.0)

            def probe() -> dict[str, float]:
                return backlog(plane.call(plane.P.Status()))

            follower = Follower.for_run(
                self.run_dir, config, self.recipe.log, self.recipe.total_steps, probe, self._phases
            ).start()
        try:
            while running:
                self.signals.check()
                if self.zygote is not None and self.zygote.process.poll() is not None:
                    return self._fail(self.zygote.process, controller, secret)
                running += elastic.poll() if elastic is not None else []  # `meshrl scale`, `meshrl join`
                if elastic is not None and elastic.failed:  # a group's last replica left with its host
                    return 1
                for c in list(running):
                    if (code := c.poll()) is None:
                        continue
                    # a replica that left the run (drained, or its group's restart.mode is "leave")
                    left = elastic is not None and elastic.ended(c, code)
                    if not left and code != 0 and self._rejoin(c):
                        continue
                    running.remove(c)
                    if code != 0 and not left:
                        return self._fail(self._cause(c), controller, secret)
                time.sleep(0.1)
        finally:
            if elastic is not None:
                elastic.close()
            if follower is not None:
                follower.stop()
                with contextlib.suppress(OSError, RuntimeError, TimeoutError):
                    plane.close()
        return 0

    def _phases(self) -> dict[str, tuple[str, float]]:
        """What each service process of this launcher is doing and for how long (its health endpoint)."""
        out = {}
        for child in self.children:
            h = health(self.processes[child.name].ports[HEALTH]) if child.name in self.processes else None
            if h and "phase" in h:
                out[child.name] = (str(h["phase"]), float(h.get("phase_s", 0.0)))
        return out

    def _may_rejoin(self, child: Child) -> bool:
        """Whether a failed process may restart on its own: its service re-joins a running run, it is in
        no colocation ring, and its group's policy allows another restart."""
        g = self.recipe.group(self.processes[child.name].group)
        in_ring = any(m.group == g.id for r in self.recipe.rings for m in r.members)
        # replicas of a stateful service (rollout) share their claims: a successor could not tell the rows
        # its predecessor had counted from rows another replica handed back, so the run restarts instead
        ok = g.config.rejoins and not in_ring and (not g.config.stateful or g.replicas == 1)
        return ok and g.restart.mode == "on-failure" and self.rejoined.get(g.id, 0) < g.restart.max_restarts

    def _cause(self, child: Child) -> Child:
        """The failure to act on when `child` failed: its zygote, if dead (its children die with it), or
        another failed process that cannot re-join (a trainer, say), else `child` itself."""
        if self.zygote is not None and self.zygote.died():
            return self.zygote.process
        others = (o for o in self.children if o is not child and o.poll() not in (None, 0))
        return next((o for o in others if not self._may_rejoin(o)), child)

    def _rejoin(self, child: Child) -> bool:
        """Restart a failed process on its own, if it may (`_may_rejoin`) and the run is not failing anyway;
        the rows it had claimed came back when its connection closed."""
        if not self._may_rejoin(child):
            return False
        group = self.processes[child.name].group
        policy, done = self.recipe.group(group).restart, self.rejoined.get(group, 0)
        delay = policy.backoff_s * 2**done
        self.signals.sleep(delay)
        # a run that is failing anyway (say the trainer this replica received weights from died, here or
        # on another launcher) restarts as a whole from its checkpoint: no restart of this one process first
        if (self.run_dir / "failure.json").exists() or self._cause(child) is not child:
            return False
        self.rejoined[group] = done + 1
        print(f"[meshrl] {child.name} failed (exit code {child.poll()}); restarting it alone after a {delay:.0f}s "
              f"back-off ({done + 1}/{policy.max_restarts}); last lines of {child.log_path}:\n"
              f"{_indent(child.tail(10))}", file=sys.stderr, flush=True)  # fmt: skip
        with open(self.run_dir / "restarts.jsonl", "a") as f:
            f.write(json.dumps({"time": time.time(), "service": child.name, "group": group, "in_place": True,
                                "code": child.poll()}) + "\n")  # fmt: skip
        child.stop()  # closes the old log handle
        child.start()
        self.write_pids()
        return True

    def _fail(self, child: Child, controller: str, secret: str | None) -> int:
        code = child.poll()
        process = self.processes.get(child.name)
        rank = process.rank if process is not None else min(self.ranks)
        failure = {"service": child.name, "group": process and process.group, "code": code, "rank": rank}
        try:  # the first failure is the one `meshrl run` acts on (a restart policy)
            with open(self.run_dir / "failure.json", "x") as f:
                json.dump(failure, f)
        except FileExistsError:
            pass
        print(f"\n[meshrl] service {child.name} failed (exit code {code}, rank {rank}, pid {child.pid}); "
              f"last lines of {child.log_path}:\n{_indent(child.tail())}\n", file=sys.stderr, flush=True)  # fmt: skip
        if self.peers.size > 1:  # tell the services of the other launchers (this one stops its own)
            try:
                import torch

                from meshrl.dataplane import Client

                with Client(controller, secret=secret, timeout=5) as c:
                    c.put(CONTROL, {EVENT: torch.tensor([FAILED])}, meta=[{BY: child.name}])
            except Exception as e:  # the data plane may be what failed
                log.warning("could not announce the failure: %s", e)
        self.shutdown()
        return 1

    def shutdown(self) -> None:
        """Stop the services (together), the zygote, the data plane; then sweep the run's segments."""
        if self.stopping:
            return
        self.stopping = True
        self.stopped = stop_all(self.children)
        if self.zygote is not None:
            self.zygote.stop()
        for c in reversed(self.plane):  # storage before controller
            c.stop()
        if self.segments is not None:
            sweep(*self.segments)
        if self.lock is not None:
            self.lock.close()  # the run directory is free for the next launch


def _prepare_dataplane(
    controller: str, secret: str | None, partitions: list[tuple[str, int, list[str]]]
) -> tuple[str, str]:
    """Create `partitions`; returns the run's id and shared-memory directory."""
    from meshrl.dataplane import protocol as P

    with Wire(controller, secret, f"launcher-{os.getpid()}") as wire:
        for part, capacity, retain in partitions:
            wire.call(P.CreatePartition(part, capacity, delete_when_acked_by=retain))
        return str(wire.hello.run), str(wire.hello.shm_dir)


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


def main(argv: list[str] | None = None) -> None:
    """`torchrun ... -m meshrl launch RECIPE [key=value ...]`: the launcher of one rank."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0].startswith("-"):
        print("usage: torchrun ... -m meshrl launch RECIPE.py [key=value ...]", file=sys.stderr)
        raise SystemExit(2)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s launcher %(levelname)s %(message)s")
    signals = Signals()
    me = Device(int(os.environ.get("RANK", 0)), host_id(), int(os.environ.get("LOCAL_RANK", 0)))
    resume = os.environ.get("MESHRL_RESUME")
    launcher = Launcher(args[0], args[1:], [me], Gloo(), signals, t0=float(os.environ.get("MESHRL_T0", time.time())),
                        resume=Path(resume) if resume else None)  # fmt: skip
    try:
        code = launcher.run()
    except RecipeError as e:
        if launcher.lead:
            print(f"[meshrl] {e}", file=sys.stderr)
        code = 2
    except Interrupted as e:
        code = 128 + e.signum
    raise SystemExit(code)


if __name__ == "__main__":
    main()
