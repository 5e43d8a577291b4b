"""Data parallel over two gloo ranks gives the update of one rank with the whole batch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshrl.engines.settings import LoraConfig
from tests.conftest import REPO, free_base_port
from tests.unit.engines.test_fsdp_engine import Step, engine_with, update_grads, varied
from tests.unit.engines.test_shared_prompts import groups


@pytest.mark.parametrize("lora_rank", [0, 4], ids=["full", "lora"])
def test_two_ranks_see_the_gradient_of_the_whole_batch(tiny_model, tmp_path: Path, lora_rank: int) -> None:
    """Each rank's loss is its share of the whole batch's (normalised by every rank's tokens), so the
    gradient is the ranks' sum: FSDP's average would halve it (and with it the clipping threshold's
    meaning and the reported grad_norm). With LoRA the adapters' shards merge into the weights inference
    receives as on one rank."""
    out = tmp_path / "two.pt"
    subprocess.run(
        [sys.executable, str(Path(__file__).with_name("two_ranks.py")), str(tiny_model), str(out),
         str(free_base_port()), str(lora_rank)],
        check=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    two = torch.load(out)
    engine = engine_with(tiny_model, micro_batch=2, lora=LoraConfig(rank=lora_rank) if lora_rank else None)
    stats, grads = update_grads(engine, varied(), Step())
    assert two["stats"]["loss"] == pytest.approx(stats["loss"], rel=1e-5)
    assert two["stats"]["grad_norm"] == pytest.approx(stats["grad_norm"], rel=1e-4)
    for a, b in zip(two["grads"], grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    if lora_rank:  # after the update: the merged weights published from the shards, as from one rank
        # (Adam's first step divides each gradient by its own size: 1e-6 gradient noise moves a few
        # weights by ~1e-5; a wrong merge would be off by the update itself, lr = 1e-2)
        for a, b in zip(two["published"], engine.get_weights(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_two_ranks_running_each_prompt_once_see_the_gradient_of_the_rows_whole(
    tiny_model, tmp_path: Path
) -> None:
    """Under FSDP a micro-batch whose rows share prompts takes two forwards (the prompts, then the
    responses on their KV cache) before its backward: the gradient is still the whole batch's, as one
    rank computes it with every row whole."""
    out = tmp_path / "two.pt"
    subprocess.run(
        [sys.executable, str(Path(__file__).with_name("two_ranks.py")), str(tiny_model), str(out),
         str(free_base_port()), "0", "groups"],
        check=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    two = torch.load(out)
    engine = engine_with(tiny_model, micro_batch=2)
    engine._share = False
    stats, grads = update_grads(engine, groups(size=4), Step())
    assert two["stats"]["loss"] == pytest.approx(stats["loss"], rel=1e-5)
    for a, b in zip(two["grads"], grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
