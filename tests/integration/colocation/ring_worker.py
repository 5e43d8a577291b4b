"""A ring member process for the colocation tests: takes random turns and logs what it saw.

    python -m tests.integration.colocation.ring_worker CONTROLLER PLAN_JSON PROCESS TURNS SEED LOG

Each line of LOG is JSON: {"t": monotonic seconds, "ev": "request" | "enter" | "exit", "by": PROCESS}.
"enter" is logged by restore() (after the grant), "exit" by offload() (before the release). An ON_DEMAND
process takes TURNS turns with random gaps and lengths; a FALLBACK process wants the token all the time
(in small slices, giving it back when preempted) until the file LOG.stop exists. The process that
runs the ring's arbiter stays until then too, as a service does until the end of its run.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

from meshrl.dataplane import Client
from meshrl.planning.recipe import Scheduling
from meshrl.runtime.colocation import RingMember, RingPlan


def main() -> None:
    controller, plan_json, process, turns, seed, log_path = sys.argv[1:7]
    spec = json.loads(plan_json)
    plan = RingPlan(
        spec["id"],
        tuple(spec["members"]),
        tuple(Scheduling(m) for m in spec["modes"]),
        tuple(tuple(p) for p in spec["processes"]),
    )
    rng = random.Random(int(seed))
    out = open(log_path, "a", buffering=1)  # noqa: SIM115

    def note(ev: str) -> None:
        out.write(json.dumps({"t": time.monotonic(), "ev": ev, "by": process}) + "\n")

    member = RingMember(
        plan, process, lambda name: Client(controller, name=name),
        offload=lambda: note("exit"), restore=lambda: note("enter"),
    )  # fmt: skip
    try:
        if member.fallback:
            while not os.path.exists(log_path + ".stop"):
                if not member.holding:
                    note("request")
                with member.turn():
                    if not os.path.exists(log_path + ".held"):
                        open(log_path + ".held", "w").close()
                    time.sleep(0.002)  # a slice of work; a safe point follows
        else:
            # the fallback, asking at once, holds the token first: wait for its first turn (a fixed
            # sleep was not enough when seven processes started at once on a loaded machine)
            while "fallback" in spec["modes"] and not os.path.exists(log_path + ".held"):
                time.sleep(0.01)
            for _ in range(int(turns)):
                time.sleep(rng.uniform(0, 0.03))
                note("request")
                with member.turn():
                    time.sleep(rng.uniform(0, 0.02))
            while member.arbiter is not None and not os.path.exists(log_path + ".stop"):
                time.sleep(0.05)  # the arbiter's process stays while the others take their turns
        if member.arbiter is not None:  # what the arbiter decided, in its order
            for turn, granted, asking, previous in list(member.arbiter.history):
                out.write(json.dumps({"t": 0, "ev": "decision", "by": process, "turn": turn,
                                      "member": granted, "asking": asking, "previous": previous}) + "\n")  # fmt: skip
        note("done")
    finally:
        member.close()
        out.close()


if __name__ == "__main__":
    main()
