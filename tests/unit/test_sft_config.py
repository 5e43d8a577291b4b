"""`meshrl sft`'s command line (meshrl/commands/sft_config.py): its own flags, and the trainer's sections
as `section.field=value`, parsed by the override parser and checked once, by the sections themselves;
every problem listed, naming its flag or field (exit 2); the flags of earlier versions answered with
what replaced them."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshrl.commands.sft import engine_settings, main
from meshrl.commands.sft_config import SettingsError, SftSettings, load
from meshrl.engines.settings import LoraConfig, MemoryConfig, OptimConfig


def argv(model: Path, *more: str) -> list[str]:
    return ["--model", str(model), "--data", "rows.jsonl", "--out", "out", *more]


def errors(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return [line.removeprefix("meshrl sft: error: ") for line in capsys.readouterr().err.splitlines()]


def test_section_fields_are_set_by_key_value_and_flags_are_sfts_own(tmp_path: Path) -> None:
    config = load(argv(tmp_path, "optim.lr=3e-3", "optim.warmup_steps=20", "--steps", "300",
                       "optim.schedule=linear", "memory.precision=bf16-mixed", "--batch", "16",
                       "memory.max_tokens_per_micro_batch=4096", "lora.rank=8", "lora.target_modules=q_proj,v_proj"))  # fmt: skip
    assert config.settings.optim == OptimConfig(lr=3e-3, warmup_steps=20, schedule="linear")
    assert config.settings.memory == MemoryConfig(
        micro_batch=8, precision="bf16-mixed", max_tokens_per_micro_batch=4096
    )
    assert config.settings.lora == LoraConfig(rank=8, target_modules=("q_proj", "v_proj"), save_merged=True)
    assert (config.steps, config.batch, config.model) == (300, 16, str(tmp_path))
    assert "optim.warmup_steps" in config.given and "memory.precision" in config.given


def test_sfts_defaults_and_what_the_run_decides_when_unset(tmp_path: Path) -> None:
    config = load(argv(tmp_path))
    assert config.settings == SftSettings()
    assert config.settings.optim == OptimConfig(lr=2e-5, schedule="cosine")
    assert config.settings.memory.micro_batch == 8 and config.settings.lora.rank == 0
    on_cpu = engine_settings(config, 100, gpu=False)
    assert on_cpu.optim.warmup_steps == 3 and on_cpu.memory.precision == "fp32"  # 3% of the steps
    assert engine_settings(config, 100, gpu=True).memory.precision == "bf16-mixed"
    given = load(argv(tmp_path, "optim.warmup_steps=0", "memory.precision=fp32"))
    assert engine_settings(given, 100, gpu=True) == given.settings


def test_bad_values_are_refused_together_each_naming_its_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = ["optim.lr=-1", "memory.precision=fp16", "lora.rank=x", "lora.dropout=1", "optim.nope=1",
           "--batch", "0", "memory.micro_batch=0"]  # fmt: skip
    assert main(argv(tmp_path, *bad)) == 2
    assert errors(capsys) == [
        "override 'optim.lr=-1': lr: must be > 0, got -1.0",
        "override 'memory.precision=fp16': 'fp16' is not one of 'fp32', 'bf16-mixed'",
        "override 'lora.rank=x': 'x' is not an integer",
        "override 'lora.dropout=1': dropout: must be in [0, 1), got 1.0",
        "override 'optim.nope=1': OptimConfig has no field 'nope' (choose from lr, schedule, warmup_steps, "
        "weight_decay, betas, grad_clip)",
        "override 'memory.micro_batch=0': micro_batch: must be >= 1, got 0",
        "--batch: must be >= 1",
    ]
    with pytest.raises(SettingsError, match="--model: no such path"):
        load(argv(tmp_path / "none"))


def test_old_flags_say_what_replaced_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = ["--lr", "3e-3", "--warmup=20", "--schedule", "linear", "--weight-decay", "0.1", "--micro-batch", "4",
           "--pack-tokens", "512", "--precision", "bf16-mixed", "--activation-checkpointing", "--lora-rank", "8"]  # fmt: skip
    assert main(argv(tmp_path, *old)) == 2
    assert errors(capsys) == [
        "--lr has moved: write optim.lr=3e-3",
        "--warmup has moved: write optim.warmup_steps=20",
        "--schedule has moved: write optim.schedule=linear",
        "--weight-decay has moved: write optim.weight_decay=0.1",
        "--micro-batch has moved: write memory.micro_batch=4",
        "--pack-tokens has moved: write memory.max_tokens_per_micro_batch=512",
        "--precision has moved: write memory.precision=bf16-mixed",
        "--activation-checkpointing has moved: write memory.activation_checkpointing=true",
        "--lora-rank has moved: write lora.rank=8",
    ]
    assert main(argv(tmp_path, "--precision", "auto", "lr=3e-3", "trainer.optim.lr=3e-3")) == 2
    assert errors(capsys) == [
        "--precision has moved: leave memory.precision unset (bf16-mixed on a GPU, fp32 on CPU)",
        "override 'lr=3e-3': lr has moved: set optim.lr",
        "override 'trainer.optim.lr=3e-3': trainer has moved: set the section's field without 'trainer.' "
        "(optim.lr=...)",
    ]
