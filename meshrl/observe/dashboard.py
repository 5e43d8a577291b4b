"""`meshrl dashboard [RUN_DIR] [--host H] [--port P]`: a run in the browser, live or finished.

A small HTTP server (standard library, a thread per request) serves one page and one JSON document.
The page draws its charts with plotly.js, served from the installed `plotly` package (`pip install
meshrl[dashboard]`; nothing is fetched from outside the machine), and asks for the JSON every two
seconds. The JSON is read from the run's files (metrics.jsonl, eval.jsonl, critic.jsonl, samples.jsonl,
restarts.jsonl) and, while the run's processes are alive, from `meshrl status`'s view of it (service
states, data-plane backlog per consumer, colocation ring turns), sampled by a thread every two seconds
and kept as a time series for as long as the dashboard runs.

Bound to loopback (the default) it needs nothing more; bound to any other address every request must
carry the token printed with the URL.
"""

from __future__ import annotations

import argparse
import contextlib
import hmac
import json
import math
import os
import secrets
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

from meshrl.observe.follow import is_signal
from meshrl.observe.status import changes, collect, latest_run, members

PAGE = Path(__file__).with_name("dashboard.html")
SAMPLES_SHOWN = 24
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def read_rows(path: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    try:
        text = path.read_text()
    except OSError:
        return rows
    for line in text.splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:  # a line being written
            continue
    return rows


def alive(run_dir: Path) -> bool:
    """Whether a process the run's launchers started is still running (pids-*.json)."""
    for path in run_dir.glob("pids-*.json"):
        try:
            pids = json.loads(path.read_text()).values()
        except (OSError, ValueError):
            continue
        for pid in pids:
            try:
                os.kill(int(pid), 0)
                return True
            except (ProcessLookupError, PermissionError, ValueError):
                continue
    return False


class Live:
    """Samples the live run's status every `every` seconds on a thread: the latest status, and the
    backlog of each consumer and the turns of each ring over time."""

    def __init__(self, run_dir: Path, every: float = 2.0) -> None:
        self.run_dir, self.every = run_dir, every
        self.lock = threading.Lock()
        self.status: dict[str, Any] | None = None
        self.history: dict[str, Any] = {"t": [], "backlog": {}, "turns": {}}
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="dashboard-live", daemon=True)

    def start(self) -> Live:
        self.thread.start()
        return self

    def _loop(self) -> None:
        while not self.stopping.is_set():
            if alive(self.run_dir):
                self.sample(collect(self.run_dir))
            self.stopping.wait(self.every)

    def sample(self, status: dict[str, Any]) -> None:
        with self.lock:
            self.status = status
            h, n = self.history, len(self.history["t"])
            h["t"].append(time.time())
            for p in status.get("dataplane", {}).get("partitions", []):
                if is_signal(p["name"]):
                    continue
                for c in p["consumers"]:
                    if not c["name"].startswith("status."):
                        series = h["backlog"].setdefault(f"{p['name']}/{c['name']}", [None] * n)
                        series.append(c["ready"])
            for r in status.get("rings", []):
                h["turns"].setdefault(r["id"], [None] * n).append(r["turns"])
            for series in [*h["backlog"].values(), *h["turns"].values()]:
                series.extend([None] * (n + 1 - len(series)))  # a consumer gone from this sample

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {"status": self.status, "history": json.loads(json.dumps(self.history))}

    def stop(self) -> None:
        self.stopping.set()


def state(run_dir: Path, live: Live) -> dict[str, Any]:
    """The JSON document the page draws."""
    config: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError, KeyError):
        config = json.loads((run_dir / "config.json").read_text())["recipe"]
    return {
        "run_dir": str(run_dir),
        "name": config.get("name", run_dir.name),
        "total_steps": config.get("total_steps"),
        "alive": alive(run_dir),
        "metrics": with_rewards(read_rows(run_dir / "metrics.jsonl"), read_rows(run_dir / "rewards.jsonl")),
        "eval": read_rows(run_dir / "eval.jsonl"),
        "critic": read_rows(run_dir / "critic.jsonl"),
        "samples": read_rows(run_dir / "samples.jsonl")[-SAMPLES_SHOWN:],
        "restarts": read_rows(run_dir / "restarts.jsonl"),
        "changes": changes(members(run_dir)),
        **live.snapshot(),
        "topology": _services(run_dir),
    }


