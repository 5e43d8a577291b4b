"""Agent programs trained through the agents service's endpoint (real processes, CPU, the tiny model): the
`openai` client drives the endpoint; a session's calls become one sample (joined, or split into
segments); programs that fail are counted and never trained; a killed agents replica loses and repeats
nothing; `meshrl eval` plays a program recipe; the logs hold no line per request."""

from __future__ import annotations

import ast
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from meshrl.dataplane.ledger import account, records
from tests.integration.fault.test_kill import kill_repeatedly, start
from tests.integration.grpo.test_grpo import REPO, rows, run

RECIPE = str(REPO / "recipes" / "agent_program.py")
SMALL = ["prompts_per_step=4", "group_size=4", "rollout.eval_every=0"]
PROGRAMS = "tests.integration.agents.programs"


def counts(run_dir: Path, what: str = "agents") -> dict:
    """The counts the agents service logs at its end: of trajectories (`agents: {...}`) or of its
    endpoint's calls (`calls {...}`), summed over its processes (a restarted one logs its own)."""
    text = "".join(p.read_text() for p in (run_dir / "logs").glob("agents-*.log"))
    found = re.findall(r"agents: (\{.*?\}); \d+ trajectories.*?; calls (\{.*?\})", text)
    assert found, text[-2000:]
    total: dict = {}
    for line in found:
        for k, v in ast.literal_eval(line[0 if what == "agents" else 1]).items():
            total[k] = total.get(k, 0) + v
    return total


