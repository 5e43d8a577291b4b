"""Dataset rows that do not parse are skipped and reported; a file without the prompt field is an error."""

from __future__ import annotations

import json

import pytest

from meshrl.roles.rollout.config import RolloutConfig
from meshrl.roles.rollout.service import load_rows


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
    train, _ = load_rows(RolloutConfig(model=".", dataset=str(path)), bad)
    assert [r["prompt"] for r in train] == ["1+1=", "3+3="]
    assert len(bad) == 3
    assert "line 2: not JSON" in bad[0] and "line 3: a list, not an object" in bad[1]
    assert "row 4: no text in field 'prompt'" in bad[2]


def test_a_file_without_the_prompt_field_is_an_error_naming_it(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"question": "1+1="}) + "\n")
    with pytest.raises(ValueError, match="rows have no field 'prompt'.*set rollout.prompt_field"):
        load_rows(RolloutConfig(model=".", dataset=str(path)))
