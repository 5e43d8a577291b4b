"""The vLLM engine for real (its CPU build): logprobs against the trainer, weight updates, GRPO.

Run by `make test-vllm` (in .venv-vllm); skipped where vLLM is not installed."""

from __future__ import annotations

import os
import time

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm


def shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def test_logprobs_match_the_trainer_after_every_weight_update(tmp_path, arith_model):
    from meshrl.engines.vllm import VLLMEngine

    before = shm()
    engine = VLLMEngine(str(arith_model), max_batch_size=32, threads=1, work_dir=str(tmp_path / "vllm"))
    try:
        check_versions(engine, arith_model)
    finally:
        engine.close()
    deadline = time.monotonic() + 20  # vLLM's processes unlink their segments as they exit
    while shm() - before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not shm() - before, f"vLLM left shared memory behind: {sorted(shm() - before)}"


def check_versions(engine, arith_model) -> None:
    from meshrl.engines.base import SamplingParams
    from meshrl.engines.fsdp import FSDPEngine
    from meshrl.engines.optim import OptimConfig
    from meshrl.engines.packing import pack
    from meshrl.roles.trainer.config import TrainerConfig

    trainer = FSDPEngine(str(arith_model), OptimConfig(lr=3e-2), device=torch.device("cpu"))
    cfg = TrainerConfig(model=str(arith_model), micro_batch=16)
    g = torch.Generator().manual_seed(0)
    prompts = [[int(t) for t in torch.randint(4, 16, (int(n),), generator=g)] for n in (3, 5, 2, 7, 4, 6)]
    previous = None
    for version in range(4):
        if version:  # one real policy update, then publish it
            rows = [torch.tensor(p) for p in prompts]
            batch = pack(rows, [torch.tensor([5, 6, 7])] * len(rows), [torch.full((3,), -2.0)] * len(rows),
                         torch.randn(len(rows), generator=g), torch.ones(len(rows), dtype=torch.bool))  # fmt: skip
            trainer.update_policy(batch, cfg)
            names = [name for name, _, _ in trainer.manifest()]
            engine.load_weights(zip(names, trainer.get_weights(), strict=True))
            engine.set_version(version)
        assert engine.version == version
        out = engine.generate(prompts, SamplingParams(max_new_tokens=6), seeds=list(range(len(prompts))))
        assert all(c.tokens and len(c.logprobs) == len(c.tokens) for c in out)
        packed = pack([torch.tensor(p) for p in prompts], [torch.tensor(c.tokens) for c in out], None,
                      torch.zeros(len(out)), torch.ones(len(out), dtype=torch.bool))  # fmt: skip
        with torch.no_grad():
            lp, _, _ = trainer.forward_logprobs(packed, 1.0)
        mine = torch.cat([torch.tensor(c.logprobs) for c in out])
        theirs = lp[packed.mask]
        assert (mine - theirs).abs().max() < 1e-5, (version, (mine - theirs).abs().max())
        # the update really reached vLLM: the same first tokens are now scored differently
        first = torch.tensor(engine.score([p + out[0].tokens[:1] for p in prompts[:1]], [len(prompts[0])])[0])
        if previous is not None:
            assert (first - previous).abs().max() > 1e-4
        previous = first


@pytest.mark.slow
def test_grpo_on_vllm_improves_arithmetic(tmp_path, arith_model):
    from tests.integration.grpo.test_grpo import REPO, rows, run

    run_dir = tmp_path / "run"
    r = run(tmp_path, f"*.model={arith_model}", f"run_dir={run_dir}", "total_steps=60", "rollout.eval_every=30",
            recipe=str(REPO / "recipes" / "grpo_arith_vllm.py"), timeout=900)  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    m = rows(run_dir / "metrics.jsonl")
    first = sum(x["reward_mean"] for x in m[:10]) / 10
    last = sum(x["reward_mean"] for x in m[-10:]) / 10
    assert last >= first + 0.1, (first, last)
