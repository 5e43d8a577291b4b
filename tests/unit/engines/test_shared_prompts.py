"""A group's rows run their prompt once in the trainer's forward (meshrl/engines/shared_prompts.py): the
update is the one of the rows computed whole."""

from __future__ import annotations

import pytest
import torch

from meshrl.dataplane.batch import Ragged
from meshrl.engines import shared_prompts
from meshrl.engines.packing import pack
from meshrl.engines.settings import LoraConfig
from meshrl.engines.shared_prompts import SAVING, grouped, plan
from tests.unit.engines.test_fsdp_engine import Step, assert_same_update, engine_with, update_grads, varied


def groups(n_groups: int = 3, size: int = 4, seed: int = 0, loss_mask: bool = False):
    """`n_groups` prompts of 6-10 tokens, each `size` times, with responses of 1-6 tokens (the first of
    length 1), per-row advantages and one invalid row; `loss_mask`: some response tokens not trained
    on (a tool's output in an agent's turn)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(4, 14, (int(k),), generator=g) for k in torch.randint(6, 11, (n_groups,), generator=g)
    ]
    rows = [p for p in prompts for _ in range(size)]
    lengths = torch.randint(1, 7, (len(rows),), generator=g)
    lengths[0] = 1
    responses = [torch.randint(4, 14, (int(k),), generator=g) for k in lengths]
    logprobs = [-torch.rand(len(r), generator=g) for r in responses]
    valid = torch.ones(len(rows))
    valid[len(rows) // 2] = 0
    masks = (
        Ragged.from_list([torch.rand(len(r), generator=g) > 0.3 for r in responses]) if loss_mask else None
    )
    return pack(rows, responses, logprobs, torch.randn(len(rows), generator=g), valid, loss_mask=masks)


CASES = {  # micro-batch rows, a loss mask, the engine's other settings (bf16: bfloat16's tolerance)
    "groups-of-4": (4, False, {}),
    "three-groups": (12, False, {}),
    "loss-mask": (4, True, {}),
    "lora": (12, False, {"lora": LoraConfig(rank=4)}),
    "bf16": (12, False, {"precision": "bf16-mixed"}),
}


@pytest.fixture(params=["packed", "cached"])
def way(request, monkeypatch) -> str:
    """Each of the two ways prompts are shared: one forward of packed groups, or the prompts' KV cache."""
    seen: list[bool] = []
    pays = shared_prompts._packing_pays
    monkeypatch.setattr(
        shared_prompts, "_packing_pays", lambda *a: seen.append(pays(*a)) or request.param == "packed"
    )
    yield request.param
    assert seen  # the choice was made, so the path forced was the one taken


@pytest.mark.parametrize("case", CASES)
def test_the_update_with_shared_prompts_is_that_of_the_rows_whole(tiny_model, case: str, way: str) -> None:
    """The same loss, metrics and gradients (to float rounding) with every micro-batch's prompts run once
    as with each row computed whole; micro-batches of 4 rows hold one group each."""
    micro_batch, loss_mask, settings = CASES[case]
    batch = groups(loss_mask=loss_mask)
    shared = engine_with(tiny_model, micro_batch=micro_batch, **settings)
    micro = shared._micro_batches(batch)
    assert shared._share and all(plan(mb) is not None for mb in micro)  # every micro-batch shares
    if micro_batch == 4:
        assert all(len(plan(mb)) == 1 for mb in micro)  # type: ignore[arg-type]
    whole = engine_with(tiny_model, micro_batch=micro_batch, **settings)
    whole._share = False
    tol = 2e-2 if "precision" in settings else 1e-5
    assert_same_update(update_grads(shared, batch, Step()), update_grads(whole, batch, Step()), tol)


def test_logprobs_with_shared_prompts_are_those_of_the_rows_whole(tiny_model, way: str) -> None:
    """Also without a gradient (the proximal policy's forward), on the positions of the mask only."""
    batch = groups(n_groups=2, size=5, seed=3)
    engine = engine_with(tiny_model, micro_batch=len(batch))
    with torch.no_grad():
        shared, shared_entropy = engine.forward_logprobs(batch, 0.7)
        engine._share = False
        whole, whole_entropy = engine.forward_logprobs(batch, 0.7)
    torch.testing.assert_close(shared, whole, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(shared_entropy, whole_entropy, rtol=1e-5, atol=1e-6)
    assert bool((shared[~batch.mask] == 0).all())


def test_rows_without_a_shared_prompt_are_computed_whole() -> None:
    """Distinct prompts (nothing to share), or too little saved, or rows packed several samples to a
    row: no plan. Ordering for micro-batches keeps a group's rows together, in the order given."""
    assert plan(varied()) is None
    few = groups(n_groups=4, size=1)  # each prompt once
    assert plan(few) is None
    batch = groups(n_groups=3, size=4)
    assert plan(batch) is not None and SAVING > 0
    packed = dict(position_ids=torch.zeros_like(batch.input_ids))
    assert plan(type(batch)(**{**batch.__dict__, **packed})) is None
    order = torch.tensor([11, 0, 5, 1, 10, 4, 2, 3, 6, 7, 8, 9])
    assert grouped(batch, order).tolist() == [11, 10, 8, 9, 0, 1, 2, 3, 5, 4, 6, 7]


def test_packing_pays_for_short_rows_and_not_for_long_groups(tiny_model) -> None:
    """The demo's shapes (4-token prompts, answers of a few tokens, groups of 8) go packed; a group of
    16 long responses (its packed row would attend 16 times what its rows do) goes by the cache."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_model)
    config._attn_implementation = "sdpa"
    short = shared_prompts.distinct([[5, 6, 7, 8]] * 8 + [[9, 10, 11, 12]] * 8, 0)
    assert shared_prompts._packing_pays(config, short, torch.randint(1, 5, (16,)), 3)
    long = shared_prompts.distinct([[5] * 100] * 16, 0)
    assert not shared_prompts._packing_pays(config, long, torch.full((16,), 120), 119)
    config.layer_types = ["full_attention", "sliding_attention"] * 2  # the 4D mask would drop the window
    assert not shared_prompts._packing_pays(config, short, torch.randint(1, 5, (16,)), 3)
    config.layer_types = ["full_attention"] * 4
    config._attn_implementation = "eager"
    assert not shared_prompts._packing_pays(config, short, torch.randint(1, 5, (16,)), 3)
