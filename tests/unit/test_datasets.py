"""Dataset rows that do not parse are skipped and reported; a file without the prompt field is an error."""

from __future__ import annotations

import dataclasses
import json

import pytest

from meshrl.roles.rollout.config import RolloutConfig
from meshrl.roles.rollout.service import load_rows

ARITH = {"meshrl.tasks.arith:reward": 1.0}


def test_broken_rows_are_skipped_with_where_and_why(tmp_path):
    path = tmp_path / "train.jsonl"
    lines = [
        json.dumps({"prompt": "1+1=", "answer": 2}),
        '{"prompt": "2+2=", "answer":',  # cut off
        json.dumps(["a", "list"]),
        json.dumps({"question": "no prompt field"}),
        "",
        json.dumps({"prompt": "3+3=", "answer": 6}),
    ]
    path.write_text("\n".join(lines) + "\n")
    bad: list[str] = []
    train, _ = load_rows(RolloutConfig(model=".", rewards=ARITH, dataset=str(path)), bad)
    assert [r["prompt"] for r in train] == ["1+1=", "3+3="]
    assert len(bad) == 3
    assert "line 2: not JSON" in bad[0] and "line 3: a list, not an object" in bad[1]
    assert "row 4: no text or chat messages in field 'prompt'" in bad[2]


def test_a_file_without_the_prompt_field_is_an_error_naming_it(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"question": "1+1="}) + "\n")
    with pytest.raises(ValueError, match="rows have no field 'prompt'.*set rollout.prompt_field"):
        load_rows(RolloutConfig(model=".", rewards=ARITH, dataset=str(path)))


def test_a_dataset_directory_and_its_splits_load_through_datasets(tmp_path):
    from datasets import Dataset, DatasetDict

    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1), "level": i % 2} for i in range(6)]
    DatasetDict({"train": Dataset.from_list(rows[:4]), "test": Dataset.from_list(rows[4:])}).save_to_disk(
        tmp_path / "ds"
    )
    cfg = RolloutConfig(
        model=".", rewards=ARITH, dataset=str(tmp_path / "ds"), eval_dataset=str(tmp_path / "ds"), max_rows=3
    )
    train, held_out = load_rows(cfg)
    assert [r["prompt"] for r in train] == ["0+1=", "1+1=", "2+1="] and train[0]["level"] == 0
    assert [r["answer"] for r in held_out] == ["5", "6"]


def test_conversational_prompts_and_the_system_prompt_reach_the_chat_template(tmp_path, tiny_model):
    from transformers import AutoTokenizer

    from meshrl.roles.rollout.data import encode

    tok = AutoTokenizer.from_pretrained(tiny_model)
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"prompt": [{"role": "user", "content": "1+1="}], "answer": "2"}) + "\n")
    cfg = RolloutConfig(model=".", rewards=ARITH, dataset=str(path), system_prompt="be brief.")
    train, _ = load_rows(cfg)
    text = tok.decode(encode(tok, cfg, train[0]).ids)
    expected = tok.apply_chat_template(
        [{"role": "system", "content": "be brief."}, {"role": "user", "content": "1+1="}],
        add_generation_prompt=True, tokenize=False,
    )  # fmt: skip
    assert text == expected and "be brief." in text
    plain = RolloutConfig(model=".", rewards=ARITH, dataset=str(path), chat_template=False)
    assert "be brief." not in tok.decode(encode(tok, plain, train[0]).ids)


def test_most_prompts_too_long_stops_naming_the_setting():
    import torch

    from meshrl.roles.rollout.data import check_lengths

    rows = [{"prompt": "x"}] * 10
    with pytest.raises(
        ValueError, match=r"max_prompt_len=4: 10 of the first 10 .*raise rollout.max_prompt_len"
    ):
        check_lengths(rows, lambda r: torch.zeros(8), 4)
    check_lengths(rows, lambda r: torch.zeros(4), 4)


