"""`meshrl dashboard` in a real browser (the system's Chromium driven by Playwright) during a real run."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshrl.schema import TOOL_ERROR_KINDS
from tests.conftest import free_base_port
from tests.integration.grpo.test_grpo import RECIPE, REPO

playwright = pytest.importorskip("playwright.sync_api")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium (apt-get install chromium)")

SCREENSHOT = REPO / "docs" / "dashboard.png"


def start(args: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "meshrl.cli", *args], cwd=cwd, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip


def stop(dash: subprocess.Popen) -> None:
    """Ctrl-C stops the dashboard in 30 s, or the test fails (and leaves no dashboard behind)."""
    dash.send_signal(signal.SIGINT)
    try:
        assert dash.wait(timeout=30) == 0
    finally:
        if dash.poll() is None:
            dash.kill()
            dash.wait()


def wait_for(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def points(page, chart: str) -> int:
    return page.evaluate(
        f"(document.getElementById('{chart}').data || []).reduce((n, t) => n + t.x.length, 0)"
    )


def test_the_dashboard_draws_a_live_run_and_follows_its_steps(tmp_path, tiny_model):
    run_dir = tmp_path / "run"
    # slow steps (many samples each) so the run is still going while the page is checked
    run = start(["run", RECIPE, f"*.model={tiny_model}", f"run_dir={run_dir}", f"base_port={free_base_port()}",
                 "total_steps=400", "prompts_per_step=32", "rollout.eval_every=5"], tmp_path)  # fmt: skip
    dash = start(["dashboard", str(run_dir), "--port", "0"], tmp_path)
    try:
        wait_for(lambda: steps(run_dir) >= 2, 300, "the run's first steps")
        line = dash.stdout.readline()
        assert line.startswith("meshrl dashboard: http://127.0.0.1:"), line
        url = line.split()[2]
        with playwright.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(url)
            wait_for(
                lambda: points(page, "reward") >= 2 and points(page, "time") >= 2, 30, "charts with data"
            )
            reward, times = points(page, "reward"), points(page, "time")
            wait_for(
                lambda: points(page, "reward") > reward and points(page, "time") > times, 60, "the next step"
            )
            states = wait_for(lambda: page.eval_on_selector_all("#services td:nth-child(2)", "tds => tds.map(t => t.textContent)"),
                              30, "the services table")  # fmt: skip
            assert "ready" in states or "running" in states, states
            assert page.eval_on_selector_all("#samples tr", "rows => rows.length") > 1
            wait_for(lambda: points(page, "backlog") > 0, 30, "a backlog sample")
            page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=False)
            browser.close()
        if os.environ.get("MESHRL_SCREENSHOT"):  # the README's picture
            shutil.copy(tmp_path / "dashboard.png", SCREENSHOT)
    finally:
        run.send_signal(signal.SIGINT)
        out, _ = run.communicate(timeout=120)
        stop(dash)
    assert run.returncode == 130, out[-3000:]
    assert json.loads((run_dir / "config.json").read_text())["recipe"]["total_steps"] == 400


def traces(page, chart: str) -> list[str]:
    return page.evaluate(
        f"(document.getElementById('{chart}').data || []).filter(t => t.x.length).map(t => t.name)"
    )


def test_the_agents_panel_draws_an_agent_runs_figures(tmp_path, tiny_model):
    """A finished run of the calculator-tool agent: the agents chart has its turns, tool calls, tool
    errors by kind and truncations; the time chart where its trajectories' seconds went."""
    run_dir = tmp_path / "run"
    run = start(["run", str(REPO / "recipes" / "agent_calc.py"), f"*.model={tiny_model}", f"run_dir={run_dir}",
                 f"base_port={free_base_port()}", "total_steps=2", "prompts_per_step=4"], tmp_path)  # fmt: skip
    out, _ = run.communicate(timeout=300)
    assert run.returncode == 0, out[-3000:]
    dash = start(["dashboard", str(run_dir), "--port", "0"], tmp_path)
    try:
        url = dash.stdout.readline().split()[2]
        with playwright.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(url)
            wait_for(lambda: points(page, "agents") >= 2, 30, "the agents chart")
            names = traces(page, "agents")
            for name in ("turns_mean", "tool_calls_mean", "truncated_turns", "truncated_tokens", "failed",
                         *(f"tool_errors/{k}" for k in TOOL_ERROR_KINDS)):  # fmt: skip
                assert name in names, names
            assert sorted(traces(page, "agent_time")) == ["env", "generate", "queued"]
            assert points(page, "agent_time") == 3 * 2
            browser.close()
    finally:
        stop(dash)
