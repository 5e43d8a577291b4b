"""The zygote: service processes forked from one warm parent start as a fresh interpreter would, and
the launcher that asks for them never imports torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.integration.launch.test_launcher import REPO, assert_all_gone, free_port_base, started_pids

PROBE = """
from meshrl.planning.recipe import Recipe, ServiceGroup
from tests.integration.launch.probe import ProbeConfig

def recipe():
    return Recipe(name="probe", groups=(ServiceGroup(id="probe", config=ProbeConfig(), replicas=2),))
"""

# `meshrl run` in a process that lists, on its way out, the torch and transformers modules it imported
IMPORTS = """
import atexit, json, sys
atexit.register(lambda: open(sys.argv[1], "w").write(json.dumps(
    sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers")))))
from meshrl.cli import main
main(["run", *sys.argv[2:]])
"""


def test_a_forked_service_starts_like_a_fresh_process(tmp_path):
    run_dir, out, recipe = tmp_path / "run", tmp_path / "probe.json", tmp_path / "probe.py"
    recipe.write_text(PROBE)
    r = subprocess.run(
        [sys.executable, "-m", "meshrl.cli", "run", str(recipe), f"run_dir={run_dir}", f"base_port={free_port_base()}",
         f"probe.out={out}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO), "MESHRL_TEST_MARK": "given"},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    report, sibling = (json.loads(Path(f"{out}.probe-{i}-0").read_text()) for i in (0, 1))
    # random generators seeded afresh, as in a new interpreter: no stream shared with a sibling
    assert report["rand"] != sibling["rand"] and report["numpy_rand"] != sibling["numpy_rand"]
    pids = started_pids(run_dir)
    assert report["ppid"] == pids["zygote"] == int(report["env"]["MESHRL_PARENT"])
    assert report["sid"] == report["pgid"] == report["pid"] == pids["probe-0-0"]  # a session of its own
    assert report["sigint_default"] and report["sigchld_default"]
    assert report["env"]["MESHRL_TEST_MARK"] == "given" and report["env"]["MESHRL_RUN_DIR"] == str(run_dir)
    assert report["argv0"].endswith(os.path.join("meshrl", "runtime", "worker.py"))
    assert report["root_handlers"] == 1  # the worker's own, nothing inherited
    log = (run_dir / "logs" / "probe-0-0.log").read_text()
    assert "probe on stdout" in log and "probe on stderr" in log and "probe through logging" in log
    assert_all_gone(pids)


def test_meshrl_run_imports_neither_torch_nor_transformers(tmp_path, tiny_model):
    heavy = tmp_path / "heavy.json"
    r = subprocess.run(
        [sys.executable, "-c", IMPORTS, str(heavy), str(REPO / "recipes" / "grpo_arith.py"),
         f"*.model={tiny_model}", f"run_dir={tmp_path / 'run'}", f"base_port={free_port_base()}",
         "total_steps=1", "rollout.eval_every=0"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "service processes ready in" in r.stdout
    assert json.loads(heavy.read_text()) == []


# what a launcher does before it starts anything, for every shipped recipe: load, override, plan
PLAN_ALL = """
import json, sys
from pathlib import Path
from meshrl.planning import prepare
from meshrl.planning.config import RecipeError
planned, refused = [], []
for path in sorted(Path(sys.argv[2]).glob("*.py")):
    try:
        prepare(path, [] if path.stem == "counter" else [f"*.model={sys.argv[3]}"])
        planned.append(path.stem)
    except RecipeError as e:  # vLLM's recipe without vLLM: refused at start-up, still torch-free
        refused.append(path.stem)
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers"))
http = sorted(m for m in sys.modules if m.split(".")[0] in ("starlette", "uvicorn", "openai", "httpx", "verifiers"))
Path(sys.argv[1]).write_text(json.dumps({"planned": planned, "refused": refused, "heavy": heavy, "http": http}))
"""


def test_every_shipped_recipe_plans_without_torch_or_transformers(tmp_path, tiny_model):
    """A launcher plans every recipe, agents' and distillation's included (environments, agent programs
    and tokenizers are checked at planning), without importing torch, transformers or the endpoint's HTTP
    stack: start-up stays fast."""
    out = tmp_path / "plan.json"
    r = subprocess.run(
        [sys.executable, "-c", PLAN_ALL, str(out), str(REPO / "recipes"), str(tiny_model)],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert len(report["planned"]) >= 20 and set(report["refused"]) <= {"grpo_arith_vllm"}, report
    assert {"agent_calc", "agent_program", "opd_arith", "ppo_rm", "counter"} <= set(report["planned"])
    assert report["heavy"] == [] and report["http"] == []
