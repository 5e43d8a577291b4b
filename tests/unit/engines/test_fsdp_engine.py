"""The training engine's packing, schedule and update step (one process, world size 1)."""

from __future__ import annotations

import math

import pytest
import torch

from meshrl.engines.fsdp import FSDPEngine, OptimConfig, lr_factor, pack
from meshrl.roles.trainer.config import TrainerConfig


def Step(**kw: object) -> TrainerConfig:
    """The trainer's loss settings as the engine sees them (micro-batches of 3 rows, PPO clip)."""
    return TrainerConfig(model=".", micro_batch=3, **kw)  # type: ignore[arg-type]


def test_pack_aligns_response_values_with_the_positions_that_predict_them():
    b = pack(
        [torch.tensor([5, 6]), torch.tensor([7])],
        [torch.tensor([8, 9, 1]), torch.tensor([2])],
        [torch.tensor([-0.1, -0.2, -0.3]), torch.tensor([-0.4])],
        torch.tensor([1.0, -2.0]),
        torch.tensor([True, False]),
    )
    assert b.input_ids.tolist() == [[5, 6, 8, 9, 1], [7, 2, 0, 0, 0]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    # position t predicts token t+1: row 0's response starts at position 1
    assert b.mask.tolist() == [[False, True, True, True], [False, False, False, False]]  # invalid row masked
    assert b.old_logprobs[0].tolist() == pytest.approx([0.0, -0.1, -0.2, -0.3])
    assert b.advantages.tolist() == [1.0, 0.0]


def test_schedules():
    cfg = OptimConfig(lr=1.0, warmup_steps=2, total_steps=12, schedule="linear")
    assert [lr_factor(s, cfg) for s in (0, 1, 2, 7, 12)] == pytest.approx([0.5, 1.0, 1.0, 0.5, 0.0])
    cos = OptimConfig(lr=1.0, total_steps=10, schedule="cosine")
    assert lr_factor(5, cos) == pytest.approx(0.5) and lr_factor(0, OptimConfig(lr=1.0)) == 1.0


def batch(n: int = 6):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 14, (3,), generator=g) for _ in range(n)]
    responses = [torch.randint(4, 14, (int(k),), generator=g) for k in torch.randint(1, 4, (n,), generator=g)]
    return pack(
        prompts,
        responses,
        [torch.zeros(len(r)) for r in responses],
        torch.randn(n, generator=g),
        torch.ones(n),
    )


def params(engine: FSDPEngine) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.get_weights()]


def test_update_moves_weights_and_reports_metrics(tiny_model):
    engine = FSDPEngine(str(tiny_model), OptimConfig(lr=1e-2), device=torch.device("cpu"))
    before = params(engine)
    stats = engine.update_policy(batch(), Step(epochs=2))
    assert stats["nan_skipped"] == 0 and math.isfinite(stats["loss"]) and stats["grad_norm"] > 0
    assert engine.steps == 2
    assert any(not torch.equal(a, b) for a, b in zip(before, params(engine), strict=True))


def test_non_finite_loss_skips_the_update(tiny_model):
    engine = FSDPEngine(str(tiny_model), OptimConfig(lr=1e-2), device=torch.device("cpu"))
    before = params(engine)
    bad = batch()
    bad.advantages[0] = float("nan")
    stats = engine.update_policy(bad, Step())
    assert stats["nan_skipped"] == 1 and engine.steps == 0
    assert all(torch.equal(a, b) for a, b in zip(before, params(engine), strict=True))
