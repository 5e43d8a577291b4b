"""`meshrl status [RUN_DIR]`: a run at a glance: services, data-plane partitions, colocation rings,
weight version.

Reads the run directory (topology, data-plane endpoint, secret) and asks each service's loopback health
endpoint and the controller. Without RUN_DIR, the most recently started run under ./runs is shown.
A colocation ring's state is read from its partition (`meshrl.runtime.colocation`: requests are rows, grants
and preemptions columns) by claiming its rows under consumer names of its own and giving them back.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from meshrl.dataplane.wire import host_id
from meshrl.schema import BY, EVENT, GRANT, PREEMPT, RELEASE, RING_CAPACITY

if TYPE_CHECKING:
    from meshrl.dataplane import Client

STATUS_CONSUMER = "status."  # prefix of the consumer names under which status reads ring partitions


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
    rings: list[dict[str, Any]] = []
    info_file = run_dir / "dataplane.json"
    if info_file.exists():
        from meshrl.dataplane import Client, DataPlaneError

        endpoint = json.loads(info_file.read_text())["controller"]
        secret_file = run_dir / "secret"
        secret = secret_file.read_text().strip() if secret_file.exists() else None
        try:
            with Client(endpoint, secret=secret, timeout=2.0) as c:
                plane = msgspec.to_builtins(c.status())
                rings = [ring_state(c, r, plane["partitions"]) for r in recipe_rings(run_dir)]
        except (OSError, TimeoutError) as e:
            plane = {"error": f"data plane unreachable at {endpoint}: {e}"}
        except DataPlaneError as e:
            plane = {"error": f"data plane at {endpoint} refused a request: {e}"}
    ledger: dict[str, Any] = {}
    if (run_dir / "ledger.jsonl").exists():
        from dataclasses import asdict

        from meshrl.dataplane.ledger import account

        ledger = asdict(account(run_dir / "ledger.jsonl"))
    restarts = run_dir / "restarts.jsonl"
    resumes = len(restarts.read_text().splitlines()) if restarts.exists() else 0
    return {"run_dir": str(run_dir), "services": services, "dataplane": plane, "rings": rings,
            "ledger": ledger, "resumes": resumes, "members": members(run_dir)}  # fmt: skip


def members(run_dir: Path) -> dict[str, Any]:
    """The run's replicas per group and every change of its shape (`members.json`, written by the lead
    launcher: meshrl/runtime/elastic.py); empty before the run is ready."""
    try:
        return dict(json.loads((run_dir / "members.json").read_text()))
    except (OSError, ValueError):
        return {}


def changes(members: dict[str, Any]) -> list[str]:
    """One line per change of the run's shape."""
    out = []
    for c in members.get("changes", []):
        sizes = ", ".join(f"{g} {a} -> {b}" for g, (a, b) in c["replicas"].items())
        what = [
            f"joined {n}" + (f" ({c['join_s'][n]:.1f}s)" if n in c["join_s"] else " (joining)")
            for n in c["joined"]
        ]
        what += [f"left {n}" + ("" if n in c["gone"] else " (draining)") for n in c["left"]]
        at = time.strftime("%H:%M:%S", time.localtime(c["time"]))
        why = f"{c['why']} {c['host']}" if "host" in c else c["why"]  # a host that joined (`meshrl join`)
        line = f"{at}  {why + ' ':<9}{sizes}: {', '.join(what)}"
        out.append(line + (f" (exit code {c['code']})" if "code" in c else ""))
    return out


def recipe_rings(run_dir: Path) -> list[dict[str, Any]]:
    """The recipe's rings as config.json has them: {"id", "members": [{"group", "mode"}], ...}."""
    config = run_dir / "config.json"
    return json.loads(config.read_text())["recipe"].get("rings", []) if config.exists() else []


