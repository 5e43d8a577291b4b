"""A mixture of experts in the training engine: the expert load it counts, the routers' auxiliary loss,
and a dense model left as it was (meshrl/engines/experts.py)."""

from __future__ import annotations

import pytest
import torch

from meshrl.engines.experts import Routed, load_metrics
from meshrl.engines.settings import MoEConfig
from tests.unit.engines.test_fsdp_engine import batch, engine_with

TOKENS = [f"moe/tokens_per_expert/{e}" for e in range(4)]


def routed(logits: torch.Tensor, tokens: list[bool], top_k: int = 2) -> Routed:
    return Routed(torch.tensor(tokens), top_k, logits.shape[-1], [logits])


def test_counts_take_each_counted_token_top_k_times():
    logits = torch.tensor([[3.0, 2.0, 0.0, 0.0], [0.0, 2.0, 3.0, 0.0], [9.0, 0.0, 0.0, 8.0]])
    assert routed(logits, [True, True, False]).counts().tolist() == [[1, 2, 1, 0]]  # the padding: not


def test_the_aux_loss_is_one_when_the_tokens_spread_evenly_and_experts_over_top_k_at_worst():
    even = torch.eye(4) * 20 + torch.eye(4).roll(1, 1) * 19  # token i: experts i and i+1, confidently
    assert float(routed(even, [True] * 4).aux_loss()) == pytest.approx(1.0, abs=1e-3)
    crowded = torch.tensor([[20.0, 19.0, 0.0, 0.0]]).repeat(4, 1)  # every token: experts 0 and 1
    assert float(routed(crowded, [True] * 4).aux_loss()) == pytest.approx(2.0, abs=1e-3)
    assert float(routed(crowded, [False] * 4).aux_loss()) == 0.0  # nothing to balance


def test_load_metrics():
    m = load_metrics(torch.tensor([[10.0, 10, 10, 10], [40, 0, 0, 0], [0, 0, 0, 0]]))
    assert [m[k] for k in TOKENS] == [50, 10, 10, 10]
    assert m["moe/load_max_over_mean"] == pytest.approx((1 + 4 + 1) / 3)  # a layer without tokens: even
    assert m["moe/load_max_over_mean_max"] == 4.0


def test_the_step_counts_every_token_top_k_times_in_every_layer(tiny_moe, tiny_model):
    b = batch()
    stats = engine_with(tiny_moe).update_policy(b)
    assert sum(stats[k] for k in TOKENS) == 2 * 4 * int(b.attention_mask.sum())  # top-2, 4 layers
    assert 1 <= stats["moe/load_max_over_mean"] <= stats["moe/load_max_over_mean_max"] <= 4
    assert stats["moe/aux_loss"] >= 1 and stats["loss"] == stats["pg_loss"]  # off: not in the loss
    dense = engine_with(tiny_model)
    assert not [k for k in dense.update_policy(b) if k.startswith("moe/")]
    with pytest.raises(ValueError, match="not a mixture of experts"):
        dense.update_policy(b, moe=MoEConfig(aux_loss_coef=0.01))


def test_recomputed_layers_and_packed_rows_count_the_tokens_once(tiny_moe):
    """Activation checkpointing runs each layer again in the backward pass: the routers' hooks do not
    count it. Packed rows hold the same tokens (and no padding)."""
    b = batch()
    plain = engine_with(tiny_moe).update_policy(b, moe=MoEConfig(aux_loss_coef=0.1))
    again = engine_with(tiny_moe, activation_checkpointing=True).update_policy(
        b, moe=MoEConfig(aux_loss_coef=0.1)
    )
    assert {k: again[k] for k in TOKENS} == {k: plain[k] for k in TOKENS}
    assert again["loss"] == pytest.approx(plain["loss"], rel=1e-5)
    assert again["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-4)
    packed = engine_with(tiny_moe, max_tokens_per_micro_batch=24).update_policy(b)
    assert sum(packed[k] for k in TOKENS) == sum(plain[k] for k in TOKENS) == 8 * int(b.attention_mask.sum())


def test_the_aux_loss_adds_to_the_loss_and_moves_the_routers(tiny_moe):
    b = batch()
    runs = {}
    for coef in (0.0, 0.5):
        engine = engine_with(tiny_moe)
        stats = engine.update_policy(b, moe=MoEConfig(aux_loss_coef=coef))
        router = engine.model.model.layers[0].mlp.gate.weight.detach().clone()
        runs[coef] = stats, router
    (off, router_off), (on, router_on) = runs[0.0], runs[0.5]
    assert on["pg_loss"] == pytest.approx(off["pg_loss"]) and on["moe/aux_loss"] == pytest.approx(
        off["moe/aux_loss"]
    )
    assert on["loss"] == pytest.approx(off["pg_loss"] + 0.5 * off["moe/aux_loss"])
    assert on["grad_norm"] != pytest.approx(off["grad_norm"])
    assert not torch.allclose(router_on, router_off)
