"""`meshrl status` reads a ring's holder, askers and turns from its partition on a real data plane."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from meshrl.dataplane import Client
from meshrl.observe.status import collect, render
from meshrl.planning.recipe import Scheduling
from meshrl.runtime.colocation import RingMember, RingPlan

MEMBERS = [("inference", "FALLBACK"), ("teacher", "ON_DEMAND"), ("trainer", "ON_DEMAND")]


def run_dir_for(tmp_path: Path, controller: str) -> Path:
    """The run files `meshrl status` reads: no services, the data plane, the recipe's ring."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "topology.json").write_text(json.dumps({"replicas": []}))
    (run_dir / "dataplane.json").write_text(json.dumps({"controller": controller}))
    ring = {"id": "shared", "members": [{"group": g, "mode": m} for g, m in MEMBERS], "hybrid": False}
    (run_dir / "config.json").write_text(json.dumps({"recipe": {"rings": [ring]}}))
    return run_dir


def ring_status(run_dir: Path, until: Callable[[dict[str, Any]], bool]) -> tuple[dict[str, Any], str]:
    """The ring's state once `until` holds (the arbiter decides on its own thread), and the text."""
    deadline = time.monotonic() + 5
    while True:
        status = collect(run_dir)
        (ring,) = status["rings"]
        if until(ring) or time.monotonic() > deadline:
            return ring, render(status)
        time.sleep(0.02)


def test_status_names_the_holder_the_askers_and_the_turns(plane, tmp_path):
    run_dir = run_dir_for(tmp_path, plane.controller)
    plan = RingPlan(
        "shared",
        tuple(g for g, _ in MEMBERS),
        tuple(Scheduling[m] for _, m in MEMBERS),
        tuple((f"{g}-0-0",) for g, _ in MEMBERS),
    )
    # a ring partition of an earlier launch (a resumed run restores it before this launch's is created),
    # with a request nobody will grant: status reads the current launch's partition, not that one
    with Client(plane.controller, name="earlier") as c:
        c.create_partition("ring.shared.earlier", 16)
        c.put("ring.shared.earlier", {"event": torch.tensor([[1, 2, 0, -1]])}, meta=[{"by": "trainer-0-0"}])
    members = {
        g: RingMember(plan, f"{g}-0-0", lambda name: Client(plane.controller, name=name)) for g, _ in MEMBERS
    }
    inference, trainer = members["inference"], members["trainer"]
    try:
        ring, text = ring_status(run_dir, lambda r: r["partition"] is not None)
        assert (ring["partition"], ring["holder"], ring["turns"], ring["asking"], ring["fallback"]) == (
            "ring.shared.0", None, 0, [], "inference"), text  # fmt: skip
        assert "shared" in text and "free" in text

        inference.acquire(timeout=5)  # the fallback takes the free token: turn 1
        asking = threading.Thread(target=trainer.acquire, kwargs={"timeout": 10})
        asking.start()  # the trainer asks: inference is asked to leave at its next safe point
        ring, text = ring_status(run_dir, lambda r: r["preempted"] and r["asking"])
        assert (ring["holder"], ring["processes"], ring["turn"], ring["turns"]) == (
            "inference", ["inference-0-0"], 1, 1), text  # fmt: skip
        assert ring["asking"] == [{"member": "trainer", "processes": ["trainer-0-0"]}], text
        assert "inference (turn 1, asked to leave)" in text and "trainer (trainer-0-0)" in text, text

        # status reads the preemption from the data plane; the holder learns of it from its own watcher
        assert inference.preempt.wait(timeout=10)
        assert inference.yield_if_preempted()  # the safe point: the token goes to the trainer
        asking.join(timeout=10)
        assert trainer.holding
        ring, text = ring_status(run_dir, lambda r: r["holder"] == "trainer")
        assert (ring["holder"], ring["turn"], ring["turns"], ring["asking"]) == ("trainer", 2, 2, []), text

        trainer.release()  # nobody asks: the token is free, and the count of turns stays visible
        ring, text = ring_status(run_dir, lambda r: r["holder"] is None)
        assert (ring["holder"], ring["turns"], ring["asking"]) == (None, 2, []), text
        # status's own consumers are left out of the partition listing
        assert "status." not in text
    finally:
        for m in reversed(members.values()):  # the arbiter's process (inference) last
            m.close()