def with_rewards(metrics: list[dict[str, Any]], rewards: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The trainer's rows with rollout's mean of each reward function of the same step (reward/<fn>)."""
    by_step = {r.get("step"): r for r in rewards}
    return [{**by_step.get(m.get("step"), {}), **m} for m in metrics]


def _services(run_dir: Path) -> list[str]:
    """The run's service processes by name (what the page lists when the run is not running)."""
    try:
        topo = json.loads((run_dir / "topology.json").read_text())
    except (OSError, ValueError):
        return []
    return [f"{p['group']}-{p['replica']}-{p['rank']}" for r in topo["replicas"] for p in r["processes"]]


def _finite(x: Any) -> Any:
    """NaN and infinities (a step that diverged) as null: JSON has no other spelling for them."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def serve(run_dir: Path, host: str = "127.0.0.1", port: int = 8765) -> tuple[ThreadingHTTPServer, str, Live]:
    """Start serving `run_dir` (on a thread); returns the server, the URL to open and the status
    sampler. Port 0 takes a free one."""
    token = None if host in LOOPBACK else secrets.token_urlsafe(16)
    plotly_js = _plotly_js()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            url = urlparse(self.path)
            given = parse_qs(url.query).get("token", [""])[0]
            if token is not None and not hmac.compare_digest(given, token):
                return self._send(403, b"a token is needed: open the URL the dashboard printed", "text/plain")
            if url.path == "/":
                return self._send(200, PAGE.read_bytes(), "text/html; charset=utf-8")
            if url.path == "/plotly.min.js":
                return self._send(200, plotly_js, "application/javascript")
            if url.path == "/api/state":
                body = json.dumps(_finite(state(run_dir, live)), allow_nan=False, default=str)
                return self._send(200, body.encode(), "application/json")
            return self._send(404, b"not found", "text/plain")

        def _send(self, code: int, body: bytes, kind: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    live = Live(run_dir).start()  # once listening: a port in use starts nothing
    threading.Thread(target=server.serve_forever, name="dashboard", daemon=True).start()
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    url = f"http://{shown}:{server.server_address[1]}/" + (f"?token={token}" if token else "")
    return server, url, live


def _plotly_js() -> bytes:
    try:
        import plotly
    except ImportError as e:
        raise SystemExit("meshrl dashboard: needs plotly (pip install 'meshrl[dashboard]')") from e
    return (Path(plotly.__file__).parent / "package_data" / "plotly.min.js").read_bytes()


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="meshrl dashboard", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", nargs="?", help="a run directory (default: the latest under ./runs)")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    ap.add_argument("--port", type=int, default=8765, help="0: any free port")
    args = ap.parse_args(argv)
    # a run directory named explicitly may not exist yet: the page fills in once the run starts
    run_dir = Path(args.run_dir) if args.run_dir else latest_run()
    if run_dir is None:
        print("meshrl dashboard: no run under ./runs; name a run directory", file=sys.stderr)
        return 2
    try:
        server, url, live = serve(run_dir.resolve(), args.host, args.port)
    except OSError as e:  # the port taken, an address this host does not have
        print(f"meshrl dashboard: cannot listen on {args.host}:{args.port}: {e.strerror or e} "
              "(choose another with --port, or --port 0 for any free one)", file=sys.stderr)  # fmt: skip
        return 2
    # SIGINT or SIGTERM stops it, also where SIGINT came ignored (a background job of a script)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"meshrl dashboard: {url}  (run {run_dir}; Ctrl-C stops it)", flush=True)
    try:
        while not stop.wait(1.0):
            pass
    finally:
        live.stop()
        server.shutdown()
    return 0
