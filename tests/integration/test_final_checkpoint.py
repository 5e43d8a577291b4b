"""A trained checkpoint is the same kind of model the user started from: the original generation config
(several EOS ids, sampling settings) with the KV cache on, the model config with the cache on, the
tokenizer files and chat template as they were; transformers loads it and generates with a KV cache."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.integration.grpo.test_grpo import REPO, run

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="module")
def chat_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a chat model's generation config: an end-of-turn token as a second EOS id, a
    temperature, a top-p, a repetition penalty."""
    from transformers import AutoTokenizer, GenerationConfig

    from meshrl.models.tiny import USER

    out = tmp_path_factory.mktemp("models") / "chat"
    shutil.copytree(tiny_model, out)
    tok = AutoTokenizer.from_pretrained(out)
    eos, turn = tok.eos_token_id, tok.convert_tokens_to_ids(USER)
    GenerationConfig(
        bos_token_id=eos, eos_token_id=[eos, turn], pad_token_id=tok.pad_token_id, do_sample=True,
        temperature=0.7, top_p=0.9, repetition_penalty=1.05,
    ).save_pretrained(out)  # fmt: skip
    assert all((out / f).exists() for f in TOKENIZER_FILES)
    return out


def assert_same_kind(final: Path, source: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    saved, original = GenerationConfig.from_pretrained(final), GenerationConfig.from_pretrained(source)
    assert saved.use_cache is True  # whatever the original said or left unset
    for field, value in original.to_dict().items():
        if field not in ("transformers_version", "use_cache"):
            assert getattr(saved, field) == value, field
    assert saved.eos_token_id == original.eos_token_id and len(saved.eos_token_id) == 2
    assert AutoConfig.from_pretrained(final).use_cache is True
    for name in TOKENIZER_FILES:
        assert (final / name).read_bytes() == (source / name).read_bytes(), name
    model = AutoModelForCausalLM.from_pretrained(final)
    out = model.generate(
        torch.tensor([[5, 6, 7]]), max_new_tokens=3, do_sample=False, return_dict_in_generate=True
    )
    assert out.past_key_values is not None and out.sequences.shape[1] > 3


@pytest.mark.parametrize("recipe", ["grpo_arith", "grpo_arith_hybrid"])
def test_a_runs_final_checkpoint_is_the_model_it_started_from(tmp_path, chat_model, recipe):
    r = run(tmp_path, f"*.model={chat_model}", f"run_dir={tmp_path / 'run'}", "total_steps=2",
            "rollout.eval_every=0", recipe=str(REPO / "recipes" / f"{recipe}.py"))  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same_kind(tmp_path / "run" / "final", chat_model)


def test_sfts_output_is_the_model_it_started_from(tmp_path, chat_model):
    from meshrl.commands.demo import warm_start

    warm_start(chat_model, tmp_path / "sft", 2)
    assert_same_kind(tmp_path / "sft", chat_model)
