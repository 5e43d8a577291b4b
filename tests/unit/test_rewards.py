"""Reward functions TRL's way: weighted, batched or per sample, sync or async, None and failures."""

from __future__ import annotations

import asyncio
import math
import threading
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


def test_eval_summary_counts_accuracy_by_the_correctness_check_alone():
    """A format bonus raises the reward, never the accuracy: accuracy is the share of completions the
    correctness function accepts; pass@k counts prompts with a correct sampled completion."""
    results = [
        (True, 1.2, 0, {"exact": 1.0, "fmt": 1.0}), (False, 0.2, 0, {"exact": 0.0, "fmt": 1.0}),
        (False, 1.2, 0, {"exact": 1.0, "fmt": 1.0}),
        (True, 0.2, 1, {"exact": 0.0, "fmt": 1.0}), (False, 0.2, 1, {"exact": 0.0, "fmt": 1.0}),
        (False, 0.0, 1, {"exact": 0.0, "fmt": 0.0}),
    ]  # fmt: skip
    s = summarize(results, "exact")
    assert s == pytest.approx({
        "prompts": 2, "greedy_accuracy": 0.5, "sampled_accuracy": 0.25, "greedy_reward": 0.7,
        "sampled_reward": 0.4, "pass@2": 0.5, "reward/exact": 0.5, "reward/fmt": 1.0,
        "sampled_answers": 4, "sampled_stderr": (0.25 * 0.75 / 4) ** 0.5,
    })  # fmt: skip
    # the same completions with every answer formatted and none right: the reward grows, accuracy is 0
    formatted = [(g, 0.2, p, {"exact": 0.0, "fmt": 1.0}) for g, _, p, _ in results]
    s = summarize(formatted, "exact")
    assert (s["greedy_accuracy"], s["sampled_accuracy"], s["pass@2"]) == (0.0, 0.0, 0.0)
    assert s["greedy_reward"] == pytest.approx(0.2)
    assert "greedy_accuracy" not in summarize(results)  # no correctness check: rewards only


def blocking(prompt, completion, row):
    """Synchronous and slow (a judge over a blocking client, math-verify on a long answer)."""
    time.sleep(0.3)
    return 1.0


def never_returns(prompt, completion, row):
    time.sleep(30)


async def ticking(seconds: float) -> int:
    """How many 10 ms ticks the event loop gives a task in `seconds`."""
    n, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        await asyncio.sleep(0.01)
        n += 1
    return n


def test_synchronous_rewards_run_off_the_event_loop_concurrently():
    functions = [rewards.RewardFunction("blocking", blocking, 1.0, False, "tests.unit.test_rewards:blocking")]

    async def go():
        workers = rewards.Workers(threads=4, timeout_s=10)
        t0 = time.monotonic()
        scored, ticks = await asyncio.gather(
            rewards.score(functions, ["p"] * 4, ["c"] * 4, [{}] * 4, workers=workers), ticking(0.3)
        )
        workers.close()
        return scored, ticks, time.monotonic() - t0

    scored, ticks, elapsed = asyncio.run(go())
    assert scored.total.tolist() == [1.0] * 4 and scored.valid.all()
    assert elapsed < 0.9, elapsed  # 4 x 0.3 s on 4 threads, not one after another
    assert ticks >= 10, ticks  # the loop kept turning meanwhile


def test_a_reward_past_its_time_limit_fails_its_sample_with_the_reason():
    functions = [
        rewards.RewardFunction(
            "never_returns", never_returns, 1.0, False, "tests.unit.test_rewards:never_returns"
        ),
        rewards.RewardFunction("blocking", blocking, 0.5, False, "tests.unit.test_rewards:blocking"),
    ]

    async def go():
        workers = rewards.Workers(threads=4, timeout_s=0.5)
        t0 = time.monotonic()
        scored = await rewards.score(functions, ["p"], ["c"], [{}], workers=workers)
        workers.close()
        return scored, time.monotonic() - t0

    scored, elapsed = asyncio.run(go())
    assert elapsed < 2 and not scored.valid[0]
    assert "never_returns took longer than reward_timeout_s=0.5s" in str(scored.failure)
    assert scored.applied["blocking"] == {0: 1.0}  # the other function still scored the sample


RELEASE = threading.Event()


def hangs_on_third(prompt, completion, row):
    """Scores 1, but on the sample whose completion is "hang" waits until the test releases it."""
    if completion == "hang":
        RELEASE.wait(30)
    return 1.0


def test_a_per_sample_reward_past_its_limit_fails_that_sample_and_the_others_go_on():
    """A per-sample function runs a run of samples per thread, one after another: the call past its
    limit fails with the reason, and the samples after it in its run are still scored."""
    functions = [rewards.RewardFunction("hangs_on_third", hangs_on_third, 1.0, False, "")]
    completions = ["a", "b", "hang", "c", "d", "e", "f", "g"]

    async def go():
        workers = rewards.Workers(threads=2, timeout_s=0.5)
        t0 = time.monotonic()
        scored = await rewards.score(functions, ["p"] * 8, completions, [{}] * 8, workers=workers)
        elapsed = time.monotonic() - t0
        RELEASE.set()  # the abandoned call returns now; its value is thrown away
        workers.close()
        return scored, elapsed

    scored, elapsed = asyncio.run(go())
    assert scored.valid.tolist() == [True, True, False, True, True, True, True, True]
    assert scored.total.tolist() == [1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert "hangs_on_third took longer than reward_timeout_s=0.5s" in str(scored.failure)
    assert elapsed < 2, elapsed


def test_functions_that_ask_run_in_worker_processes_and_a_stuck_one_is_replaced():
    import os

    specs = {"tests.unit.reward_helpers:worker_pid": 1.0, "tests.unit.reward_helpers:raises": 0.0}
    stuck = rewards.load({"tests.unit.reward_helpers:hangs_on_stop": 1.0})

    async def go():
        workers = rewards.Workers(threads=2, timeout_s=3)
        first = await rewards.score(rewards.load(specs), ["p"] * 2, ["a", "b"], [{}, {}], workers=workers)
        workers.timeout_s = 1.0
        hung = await rewards.score(stuck, ["p"] * 2, ["stop", "x"], [{}, {}], workers=workers)
        after = await rewards.score(stuck, ["p"], ["x"], [{}], workers=workers)
        workers.close()
        return first, hung, after

    first, hung, after = asyncio.run(go())
    pids = set(first.applied["worker_pid"].values())
    assert pids and os.getpid() not in pids  # ran in a process of its own
    assert not first.valid.any() and "cannot score 'a'" in str(first.failure)  # its error came back
    assert not hung.valid.any() and "hangs_on_stop took longer than reward_timeout_s=1s" in str(hung.failure)
    assert after.valid.all() and after.total.tolist() == [1.0]  # a fresh worker took the next call
