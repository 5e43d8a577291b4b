"""Reward functions TRL's way: weighted, batched or per sample, sync or async, None and failures."""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path

import pytest

from meshrl.planning.config import RecipeError
from meshrl.planning.overrides import apply_overrides
from meshrl.planning.recipe import read_recipe
from meshrl.roles.rollout import reward_functions as rewards
from meshrl.roles.rollout.config import RolloutConfig
from meshrl.roles.rollout.evaluation import summarize


def length(prompts, completions, **columns):
    """Batched (TRL's signature): gets every other column by name."""
    assert columns["answer"] == ["2", "4", None] and "prompt" not in columns
    return [float(len(c)) for c in completions]


def exact(prompt, completion, row):
    """Per sample: None where the row has no answer."""
    return None if row.get("answer") is None else float(completion == row["answer"])


async def slow_judge(prompts, completions, **columns):
    await asyncio.sleep(0.2)
    return [1.0] * len(completions)


async def slow_per_sample(prompt, completion, row):
    await asyncio.sleep(0.2)
    return 0.5


def picky(prompt, completion, row):
    if completion == "4":
        raise ValueError("cannot judge a four")
    return math.nan if completion == "x" else 1.0


def wrong_length(prompts, completions, **columns):
    return [1.0]


def fns(**weights: float) -> list[rewards.RewardFunction]:
    return rewards.load({f"tests.unit.test_rewards:{name}": w for name, w in weights.items()})


ROWS = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}, {"prompt": "?", "answer": None}]


def run(functions, completions):
    return asyncio.run(rewards.score(functions, [r["prompt"] for r in ROWS], completions, ROWS))


def test_weighted_sum_of_batched_and_per_sample_functions_with_none_left_out_of_the_mean():
    functions = fns(length=0.5, exact=2.0)
    assert [f.batched for f in functions] == [True, False]
    s = run(functions, ["2", "44", "?"])
    assert s.total.tolist() == [0.5 + 2.0, 1.0 + 0.0, 0.5]  # None adds nothing
    assert s.valid.all() and s.failure is None
    assert s.applied["exact"] == {0: 1.0, 1: 0.0}  # mean 0.5 over the two rows it applied to


def test_async_functions_run_concurrently():
    start = time.perf_counter()
    s = run(fns(slow_judge=1.0, slow_per_sample=1.0), ["a", "b", "c"])
    assert time.perf_counter() - start < 0.5  # four 0.2 s waits, overlapped
    assert s.total.tolist() == [1.5, 1.5, 1.5]


def test_a_raising_or_nan_reward_fails_only_its_sample_and_a_bad_batch_fails_all():
    s = run(fns(picky=1.0), ["2", "4", "x"])
    assert s.valid.tolist() == [True, False, False]
    assert "picky on sample 1" in s.failure and "cannot judge a four" in s.failure
    s = run(fns(wrong_length=1.0), ["2", "4", "x"])
    assert not s.valid.any() and "returned 1 values for 3 completions" in s.failure


def test_config_checks_reward_specs_and_says_where_the_old_field_moved():
    with pytest.raises(RecipeError) as e:
        RolloutConfig(model=".", rewards={"nocolon": 1.0, "a.b:f": -1, "c.d:f": 1.0})
    assert "'nocolon' must look like" in str(e.value) and "weight of 'a.b:f' must be a number >= 0" in str(
        e.value
    )
    assert "two functions named 'f'" in str(e.value)
    with pytest.raises(RecipeError, match="nothing to train on"):
        RolloutConfig(model=".", rewards={"a.b:f": 0.0})
    recipe = read_recipe(Path(__file__).parents[2] / "recipes" / "grpo_arith.py")
    _, problems = apply_overrides(recipe, ["rollout.reward=a.b:f"])
    assert problems and "reward has moved: set rewards=" in problems[0]
    r, problems = apply_overrides(recipe, ['rollout.rewards={"meshrl.rewards:math_answer": 1, "a.b:g": 0.5}'])
    assert not problems and r.group("rollout").config.rewards == {
        "meshrl.rewards:math_answer": 1,
        "a.b:g": 0.5,
    }


def test_builtin_math_answer_and_format_rewards():
    from meshrl.rewards import answer_format, math_answer

    completions = ["so \\boxed{4}", "Answer: 1/2", "<answer>12</answer> or 13", "I think 5", "x"]
    answers = ["4", "0.5", "12", "4", None]
    assert math_answer([None] * 5, completions, answer=answers) == [1.0, 1.0, 1.0, 0.0, None]
    chat = [[{"role": "assistant", "content": c}] for c in completions]
    assert answer_format([None] * 5, chat) == [1.0, 1.0, 1.0, 0.0, 0.0]


def test_eval_summary_has_accuracy_pass_at_k_and_each_function():
    results = [
        (True, 1.0, 0, {"exact": 1.0}), (False, 0.0, 0, {}), (False, 1.0, 0, {}),
        (True, 0.0, 1, {"exact": 0.0}), (False, 0.0, 1, {}), (False, 0.0, 1, {}),
    ]  # fmt: skip
    s = summarize(results)
    assert s == {
        "greedy_accuracy": 0.5,
        "sampled_accuracy": 0.25,
        "prompts": 2,
        "pass@2": 0.5,
        "reward/exact": 0.5,
    }
