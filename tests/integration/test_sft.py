"""Supervised warm start on arithmetic, for real: a short run from a fresh tiny model must learn.

Measured at these settings (100 steps, defaults otherwise) over model/batch seeds 0-4: greedy train
accuracy 0% before and 74-96% after; loss from 3.9 to 0.26-0.47. The assertions leave a wide margin
for seed and platform noise. The run takes about 6 s on two CPU cores.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from meshrl.models.tiny import build_tiny_model
from meshrl.tasks.arith import split
from meshrl.tasks.arith.sft import SFTConfig, collate, encode_example, evaluate, main, train

STEPS = 100


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("sft") / "tiny")


@pytest.fixture(scope="module")
def trained(fresh: Path) -> tuple[SFTConfig, dict, list[dict]]:
    cfg = SFTConfig(model=str(fresh), out=str(fresh.parent / "sft"), steps=STEPS, eval_every=50)
    logged: list[dict] = []
    return cfg, train(cfg, log=logged.append), logged


@pytest.mark.slow
def test_short_sft_learns_the_task(trained: tuple[SFTConfig, dict, list[dict]]) -> None:
    cfg, result, logged = trained
    assert result["train_greedy_before"] <= 0.1
    assert result["eval_greedy_before"] <= 0.1
    assert result["train_greedy_after"] >= 0.5
    assert result["train_greedy_after"] - result["train_greedy_before"] >= 0.4
    assert result["loss_last"] < result["loss_first"] / 4
    assert [row["step"] for row in logged] == [50, 100]
    assert logged[-1]["train_greedy"] == result["train_greedy_after"]
    assert logged[0]["lr"] > logged[-1]["lr"] and logged[-1]["lr"] < cfg.lr / 100  # cosine decay


@pytest.mark.slow
def test_saved_checkpoint_reloads(trained: tuple[SFTConfig, dict, list[dict]]) -> None:
    cfg, result, _ = trained
    model = AutoModelForCausalLM.from_pretrained(cfg.out)
    tokenizer = AutoTokenizer.from_pretrained(cfg.out)
    train_rows, _ = split()
    assert evaluate(model, tokenizer, train_rows) == pytest.approx(result["train_greedy_after"])
    text = "<|user|>0123456789 abcdefghijklmnopqrstuvwxyz +-*/=()?.,:<|assistant|>"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text


def test_sampled_evaluation_is_seeded(fresh: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(fresh)
    tokenizer = AutoTokenizer.from_pretrained(fresh)
    rows = split()[1][:5]
    model.train()
    first = evaluate(model, tokenizer, rows, greedy=False, samples=3, seed=5, chat_template=True)
    assert evaluate(model, tokenizer, rows, greedy=False, samples=3, seed=5, chat_template=True) == first
    assert model.training  # the mode it had before is restored
    assert 0.0 <= first <= 1.0


def test_loss_covers_only_the_answer_and_eos(fresh: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(fresh)
    row = {"prompt": "9+8=", "answer": "17", "a": 9, "b": 8}
    short = {"prompt": "1+2=", "answer": "3", "a": 1, "b": 2}
    examples = [encode_example(tokenizer, r, chat_template=False) for r in (row, short)]
    batch = collate(examples, tokenizer.pad_token_id)
    assert tokenizer.decode(batch["input_ids"][0]) == "9+8=17<eos>"
    assert tokenizer.decode(batch["input_ids"][1]) == "1+2=3<eos><pad>"
    assert batch["attention_mask"].tolist() == [[1] * 7, [1] * 6 + [0]]
    targets = [[t for t in labels if t != -100] for labels in batch["labels"].tolist()]
    assert [tokenizer.decode(t) for t in targets] == ["17<eos>", "3<eos>"]
    assert batch["labels"][:, :4].eq(-100).all()
    chat_prompt, _ = encode_example(tokenizer, row, chat_template=True)
    assert tokenizer.decode(chat_prompt) == "<|user|>9+8=<|assistant|>"


@pytest.mark.parametrize(
    ("field", "value"),
    [("steps", 0), ("batch_size", 0), ("lr", 0.0), ("warmup", -1), ("weight_decay", -0.1), ("eval_every", 0)],
)
def test_config_validation_names_the_field(fresh: Path, field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"SFTConfig.{field}:"):
        SFTConfig(model=str(fresh), out="x", **{field: value})  # type: ignore[arg-type]


def test_config_rejects_missing_model(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="SFTConfig.model: no such path"):
        SFTConfig(model=str(tmp_path / "nope"), out="x")


def test_command_line(fresh: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli"
    argv = ["--model", str(fresh), "--out", str(out), "--steps", "4", "--batch-size", "8", "--lr", "1e-3"]
    assert main([*argv, "--seed", "1", "--eval-every", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in lines[:2]] == [["step", "2"], ["step", "4"]]
    assert lines[-2].startswith("greedy accuracy")
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert main(["--model", str(tmp_path / "missing"), "--out", str(out)]) == 2
    assert "SFTConfig.model" in capsys.readouterr().err


def test_threads_left_alone(fresh: Path, tmp_path: Path) -> None:
    before = torch.get_num_threads()
    train(SFTConfig(model=str(fresh), out=str(tmp_path / "o"), steps=1, batch_size=2))
    assert torch.get_num_threads() == before
