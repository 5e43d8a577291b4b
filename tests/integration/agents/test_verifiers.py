"""verifiers v1 environments trained as agent programs (meshrl/envs/verifiers.py): real processes, CPU,
the tiny model, a taskset of the test tree's own (tests/integration/agents/vf/vf_arith.py) whose harness
runs in-process, and recipes/agent_verifiers.py on meshrl's own taskset (meshrl/tasks/vf_sums.py).
Every task is one episode, trained once (a killed agents service too); what is trained is what verifiers
received; `meshrl eval` plays the recipe's held-out tasks."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import torch

from meshrl.dataplane.ledger import account
from tests.conftest import free_base_port
from tests.integration.agents.test_programs import SMALL, counts, same_report
from tests.integration.fault.test_kill import kill_repeatedly, start
from tests.integration.grpo.test_grpo import REPO, rows, run

AGENT_VERIFIERS = str(REPO / "recipes" / "agent_verifiers.py")

TASKSET = Path(__file__).resolve().parent / "vf"
"""v1 imports a taskset by its id as a top-level module: this folder goes on PYTHONPATH."""


def run_episodes(
    tmp_path: Path, model: Path, steps: int, record: Path
) -> tuple[subprocess.CompletedProcess, Path]:
    """recipes/agent_verifiers.py on the test tree's taskset (as test_grpo.run, plus the taskset's folder
    on PYTHONPATH)."""
    run_dir = tmp_path / "run"
    args = {"agent": {"runtime": {"type": "subprocess"}}, "taskset": {"task": {"record": str(record)}}}
    overrides = [
        f"base_port={free_base_port()}", f"*.model={model}", f"total_steps={steps}", *SMALL, f"run_dir={run_dir}",
        "agents.verifiers=vf_arith", f"agents.args={json.dumps(args)}", "rollout.dataset=arith", "rollout.eval_size=null",
    ]  # fmt: skip
    r = subprocess.run([sys.executable, "-m", "meshrl.cli", "run", AGENT_VERIFIERS, *overrides], cwd=tmp_path,
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(TASKSET)])})  # fmt: skip
    return r, run_dir


def test_every_task_is_one_episode_trained_once(tmp_path: Path, arith_model: Path) -> None:
    """Each task runs as one verifiers episode and trains once, as one sample, with the tokens verifiers'
    client received: the samples' text is the traces' tokens, and the traces' log-probs are the
    model's own (those of the first step's episodes: all generated before the weights changed)."""
    steps, record = 3, tmp_path / "tokens.jsonl"
    r, run_dir = run_episodes(tmp_path, arith_model, steps, record)
    assert r.returncode == 0, r.stderr[-3000:]
    batch = 4 * 4
    tally = account(run_dir / "ledger.jsonl")
    assert (tally.consumed, tally.pending, tally.duplicated) == (steps * batch, 0, 0), tally
    done = counts(run_dir)
    assert done.get("failed", 0) == 0 and done["finished"] >= steps * batch, done
    assert done["turns"] == done["finished"], done  # one generate call per episode, each in its sample
    # verifiers' side: one trace per episode, one branch: the prompt, then the sampled tokens
    traces = [t["branches"] for t in rows(record)]
    assert len(traces) == done["finished"] and all(len(b) == 1 for b in traces)
    tokens = []
    for (branch,) in traces:
        ids, sampled = branch["token_ids"], branch["sampled"]
        first = sampled.index(True)
        assert all(sampled[first:]) and len(branch["logprobs"]) == len(ids) - first
        tokens.append((ids[:first], ids[first:], branch["logprobs"]))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # the trainer's side: each logged sample is a trace's tokens (a character tokenizer: text is ids)
    tokenizer = AutoTokenizer.from_pretrained(str(arith_model))
    texts = {(tokenizer.decode(p), tokenizer.decode(c)) for p, c, _ in tokens}
    samples = rows(run_dir / "samples.jsonl")
    assert samples and all((s["prompt"], s["completion"]) in texts for s in samples), (samples[:2], texts)
    # the behaviour log-probs verifiers got (and the sample carries) are the model's, token by token
    model = AutoModelForCausalLM.from_pretrained(str(arith_model)).eval()
    for prompt, completion, logprobs in tokens[:batch]:
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
        own = logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
        assert torch.allclose(own, torch.tensor(logprobs), atol=1e-4), (own, logprobs)


def test_the_verifiers_recipe_trains_meshrls_taskset_by_its_id(tmp_path: Path, arith_model: Path) -> None:
    """recipes/agent_verifiers.py, two small steps, nothing on PYTHONPATH but the repository: rollout
    and the agents service both resolve the taskset `meshrl-vf-sums` by its id; rollout feeds its rows
    less the 20 held out; the renderer's tokenizer is the policy's (the recipe names none); every
    episode is played and scored by verifiers."""
    from meshrl.tasks import arith

    run_dir = tmp_path / "run"
    r = run(
        tmp_path,
        f"*.model={arith_model}",
        "total_steps=2",
        *SMALL,
        f"run_dir={run_dir}",
        recipe=AGENT_VERIFIERS,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    done = counts(run_dir)
    assert done.get("failed", 0) == 0 and done["finished"] >= 2 * 16 and done["turns"] == done["finished"], (
        done
    )
    assert [list(row) for row in rows(run_dir / "rewards.jsonl")][-1][-1] == "reward/env_correct"
    log = "".join(p.read_text() for p in (run_dir / "logs").glob("agents-*.log"))
    assert f"renderer matched '{arith_model}'" in log  # the policy's path (it follows *.model), not "policy"
    held_out = {f"<|user|>{row['prompt']}<|assistant|>" for row in arith.split()[1]}
    trained = {s["prompt"] for s in rows(run_dir / "samples.jsonl")}
    assert trained and not trained & held_out, trained


WITHOUT_VERIFIERS = """
import importlib.util, sys
found = importlib.util.find_spec
importlib.util.find_spec = lambda name, package=None: None if name == "verifiers" else found(name, package)
from meshrl.planning import prepare
from meshrl.planning.config import RecipeError
try:
    prepare(sys.argv[1], [f"*.model={sys.argv[2]}"])
