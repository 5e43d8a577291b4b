"""`meshrl eval`: held-out evaluation of a model, or of a run's final checkpoint, outside a run.

    meshrl eval recipes/grpo_smollm.py                          # the recipe's model on its eval set
    meshrl eval recipes/grpo_smollm.py --model runs/grpo_smollm/final rollout.eval_samples=8

It measures what a run's evaluation measures, with the same pieces: rollout's dataset loading, prompt
encoding and reward functions (`roles/rollout/`), the inference engine the recipe names, built the way
the inference service builds it, greedy and `rollout.eval_samples` sampled completions per prompt at
the recipe's temperature with the seeds of a run's version-0 evaluation, and evaluation's `summarize`.
It prints one JSON object: greedy / sampled reward (the mean reward trained on), greedy / sampled
accuracy and pass@k (by the recipe's correctness check, `rollout.correctness`), each reward function's
mean, timing.

With an environment service in the recipe (an agent trained through `meshrl.envs`), each held-out row
is played as the run plays it: the environment the recipe builds (its `environment_args` and limits),
the chat template and tool-call parser of the env group, turns generated greedy and sampled until the
trajectory ends. It reports the environment's reward (greedy / sampled), each named part of it
(`greedy/env_<part>`, `sampled/env_<part>`: a part named "correct" is the accuracy), turns, tool calls
and tool errors per trajectory, and truncations. Agent programs (the endpoint) are not evaluated here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from meshrl.planning.config import RecipeError
from meshrl.schema import EVAL_VERSION, GREEDY, MEMBER, PROMPT_ID


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="meshrl eval", description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe", help="recipe file: its rollout and inference settings are used")
    ap.add_argument("--model", help="model to evaluate (a path, hub id, or a run directory: its final/)")
    ap.add_argument("--out", help="also write the JSON object to this file")
    ap.add_argument("overrides", nargs="*", help="key=value, e.g. rollout.eval_dataset=test.jsonl")
    args = ap.parse_intermixed_args(argv)
    overrides = list(args.overrides)
    if args.model:
        final = Path(args.model) / "final"
        overrides.append(f"*.model={final if final.is_dir() else args.model}")
    try:
        rollout, inference, recipe = _configs(args.recipe, overrides)
    except RecipeError as e:
        print(f"meshrl eval: {e}", file=sys.stderr)
        return 2
    env = next((g.config for g in recipe.groups if type(g.config).__name__ == "EnvConfig"), None)
    result = (
        evaluate(rollout, inference, recipe) if env is None else evaluate_env(rollout, inference, env, recipe)
    )
    text = json.dumps(result)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


def _configs(path: str, overrides: list[str]) -> tuple[Any, Any, Any]:
    from meshrl.planning import prepare
    from meshrl.roles.inference.config import InferenceConfig
    from meshrl.roles.rollout.config import RolloutConfig

    recipe, _ = prepare(path, overrides)
    rollout = next((g.config for g in recipe.groups if isinstance(g.config, RolloutConfig)), None)
    inference = next((g.config for g in recipe.groups if isinstance(g.config, InferenceConfig)), None)
    if rollout is None or inference is None:
        raise RecipeError(["meshrl eval needs a recipe with a rollout and an inference group"])
    if any(type(g.config).__name__ == "AgentsConfig" for g in recipe.groups):
        raise RecipeError(["meshrl eval does not run agent programs (an agents group): they call a run's "
                           "endpoint; follow them by the run's reward (rewards.jsonl), or point the program "
                           "at any OpenAI-compatible server"])  # fmt: skip
    return rollout, inference, recipe


def evaluate(rollout: Any, inference: Any, recipe: Any) -> dict[str, Any]:
    """The evaluation of `inference.model` on rollout's held-out rows (see the module docstring)."""
    import torch
    from transformers import AutoTokenizer

    from meshrl.dataplane import Batch, Ragged
    from meshrl.roles.inference.engine import build_engine
    from meshrl.roles.rollout import reward_functions
    from meshrl.roles.rollout.data import encode, load_rows
    from meshrl.roles.rollout.evaluation import results, summarize
    from meshrl.roles.rollout.scoring import Rewards
    from meshrl.schema import EVAL, RESPONSE

    _, rows = load_rows(rollout)
    if not rows:
        raise SystemExit("meshrl eval: no held-out rows: set rollout.eval_dataset (and rollout.eval_split)")
    if inference.threads:
        torch.set_num_threads(inference.threads)
    tokenizer = AutoTokenizer.from_pretrained(rollout.model)
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    engine = build_engine(inference, device=device, seed=recipe.seed, work_dir=None)
    t0 = time.perf_counter()
    prompts = [encode(tokenizer, rollout, r).tolist() for r in rows]
    meta: list[dict[str, Any]] = [{GREEDY: k == 0, PROMPT_ID: i, MEMBER: k, EVAL_VERSION: 0}
            for i in range(len(rows)) for k in range(1 + rollout.eval_samples)]  # fmt: skip
    completions = generate(engine, inference, recipe, prompts, meta)
    gen_s = time.perf_counter() - t0
    batch = Batch(EVAL, "eval", 0, np.arange(len(meta)), [*meta], {RESPONSE: Ragged.from_list(completions)})
    workers = reward_functions.Workers(rollout.reward_threads, rollout.reward_timeout_s)
    rewards = Rewards(tokenizer, reward_functions.load(rollout.functions), rollout.prompt_field, workers)
    try:
        summary = summarize(asyncio.run(results(rewards, batch, rows)), rollout.correctness_name)
    finally:
        rewards.close()
    return {"model": inference.model, "dataset": rollout.eval_dataset or rollout.dataset, **summary,
            "engine": inference.engine, "generate_s": round(gen_s, 3)}  # fmt: skip


