"""Entry point of one service process: `python -m meshrl.runtime.worker GROUP REPLICA WORKER [...]`.

A launcher has its zygote fork the process and call `main` (`meshrl/runtime/zygote.py`: torch and the
service's modules are imported already); run as a module it works the same, only slower to start. The
launcher passes the recipe, overrides and gathered device list in the environment; the process
rebuilds the same plan, finds itself in it, and runs its service with its context (`context`): its
group's config and wiring, the recipe-wide settings and its identity, not the recipe or the plan.
Stdout/stderr go to the process's log file (set up by the zygote), so a crash leaves its full
traceback there. Several triples: the
members of a hybrid colocation ring on one device, run as threads of this one process.
"""

from __future__ import annotations

import asyncio
import faulthandler
import gc
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshrl.lifetime import die_with_parent
from meshrl.planning.members import Membership
from meshrl.planning.recipe import Recipe, RunSettings, load_recipe, service_class
from meshrl.planning.topology import Device, Topology, plan

if TYPE_CHECKING:
    from meshrl.runtime.service import ServiceContext


def main(argv: list[str] | None = None) -> None:
    die_with_parent()
    args = sys.argv[1:] if argv is None else argv
    if not args or len(args) % 3:
        raise SystemExit(
            "usage: python -m meshrl.runtime.worker GROUP REPLICA WORKER [GROUP REPLICA WORKER ...]"
        )
    triples = [(args[i], int(args[i + 1]), int(args[i + 2])) for i in range(0, len(args), 3)]
    group, replica_index, worker = triples[0]
    logging.basicConfig(
        level=os.environ.get("MESHRL_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s {group}-{replica_index}.{worker} %(levelname)s %(name)s: %(message)s",
        stream=sys.stdout,
    )
    recipe = load_recipe(os.environ["MESHRL_RECIPE"], json.loads(os.environ.get("MESHRL_OVERRIDES", "[]")))
    devices = [Device(*d) for d in json.loads(os.environ["MESHRL_DEVICES"])]
    # the run's shape when this process started (replicas that joined or left: meshrl/planning/members.py)
    topology = plan(
        recipe, devices, Membership.from_json(json.loads(os.environ.get("MESHRL_MEMBERS", "null")))
    )

    # heavy imports (torch, transformers; done already in a zygote's child) only from here on
    from meshrl.runtime import hybrid

    services, servers = [], []
    for g, r, w in triples:  # more than one: a hybrid ring's members on this device, one thread each
        ctx = context(recipe, topology, g, r, w, os.environ)
        servers.append(ctx.health.serve(ctx.process.ports[0]))
        services.append(service_class(ctx.config)(ctx))
    hybrid.register(services)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGUSR2, lambda *_: [s.leave() for s in services])  # drained (`meshrl scale`)
    # `kill -USR1 PID`: every thread's stack into the log, then (once the main thread runs Python again)
    # every asyncio task's
    signal.signal(signal.SIGUSR1, dump_tasks)
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=True)
    t0 = time.monotonic()
    try:
        # a weight source (the trainer) first: co-hosted inference generates with the trainer's model
        for service in sorted(services, key=lambda s: not s.ctx.config.publishes_weights):
            service.setup()
            service.join_ring()
        logging.getLogger("meshrl.runtime.worker").info("ready after %.1fs", time.monotonic() - t0)
        # what setup built (models, datasets, tokenizers) lives for the whole run: keep it out of the
        # garbage collector's full passes, which otherwise stall a service for 100+ ms now and then
        gc.collect()
        gc.freeze()
        for service in services:
            service.ctx.health.state = "running"
            service.ctx.health.set_phase("running")
        if len(services) == 1:
            services[0].run()
        else:
            run_threads(services)
        for service in services:
            service.ctx.health.state = "finished"
    except BaseException:
        for service in services:
            if service.ctx.health.state != "finished":
                service.ctx.health.state = "failed"
        raise
    finally:
        for service in services:
            service.close()
        for server in servers:
            server.shutdown()
    # Done. Leave without tearing the interpreter down: threads blocked in a collective of a peer that
    # already left (a weight receiver, say) would abort the process during finalisation.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def context(
    recipe: Recipe, topology: Topology, group: str, index: int, worker: int, env: Mapping[str, str]
) -> ServiceContext:
    """What process `worker` of replica `index` of `group` is handed: its group's config and wiring, the
    recipe-wide settings, its identity (and the launch's facts from `env`); not the recipe or the plan."""
    from meshrl.runtime.service import Health, ServiceContext

    replica = topology.replica(group, index)
    process = replica.processes[worker]
    return ServiceContext(
        config=recipe.group(group).config,
        wiring=topology.wiring[group],
        run=RunSettings.of(recipe),
        replica=replica,
        process=process,
        run_dir=Path(env["MESHRL_RUN_DIR"]),
        controller=env["MESHRL_CONTROLLER"],
        secret=env.get("MESHRL_SECRET") or None,
        health=Health(process.name),
        single_host=topology.single_host,
        launch=env.get("MESHRL_LAUNCH", "0"),
        resume=Path(env["MESHRL_RESUME"]) if env.get("MESHRL_RESUME") else None,
        addresses=json.loads(env.get("MESHRL_ADDRESSES", "{}")),
    )


def dump_tasks(*_: object) -> None:
    try:
        tasks = asyncio.all_tasks()
    except RuntimeError:  # no event loop runs in the main thread
        return
    print(f"{len(tasks)} asyncio tasks:", flush=True)
    for task in tasks:
        task.print_stack(file=sys.stdout)
    sys.stdout.flush()


def run_threads(services: list[Any]) -> None:
    """Run co-hosted services, one thread each, until all return; the first failure fails the process."""
    errors: list[BaseException] = []
    done = threading.Event()

    def body(service: Any) -> None:
        try:
            service.run()
        except BaseException as e:
            logging.getLogger("meshrl.runtime.worker").exception("%s failed", service.ctx.name)
            errors.append(e)
            done.set()

    threads = [threading.Thread(target=body, args=(s,), name=s.ctx.name, daemon=True) for s in services]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads) and not done.wait(0.2):
        pass
    if errors:
        raise errors[0]


if __name__ == "__main__":
    main()
