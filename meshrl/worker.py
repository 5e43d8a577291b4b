"""Entry point of one service process: `python -m meshrl.worker GROUP REPLICA WORKER`.

Its launcher passes the recipe, overrides and gathered device list in the environment; the process
rebuilds the same plan, finds itself in it, and runs its service. Stdout/stderr go to the process's
log file (set up by the launcher), so a crash leaves its full traceback there.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

from meshrl.recipe import load_recipe, service_class
from meshrl.topology import Device, plan


def main() -> None:
    group, replica_index, worker = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    logging.basicConfig(
        level=os.environ.get("MESHRL_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s {group}-{replica_index}.{worker} %(levelname)s %(name)s: %(message)s",
        stream=sys.stdout,
    )
    recipe = load_recipe(os.environ["MESHRL_RECIPE"], json.loads(os.environ.get("MESHRL_OVERRIDES", "[]")))
    devices = [Device(*d) for d in json.loads(os.environ["MESHRL_DEVICES"])]
    topology = plan(recipe, devices)
    replica = topology.replica(group, replica_index)
    process = replica.processes[worker]

    # heavy imports (torch, transformers) only from here on
    from meshrl.service import Health, ServiceContext

    health = Health(process.name)
    server = health.serve(process.ports[0])
    ctx = ServiceContext(
        recipe=recipe,
        topology=topology,
        replica=replica,
        process=process,
        run_dir=Path(os.environ["MESHRL_RUN_DIR"]),
        controller=os.environ["MESHRL_CONTROLLER"],
        secret=os.environ.get("MESHRL_SECRET") or None,
        health=health,
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    service = service_class(ctx.config)(ctx)
    t0 = time.monotonic()
    try:
        service.setup()
        service.join_ring()
        logging.getLogger("meshrl.worker").info("ready after %.1fs", time.monotonic() - t0)
        health.state = "running"
        service.run()
        health.state = "finished"
    except BaseException:
        health.state = "failed"
        raise
    finally:
        service.close()
        server.shutdown()
    # Done. Leave without tearing the interpreter down: threads blocked in a collective of a peer that
    # already left (a weight receiver, say) would abort the process during finalisation.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
