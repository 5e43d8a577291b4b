"""`meshrl status [RUN_DIR]`: a run at a glance: services, data-plane partitions, weight version.

Reads the run directory (topology, data-plane endpoint, secret) and asks each service's loopback health
endpoint and the controller. Without RUN_DIR, the most recently started run under ./runs is shown.
"""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path
from typing import Any

import msgspec

from meshrl.dataplane.wire import host_id


def latest_run(root: Path = Path("runs")) -> Path | None:
    runs = sorted(root.glob("*/topology.json"), key=lambda p: p.stat().st_mtime)
    return runs[-1].parent if runs else None


def health(port: int) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1.0) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


def collect(run_dir: Path) -> dict[str, Any]:
    topo = json.loads((run_dir / "topology.json").read_text())
    me = host_id()
    services = []
    for rep in topo["replicas"]:
        for p in rep["processes"]:
            name = f"{p['group']}-{p['replica']}-{p['rank']}"
            h = health(p["ports"][0]) if p["host"] == me else None
            state = h["state"] if h else ("remote" if p["host"] != me else "down")
            services.append({"name": name, "host": p["host"], "state": state, "health": h or {}})
    plane: dict[str, Any] = {}
    info_file = run_dir / "dataplane.json"
    if info_file.exists():
        from meshrl.dataplane import Client

        endpoint = json.loads(info_file.read_text())["controller"]
        secret_file = run_dir / "secret"
        secret = secret_file.read_text().strip() if secret_file.exists() else None
        try:
            with Client(endpoint, secret=secret, timeout=2.0) as c:
                plane = msgspec.to_builtins(c.status())
        except (OSError, TimeoutError) as e:
            plane = {"error": f"data plane unreachable at {endpoint}: {e}"}
    ledger: dict[str, Any] = {}
    if (run_dir / "ledger.jsonl").exists():
        from dataclasses import asdict

        from meshrl.dataplane.ledger import account

        ledger = asdict(account(run_dir / "ledger.jsonl"))
    restarts = run_dir / "restarts.jsonl"
    resumes = len(restarts.read_text().splitlines()) if restarts.exists() else 0
    return {"run_dir": str(run_dir), "services": services, "dataplane": plane, "ledger": ledger,
            "resumes": resumes}  # fmt: skip


def render(status: dict[str, Any]) -> str:
    lines = [f"run {status['run_dir']}", ""]
    lines.append(f"{'SERVICE':<22}{'STATE':<10}{'UPTIME':>9}  {'PID':>7}  INFO")
    versions = []
    for s in status["services"]:
        h = dict(s["health"])
        uptime = f"{h.pop('uptime_s', 0):.0f}s" if h else "-"
        pid = str(h.pop("pid", "-"))
        h.pop("service", None)
        h.pop("state", None)
        if "version" in h:
            versions.append(h["version"])
        info = " ".join(f"{k}={v}" for k, v in h.items())
        lines.append(f"{s['name']:<22}{s['state']:<10}{uptime:>9}  {pid:>7}  {info}")
    plane = status["dataplane"]
    lines.append("")
    if "error" in plane:
        lines.append(plane["error"])
    elif plane:
        lines.append(
            f"{'PARTITION':<12}{'ROWS':>14}  {'OLDEST':>7}  COLUMNS / CONSUMERS (ready, claimed, acked)"
        )
        for p in plane["partitions"]:
            cols = " ".join(f"{k}={v}" for k, v in p["columns"].items())
            lines.append(
                f"{p['name']:<12}{p['rows']:>7}/{p['capacity']:<6}  {p['oldest_age_s']:>6.1f}s  {cols}"
            )
            for c in p["consumers"]:
                lines.append(
                    f"{'':<32}{c['name']}: {c['ready']} ready, {c['claimed']} claimed, {c['acked']} acked"
                )
    else:
        lines.append("data plane: not running")
    if versions:
        lines += ["", f"weight version: {max(versions)}"]
    ledger = status.get("ledger") or {}
    if ledger:
        lines += [
            "",
            "samples (ledger, trainer): {produced} produced, {consumed} consumed, {deleted} filtered, "
            "{pending} in flight (lost if the run is over), {duplicated} duplicated".format(**ledger)
            + f"; {status.get('resumes', 0)} resumes",
        ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    as_json = "--json" in argv
    args = [a for a in argv if a != "--json"]
    run_dir = Path(args[0]) if args else latest_run()
    if run_dir is None or not (run_dir / "topology.json").exists():
        print(
            f"meshrl status: no run found{f' in {run_dir}' if run_dir else ' under ./runs'}", file=sys.stderr
        )
        return 1
    status = collect(run_dir)
    print(json.dumps(status, indent=2) if as_json else render(status))
    return 0
