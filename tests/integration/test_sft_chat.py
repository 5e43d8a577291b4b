"""`meshrl sft --data chats.jsonl`: supervised fine-tuning on chat data, for real, on the tiny model.

Measured (200 conversations "a+b=" -> "a+b" with a, b in 0-9, 10% held out, 150 steps of 32 at lr 3e-3,
one thread): held-out loss 3.94 -> 0.41; greedy accuracy over all 100 sums 0% (base) -> 92%. The run
takes about 9 s on two CPU cores (13 s with the start of the process). The assertions leave a wide
margin: held-out loss below a quarter of where it started, accuracy at least 50 points above the
base model's.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from meshrl.cli import main as cli
from meshrl.commands.chat_data import DataError, chat_tokens, conversation, encode, to_batch
from meshrl.engines.settings import LoraConfig, OptimConfig

REPO = Path(__file__).resolve().parents[2]
SUMS = [(a, b) for a in range(10) for b in range(10)]


def chats(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"messages": [{"role": "user", "content": f"{a}+{b}="},
                                  {"role": "assistant", "content": str(a + b)}]})  # fmt: skip
    return rows


def write(path: Path, rows: list[object] | list[str]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def accuracy(model_dir: Path) -> float:
    """Greedy accuracy of the chat model in `model_dir` on every sum of two digits."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{a}+{b}="}], tokenize=False, add_generation_prompt=True
        )
        for a, b in SUMS
    ]
    answers = greedy(model, tokenizer, prompts, max_new_tokens=3)
    return sum(answer == str(a + b) for answer, (a, b) in zip(answers, SUMS, strict=True)) / len(SUMS)


def greedy(model: object, tokenizer: object, prompts: list[str], max_new_tokens: int) -> list[str]:
    """Greedy completions of `prompts` (left-padded together), cut at EOS."""
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)  # type: ignore[operator]
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False,  # type: ignore[attr-defined]
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)  # type: ignore[attr-defined]  # fmt: skip
    new = out[:, batch["input_ids"].shape[1] :]
    return [
        tokenizer.decode(row).split(tokenizer.eos_token)[0].replace(tokenizer.pad_token, "") for row in new
    ]  # type: ignore[attr-defined]


# --- the loss mask -------------------------------------------------------------------------------------


def test_mask_covers_exactly_the_assistant_tokens(tiny_model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    row = {"messages": [
        {"role": "system", "content": "add."},
        {"role": "user", "content": "3+4="},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "and 9+3="},
        {"role": "assistant", "content": "12"},
    ]}  # fmt: skip
    ids, mask = chat_tokens(tokenizer, conversation(row, "row 1"))
    assert tokenizer.decode(ids) == "add. <|user|>3+4=<|assistant|>7<eos><|user|>and 9+3=<|assistant|>12<eos>"
    assert len(mask) == len(ids)
    # runs of masked tokens, in order: each assistant message's content and end of turn, no header
    runs, current = [], []
    for token, m in zip(ids, mask, strict=True):
        if m:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    runs += [tokenizer.decode(current)] if current else []
    assert runs == ["7<eos>", "12<eos>"]

    # the engine's batch: the masked positions are exactly those that predict the assistant's tokens
    batch = to_batch([encode(tokenizer, conversation(row, "row 1"), 128)], tokenizer.pad_token_id)
    predicted = batch.input_ids[0, 1:][batch.mask[0]]
    assert tokenizer.decode(predicted) == "7<eos>12<eos>"


def test_mask_survives_truncation_and_refuses_rewriting_templates(tiny_model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    chat = conversation(chats(1)[0], "row 1")
    cut = encode(tokenizer, chat, 6)  # "<|user|>a+b=<|assistant|>" is 6 tokens: the answer is cut off
    assert cut.truncated and len(cut.ids) == 6 and sum(cut.mask) == 0
    # a template that renders a past assistant turn differently from the last one
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}"
        "{% elif loop.last %}<|assistant|>{{ m['content'] }}<eos>{% else %}<|assistant|><eos>{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    two = {"messages": [*chats(1)[0]["messages"], *chats(1, seed=1)[0]["messages"]]}
    with pytest.raises(DataError, match="row 7: the chat template renders"):
        chat_tokens(tokenizer, conversation(two, "row 7"))


