"""verifiers v1 environments as agent programs (meshrl/envs/programs.py): each task is one verifiers
episode, played through the agents service's endpoint and trained as one sample under its reward.

    AgentsConfig(model=MODEL, verifiers="my-taskset",          # the taskset id (`--env.taskset.id`)
                 args={"agent": {"runtime": {"type": "subprocess"}}, "taskset": {"task": {...}}})

is `program="meshrl.envs.verifiers:run_episode"` with `args={"environment": "my-taskset",
"environment_args": {...}}`, the form that also takes `tokenizer` and `sampling`. v1 names an
environment by config: an `EnvConfig` whose `taskset.id` is an installed module exporting a `Taskset`
(and maybe its own `Harness` and `Env`), plus the agent seats (harness, runtime, limits) and knobs, as
the `[env]` block of a verifiers run writes them. The seats default to verifiers' (a Prime sandbox
runtime, the taskset's harness, else `bash`): set what the agents service's hosts can run.

The rows are the taskset's tasks in their wire form (`task.data.model_dump()`; `rollout.dataset=
"verifiers:<id>"` writes them: `taskset_rows`), each validated into the taskset's `TaskData`. The
episode runs with verifiers' training client, which renders messages with the policy's tokenizer
(`tokenizer`, else `run.tokenizer`: it follows `*.model`) and posts token ids to the session's
`/inference/v1/generate`, so the tokens trained are those inference generated. Sampling is the run's
unless `sampling` sets some (the client ignores what a harness's request asks for). Rewards: every
trace's named rewards, prefixed by the agent's name when there are several agents; every agent's calls
are trained, untrainable seats included. An episode that ends with an error fails its trajectory with
verifiers' reason. Each episode gets its own interception server bound to its session, so
`Env.serving()` is not entered: environments that need it (taskset toolsets, `Env.start()`) are refused.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from meshrl.envs.programs import AgentRun

if importlib.util.find_spec("verifiers") is None:  # a recipe naming this program fails at planning, saying so
    raise ImportError("verifiers environments need verifiers 0.4.0: pip install 'meshrl[verifiers]'")

KEY_VAR = "MESHRL_API_KEY"
"""Where the endpoint's key is put for verifiers' client, which reads its key from a variable (never
from its config, which traces record); "API_KEY" in the name keeps it from local harness processes."""

_envs: dict[str, asyncio.Future[Any]] = {}
"""Loaded environments by config (programs run many at once on one event loop: one load each)."""


async def run_episode(
    run: AgentRun,
    environment: str,
    environment_args: dict[str, Any] | None = None,
    tokenizer: str | None = None,
    sampling: dict[str, Any] | None = None,
) -> dict[str, float]:
    """One verifiers episode of `run.task`; its rewards (named parts).

    `environment`: the taskset id; `environment_args`: the rest of the env config (module docstring).
    `tokenizer`: the policy's tokenizer (name or path) for verifiers' renderer; None: the policy's
    local path (`run.tokenizer`). `sampling`: sampling knobs sent with every call
    (`max_tokens`, `temperature`, ...)."""
    from verifiers.v1 import ModelContext, SamplingConfig, TrainClientConfig

    env = await _environment(environment, environment_args or {})
    task_cls = type(env.taskset).task_type()
    task = task_cls(task_cls.data_type().model_validate(run.task), env.config.taskset.task)
    os.environ[KEY_VAR] = run.api_key
    client = TrainClientConfig(
        base_url=run.base_url,  # /v1 kept: it asks <base>/models, and posts to <base less /v1>/inference/...
        api_key_var=KEY_VAR,
        renderer_model_name=tokenizer or run.tokenizer or run.model,
    )
    ctx = ModelContext(model=run.model, client=client, sampling=SamplingConfig(**(sampling or {})))
    episode = await env.run_episode(task, ctx)
    if not episode.ok:
        raise RuntimeError(f"the episode failed: {_reason(episode)}")
    return _rewards(episode)


async def _environment(environment: str, args: dict[str, Any]) -> Any:
    """The environment for this config, loaded once per process (on a thread: the import and the
    plugins' own take a while, and the agents service's other programs go on meanwhile)."""
    key = json.dumps([environment, args], sort_keys=True)
    loading = _envs.get(key)
    if loading is None or loading.get_loop() is not asyncio.get_running_loop():
        loading = _envs[key] = asyncio.ensure_future(asyncio.to_thread(_load, environment, args))
    try:
        return await asyncio.shield(loading)
    except Exception:
        _envs.pop(key, None)  # the next program tries again (and says why again)
        raise


def taskset_rows(taskset: str, config: dict[str, Any]) -> list[dict[str, Any]]:
    """Every task of taskset `taskset` under taskset config `config` (its `TasksetConfig` fields), in
    load order, as the rows a run trains on: the wire form verifiers sends
    (`task.data.model_dump(mode="json")`, its `idx` set by position)."""
    from verifiers.v1 import load_taskset, taskset_config_type

    try:
        loaded = load_taskset(taskset_config_type(taskset).model_validate({**config, "id": taskset}))
        return [task.data.model_dump(mode="json") for task in loaded]
    except ModuleNotFoundError as e:
        raise ValueError(f"verifiers taskset {taskset!r}: {e}") from None


def _load(environment: str, args: dict[str, Any]) -> Any:
    from verifiers.v1 import Env, load_environment, resolve_env_config

    config = {**args, "taskset": {**args.get("taskset", {}), "id": environment}}
    env = load_environment(resolve_env_config(config))
    if env.taskset.toolsets(env.taskset.config) or type(env).start is not Env.start:
        raise ValueError(
            f"environment {environment!r} shares servers across episodes (taskset toolsets or "
            "Env.start), which needs Env.serving(): not supported by meshrl.envs.verifiers"
        )
    return env


def _reason(episode: Any) -> str:
    errors = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
    if errors:
        e = errors[-1]
        return f"{e.type}: {e.message}"
    stops = [t.stop_condition for t in episode.traces if not t.ok]
    return f"a trace ended without success ({stops})"


def _rewards(episode: Any) -> dict[str, float]:
    """Every trace's named rewards; agents' names prefix them when the episode has several agents."""
    several = len({t.agent.name for t in episode.traces}) > 1
    parts: dict[str, float] = {}
    for trace in episode.traces:
        for name, reward in trace.rewards.items():
            if reward is None:
                raise RuntimeError(f"the episode's reward {name!r} was never scored")
            key = f"{trace.agent.name}/{name}" if several else name
            parts[key] = parts.get(key, 0.0) + reward.value
    if not parts:
        raise RuntimeError("the episode recorded no reward")
    return parts
