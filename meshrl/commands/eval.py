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

With an agents group in the recipe (an environment, an agent program or a verifiers taskset), each
held-out row is played as the run plays it, greedy and sampled (meshrl/commands/eval_agents.py): the
reward, each named part of it (`greedy/env_<part>`: a part named "correct" is the accuracy), turns,
tool calls and the share that worked, truncations and failures per trajectory.
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
    agents = next((g.config for g in recipe.groups if type(g.config).__name__ == "AgentsConfig"), None)
    result = (
        evaluate(rollout, inference, recipe)
        if agents is None
        else evaluate_agents(rollout, inference, agents, recipe)
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
    return rollout, inference, recipe


def evaluate(rollout: Any, inference: Any, recipe: Any) -> dict[str, Any]:
    """The evaluation of `inference.model` on rollout's held-out rows (see the module docstring)."""
    import torch
    from transformers import AutoTokenizer

    from meshrl.dataplane import Batch, Ragged
    from meshrl.models import vision
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
    processor = vision.load_processor(rollout.model) if vision.is_vision(rollout.model) else None
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    engine = build_engine(inference, device=device, seed=recipe.seed, work_dir=None)
    t0 = time.perf_counter()
    encoded = [encode(processor or tokenizer, rollout, r, f"held-out row {i}") for i, r in enumerate(rows)]
    prompts = [(p.ids.tolist(), p.images) for p in encoded]
    meta: list[dict[str, Any]] = [{GREEDY: k == 0, PROMPT_ID: i, MEMBER: k, EVAL_VERSION: 0}
            for i in range(len(rows)) for k in range(1 + rollout.eval_samples)]  # fmt: skip
    completions = generate(engine, inference, recipe, prompts, meta)
    gen_s = time.perf_counter() - t0
    batch = Batch(
        EVAL,
        "eval",
        0,
        np.arange(len(meta)),
        [*meta],
        {RESPONSE: Ragged.from_list(completions, dtype=torch.int64)},
    )
    workers = reward_functions.Workers(rollout.reward_threads, rollout.reward_timeout_s)
    rewards = Rewards(tokenizer, reward_functions.load(rollout.functions), rollout.prompt_field, workers)
    try:
        summary = summarize(asyncio.run(results(rewards, batch, rows)), rollout.correctness_name)
    finally:
        rewards.close()
    return {"model": inference.model, "dataset": rollout.eval_dataset or rollout.dataset, **summary,
            "engine": inference.engine, "generate_s": round(gen_s, 3)}  # fmt: skip


def generate(
    engine: Any, inference: Any, recipe: Any, prompts: list[tuple[list[int], Any]], meta: list[dict[str, Any]]
) -> list[list[int]]:
    """One completion per meta row (greedy or sampled), in batches of `inference.max_batch`, seeded as
    the inference service seeds evaluation rows."""

    out: list[list[int]] = [[] for _ in meta]
    for greedy in (False, True):
        todo = [j for j, m in enumerate(meta) if m[GREEDY] == greedy]
        params = sampling_params(inference, recipe, greedy)
        for start in range(0, len(todo), inference.max_batch):
            part = todo[start : start + inference.max_batch]
            seeds = [seed_of(recipe, meta[j][PROMPT_ID], meta[j][MEMBER]) for j in part]
            ids, images = zip(*(prompts[meta[j][PROMPT_ID]] for j in part), strict=True)
            done = engine.generate(
                list(ids),
                params,
                seeds=seeds,
                images=None if all(i is None for i in images) else list(images),
            )
            for j, c in zip(part, done, strict=True):
                out[j] = c.tokens
    return out


def sampling_params(inference: Any, recipe: Any, greedy: bool) -> Any:
    """The sampling parameters of an evaluation's greedy or sampled completions."""
    from meshrl.engines.base import SamplingParams

    return SamplingParams(
        temperature=0.0 if greedy else recipe.temperature, top_k=inference.top_k, top_p=inference.top_p,
        max_new_tokens=inference.max_new_tokens,
    )  # fmt: skip


def seed_of(recipe: Any, prompt: int, member: int) -> int:
    """The seed the inference service gives member `member` of held-out prompt `prompt` (version 0)."""
    from meshrl.roles.inference.engine import row_seed

    return row_seed(recipe.seed, (1, 0, prompt), member) * 4099 % 2**63


def evaluate_agents(rollout: Any, inference: Any, agents: Any, recipe: Any) -> dict[str, Any]:
    """Held-out trajectories of the recipe's agents, greedy and sampled (meshrl/commands/eval_agents.py)."""
    import torch

    from meshrl.commands.eval_agents import evaluate_agents as play
    from meshrl.roles.rollout.data import load_rows

    _, rows = load_rows(rollout)
    if not rows:
        raise SystemExit("meshrl eval: no held-out rows: set rollout.eval_dataset (and rollout.eval_split)")
    if inference.threads:
        torch.set_num_threads(inference.threads)
    t0 = time.perf_counter()
    result = play(rows, agents, inference, recipe, rollout.eval_samples)
    what = agents.environment or agents.program or f"verifiers:{agents.verifiers}"
    return {"model": inference.model, "dataset": rollout.eval_dataset or rollout.dataset, "agent": what, **result,
            "engine": inference.engine, "generate_s": round(time.perf_counter() - t0, 3)}  # fmt: skip