# --- the command ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_sft_on_chats_learns_and_saves_a_model(tiny_model: Path, tmp_path: Path) -> None:
    data = write(tmp_path / "chats.jsonl", chats(200))
    out = tmp_path / "sft"
    args = ["--model", str(tiny_model), "--data", str(data), "--out", str(out), "--steps", "150",
            "--batch", "32", "optim.lr=3e-3", "--eval-fraction", "0.1", "--eval-every", "50", "--threads", "1"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "meshrl.cli", "sft", *args], env=env, capture_output=True,
                       text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["steps"] == 150 and result["sequences"] == 180 and result["held_out_sequences"] == 20
    assert result["truncated"] == 0 and result["nan_skipped"] == 0
    before, after = result["held_out_loss_before"], result["held_out_loss_after"]
    assert before > 3.0 and after < before / 4, result  # measured 3.94 -> 0.41
    assert result["train_loss_last"] < result["train_loss_first"] / 4
    progress = [line for line in r.stderr.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in progress] == ["0/150", "50/150", "100/150", "150/150"]
    assert "tokens/s" in progress[-1]

    torch.set_num_threads(1)
    base, trained = accuracy(tiny_model), accuracy(out)  # measured 0.0 -> 0.92
    assert trained >= base + 0.5, (base, trained)
    assert (out / "tokenizer.json").is_file()
    assert (
        AutoTokenizer.from_pretrained(out).chat_template
        == AutoTokenizer.from_pretrained(tiny_model).chat_template
    )


# --- bad input -----------------------------------------------------------------------------------------


def run_cli(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as exit_:
        cli(["sft", *argv])
    return int(exit_.value.code or 0)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('{"messages": [{"role": "user", "content": "1+1="}', "line 3: not JSON"),
        ('{"messages": [{"role": "user", "content": "1+1="}]}', "line 3: no assistant message"),
        ('{"prompt": "1+1="}', "line 3: no 'messages' list"),
        ('{"prompt": "1+1=", "completion": 2}', "line 3: 'prompt' and 'completion' must both be text or both"),
        ('{"prompt": "1+1=", "completion": ""}', "line 3: an empty 'completion'"),
        ('{"messages": [{"role": "tool", "content": "2"}, {"role": "assistant", "content": "2"}]}',
         "line 3: the chat template cannot render it"),
    ],
)  # fmt: skip
def test_bad_rows_are_errors_naming_the_line(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], line: str, expected: str
) -> None:
    rows = chats(2)
    data = write(tmp_path / "bad.jsonl", [rows[0], rows[1], line])
    assert run_cli(["--model", str(tiny_model), "--data", str(data), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "meshrl sft: error:" in err and expected in err, err
    assert not (tmp_path / "o").exists()


def test_missing_model_and_bad_settings_are_errors(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = write(tmp_path / "chats.jsonl", chats(4))
    missing = tmp_path / "no-model"
    assert run_cli(["--model", str(missing), "--data", str(data), "--out", str(tmp_path / "o")]) == 2
    assert f"--model: no such path: '{missing}'" in capsys.readouterr().err
    argv = ["--model", str(tiny_model), "--data", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "o")]
    assert run_cli(argv) == 2
    assert "none.jsonl: no such file or directory" in capsys.readouterr().err
    argv = ["--model", str(tiny_model), "--data", str(data), "--out", "o", "--batch", "0", "--eval-fraction", "1"]  # fmt: skip
    assert run_cli(argv) == 2
    err = capsys.readouterr().err
    assert "error: --batch: must be >= 1\nmeshrl sft: error: --eval-fraction: must be in [0, 1)" in err


def test_lora_and_packing_reach_the_engine(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sections set on the command line are what the engine is built with and trains by: adapters of
    lora.rank (saved with the merged model), micro-batches packed by memory.max_tokens_per_micro_batch."""
    from meshrl.commands import sft
    from meshrl.engines import fsdp

    engines, packed = [], []
    build, pack = sft.build_engine, fsdp.token_micro_batches
    monkeypatch.setattr(sft, "build_engine", lambda *a: engines.append(build(*a)) or engines[-1])
    monkeypatch.setattr(fsdp, "token_micro_batches", lambda *a: packed.append(a[1]) or pack(*a))
    data, out = write(tmp_path / "chats.jsonl", chats(16)), tmp_path / "lora"
    argv = ["--model", str(tiny_model), "--data", str(data), "--out", str(out), "--steps", "2", "--batch", "8",
            "--eval-fraction", "0", "optim.lr=1e-3", "lora.rank=4", "lora.alpha=8",
            "memory.max_tokens_per_micro_batch=64", "optim.schedule=constant"]  # fmt: skip
    threads = torch.get_num_threads()
    try:
        result = sft.train(sft.load(argv))
    finally:
        torch.set_num_threads(threads)
    (engine,) = engines
    assert engine.lora == LoraConfig(rank=4, alpha=8.0, save_merged=True)
    assert engine.memory.max_tokens_per_micro_batch == 64 and engine.memory.precision == "fp32"
    assert engine.optim_cfg == OptimConfig(lr=1e-3, schedule="constant", warmup_steps=1)  # 3% of 2 steps
    assert packed and set(packed) == {64}
    assert result is not None and result["model"] == str(out / "merged") and result["steps"] == 2
    assert (out / "adapter_config.json").is_file() and (out / "merged" / "config.json").is_file()
