"""GGUF models: a GGUF file (here a tiny Llama written with the `gguf` package, weights in Q8_0) is
dequantized once into a plain HF folder that every group of a recipe loads, saves and syncs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from meshrl.models.hub import local
from meshrl.planning.models import resolve_models
from meshrl.planning.recipe import read_recipe

RECIPE = Path(__file__).parents[2] / "recipes" / "grpo_arith.py"


def write_gguf(model, tok, path: Path) -> None:
    """`model` (a Llama) and `tok` as a GGUF file the way llama.cpp lays one out: its tensor names,
    q/k rows permuted for its rotary layout, matrices in Q8_0."""
    import gguf

    cfg = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    vocab = sorted(tok.get_vocab(), key=tok.get_vocab().get)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(vocab)
    w.add_token_types([3 if t in tok.all_special_tokens else 1 for t in vocab])
    w.add_token_scores([0.0] * len(vocab))
    w.add_token_merges([])
    w.add_eos_token_id(tok.eos_token_id)
    w.add_bos_token_id(tok.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    w.add_chat_template(tok.chat_template)
    names = {"model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm"}
    layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}  # fmt: skip
    for i in range(cfg.num_hidden_layers):
        names |= {f"model.layers.{i}.{hf}.weight": f"blk.{i}.{g}" for hf, g in layer.items()}
    for hf, t in model.state_dict().items():
        if hf not in names:  # lm_head: tied to the embeddings
            continue
        x = t.float().numpy()
        heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
        for part, n in heads.items():
            if part in hf:  # llama.cpp's rotary layout
                x = x.reshape(n, 2, x.shape[0] // n // 2, x.shape[1]).swapaxes(1, 2).reshape(x.shape)
        if x.ndim == 2:
            q = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(f"{names[hf]}.weight", gguf.quants.quantize(x, q), raw_dtype=q)
        else:
            w.add_tensor(f"{names[hf]}.weight", np.ascontiguousarray(x))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture
def gguf_dir(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from meshrl.models.tiny import build_tiny_model

    src = build_tiny_model(tmp_path / "src", arch="llama")
    out = tmp_path / "gguf"
    out.mkdir()
    write_gguf(
        AutoModelForCausalLM.from_pretrained(src), AutoTokenizer.from_pretrained(src), out / "tiny.gguf"
    )
    monkeypatch.setenv("MESHRL_CACHE", str(tmp_path / "cache"))
    return src, out


def test_a_gguf_file_becomes_a_plain_folder_with_the_same_model(gguf_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, out = gguf_dir
    folder = local(str(out / "tiny.gguf"))
    assert folder is not None and not list(folder.glob("*.gguf"))
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    assert local(str(out), "tiny.gguf") == folder  # made once
    model, original = AutoModelForCausalLM.from_pretrained(folder), AutoModelForCausalLM.from_pretrained(src)
    tok, tok0 = AutoTokenizer.from_pretrained(folder), AutoTokenizer.from_pretrained(src)
    ids = tok0.apply_chat_template([{"role": "user", "content": "1+2="}], add_generation_prompt=True)
    assert tok.apply_chat_template([{"role": "user", "content": "1+2="}], add_generation_prompt=True) == ids
    x = torch.tensor([ids["input_ids"] if hasattr(ids, "keys") else ids])
    with torch.no_grad():  # Q8_0 keeps the logits close
        assert torch.allclose(model(x).logits, original(x).logits, atol=0.05)
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_loader_kwargs_gguf_file_gives_every_group_the_same_folder(gguf_dir):
    _, out = gguf_dir
    recipe = read_recipe(RECIPE).with_overrides(
        [f"*.model={out}", '*.loader_kwargs={"gguf_file": "tiny.gguf"}']
    )
    resolved = resolve_models(recipe)
    assert len({g.config.model for g in resolved.groups}) == 1  # rollout's tokenizer too
    assert all("gguf_file" not in getattr(g.config, "loader_kwargs", {}) for g in resolved.groups)
