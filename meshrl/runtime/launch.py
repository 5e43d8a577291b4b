"""The SPMD launcher: one per device, started by torchrun (`meshrl run` wraps it on one host).

    torchrun --nnodes 4 --nproc-per-node 8 ... -m meshrl launch recipes/grpo_math.py [key=value ...]

Each launcher gathers the device list over gloo, computes the same plan as every other launcher, starts
the data plane (controller on rank 0, a storage server per host) and then only its own service
processes, waits until all are ready, and supervises them. A service that fails stops the run: its
launcher prints which service, replica and rank failed with the tail of its traceback, and exits
non-zero, which makes torchrun stop the other launchers. When training ends every process exits.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import sys
import time
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshrl.dataplane.wire import host_id, new_secret, write_secret
from meshrl.planning.recipe import Recipe, RecipeError, load_recipe, to_jsonable
from meshrl.planning.topology import HEALTH, Device, Topology, cohosts, plan
from meshrl.runtime.service import CONTROL, FAILED
from meshrl.runtime.supervise import Child, wait_ready
from meshrl.state import checkpoint as ckpt

log = logging.getLogger("meshrl.launch")


class Launcher:
    def __init__(self, recipe_path: str, overrides: list[str]) -> None:
        self.t0 = float(os.environ.get("MESHRL_T0", time.time()))
        self.recipe_path = str(Path(recipe_path).resolve())
        self.overrides = overrides
        self.rank = int(os.environ.get("RANK", 0))
        self.world = int(os.environ.get("WORLD_SIZE", 1))
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.children: list[Child] = []
        self.plane: list[Child] = []
        self.stopping = False
        self.rejoined: dict[str, int] = {}  # in-place restarts per group

    # ---------------------------------------------------------------------------------------------------
    # collectives among launchers (gloo)

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def gather_json(self, obj: object) -> list[object]:
        data = json.dumps(obj).encode()
        if self.world == 1:
            return [obj]
        size = torch.tensor([len(data)])
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(sizes, size)
        width = int(max(s.item() for s in sizes))
        buf = torch.zeros(width, dtype=torch.uint8)
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.zeros(width, dtype=torch.uint8) for _ in range(self.world)]
        dist.all_gather(out, buf)
        return [json.loads(bytes(o[: int(s.item())].tolist())) for o, s in zip(out, sizes, strict=True)]

    # ---------------------------------------------------------------------------------------------------

    def run(self) -> int:
        if self.world > 1:
            dist.init_process_group("gloo", timeout=timedelta(days=7))
        recipe = self.recipe = load_recipe(self.recipe_path, self.overrides)
        me = Device(self.rank, host_id(), self.local_rank)
        gathered: list[Any] = self.gather_json([me.rank, me.host, me.local_rank, _my_address()])
        devices = [Device(int(r), str(h), int(lr)) for r, h, lr, _ in gathered]
        address = {str(h): str(a) for _, h, _, a in sorted(gathered, key=lambda x: -int(x[0]))}
        topology = plan(recipe, devices)
        self.total_steps = recipe.total_steps
        self.run_dir = recipe.resolved_run_dir.resolve()
        self.logs = self.run_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        if not topology.single_host and not recipe.dataplane.bind_all:
            raise RecipeError(
                ["dataplane.bind_all: a run over several hosts must set it (the secret protects it)"]
            )
        self.resume = os.environ.get("MESHRL_RESUME") or None
        if self.rank == 0:
            (self.run_dir / "failure.json").unlink(missing_ok=True)
            if self.resume is None:  # a fresh start: nothing of an earlier run may be resumed or counted
                shutil.rmtree(ckpt.root(self.run_dir), ignore_errors=True)
                (self.run_dir / "ledger.jsonl").unlink(missing_ok=True)
            self._write_run_files(recipe, topology)
        self.groups = {p.name: p.group for r in topology.replicas for p in r.processes}
        secret = self._secret(recipe, topology)
        controller = self._start_dataplane(recipe, topology, address, secret)
        env = self._service_env(recipe, devices, controller, secret)
        env["MESHRL_ADDRESSES"] = json.dumps(address)
        # this launch's id (rank 0's): state that must not outlive a launch (colocation rings) is named
        # by it, so a resumed run never reads the rings of the processes it replaces
        env["MESHRL_LAUNCH"] = str(self.gather_json(os.urandom(4).hex() if self.rank == 0 else "")[0])
        self._start_services(recipe, topology, env)
        failed = wait_ready(self.children, timeout=900)
        if failed is not None:
            return self._fail(failed, controller, secret)
        self.barrier()
        if self.rank == 0:
            print(f"[meshrl] {sum(len(r.processes) for r in topology.replicas)} service processes ready "
                  f"in {time.time() - self.t0:.1f}s (run dir {self.run_dir})", flush=True)  # fmt: skip
        code = self._supervise(controller, secret)
        if code:
            return code
        self.barrier()  # every launcher's services are done before the data plane goes away
        self.shutdown()
        if self.rank == 0:
            print(f"[meshrl] run finished in {time.time() - self.t0:.1f}s", flush=True)
        return 0

    def _write_run_files(self, recipe: Recipe, topology: Topology) -> None:
        config = {"recipe_file": self.recipe_path, "overrides": self.overrides, "recipe": to_jsonable(recipe)}
        (self.run_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (self.run_dir / "topology.json").write_text(
            json.dumps(asdict(topology), indent=2, default=str) + "\n"
        )

    def _secret(self, recipe: Recipe, topology: Topology) -> str | None:
        if topology.single_host and not recipe.dataplane.bind_all:
            return None
        token = new_secret() if self.rank == 0 else ""
        shared = str(self.gather_json(token)[0])
        write_secret(self.run_dir / "secret", shared)
        return shared

    def _start_dataplane(
        self, recipe: Recipe, topology: Topology, address: dict[str, str], secret: str | None
    ) -> str:
        bind_host = "0.0.0.0" if recipe.dataplane.bind_all else "127.0.0.1"
        controller = topology.controller_endpoint(recipe.dataplane.bind_all)
        if not topology.single_host or recipe.dataplane.bind_all:
            controller = f"tcp://{address[topology.controller_host]}:{topology.controller_port}"
        env = {**os.environ, **({"MESHRL_SECRET": secret} if secret else {})}
        serve = [sys.executable, "-m", "meshrl.dataplane.serve", "--log-level", "INFO"]
        if self.resume is not None:
            serve += ["--restore", str(Path(self.resume) / "dataplane")]
        started: list[tuple[Child, Path]] = []
        if self.rank == 0:
            ready = self.run_dir / "controller.ready"
            ready.unlink(missing_ok=True)
            bind = f"tcp://{bind_host}:{topology.controller_port}"
            args = ["--no-storage", "--controller", bind, "--ready-file", str(ready),
                    "--ledger", str(self.run_dir / "ledger.jsonl")]  # fmt: skip
            started.append((Child("controller", [*serve, *args], self.logs / "controller.log", env), ready))
        for host, rank, port in topology.storage:  # storage servers wait for the controller themselves
            if rank == self.rank:
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
        for child, ready in started:
            self._wait_file(child, ready)
        self.barrier()
        if self.rank == 0:
            from meshrl.dataplane import Client

            (self.run_dir / "dataplane.json").write_text(json.dumps({"controller": controller}) + "\n")
            with Client(controller, secret=secret) as c:
                c.create_partition(CONTROL, 4096)
                parts = {p for g in recipe.groups for p in g.config.writes()}
                retain: dict[str, set[str]] = {}
                for g in recipe.groups:
                    for p, consumers in g.config.retention().items():
                        retain.setdefault(p, set()).update(consumers)
                for p in sorted(parts - {CONTROL}):
                    c.create_partition(
                        p, recipe.dataplane.capacity, delete_when_acked_by=sorted(retain.get(p, ()))
                    )
        self.barrier()
        return controller

    def _wait_file(self, child: Child, ready: Path) -> None:
        deadline = time.monotonic() + 60
        while not ready.exists():
            if child.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"{child.name} did not start; last lines of {child.log_path}:\n{child.tail()}"
                )
            time.sleep(0.02)

    def _service_env(
        self, recipe: Recipe, devices: list[Device], controller: str, secret: str | None
    ) -> dict[str, str]:
        torchrun = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                    "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE"}  # fmt: skip
        # a service's own torch.distributed group is not the launchers': drop what torchrun set for us
        env = {k: v for k, v in os.environ.items() if k not in torchrun and not k.startswith("TORCHELASTIC_")}
        env.update(
            MESHRL_RECIPE=self.recipe_path,
            MESHRL_OVERRIDES=json.dumps(self.overrides),
            MESHRL_DEVICES=json.dumps([[d.rank, d.host, d.local_rank] for d in devices]),
            MESHRL_RUN_DIR=str(self.run_dir),
            MESHRL_CONTROLLER=controller,
            PYTHONUNBUFFERED="1",
        )
        if secret:
            env["MESHRL_SECRET"] = secret
        return env

    def _start_services(self, recipe: Recipe, topology: Topology, env: dict[str, str]) -> None:
        hosts = cohosts(recipe, topology)
        for p in topology.processes_on(self.rank):
            if p.name not in hosts:
                continue  # runs inside another process (a hybrid ring)
            args = [str(x) for q in hosts[p.name] for x in (q.group, q.replica, q.worker)]
            child = Child(
                p.name,
                [sys.executable, "-m", "meshrl.runtime.worker", *args],
                self.logs / f"{p.name}.log",
                env,
                health_port=p.ports[HEALTH],
            )
            child.start()
            self.children.append(child)
        self._write_pids()

    def _write_pids(self) -> None:
        pids = {c.name: c.pid for c in [*self.plane, *self.children]}
        # replaced whole on each in-place restart: a reader never sees half a file
        ckpt.save_json(self.run_dir / f"pids-{self.rank}.json", pids)

    def _supervise(self, controller: str, secret: str | None) -> int:
        running = list(self.children)
        progress = Progress(self.run_dir / "metrics.jsonl", self.total_steps) if self.rank == 0 else None
        while running:
            if progress is not None:
                progress.update()
            for c in list(running):
                code = c.poll()
                if code is None:
                    continue
                if code != 0 and self._rejoin(c):
                    continue
                running.remove(c)
                if code != 0:
                    if progress is not None:
                        progress.close()
                    return self._fail(c, controller, secret)
            time.sleep(0.1)
        if progress is not None:
            progress.update()
            progress.close()
        return 0

    def _rejoin(self, child: Child) -> bool:
        """Restart a failed process on its own, if its service re-joins a running run and its group's
        policy allows another restart; the rows it had claimed came back when its connection closed."""
        group = self.groups.get(child.name)
        if group is None:
            return False
        g = self.recipe.group(group)
        policy, done = g.restart, self.rejoined.get(group, 0)
        in_ring = any(m.group == group for r in self.recipe.rings for m in r.members)
        if not g.config.rejoins or in_ring or policy.mode != "on-failure" or done >= policy.max_restarts:
            return False
        # replicas of a stateful service (rollout) share their claims: a successor could not tell the rows
        # its predecessor had counted from rows another replica handed back, so the run restarts instead
        if g.config.stateful and g.replicas > 1:
            return False
        delay = policy.backoff_s * 2**done
        time.sleep(delay)
        # a run that is failing anyway (say the trainer this replica received weights from died) restarts
        # as a whole from its checkpoint: no restart of this one process first
        if (self.run_dir / "failure.json").exists():
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
        self._write_pids()
        return True

    def _fail(self, child: Child, controller: str, secret: str | None) -> int:
        code = child.poll()
        failure = {
            "service": child.name,
            "group": self.groups.get(child.name),
            "code": code,
            "rank": self.rank,
        }
        try:  # the first failure is the one `meshrl run` acts on (a restart policy)
            with open(self.run_dir / "failure.json", "x") as f:
                json.dump(failure, f)
        except FileExistsError:
            pass
        print(
            f"\n[meshrl] service {child.name} failed (exit code {code}, rank {self.rank}, pid {child.pid}); "
            f"last lines of {child.log_path}:\n{_indent(child.tail())}\n",
            file=sys.stderr,
            flush=True,
        )
        try:  # tell the services of other launchers, then stop ours
            from meshrl.dataplane import Client

            with Client(controller, secret=secret, timeout=5) as c:
                c.put(CONTROL, {"event": torch.tensor([FAILED])}, meta=[{"by": child.name}])
        except Exception as e:  # the data plane may be what failed
            log.warning("could not announce the failure: %s", e)
        self.shutdown()
        return 1

    def shutdown(self) -> None:
        if self.stopping:
            return
        self.stopping = True
        for c in self.children:
            c.stop()
        for c in reversed(self.plane):  # storage before controller
            c.stop()


class Progress:
    """A progress bar over training steps, fed by the trainer's metrics.jsonl (launcher rank 0)."""

    def __init__(self, path: Path, total: int) -> None:
        self.path = path
        self.total = total
        self.offset = 0
        self.bar: Any = None

    def update(self) -> None:
        try:
            with open(self.path) as f:
                f.seek(self.offset)
                lines = f.readlines()
                self.offset = f.tell()
        except OSError:
            return
        rows = [json.loads(line) for line in lines if line.endswith("\n")]
        if not rows:
            return
        last = rows[-1]
        if not sys.stderr.isatty():  # logs and CI: a line every 10 steps instead of a redrawn bar
            for row in rows:
                if row["step"] % 10 == 9 or row["step"] == self.total - 1:
                    print(f"[meshrl] step {row['step'] + 1}/{self.total} reward {row.get('reward_mean', 0):.3f} "
                          f"loss {row.get('loss', 0):.4f}", flush=True)  # fmt: skip
            return
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, desc="train", unit="step", dynamic_ncols=True)
        self.bar.set_postfix(reward=f"{last.get('reward_mean', 0):.3f}", loss=f"{last.get('loss', 0):.4f}")
        self.bar.update(len(rows))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _my_address() -> str:
    """The address other hosts reach this one at (the interface that routes to the rendezvous host)."""
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master, 9))
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0].startswith("-"):
        print("usage: torchrun ... -m meshrl launch RECIPE.py [key=value ...]", file=sys.stderr)
        raise SystemExit(2)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s launcher %(levelname)s %(message)s")
    launcher = Launcher(args[0], args[1:])

    def on_signal(signum: int, _frame: object) -> None:
        launcher.shutdown()
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        code = launcher.run()
    except RecipeError as e:
        if launcher.rank == 0:
            print(f"[meshrl] {e}", file=sys.stderr)
        launcher.shutdown()
        code = 2
    except BaseException:
        launcher.shutdown()
        raise
    raise SystemExit(code)


if __name__ == "__main__":
    main()
