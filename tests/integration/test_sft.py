"""The arithmetic demo's warm start, for real: `meshrl sft` on prompt/completion rows of the task's train
split (meshrl/commands/demo.py `warm_start`), from a fresh tiny model.

Measured at the demo's settings (52 steps of 40, lr 3e-3) over batch-order seeds 0-4: greedy accuracy
on the 80 train problems 0% -> 50-69%, on the 20 held-out ones 0% -> 15-40%; it takes about 2 s. The
warm start is imperfect on purpose (RL needs room to improve), so the test bounds it on both sides,
with a wide margin.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from meshrl.commands.chat_data import completion_tokens, encode, read_rows, to_batch
from meshrl.commands.demo import SFT_STEPS, warm_start
from meshrl.models.tiny import build_tiny_model
from meshrl.tasks import arith
from tests.integration.test_sft_chat import greedy, run_cli


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("sft") / "tiny")


def accuracy(model_dir: Path, rows: list[dict]) -> float:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    answers = greedy(model, tokenizer, [r["prompt"] for r in rows], max_new_tokens=4)
    return sum(arith.correct(a, r) for a, r in zip(answers, rows, strict=True)) / len(rows)


def test_the_loss_covers_the_completion_and_eos(fresh: Path, tmp_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(fresh)
    rows = [{"prompt": "9+8=", "answer": "17"}, {"prompt": "1+2=", "answer": "3"}]
    data = tmp_path / "demos.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in arith.demonstrations(rows)))
    read = read_rows(str(data))
    ids, mask = completion_tokens(tokenizer, read[0])  # type: ignore[arg-type]
    assert tokenizer.decode(ids) == "9+8=17<eos>" and mask == [0, 0, 0, 0, 1, 1, 1]
    batch = to_batch([encode(tokenizer, r, 128) for r in read], tokenizer.pad_token_id)
    assert [tokenizer.decode(batch.input_ids[i, 1:][batch.mask[i]]) for i in range(2)] == [
        "17<eos>",
        "3<eos>",
    ]


@pytest.mark.slow
def test_the_demo_warm_start_learns_part_of_the_task(fresh: Path, tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    result = warm_start(fresh, tmp_path / "arith-sft")
    assert torch.get_num_threads() == threads  # the caller's threads are left alone
    assert result["steps"] == SFT_STEPS and result["sequences"] == 80 and result["nan_skipped"] == 0
    assert result["train_loss_last"] < result["train_loss_first"] / 4, result
    assert (tmp_path / "arith-sft.jsonl").read_text().count("\n") == 80
    train, held_out = arith.split()
    assert accuracy(fresh, train) <= 0.1
    after = accuracy(tmp_path / "arith-sft", train)
    assert 0.3 <= after <= 0.9, after  # measured 0.50-0.69: right in form, often wrong
    assert accuracy(tmp_path / "arith-sft", held_out) > 0.0
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "arith-sft")
    text = "<|user|>0123456789 abcdefghijklmnopqrstuvwxyz +-*/=()?.,:<|assistant|>"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text


def test_sft_needs_data(fresh: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["--model", str(fresh), "--out", str(tmp_path / "o")]) == 2
    assert "--data" in capsys.readouterr().err