except RecipeError as e:
    print(e)
"""


def test_a_verifiers_recipe_without_verifiers_says_what_to_install(tiny_model: Path) -> None:
    """Planning recipes/agent_verifiers.py where verifiers is not installed (as find_spec reports it)
    refuses it at start-up, for the dataset and for the agents, naming the extra to install."""
    r = subprocess.run([sys.executable, "-c", WITHOUT_VERIFIERS, AGENT_VERIFIERS, str(tiny_model)], cwd=REPO,
                       capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert (
        "dataset: 'verifiers:meshrl-vf-sums' needs verifiers 0.4.0: pip install 'meshrl[verifiers]'"
        in r.stdout
    )
    assert "agents'].config.verifiers: verifiers environments need verifiers 0.4.0: pip install" in r.stdout
    assert r.stdout.count("meshrl[verifiers]") == 2


def test_a_killed_agents_service_loses_and_repeats_no_episode(tmp_path: Path, arith_model: Path) -> None:
    """verifiers episodes with the agents service SIGKILLed twice at seeded random moments: it restarts
    alone each time, the episodes it was playing run again from their start (under new sessions), and
    every task is trained once, as one sample."""
    steps, run_dir = 5, tmp_path / "run"
    proc = start(tmp_path, f"*.model={arith_model}", f"total_steps={steps}", *SMALL, f"run_dir={run_dir}",
                 "agents.restart.mode=on-failure", "agents.restart.max_restarts=2", "agents.restart.backoff_s=0.2",
                 recipe=AGENT_VERIFIERS)  # fmt: skip
    kill_repeatedly(proc, run_dir, "agents", random.Random(11), range(1, steps - 1), 2, within_s=0.3)
    proc.wait(timeout=600)
    assert proc.returncode == 0, (tmp_path / "run.log").read_text()[-4000:]
    assert [r["group"] for r in rows(run_dir / "restarts.jsonl")] == ["agents"] * 2
    tally = account(run_dir / "ledger.jsonl")
    assert (tally.consumed, tally.pending, tally.duplicated) == (steps * 16, 0, 0), tally


def test_meshrl_eval_plays_the_verifiers_recipe(tmp_path: Path, arith_model: Path) -> None:
    """`meshrl eval` plays the taskset's held-out tasks as verifiers episodes against the endpoint served
    by its own engine: the warm model answers the sums it was taught about as often greedy as the demo
    measures, the reward's part is verifiers' `correct`, and the same command gives the same figures."""

    def meshrl_eval() -> dict:
        r = subprocess.run([sys.executable, "-m", "meshrl.cli", "eval", AGENT_VERIFIERS, "--model", str(arith_model),
                            "rollout.eval_samples=1"], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                           env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    result = meshrl_eval()
    assert result["agent"] == "verifiers:meshrl-vf-sums" and result["prompts"] == 20, result
    assert result["greedy/failed"] == result["sampled/failed"] == 0 and result["greedy/turns_mean"] == 1, (
        result
    )
    assert (
        0 <= result["greedy/env_correct"] <= 1 and result["greedy_reward"] == result["greedy/env_correct"]
    ), result
    again = meshrl_eval()
    assert same_report(again, result)
