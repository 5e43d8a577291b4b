"""Time to plan a large recipe: 512 hosts x 8 devices, 6 service groups, 2 colocation rings.

python benchmarks/plan.py --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass

from meshrl.planning.config import Columns, ServiceConfig
from meshrl.planning.recipe import ColocationRing, Recipe, RingMember, Scheduling, ServiceGroup
from meshrl.planning.topology import Device, plan


@dataclass(frozen=True, kw_only=True)
class Role(ServiceConfig):
    service = "bench:Role"
    reads_: tuple[str, ...] = ()
    writes_: tuple[str, ...] = ()

    def reads(self) -> Columns:
        return {"samples": self.reads_} if self.reads_ else {}

    def writes(self) -> Columns:
        return {"samples": self.writes_} if self.writes_ else {}


def big_recipe() -> Recipe:
    groups = (
        ServiceGroup(id="rollout", config=Role(writes_=("prompt",), reads_=("response",)), replicas=1024),
        ServiceGroup(
            id="inference",
            config=Role(writes_=("response",), reads_=("prompt",)),
            replicas=384,
            devices_per_replica=8,
        ),
        ServiceGroup(
            id="reference",
            config=Role(writes_=("ref",), reads_=("response",)),
            replicas=384,
            devices_per_replica=8,
        ),
        ServiceGroup(
            id="trainer", config=Role(reads_=("response", "ref", "values")), devices_per_replica=1024
        ),
        ServiceGroup(
            id="critic", config=Role(writes_=("values",), reads_=("response",)), devices_per_replica=1024
        ),
        ServiceGroup(id="reward", config=Role(writes_=("score",), reads_=("response",)), replicas=128),
    )
    rings = (
        ColocationRing(
            id="gen",
            members=(RingMember(group="inference", mode=Scheduling.FALLBACK), RingMember(group="reference")),
        ),
        ColocationRing(id="train", members=(RingMember(group="trainer"), RingMember(group="critic"))),
    )
    return Recipe(name="big", groups=groups, rings=rings, base_port=20000)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    recipe = big_recipe()
    devices = [Device(h * 8 + i, f"node{h:04d}", i) for h in range(512) for i in range(8)]
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        topo = plan(recipe, devices)
        times.append(time.perf_counter() - t0)
    result = {
        "plan_seconds_4096": round(statistics.median(times), 4),
        "devices": len(devices),
        "processes": sum(len(r.processes) for r in topo.replicas),
        "replicas": len(topo.replicas),
    }
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