def generate(
    engine: Any, inference: Any, recipe: Any, prompts: list[list[int]], meta: list[dict[str, Any]]
) -> list[list[int]]:
    """One completion per meta row (greedy or sampled), in batches of `inference.max_batch`, seeded as
    the inference service seeds evaluation rows."""

    out: list[list[int]] = [[] for _ in meta]
    for greedy in (False, True):
        todo = [j for j, m in enumerate(meta) if m[GREEDY] == greedy]
        params = _sampling(inference, recipe, greedy)
        for start in range(0, len(todo), inference.max_batch):
            part = todo[start : start + inference.max_batch]
            seeds = [_seed(recipe, meta[j][PROMPT_ID], meta[j][MEMBER]) for j in part]
            done = engine.generate([prompts[meta[j][PROMPT_ID]] for j in part], params, seeds=seeds)
            for j, c in zip(part, done, strict=True):
                out[j] = c.tokens
    return out


def _sampling(inference: Any, recipe: Any, greedy: bool) -> Any:
    """The sampling parameters of an evaluation's greedy or sampled completions."""
    from meshrl.engines.base import SamplingParams

    return SamplingParams(
        temperature=0.0 if greedy else recipe.temperature, top_k=inference.top_k, top_p=inference.top_p,
        max_new_tokens=inference.max_new_tokens,
    )  # fmt: skip


def _seed(recipe: Any, prompt: int, member: int) -> int:
    """The seed the inference service gives member `member` of held-out prompt `prompt` (version 0)."""
    from meshrl.roles.inference.engine import row_seed

    return row_seed(recipe.seed, (1, 0, prompt), member) * 4099 % 2**63


def evaluate_env(rollout: Any, inference: Any, env_cfg: Any, recipe: Any) -> dict[str, Any]:
    """Held-out trajectories of the recipe's environment, greedy and sampled (see the module docstring)."""
    import importlib
    import math

    import torch
    from transformers import AutoTokenizer

    from meshrl.envs.episode import Outcome, advance, start
    from meshrl.envs.parsers import build_parser
    from meshrl.envs.render import Renderer
    from meshrl.roles.inference.engine import build_engine
    from meshrl.roles.rollout.data import load_rows

    _, rows = load_rows(rollout)
    if not rows:
        raise SystemExit("meshrl eval: no held-out rows: set rollout.eval_dataset (and rollout.eval_split)")
    if inference.threads:
        torch.set_num_threads(inference.threads)
    module, _, name = env_cfg.environment.partition(":")
    env = getattr(importlib.import_module(module), name)(**env_cfg.environment_args)
    env.limits = env_cfg.limits(inference.max_new_tokens)
    tokenizer = AutoTokenizer.from_pretrained(env_cfg.model)
    renderer = Renderer(tokenizer, env.tools, tool_role=env_cfg.tool_role)
    parser = build_parser(env_cfg.parser, [t.name for t in env.tools])
    engine = build_engine(inference, device="cuda:0" if torch.cuda.is_available() else "cpu",
                          seed=recipe.seed, work_dir=None)  # fmt: skip
    members = [(i, k) for i in range(len(rows)) for k in range(1 + rollout.eval_samples)]

    async def play() -> list[Outcome]:
        outs = list(await asyncio.gather(*(start(env, renderer, rows[i]) for i, _ in members)))
        while todo := [j for j, o in enumerate(outs) if not o.done]:
            for greedy in (False, True):
                part = [j for j in todo if (members[j][1] == 0) == greedy]
                params = _sampling(inference, recipe, greedy)
                for b in range(0, len(part), inference.max_batch):
                    some = part[b : b + inference.max_batch]
                    seeds = [(_seed(recipe, *members[j]) + outs[j].trajectory.turns) % 2**63 for j in some]
                    done = engine.generate([outs[j].trajectory.ids for j in some], params, seeds=seeds)
                    turns = [advance(env, renderer, parser, outs[j], c.tokens, c.logprobs, 0)
                             for j, c in zip(some, done, strict=True)]  # fmt: skip
                    for j, o in zip(some, await asyncio.gather(*turns), strict=True):
                        outs[j] = o
        return outs

    t0 = time.perf_counter()
    outs = asyncio.run(play())
    gen_s = time.perf_counter() - t0
    result: dict[str, Any] = {"model": inference.model, "dataset": rollout.eval_dataset or rollout.dataset,
                              "environment": env_cfg.environment, "prompts": len(rows)}  # fmt: skip
    for label, greedy in (("greedy", True), ("sampled", False)):
        mine = [o for (_, k), o in zip(members, outs, strict=True) if (k == 0) == greedy]
        if not mine:
            continue
        ok = [o for o in mine if not math.isnan(o.reward)]
        result[f"{label}_reward"] = round(sum(o.reward for o in ok) / max(len(ok), 1), 4)
        for part in sorted({p for o in ok for p in o.rewards} - {"reward"}):  # "reward": one unnamed number
            result[f"{label}/env_{part}"] = round(
                sum(o.rewards.get(part, 0.0) for o in ok) / max(len(ok), 1), 4
            )
        calls = sum(o.tool_calls for o in mine)
        errors = sum(sum(o.tool_errors.values()) for o in mine)
        result[f"{label}/turns_mean"] = round(sum(o.trajectory.turns for o in mine) / len(mine), 3)
        result[f"{label}/tool_calls_mean"] = round(calls / len(mine), 3)
        result[f"{label}/tool_success"] = round((calls - errors) / calls, 4) if calls else None
        result[f"{label}/truncated"] = sum(o.truncated is not None for o in mine)
        result[f"{label}/failed"] = len(mine) - len(ok)
    return {**result, "engine": inference.engine, "generate_s": round(gen_s, 3)}
