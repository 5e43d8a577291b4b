"""The arithmetic task: its 100 problems, the fixed train/eval split, and the reward's edge cases."""

from __future__ import annotations

import pytest

from meshrl.tasks.arith import all_problems, correct, reward, split

ROW: dict = {"prompt": "3+4=", "answer": "7", "a": 3, "b": 4}
ROW_TWO_DIGITS: dict = {"prompt": "9+8=", "answer": "17", "a": 9, "b": 8}


def test_all_problems() -> None:
    rows = all_problems()
    assert len(rows) == 100
    assert rows[0] == {"prompt": "0+0=", "answer": "0", "a": 0, "b": 0}
    assert rows[-1] == {"prompt": "9+9=", "answer": "18", "a": 9, "b": 9}
    for r in rows:
        assert r["prompt"] == f"{r['a']}+{r['b']}="
        assert int(r["answer"]) == r["a"] + r["b"]
    assert len({r["prompt"] for r in rows}) == 100


@pytest.mark.parametrize("completion", ["7", "7<eos>", "7 ", "7.", "7+1", "7\n", "7abc"])
def test_right_answers(completion: str) -> None:
    assert correct(completion, ROW)
    assert reward(ROW["prompt"], completion, ROW) == 1.0


@pytest.mark.parametrize("completion", ["71", " 7", "", "07", "6", "77", "x7", "<eos>7", "7\u0663"])
def test_wrong_answers(completion: str) -> None:
    assert not correct(completion, ROW)
    assert reward(ROW["prompt"], completion, ROW) == 0.0


@pytest.mark.parametrize(
    ("completion", "right"),
    [("17", True), ("17<eos>", True), ("1", False), ("170", False), ("1 7", False), ("18", False)],
)
def test_two_digit_answers(completion: str, right: bool) -> None:
    assert correct(completion, ROW_TWO_DIGITS) is right
    assert reward(ROW_TWO_DIGITS["prompt"], completion, ROW_TWO_DIGITS) == float(right)


def test_zero_answer() -> None:
    row = {"prompt": "0+0=", "answer": "0", "a": 0, "b": 0}
    assert correct("0", row)
    assert not correct("00", row)
    assert not correct("10", row)


def test_split_is_deterministic_disjoint_and_complete() -> None:
    train, evaluation = split()
    assert split() == (train, evaluation)
    assert (len(train), len(evaluation)) == (80, 20)
    prompts_train = {r["prompt"] for r in train}
    prompts_eval = {r["prompt"] for r in evaluation}
    assert not prompts_train & prompts_eval
    assert prompts_train | prompts_eval == {r["prompt"] for r in all_problems()}


def test_split_depends_on_seed_and_size() -> None:
    assert split(seed=1) != split(seed=0)
    assert split(seed=1) == split(seed=1)
    train, evaluation = split(seed=3, eval_size=30)
    assert (len(train), len(evaluation)) == (70, 30)
    assert split(eval_size=0) == (all_problems(), [])


def test_split_rejects_bad_size() -> None:
    with pytest.raises(ValueError, match="eval_size"):
        split(eval_size=101)
    with pytest.raises(ValueError, match="eval_size"):
        split(eval_size=-1)
