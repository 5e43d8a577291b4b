"""Colocation benchmark: the token ring's hand-off latency and correctness, and memory freed by offload.

    python benchmarks/colocation.py --json

Real processes on loopback: a data plane, and ring members as separate processes.

- handoff_ms: median time from an ON_DEMAND member's request to its grant while the FALLBACK member
  holds the token idle (request row -> arbiter -> preempt column -> the holder releases -> grant column),
  over `--handoffs` hand-offs; roundtrip_ms: the median of one data-plane put + claim in the same
  run, the floor a hand-off is built from (it takes several);
- violations: in a ring of 4 members (1 FALLBACK, 3 ON_DEMAND, random request patterns, `--turns`
  turns each), the number of moments two members held the token at once (from the members' own logs;
  must be 0), with turns_granted / turns_asked;
- rss_drop_mb_trainer / rss_drop_mb_inference: resident memory released by offload on the tiny model
  (training engine with optimizer state after one step; HF inference engine), each measured in a fresh
  process, with the bytes the offload moved (offloaded_mb_*), and the time of offload and restore.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.conftest import start_plane, stop_plane  # noqa: E402 (a real data plane, as the tests start it)


def handoff_worker(controller: str, role: str, n: int, out: str) -> None:
    """FALLBACK: hold the token, give it back when preempted, ask again. ON_DEMAND: n timed turns."""
    from meshrl.dataplane import Client
    from meshrl.planning.recipe import Scheduling
    from meshrl.runtime.colocation import RingMember, RingPlan

    plan = RingPlan("bench", ("inference", "trainer"), (Scheduling.FALLBACK, Scheduling.ON_DEMAND),
                    (("inference-0-0",), ("trainer-0-0",)))  # fmt: skip
    name = "inference-0-0" if role == "fallback" else "trainer-0-0"
    member = RingMember(plan, name, lambda c: Client(controller, name=c))
    try:
        if role == "fallback":
            while not os.path.exists(out + ".stop"):
                with member.turn():
                    time.sleep(0.001)
            return
        waits = []
        for _ in range(n + 3):
            time.sleep(0.02)  # the fallback takes the token back and sits idle on it
            waits.append(member.acquire())
            member.release()
        Path(out).write_text(json.dumps(waits[3:]))
    finally:
        member.close()


def roundtrip_ms(controller: str, n: int = 200) -> float:
    import torch

    from meshrl.dataplane import Client

    with Client(controller, name="bench-rtt") as c:
        c.create_partition("rtt", 1024, delete_when_acked_by=["r"])
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            c.put("rtt", {"x": torch.zeros(1, 1)})
            b = c.claim("rtt", "r", ["x"], 1, timeout=5)
            times.append(time.perf_counter() - t0)
            c.ack(b)
    return statistics.median(times) * 1e3


def measure_handoff(plane, tmp: Path, n: int) -> float:
    out = str(tmp / "handoff.json")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, __file__, "--worker"]
    fallback = subprocess.Popen([*cmd, plane.controller, "fallback", "0", out], env=env)
    demand = subprocess.Popen([*cmd, plane.controller, "on_demand", str(n), out], env=env)
    try:
        demand.wait(timeout=300)
        Path(out + ".stop").touch()
        fallback.wait(timeout=60)
    finally:
        for p in (fallback, demand):
            if p.poll() is None:
                p.kill()
    if demand.returncode != 0:
        raise SystemExit("hand-off worker failed")
    return statistics.median(json.loads(Path(out).read_text())) * 1e3


def measure_violations(plane, tmp: Path, turns: int) -> dict[str, int]:
    from tests.integration.colocation.test_ring import FALLBACK, ON_DEMAND, run_ring, turns_of

    modes = [FALLBACK, ON_DEMAND, ON_DEMAND, ON_DEMAND]
    processes = [["inference"], ["trainer"], ["teacher"], ["reference"]]
    events = run_ring(plane, tmp, modes, processes, turns, seed=7)
    member_of = {p: m for m, group in enumerate(processes) for p in group}
    held = turns_of(events, member_of)
    violations = sum(1 for i, a in enumerate(held) for b in held[i + 1 :] if b[0] < a[1] and b[2] != a[2])
    granted = sum(1 for e in events if e["ev"] == "enter" and member_of[e["by"]] != 0)
    return {"violations": violations, "turns_granted": granted, "turns_asked": 3 * turns}


def memory_worker(kind: str, out: str) -> None:
    import psutil
    import torch

    torch.set_num_threads(1)
    from meshrl.models.tiny import build_tiny_model

    tmp = Path(out).parent
    model = str(build_tiny_model(tmp / f"model-{kind}"))
    if kind == "trainer":
        from meshrl.engines.fsdp import FSDPEngine
        from meshrl.engines.optim import OptimConfig
        from meshrl.engines.packing import pack

        engine = FSDPEngine(model, OptimConfig(lr=1e-3), device=torch.device("cpu"))
        rows = [torch.tensor([1, 2, 3])] * 8
        batch = pack(rows, [torch.tensor([4, 5])] * 8, [torch.tensor([-1.0, -1.0])] * 8,
                     torch.tensor([1.0, -1.0] * 4), torch.ones(8, dtype=torch.bool))  # fmt: skip
        engine.update_policy(batch)  # optimizer state exists
        target = engine
    else:
        from meshrl.engines.base import SamplingParams
        from meshrl.engines.hf import HFEngine

        target = HFEngine(model)  # type: ignore[assignment]
        target.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, seed=0))  # type: ignore[attr-defined]
    proc = psutil.Process()
    before = proc.memory_info().rss
    t0 = time.perf_counter()
    moved = target.offload(str(tmp / f"{kind}.bin"))
    t1 = time.perf_counter()
    after = proc.memory_info().rss
    target.restore()
    t2 = time.perf_counter()
    Path(out).write_text(json.dumps({
        "rss_drop_mb": round((before - after) / 2**20, 2), "offloaded_mb": round(moved / 2**20, 2),
        "offload_ms": round((t1 - t0) * 1e3, 2), "restore_ms": round((t2 - t1) * 1e3, 2),
    }))  # fmt: skip


def measure_memory(tmp: Path, kind: str) -> dict[str, float]:
    out = tmp / f"mem-{kind}.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, __file__, "--memory", kind, str(out)], env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300)  # fmt: skip
    return {f"{k}_{kind}": v for k, v in json.loads(out.read_text()).items()}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        handoff_worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--memory":
        memory_worker(sys.argv[2], sys.argv[3])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--handoffs", type=int, default=50)
    ap.add_argument("--turns", type=int, default=20)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="meshrl-coloc-") as tmp_name:
        tmp = Path(tmp_name)
        plane = start_plane(tmp)
        try:
            result: dict[str, object] = {
                "handoff_ms": round(measure_handoff(plane, tmp, args.handoffs), 2),
                "roundtrip_ms": round(roundtrip_ms(plane.controller), 3),
                **measure_violations(plane, tmp, args.turns),
            }
        finally:
            stop_plane(plane)
        result.update(measure_memory(tmp, "trainer"))
        result.update(measure_memory(tmp, "inference"))
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
