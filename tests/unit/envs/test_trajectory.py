"""A trajectory's model calls as one sample: joined where each call extends the last, segments where the
history was rewritten (meshrl/envs/trajectory.py); the one reward rule; programs' loading."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from meshrl.envs.base import EnvError, reward_parts
from meshrl.envs.programs import load_program
from meshrl.envs.trajectory import Call, Trajectory, join
from meshrl.schema import SEGMENTS


def test_calls_that_extend_each_other_join_one_sequence() -> None:
    first = Call(prompt=[1, 2], completion=[3, 4], logprobs=[-0.1, -0.2], version=3)
    # the next prompt: everything so far, then the tool's result (masked), then the model's next turn
    second = Call(prompt=[1, 2, 3, 4, 9, 9], completion=[5], logprobs=[-0.5], version=4)
    t = join([first, second])
    assert t.ids[: t.prompt_len] == [1, 2] and t.ids[t.prompt_len :] == [3, 4, 9, 9, 5]
    assert t.mask == [1, 1, 0, 0, 1]
    assert t.logprobs == [-0.1, -0.2, 0.0, 0.0, -0.5]
    assert t.versions == [3, 3, -1, -1, 4]
    assert t.segments == [7] and t.splits == 0 and t.calls == 2
    assert t.version_range == (3, 4)


def test_a_rewritten_history_starts_a_segment_of_its_own() -> None:
    first = Call(prompt=[1, 2], completion=[3], logprobs=[-0.1], version=0)
    edited = Call(prompt=[1, 2, 8], completion=[5, 6], logprobs=[-0.5, -0.6], version=0)  # 3 became 8
    after = Call(prompt=[1, 2, 8, 5, 6, 7], completion=[4], logprobs=[-0.4], version=1)
    t = join([first, edited, after])
    assert t.splits == 1
    # segment 1: [1, 2] + [3]; segment 2: the edited prompt (masked) + its completion, then the third call
    assert t.segments == [3, 7] and sum(t.segments) == len(t.ids)
    assert t.ids[t.prompt_len :] == [3, 1, 2, 8, 5, 6, 7, 4]
    assert t.mask == [1, 0, 0, 0, 1, 1, 0, 1]
    assert t.tail == [1, 2, 8, 5, 6, 7, 4]


def test_a_trajectory_without_an_answer_still_has_a_row() -> None:
    assert Trajectory().sample(stop=9)[SEGMENTS] == [
        2
    ]  # the stop as its prompt and one masked response token
    with pytest.raises(ValueError, match="log-probs"):
        join([Call(prompt=[1], completion=[2, 3], logprobs=[-1.0], version=0)])


@pytest.mark.parametrize(
    ("value", "parts"),
    [
        (1, {"reward": 1.0}),
        (0.5, {"reward": 0.5}),
        (True, {"reward": 1.0}),  # a check that returns a bool counts as 0 or 1
        (np.float32(0.25), {"reward": 0.25}),
        (torch.tensor(2.0), {"reward": 2.0}),
        ({"correct": 1, "format": 0.5, "done": False}, {"correct": 1.0, "format": 0.5, "done": 0.0}),
    ],
)
def test_the_reward_rule_takes_numbers_and_named_numbers(value: object, parts: dict[str, float]) -> None:
    assert reward_parts(value) == parts


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (None, "must be a number or a dict of named numbers, not None"),
        ("1", "not '1'"),
        ([1.0], r"not \[1.0\]"),
        ({}, "empty dict"),
        ({"a": "x"}, "a dict of named numbers"),
        ({1: 1.0}, "a dict of named numbers"),
        (math.nan, "reward part 'reward' is nan"),
        ({"ok": 1.0, "bad": math.inf}, "reward part 'bad' is inf"),
        (-math.inf, "is -inf"),
        (torch.tensor([1.0, 2.0]), "a number or a dict"),
    ],
)
def test_the_reward_rule_refuses_everything_else_by_name(value: object, why: str) -> None:
    with pytest.raises(EnvError, match=why):
        reward_parts(value)


def test_programs_are_loaded_with_clear_errors() -> None:
    assert callable(load_program("meshrl.tasks.arith.agent:solve"))
    with pytest.raises(ValueError, match="must look like"):
        load_program("meshrl.tasks.arith.agent")
    with pytest.raises(ValueError, match="cannot import"):
        load_program("no_such_module_here:run")
    with pytest.raises(ValueError, match="has no function"):
        load_program("meshrl.tasks.arith.agent:nope")