def ring_state(client: Client, ring: dict[str, Any], partitions: list[dict[str, Any]]) -> dict[str, Any]:
    """Holder, askers, turns granted and fallback of one ring, from the current launch's partition.

    A request row without a RELEASE row naming it is live: granted, it is the holder's; not granted
    yet, its member is asking. Grants carry the turn number; the arbiter keeps the last turn's rows
    until the next grant, so the highest number seen is the count of turns granted."""
    groups = [m["group"] for m in ring["members"]]
    fallback = next((m["group"] for m in ring["members"] if m["mode"] == "FALLBACK"), None)
    state: dict[str, Any] = {"id": ring["id"], "members": groups, "fallback": fallback, "partition": None,
                             "holder": None, "processes": [], "turn": None, "preempted": False, "asking": [],
                             "turns": 0}  # fmt: skip
    prefix = f"ring.{ring['id']}."
    # one partition per launch; the controller lists them in creation order (a resumed run's restored
    # ones first), so the last is this launch's
    launches = [n for p in partitions if (n := p["name"]).startswith(prefix) and "." not in n[len(prefix) :]]
    if not launches:
        return state
    part = launches[-1]
    state["partition"] = part
    rows = {c: _peek(client, part, c, RING_CAPACITY) for c in (EVENT, GRANT, PREEMPT)}
    events = {i: (int(e[0]), int(e[1]), int(e[3]), str(by)) for i, e, by in rows[EVENT]}
    grants = {i: int(v[0]) for i, v, _ in rows[GRANT]}
    preempts = {i: int(v[0]) for i, v, _ in rows[PREEMPT]}
    released = {ref for kind, _, ref, _ in events.values() if kind == RELEASE}
    live = {i: e for i, e in events.items() if e[0] != RELEASE and i not in released}
    holding = sorted(i for i in live if i in grants)
    if holding:
        state["holder"] = groups[live[holding[0]][1]]
        state["turn"] = grants[holding[0]]
        state["processes"] = [live[i][3] for i in holding]
        state["preempted"] = any(i in preempts for i in holding)
    asking: dict[str, list[str]] = {}
    for i in sorted(live):
        if i not in grants:
            asking.setdefault(groups[live[i][1]], []).append(live[i][3])
    state["asking"] = [{"member": g, "processes": procs} for g, procs in asking.items()]
    state["turns"] = max(grants.values(), default=0)
    return state


def _peek(client: Client, part: str, column: str, n: int) -> list[tuple[int, list[int], object]]:
    """(row id, value, meta "by") of every row of `part` that has `column`, claimed under a consumer of
    `meshrl status` and released at once (the ring's own consumers never see it)."""
    batch = client.claim(part, f"{STATUS_CONSUMER}{column}", [column], n, lease=10.0)
    if not batch:
        return []
    try:
        return list(zip(batch.ids.tolist(), batch.tensor(column).tolist(), batch.meta_of(BY), strict=True))
    finally:
        client.release(batch)


def render(status: dict[str, Any]) -> str:
    lines = [f"run {status['run_dir']}", ""]
    lines.append(f"{'SERVICE':<22}{'STATE':<10}{'UPTIME':>9}  {'PID':>7}  PHASE (FOR)  |  INFO")
    versions = []
    for s in status["services"]:
        h = dict(s["health"])
        uptime = f"{h.pop('uptime_s', 0):.0f}s" if h else "-"
        pid = str(h.pop("pid", "-"))
        h.pop("service", None)
        h.pop("state", None)
        phase = f"{h.pop('phase')} ({h.pop('phase_s', 0):.0f}s)" if "phase" in h else "-"
        if "version" in h:
            versions.append(h["version"])
        info = " ".join(f"{k}={v}" for k, v in h.items())
        lines.append(f"{s['name']:<22}{s['state']:<10}{uptime:>9}  {pid:>7}  {phase}  |  {info}")
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
                if c["name"].startswith(STATUS_CONSUMER):
                    continue
                lines.append(
                    f"{'':<32}{c['name']}: {c['ready']} ready, {c['claimed']} claimed, {c['acked']} acked"
                )
    else:
        lines.append("data plane: not running")
    if status.get("rings"):
        lines += ["", f"{'RING':<12}{'HOLDER':<38}{'TURNS':>6}  {'FALLBACK':<12}ASKING"]
        for r in status["rings"]:
            if r["holder"] is None:
                holder = "free" if r["partition"] else "not started"
            else:
                holder = f"{r['holder']} (turn {r['turn']}{', asked to leave' if r['preempted'] else ''})"
            asking = ", ".join(f"{a['member']} ({' '.join(a['processes'])})" for a in r["asking"]) or "-"
            lines.append(f"{r['id']:<12}{holder:<38}{r['turns']:>6}  {r['fallback'] or '-':<12}{asking}")
    if versions:
        lines += ["", f"weight version: {max(versions)}"]
    shape = status.get("members") or {}
    if shape.get("changes"):
        now = ", ".join(f"{g} {n}" for g, n in shape["replicas"].items())
        hosts = [h["name"] for h in shape.get("members", {}).get("hosts", [])]
        now += f"; hosts joined: {', '.join(hosts)}" if hosts else ""
        lines += ["", f"replicas: {now}; changes of the run's shape:", *("  " + c for c in changes(shape))]
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
