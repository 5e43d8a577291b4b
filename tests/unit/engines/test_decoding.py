"""The HF engine's decode loop without per-step copies of its KV cache (meshrl/engines/decoding.py):
keys and values written in place, grouped key/value heads given to SDPA as they are. The tokens and
logprobs it generates against the model run whole are tests/unit/engines/test_hf_engine.py's; here,
what each part does on its own."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, Qwen2Config, Qwen2ForCausalLM

from meshrl.engines.base import SamplingParams
from meshrl.engines.decoding import GROUPED, Reserved, reserve, use_grouped_attention
from meshrl.engines.hf import HFEngine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 with grouped key/value heads (4 query heads, 2 key/value heads)."""
    config = Qwen2Config(
        vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, eos_token_id=1, pad_token_id=0,
        bos_token_id=None, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-gqa")
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path


def left_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def test_grouped_attention_gives_sdpa_s_logits_under_a_padding_mask(model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids, mask = left_padded([[5, 6, 7, 8, 9], [3, 4], [10, 11, 12]])
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        use_grouped_attention(model)
        assert model.config._attn_implementation == GROUPED
        got = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], rtol=0, atol=1e-5)


def test_the_engine_s_own_model_attends_with_grouped_heads_and_a_given_one_is_left_alone(
    model_dir: Path,
) -> None:
    assert HFEngine(str(model_dir)).model.config._attn_implementation == GROUPED
    trainers = AutoModelForCausalLM.from_pretrained(model_dir)
    assert HFEngine(str(model_dir), model=trainers).model.config._attn_implementation == "sdpa"
    eager = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
    use_grouped_attention(eager)
    assert eager.config._attn_implementation == "eager"


def test_a_reserved_layer_writes_in_place_and_matches_a_growing_cache() -> None:
    torch.manual_seed(0)
    grown, reserved = DynamicCache(), DynamicCache()
    prompt = torch.randn(3, 2, 4, 8), torch.randn(3, 2, 4, 8)
    grown.update(*prompt, layer_idx=0)
    reserved.update(*prompt, layer_idx=0)
    reserve(reserved, room=3)
    layer = reserved.layers[0]
    assert isinstance(layer, Reserved)
    buffer = layer.keys.data_ptr()
    rows = 3
    for step in range(3):
        if step == 1:  # rows dropped mid-way, as the engine drops finished ones
            keep, rows = torch.tensor([0, 2]), 2
            grown.batch_select_indices(keep)
            reserved.batch_select_indices(keep)
            buffer = layer.keys.data_ptr()
        new = torch.randn(rows, 2, 1, 8), torch.randn(rows, 2, 1, 8)
        expected, got = grown.update(*new, layer_idx=0), reserved.update(*new, layer_idx=0)
        assert layer.keys.data_ptr() == buffer  # written in place, not concatenated
        for e, g in zip(expected, got, strict=True):
            torch.testing.assert_close(g, e, rtol=0, atol=0)
    assert reserved.get_seq_length() == grown.get_seq_length() == 7
    with pytest.raises(ValueError, match="7 positions given 8"):
        reserved.update(torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8), layer_idx=0)


def test_generation_is_the_same_whatever_the_batch_with_the_cache_reserved(model_dir: Path) -> None:
    """Rows finish at different steps (finished ones are dropped from the reserved cache) and each row's
    tokens are a pure function of its seed: alone or in a batch, the same completion."""
    engine = HFEngine(str(model_dir))
    prompts = [[5, 6, 7], [3] * 9, [9], [4, 5, 6, 7, 8], [12, 2], [7, 7]]
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=3, stop_token_ids=tuple(range(40, 48)))
    together = engine.generate(prompts, params, seeds=list(range(len(prompts))))
    assert len({len(c.tokens) for c in together}) > 1  # some rows stopped early
    for i, prompt in enumerate(prompts):
        alone = engine.generate([prompt], params, seeds=[i])[0]
        assert alone.tokens == together[i].tokens
        assert alone.logprobs == pytest.approx(together[i].logprobs, abs=1e-5)