def endpoint_url(run_dir: Path, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for log in (run_dir / "logs").glob("agents-*.log"):
            m = re.search(r"serving (http://\S+/v1)", log.read_text())
            if m:
                return m.group(1)
        time.sleep(0.1)
    raise AssertionError("the endpoint never said where it serves")


def calls_put_and_deleted(run_dir: Path) -> tuple[int, int]:
    put = deleted = 0
    for r in records(run_dir / "ledger.jsonl", "calls"):
        put += r["n"] if r["op"] == "put" else 0
        deleted += len(r["ids"]) if r["op"] == "del" else 0
    return put, deleted


def same_report(a: dict, b: dict) -> bool:
    """Two `meshrl eval` reports agree on every figure but the time taken (evaluation is seeded)."""
    return {k: v for k, v in a.items() if k != "generate_s"} == {
        k: v for k, v in b.items() if k != "generate_s"
    }


def test_the_openai_client_drives_the_endpoint(tmp_path: Path, arith_model: Path) -> None:
    """Chat (plain and streamed), the token route and the model list through the `openai` package; bad
    requests get OpenAI-style 4xx errors and write no row."""
    run_dir, release = tmp_path / "run", tmp_path / "release"
    args = {"release": str(release)}
    proc = start(tmp_path, f"*.model={arith_model}", "total_steps=1", *SMALL, f"run_dir={run_dir}",
                 f"agents.program={PROGRAMS}:hold", f"agents.args={json.dumps(args)}", recipe=RECIPE)  # fmt: skip
    try:
        url = endpoint_url(run_dir)
        client = openai.OpenAI(base_url=url, api_key="unused-on-loopback", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["policy"]
        hi = [{"role": "user", "content": "3+4="}]
        answer = client.chat.completions.create(model="policy", messages=hi, max_tokens=3, seed=1)
        choice = answer.choices[0]
        assert choice.finish_reason in ("stop", "length") and answer.usage.completion_tokens <= 3
        extra = answer.model_extra
        assert len(choice.model_extra["token_ids"]) == answer.usage.completion_tokens
        assert len(extra["meshrl"]["completion_logprobs"]) == answer.usage.completion_tokens
        assert extra["meshrl"]["weight_version"] == [0, 0] and extra["prompt_token_ids"]
        again = client.chat.completions.create(model="policy", messages=hi, max_tokens=3, seed=1)
        assert again.choices[0].message.content == choice.message.content  # the caller's seed decides
        first_ids = extra["prompt_token_ids"]
        chunks = list(client.chat.completions.create(model="policy", messages=hi, max_tokens=3, stream=True,
                                                     stream_options={"include_usage": True}))  # fmt: skip
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[-1].usage is not None and [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        assert isinstance(text, str)
        tokens = httpx.post(f"{url.removesuffix('/v1')}/inference/v1/generate",
                            json={"model": "policy", "token_ids": first_ids, "sampling_params": {"max_tokens": 2}})  # fmt: skip
        assert tokens.status_code == 200 and len(tokens.json()["choices"][0]["token_ids"]) <= 2
        good = 4
        # bad input: 4xx with an OpenAI error body, and nothing written
        with pytest.raises(openai.NotFoundError, match="not served here"):
            client.chat.completions.create(model="gpt-4", messages=hi)
        with pytest.raises(openai.BadRequestError, match="unsupported field"):
            client.chat.completions.create(model="policy", messages=hi, extra_body={"beam_width": 4})
        with pytest.raises(openai.BadRequestError, match="n must be 1"):
            client.chat.completions.create(model="policy", messages=hi, n=2)
        with pytest.raises(openai.BadRequestError, match="at most"):
            client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "1" * 5000}])
        broken = httpx.post(
            f"{url}/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
        )
        assert broken.status_code == 400 and "not JSON" in broken.json()["error"]["message"]
        bad = 5
        release.touch()  # the programs go on; the run ends
        assert proc.wait(timeout=300) == 0, (tmp_path / "run.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    served = counts(run_dir, "calls")
    assert served["http_400"] + served["http_404"] == bad
    put, deleted = calls_put_and_deleted(run_dir)
    programs = counts(run_dir)["turns"]
    assert put == good + programs == served["answered"], (put, good, programs, served)
    assert (
        deleted == put
    )  # every call row is gone at the end: the test's (nobody's session) and the programs'
    log = "".join(p.read_text() for p in (run_dir / "logs").glob("*.log"))
    # no line per request in any service's log (httpx's client lines, uvicorn's access lines): counts only
    assert "HTTP Request:" not in log and "HTTP/1.1" not in log


@pytest.mark.parametrize(
    ("program", "args", "splits"),
    [("meshrl.tasks.arith.agent:solve", {"turns": 2}, False), ("meshrl.tasks.arith.agent:solve",
     {"turns": 2, "rewrite": True}, True), (f"{PROGRAMS}:plain", {}, False), (f"{PROGRAMS}:own_client", {}, False)],
    ids=["joined", "segments", "plain-function", "own-client"],
)  # fmt: skip
def test_every_task_trains_once_as_one_sample(
    tmp_path: Path, arith_model: Path, program, args, splits
) -> None:
    steps, run_dir = 3, tmp_path / "run"
    r = run(tmp_path, f"*.model={arith_model}", f"total_steps={steps}", *SMALL, f"run_dir={run_dir}",
            f"agents.program={program}", f"agents.args={json.dumps(args)}", recipe=RECIPE)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    batch = 4 * 4
    tally = account(run_dir / "ledger.jsonl")
    assert (tally.consumed, tally.pending, tally.duplicated) == (steps * batch, 0, 0), tally
    done = counts(run_dir)
    turns = args.get("turns", 1)
    assert done.get("failed", 0) == 0 and done["turns"] >= turns * steps * batch
    assert (done.get("splits", 0) > 0) == splits, done
    put, deleted = calls_put_and_deleted(run_dir)
    assert deleted == put
    metrics = rows(run_dir / "metrics.jsonl")  # the agent figures, per step
    assert all(
        m["agent/turns_mean"] == turns and m["agent/truncated_turns"] == m["agent/truncated_tokens"] == 0
        for m in metrics
    ), metrics[0]
    assert all((m["agent/sequences_mean"] > 1) == splits for m in metrics), metrics[0]
    # the figures every kind of agent has: a program's tool calls are those the endpoint parsed (none here),
    # its time in the environment its own time
    assert all(m["agent/tool_calls_mean"] == 0 and m["agent/env_s_mean"] > 0 for m in metrics), metrics[0]
    # the trained completions hold both calls' answers where the calls joined or split
    samples = rows(run_dir / "samples.jsonl")
    if turns == 2:
        assert all("<|user|>" in s["completion"] for s in samples), samples[:2]


def test_failing_programs_are_counted_and_never_trained(tmp_path: Path, arith_model: Path) -> None:
    steps, run_dir = 3, tmp_path / "run"
    r = run(tmp_path, f"*.model={arith_model}", f"total_steps={steps}", "prompts_per_step=8", "group_size=4",
            "rollout.eval_every=0", f"run_dir={run_dir}", f"agents.program={PROGRAMS}:flaky", "agents.timeout_s=10",
            "rollout.max_failed_fraction=0.5", recipe=RECIPE)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    done = counts(run_dir)
    assert done["failed"] > 0 and done["finished"] >= steps * 32, done
    log = "".join(p.read_text() for p in (run_dir / "logs").glob("agents-*.log"))
    assert "the agent broke on" in log and "timed out after 10s" in log and "not 'not a reward'" in log
    assert done["failed_raised"] and done["failed_timeout"] and done["failed_bad_reward"], done


def test_trajectories_failed_ahead_of_their_weights_do_not_stall_the_step_before(
    tmp_path: Path, arith_model: Path
) -> None:
    """The second step's programs fail at once, before the weights they were fed for exist, while the
    first step's are still running: rollout scores those failed groups without waiting for that
    version's gate (which the first step's scoring must come first for), and the run finishes."""
    run_dir = tmp_path / "run"
    r = run(tmp_path, f"*.model={arith_model}", "total_steps=2", *SMALL, f"run_dir={run_dir}",
            f"agents.program={PROGRAMS}:fails_ahead", "rollout.max_failed_fraction=1.0", recipe=RECIPE,
            timeout=240)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    done = counts(run_dir)
    assert done["failed"] == 16 and done["finished"] == 32, done
    assert [m["step"] for m in rows(run_dir / "metrics.jsonl")] == [0, 1]


def test_a_killed_agents_service_loses_and_repeats_nothing(tmp_path: Path, arith_model: Path) -> None:
    """SIGKILLed three times at seeded random moments, the agents service restarts alone each time: the
    programs it ran start again under new sessions (the answers to their old calls are dropped as they
    arrive), so every task ends as exactly one sample, trained once, and every call row is deleted."""
    steps, run_dir = 8, tmp_path / "run"
    proc = start(tmp_path, f"*.model={arith_model}", f"total_steps={steps}", *SMALL, f"run_dir={run_dir}",
                 'agents.args={"turns": 2}', "agents.restart.mode=on-failure", "agents.restart.max_restarts=3",
                 "agents.restart.backoff_s=0.2", recipe=RECIPE)  # fmt: skip
    kill_repeatedly(proc, run_dir, "agents", random.Random(7), range(1, steps - 1), 3, within_s=0.3)
    proc.wait(timeout=600)
    assert proc.returncode == 0, (tmp_path / "run.log").read_text()[-4000:]
    assert [m["step"] for m in rows(run_dir / "metrics.jsonl")] == list(range(steps))
    assert [r["group"] for r in rows(run_dir / "restarts.jsonl")] == ["agents"] * 3
    tally = account(run_dir / "ledger.jsonl")
    assert (tally.consumed, tally.pending, tally.duplicated) == (steps * 16, 0, 0), tally
    put, deleted = calls_put_and_deleted(run_dir)
    assert deleted == put


def test_meshrl_eval_plays_a_program_recipe(tmp_path: Path, arith_model: Path) -> None:
    """`meshrl eval` runs the recipe's program on each held-out row against the endpoint served by its own
    engine, greedy and sampled as a run's evaluation; the same command gives the same figures."""

    def meshrl_eval() -> dict:
        r = subprocess.run([sys.executable, "-m", "meshrl.cli", "eval", RECIPE, "--model", str(arith_model),
                            "rollout.eval_samples=2", 'agents.args={"turns": 2}'], cwd=tmp_path, capture_output=True,
                           text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    result = meshrl_eval()
    assert result["agent"] == "meshrl.tasks.arith.agent:solve" and result["prompts"] == 20
    for label in ("greedy", "sampled"):
        assert result[f"{label}/failed"] == 0 and result[f"{label}/turns_mean"] == 2, result
    assert (
        0 <= result["greedy/env_correct"] <= 1 and result["greedy_reward"] == result["greedy/env_correct"]
    ), result
    again = meshrl_eval()
    assert same_report(again, result)
