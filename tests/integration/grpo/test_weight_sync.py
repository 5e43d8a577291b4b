"""After each weight sync the inference engine scores a sequence exactly as the trainer does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from meshrl.engines.hf import HFEngine
from meshrl.runtime.weights import WeightGroup
from tests.conftest import free_base_port
from tests.integration.grpo.sync_trainer import PROMPT_LEN, SEQUENCE


def test_logprobs_match_the_trainer_after_every_sync(tiny_model):
    base = free_base_port()
    versions = 4
    trainer = subprocess.Popen(
        [
            sys.executable,
            str(Path(__file__).with_name("sync_trainer.py")),
            str(tiny_model),
            str(base),
            str(base + 1),
            str(versions),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        engine = HFEngine(str(tiny_model))
        group = WeightGroup("127.0.0.1", base, 1, 2, timeout_s=120)
        seen = []
        for expected in range(versions):
            version = group.receive(group.wait(), engine.load_weights)
            engine.set_version(version)
            theirs = json.loads(trainer.stdout.readline())  # type: ignore[union-attr]
            ours = engine.score([SEQUENCE], [PROMPT_LEN])[0]
            assert version == theirs["version"] == expected
            diff = (torch.tensor(ours) - torch.tensor(theirs["logprobs"])).abs().max().item()
            assert diff < 1e-5, f"version {version}: inference and trainer logprobs differ by {diff}"
            # the trainer's send returned before it printed: its announcement, read by every receiver, is
            # gone from the store (the store does not grow with the number of versions)
            assert not group.store.check([f"pub/{group.published}"])
            seen.append(ours)
        assert seen[0] != seen[-1], "training changed nothing: the test would pass without a sync"
    finally:
        trainer.stdin.close()  # type: ignore[union-attr]  # the trainer (and the store it hosts) may go now
        trainer.wait(timeout=60)
    assert trainer.returncode == 0