def test_a_reasoning_gym_task_generates_train_and_other_held_out_rows():
    cfg = RolloutConfig(
        model=".", rewards=ARITH, dataset="reasoning_gym:leg_counting", eval_dataset="reasoning_gym:leg_counting",
        dataset_kwargs={"size": 20, "seed": 3, "min_animals": 1, "max_animals": 2}, eval_size=5,
    )  # fmt: skip
    train, held_out = load_rows(cfg)
    assert len(train) == 20 and len(held_out) == 5
    assert all(r["answer"].isdigit() and "legs" in r["prompt"] for r in train + held_out)
    assert {r["prompt"] for r in held_out} != {r["prompt"] for r in train[:5]}
    assert load_rows(cfg)[0] == train  # the same seed, the same rows
    # eval_size=0: nothing held out, so a run evaluates nothing (the built-in task's split too)
    assert load_rows(dataclasses.replace(cfg, eval_size=0)) == (train, [])
    assert load_rows(RolloutConfig(model=".", rewards=ARITH, dataset="arith", eval_size=0))[1] == []


def test_dataset_settings_are_checked_all_at_once():
    from meshrl.planning.config import RecipeError

    with pytest.raises(RecipeError) as e:
        RolloutConfig(model=".", rewards=ARITH, max_rows=0, eval_size=-1, streaming=True)
    assert [p.split(":")[0] for p in e.value.problems] == ["max_rows", "eval_size"]
    with pytest.raises(RecipeError, match="streaming: needs max_rows"):
        RolloutConfig(model=".", rewards=ARITH, streaming=True)


def test_a_verifiers_taskset_is_the_rows_with_a_held_out_split_by_seed():
    """`verifiers:<taskset id>`: the taskset's tasks in verifiers' wire form, its config from
    dataset_kwargs, `eval_size` of them held out, the same ones every time (meshrl's own taskset,
    resolved by its id as verifiers resolves it: no folder on PYTHONPATH)."""
    pytest.importorskip("verifiers")
    from meshrl.tasks import arith

    cfg = RolloutConfig(model=".", rewards={"env": 1.0}, dataset="verifiers:meshrl-vf-sums", eval_size=20)
    train, held_out = load_rows(cfg)
    assert len(train) == 80 and len(held_out) == 20
    assert train[0]["prompt"] == "0+0=" and train[0]["answer"] == "0" and train[0]["idx"] == 0
    assert {"network_allow", "timeout", "system_prompt"} <= set(train[0])  # TaskData's fields, all of them
    demo_train, demo_eval = (
        arith.split()
    )  # seed 0: the demo's held-out problems, which its warm start never saw
    assert [r["prompt"] for r in held_out] == [r["prompt"] for r in demo_eval]
    assert [r["prompt"] for r in train] == [r["prompt"] for r in demo_train]
    assert load_rows(cfg) == (train, held_out)
    mixed = dataclasses.replace(cfg, dataset_kwargs={"two_digit": 50}, eval_size=None, max_rows=120)
    train, held_out = load_rows(mixed)
    assert held_out == [] and len(train) == 120 and train[-1]["idx"] == 119
    assert sum(len(r["answer"]) == 3 or r["prompt"].index("+") == 2 for r in train) >= 20  # two-digit terms


def test_a_verifiers_taskset_that_cannot_load_says_which_setting_to_change():
    pytest.importorskip("verifiers")
    cases = [
        ("verifiers:no-such-taskset", {}, None, "taskset 'no-such-taskset' not found"),
        (
            "verifiers:meshrl-vf-sums",
            {"two_digits": 5},
            None,
            r"(?s)dataset_kwargs \{'two_digits': 5\}.*two_digits.*Extra inputs",
        ),
        ("verifiers:meshrl-vf-sums", {}, 100, "rollout.eval_size=100 holds out all 100 tasks"),
    ]
    for dataset, kwargs, eval_size, message in cases:
        cfg = RolloutConfig(
            model=".", rewards={"env": 1.0}, dataset=dataset, dataset_kwargs=kwargs, eval_size=eval_size
        )
        with pytest.raises(ValueError, match=message):
            load_rows(cfg)
