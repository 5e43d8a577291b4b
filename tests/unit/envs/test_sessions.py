"""A session's model calls as one sample: joined where each call extends the last, segments where the
agent rewrote its history (meshrl/envs/sessions.py); session tokens; programs' return values."""

from __future__ import annotations

import pytest

from meshrl.envs.programs import load_program, reward_parts
from meshrl.envs.sessions import Record, join, parse_token, session_token


def test_calls_that_extend_each_other_join_one_sequence() -> None:
    first = Record(prompt=[1, 2], completion=[3, 4], logprobs=[-0.1, -0.2], version=3)
    # the next prompt: everything so far, then the tool's result (masked), then the model's next turn
    second = Record(prompt=[1, 2, 3, 4, 9, 9], completion=[5], logprobs=[-0.5], version=4)
    j = join([first, second])
    assert j.prompt == [1, 2]
    assert j.response == [3, 4, 9, 9, 5]
    assert j.loss_mask == [1, 1, 0, 0, 1]
    assert j.logprobs == [-0.1, -0.2, 0.0, 0.0, -0.5]
    assert j.versions == [3, 3, -1, -1, 4]
    assert j.segments == [7] and j.splits == 0
    assert j.version_range == (3, 4)


def test_a_rewritten_history_starts_a_segment_of_its_own() -> None:
    first = Record(prompt=[1, 2], completion=[3], logprobs=[-0.1], version=0)
    edited = Record(prompt=[1, 2, 8], completion=[5, 6], logprobs=[-0.5, -0.6], version=0)  # 3 became 8
    after = Record(prompt=[1, 2, 8, 5, 6, 7], completion=[4], logprobs=[-0.4], version=1)
    j = join([first, edited, after])
    assert j.splits == 1
    # segment 1: [1, 2] + [3]; segment 2: the edited prompt (masked) + its completion, then the third call
    assert j.segments == [3, 7]
    assert sum(j.segments) == len(j.prompt) + len(j.response)
    assert j.response == [3, 1, 2, 8, 5, 6, 7, 4]
    assert j.loss_mask == [1, 0, 0, 0, 1, 1, 0, 1]


def test_bad_records_are_refused() -> None:
    with pytest.raises(ValueError, match="without model calls"):
        join([])
    with pytest.raises(ValueError, match="log-probs"):
        join([Record(prompt=[1], completion=[2, 3], logprobs=[-1.0], version=0)])


def test_session_tokens_round_trip() -> None:
    token = session_token("agents-1", "ab12.40", 7)
    assert parse_token(token) == ("agents-1", 7)
    assert parse_token("my-own-session") == (None, 0)


def test_reward_parts() -> None:
    assert reward_parts(1) == {"reward": 1.0}
    assert reward_parts({"correct": 1.0, "format": 0.5}) == {"correct": 1.0, "format": 0.5}
    for bad in (None, True, "1", {}, {"a": "x"}, [1.0]):
        with pytest.raises(TypeError, match="number or a dict of numbers"):
            reward_parts(bad)


def test_programs_are_loaded_with_clear_errors() -> None:
    assert callable(load_program("meshrl.tasks.arith.agent:solve"))
    with pytest.raises(ValueError, match="must look like"):
        load_program("meshrl.tasks.arith.agent")
    with pytest.raises(ValueError, match="cannot import"):
        load_program("no_such_module_here:run")
    with pytest.raises(ValueError, match="has no function"):
        load_program("meshrl.tasks.arith.agent:nope")
