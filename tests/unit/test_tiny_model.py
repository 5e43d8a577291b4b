"""The tiny model and its character tokenizer: exact round trips, the chat template, size, reloading."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from meshrl.models.tiny import CHARACTERS, build_tiny_model, build_tokenizer
from meshrl.tasks.arith import all_problems

EVERY_CLASS = "0123456789 abcdefghijklmnopqrstuvwxyz +-*/=()?.,: what is (3+4)*2? it is 14.  x:y, a/b-c "


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_vocabulary_layout(tok) -> None:
    assert len(tok) == 4 + len(CHARACTERS) == 52
    assert (tok.pad_token, tok.pad_token_id, tok.eos_token, tok.eos_token_id) == ("<pad>", 0, "<eos>", 1)
    assert tok.convert_tokens_to_ids(["<|user|>", "<|assistant|>"]) == [2, 3]
    assert ids(tok, "09az +:") == [4, 13, 14, 39, 40, 41, 51]


def test_round_trip_arithmetic(tok) -> None:
    for row in all_problems():
        text = row["prompt"] + row["answer"]
        encoded = ids(tok, text)
        assert len(encoded) == len(text)
        assert tok.decode(encoded) == text


def test_round_trip_every_character_class(tok) -> None:
    assert set(EVERY_CLASS) == set(CHARACTERS)
    encoded = ids(tok, EVERY_CLASS)
    assert len(encoded) == len(EVERY_CLASS)
    assert tok.decode(encoded) == EVERY_CLASS
    assert [tok.decode([i]) for i in encoded] == list(EVERY_CLASS)


def test_special_tokens_are_single_tokens(tok) -> None:
    text = "<|user|>1+2=<|assistant|>3<eos>"
    assert ids(tok, text) == [2, 5, 41, 6, 45, 3, 7, 1]
    assert tok.decode(ids(tok, text)) == text
    assert tok.decode(ids(tok, text), skip_special_tokens=True) == "1+2=3"


def test_unknown_characters_fall_back_to_question_mark(tok) -> None:
    q = tok.convert_tokens_to_ids("?")
    assert ids(tok, "A\né") == [q, q, q]
    assert tok.decode(ids(tok, "Hi\tthere")) == "?i?there"


def test_no_tokens_added_when_encoding(tok) -> None:
    assert tok("1+2=")["input_ids"] == ids(tok, "1+2=")


def test_chat_template(tok) -> None:
    conversation = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}]
    assert tok.apply_chat_template(conversation, tokenize=False) == "<|user|>1+2=<|assistant|>3<eos>"
    prompt = tok.apply_chat_template(conversation[:1], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|user|>1+2=<|assistant|>"
    assert tok.apply_chat_template(conversation[:1], tokenize=False) == "<|user|>1+2="
    system = [{"role": "system", "content": "be brief."}, *conversation[:1]]
    assert tok.apply_chat_template(system, tokenize=False) == "be brief. <|user|>1+2="
    with pytest.raises(Exception, match="system, user and assistant"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_model_size_and_config(built: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(built)
    n = sum(p.numel() for p in model.parameters())
    assert 600_000 < n < 1_300_000, n
    cfg = model.config
    assert (cfg.model_type, cfg.vocab_size, cfg.max_position_embeddings) == ("qwen2", 52, 128)
    assert cfg.tie_word_embeddings and model.lm_head.weight is model.get_input_embeddings().weight
    assert (cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id) == (0, 1, 1)
    gen = model.generation_config
    assert (gen.pad_token_id, gen.bos_token_id, gen.eos_token_id) == (0, 1, 1)
    assert model.dtype == torch.float32
    assert (built / "model.safetensors").is_file()


def test_reloads_with_auto_classes(built: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(built)
    tokenizer = AutoTokenizer.from_pretrained(built)
    text = "<|user|>4+5=<|assistant|>9<eos>"
    encoded = ids(tokenizer, text)
    assert encoded == ids(build_tokenizer(), text)
    assert tokenizer.decode(ids(tokenizer, EVERY_CLASS)) == EVERY_CLASS
    assert (
        tokenizer.apply_chat_template([{"role": "user", "content": "4+5="}], tokenize=False) == "<|user|>4+5="
    )
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.padding_side) == (0, 1, "left")
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([encoded])).logits
    assert logits.shape == (1, len(encoded), 52)
    assert torch.isfinite(logits).all()


def weights(path: Path) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(path).state_dict()


def test_same_seed_same_weights(tmp_path: Path, built: Path) -> None:
    again = weights(build_tiny_model(tmp_path / "again"))
    first = weights(built)
    assert first.keys() == again.keys()
    assert all(torch.equal(first[k], again[k]) for k in first)
    other = weights(build_tiny_model(tmp_path / "other", seed=1))
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


def test_leaves_caller_rng_alone(tmp_path: Path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(tmp_path / "m", seed=7)
    assert torch.equal(torch.rand(3), expected)


def test_llama_arch_and_shape_options(tmp_path: Path) -> None:
    path = build_tiny_model(
        tmp_path / "llama", arch="llama", hidden_size=64, num_layers=2, intermediate_size=128
    )
    model = AutoModelForCausalLM.from_pretrained(path)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (model.config.hidden_size, model.config.num_hidden_layers) == (64, 2)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.decode(ids(tokenizer, EVERY_CLASS)) == EVERY_CLASS
    assert ids(tokenizer, "A") == ids(tokenizer, "?")


def test_a_mixture_of_experts_arch(tiny_moe: Path) -> None:
    """arch="qwen3_moe": every layer routes each token to 2 of 4 experts; about the dense model's size,
    and its tokenizer loads as saved."""
    model = AutoModelForCausalLM.from_pretrained(tiny_moe)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    cfg = model.config
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (4, 2, 192)
    assert 1_000_000 < sum(p.numel() for p in model.parameters()) < 1_600_000
    tokenizer = AutoTokenizer.from_pretrained(tiny_moe)
    assert ids(tokenizer, EVERY_CLASS) == ids(build_tokenizer(), EVERY_CLASS)
    assert tokenizer.decode(ids(tokenizer, EVERY_CLASS)) == EVERY_CLASS


def test_rejects_unknown_arch(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="arch"):
        build_tiny_model(tmp_path / "x", arch="gpt2")


def test_a_padded_vocabulary_decodes_every_id_and_encodes_as_before(tok, tmp_path: Path) -> None:
    padded = build_tokenizer(4096)
    assert len(padded) == 4096
    text = "what is 3+4? 7"
    assert padded.encode(text) == tok.encode(text)
    assert padded.decode([4, 1000, 4095, 5]) == "0w1000w40951"
    padded.save_pretrained(tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path).decode([1000]) == "w1000"
