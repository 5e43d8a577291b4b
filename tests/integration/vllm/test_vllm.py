"""The vLLM engine for real (its CPU build): logprobs against the trainer, weight updates, GRPO.

Run by `make test-vllm` (in .venv-vllm); skipped where vLLM is not installed."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from meshrl.engines.base import SamplingParams
from tests.integration.engine_checks import WeightLink, check_versions, direct

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm


def shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


@pytest.mark.parametrize("transport", ["load_weights", "shm", "broadcast"])
def test_logprobs_match_the_trainer_after_every_weight_update(tmp_path, arith_model, transport):
    """Weights reach vLLM's workers through `load_weights` (a file the workers reload), or straight from
    the trainer's weight group: its shared memory mapped in the workers, or a gloo broadcast the workers
    take part in (the path NCCL takes on GPU)."""
    from meshrl.engines.vllm import VLLMEngine

    before = shm()
    engine = VLLMEngine(str(arith_model), max_batch_size=32, threads=1, work_dir=str(tmp_path / "vllm"))
    try:
        if transport == "load_weights":
            check_versions(engine, arith_model, direct)
        else:
            with WeightLink(engine, tmp_path if transport == "shm" else None) as link:
                check_versions(engine, arith_model, link.publish)
    finally:
        engine.close()
    deadline = time.monotonic() + 20  # vLLM's processes unlink their segments as they exit
    while shm() - before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not shm() - before, f"vLLM left shared memory behind: {sorted(shm() - before)}"


@pytest.mark.parametrize("transport", ["load_weights", "shm"])
def test_a_mixture_of_experts_follows_the_trainer_after_every_weight_update(tmp_path, tiny_moe, transport):
    """Qwen3-MoE (the tiny one: 4 experts, 2 per token) on vLLM's CPU build. vLLM packs the experts'
    weights for its grouped GEMM at the first load only; after each in-place reload the worker packs
    them again (`WeightReceiver.meshrl_repack_experts`), so logprobs follow every update exactly."""
    from meshrl.engines.vllm import VLLMEngine

    engine = VLLMEngine(str(tiny_moe), max_batch_size=32, threads=1, work_dir=str(tmp_path / "vllm"))
    try:
        if transport == "load_weights":
            check_versions(engine, tiny_moe, direct)
        else:
            with WeightLink(engine, tmp_path) as link:
                check_versions(engine, tiny_moe, link.publish)
    finally:
        engine.close()


@pytest.mark.parametrize("transport", ["load_weights", "shm"])
def test_a_vision_language_model_follows_the_trainer_with_images(tmp_path, vlm, processor, transport):
    """Idefics3 on vLLM's CPU build: the prompts' placeholders expanded by rollout's processor, the
    pictures (the PICTURES column) processed again by vLLM into the same pixels the trainer reads, so
    the logprobs of the completions match the trainer's after every weight update (the vision tower
    trains here too, so its updates must reach vLLM as well)."""
    from PIL import Image

    from meshrl.engines.vllm import VLLMEngine
    from meshrl.models import vision

    def ask(*pictures):
        parts = [{"type": "image"} for _ in pictures] + [{"type": "text", "text": "colour?"}]
        return vision.encode(processor, [{"role": "user", "content": parts}], list(pictures), "a test row")

    red, blue = Image.new("RGB", (32, 24), (200, 30, 30)), Image.new("RGB", (20, 32), (20, 40, 220))
    encoded = [ask(red), ask(blue, red), ask(), ask(blue)]
    prompts = [ids.tolist() for ids, _ in encoded]
    images = [i for _, i in encoded]
    assert [len(i.pictures) if i else 0 for i in images] == [1, 2, 0, 1]
    engine = VLLMEngine(str(vlm), max_batch_size=32, threads=1, work_dir=str(tmp_path / "vllm"))
    try:
        if transport == "load_weights":
            check_versions(engine, vlm, direct, prompts=prompts, images=images, train_vision=True)
        else:
            with WeightLink(engine, tmp_path) as link:
                check_versions(engine, vlm, link.publish, prompts=prompts, images=images, train_vision=True)
        pixels_only = [vision.Images(images[0].pixels, images[0].mask)]
        with pytest.raises(ValueError, match="PICTURES"):
            engine.generate(prompts[:1], SamplingParams(max_new_tokens=2), images=pixels_only)
    finally:
        engine.close()


def test_a_vision_language_model_trains_on_vllm(tmp_path, vlm):
    """The services' path with pictures: rollout writes each prompt's pixels and pictures once, vLLM
    generates from the pictures, the trainer trains on the pixels (vision tower too), and each step's
    weights reach vLLM's workers: the two agree on every sample (kl_behaviour)."""
    from tests.integration.grpo.test_grpo import REPO, rows, run

    run_dir = tmp_path / "run"
    r = run(tmp_path, f"*.model={vlm}", f"run_dir={run_dir}", "total_steps=3", "rollout.eval_every=0",
            "prompts_per_step=4", "group_size=4", "trainer.mini_batches=1", "inference.engine=vllm",
            "trainer.train_vision=true", "inference.threads=1", "trainer.threads=1",
            'rollout.rewards={"tests.integration.test_vlm:reward": 1.0}',  # a random model's samples differ
            recipe=str(REPO / "recipes" / "grpo_vlm.py"), timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    m = rows(run_dir / "metrics.jsonl")
    assert [x["version"] for x in m] == [1, 2, 3] and all(x["grad_norm"] > 0 for x in m)
    assert all(x["kl_behaviour"] < 1e-4 for x in m), [x["kl_behaviour"] for x in m]


def test_a_mixture_of_experts_trains_on_vllm(tmp_path, tiny_moe):
    """The services' path: GRPO with vLLM generating from a mixture of experts, its weights published
    into vLLM's workers each step; one mini-batch a step, so the trainer scores every sample with the
    weights vLLM generated it with, and they agree (measured: 3e-14 nats per token)."""
    from tests.integration.grpo.test_grpo import REPO, rows, run

    run_dir = tmp_path / "run"
    r = run(tmp_path, f"*.model={tiny_moe}", f"run_dir={run_dir}", "total_steps=3", "rollout.eval_every=0",
            "prompts_per_step=8", "trainer.mini_batches=1", "trainer.optim.lr=1e-3",
            'rollout.rewards={"tests.integration.ppo.rewards:even_first_digit": 1}',
            recipe=str(REPO / "recipes" / "grpo_arith_vllm.py"), timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    m = rows(run_dir / "metrics.jsonl")
    assert [x["version"] for x in m] == [1, 2, 3] and all(x["grad_norm"] > 0 for x in m)
    assert all(x["kl_behaviour"] < 1e-4 for x in m), [x["kl_behaviour"] for x in m]
    assert all(sum(x[f"moe/tokens_per_expert/{e}"] for e in range(4)) > 0 for x in m)


def test_a_seeded_batch_past_the_step_budget_samples_reproducibly(tmp_path, arith_model):
    """64 prompts of 100 tokens: more prompt tokens than one engine step takes (2048). vLLM would cut a
    prompt over two steps and rewind its request's generator, which a CPU generator cannot do; the engine
    keeps prompts whole, so seeded sampling works, repeats itself, and does not depend on the batch."""
    from meshrl.engines.base import SamplingParams
    from meshrl.engines.vllm import VLLMEngine

    engine = VLLMEngine(str(arith_model), max_batch_size=64, threads=1, work_dir=str(tmp_path / "vllm"))
    try:
        g = torch.Generator().manual_seed(0)
        prompts = [[int(t) for t in torch.randint(4, 40, (100,), generator=g)] for _ in range(64)]
        params = SamplingParams(temperature=1.0, max_new_tokens=6)
        first = engine.generate(prompts, params, seeds=list(range(64)))
        again = engine.generate(prompts, params, seeds=list(range(64)))
        alone = engine.generate(prompts[:3], params, seeds=list(range(3)))
    finally:
        engine.close()
    assert [c.tokens for c in first] == [c.tokens for c in again]
    assert [c.tokens for c in first[:3]] == [c.tokens for c in alone]
    assert len({tuple(c.tokens) for c in first}) > 1  # sampled, not one completion repeated


def test_lora_adapters_alone_reach_vllm_and_its_logprobs_match_the_trainer(tmp_path, arith_model):
    """A trainer of LoRA adapters publishes only them (PEFT's names); vLLM loads each version as an adapter
    in place of the last, and samples and scores with it as the trainer computes with its PEFT model."""
    from meshrl.engines.settings import LoraConfig
    from meshrl.engines.vllm import VLLMEngine

    lora = LoraConfig(rank=4, alpha=16.0)
    engine = VLLMEngine(
        str(arith_model), max_batch_size=32, threads=1, work_dir=str(tmp_path / "vllm"), adapters=lora
    )
    sent: list[list[str]] = []

    def publish(engine, version, manifest, tensors) -> None:
        sent.append([name for name, _, _ in manifest])
        direct(engine, version, manifest, tensors)

    try:
        assert engine.weight_member() is None  # adapters come through load_weights
        check_versions(engine, arith_model, publish, tolerance=1e-4, lora=lora, publish_adapters=True)
        with pytest.raises(ValueError, match="LoRA adapter matrices"):
            engine.load_weights([("model.embed_tokens.weight", torch.zeros(1))])
    finally:
        engine.close()
    assert len(sent) == 3 and all(".lora_A.weight" in n or ".lora_B.weight" in n for n in sent[0])
    assert (tmp_path / "vllm" / "adapter" / "adapter_config.json").exists()


@pytest.mark.gpu(gpus=2)
def test_weights_broadcast_over_nccl_into_vllm_workers(tmp_path, arith_model):
    """GPU: the trainer on device 0 broadcasts over NCCL straight into vLLM's worker on device 1 (NCCL
    refuses two ranks on one device). Kernels differ from the trainer's: a looser tolerance."""
    from meshrl.engines.vllm import VLLMEngine

    torch.zeros(1, device="cuda:0")  # this process's CUDA sees every device before vLLM narrows the env
    engine = VLLMEngine(str(arith_model), device="cuda:1", max_batch_size=32, work_dir=str(tmp_path / "vllm"))
    try:
        with WeightLink(engine, None, device="cuda:0") as link:
            check_versions(engine, arith_model, link.publish, device="cuda:0", tolerance=1e-3)
    finally:
        engine.close()


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


def test_a_lora_run_on_vllm_publishes_adapters_and_samples_with_them(tmp_path, arith_model):
    """The services' path: the trainer publishes its adapters alone (shared memory -> the inference
    service -> vLLM's LoRA), and every step's trainer logprobs agree with those vLLM sampled with."""
    from tests.integration.grpo.test_grpo import REPO, rows, run

    run_dir = tmp_path / "run"
    r = run(tmp_path, f"*.model={arith_model}", f"run_dir={run_dir}", "total_steps=6", "rollout.eval_every=0",
            "trainer.lora.rank=8", "trainer.lora.alpha=32", "trainer.optim.lr=1e-3", "trainer.mini_batches=1",
            recipe=str(REPO / "recipes" / "grpo_arith_vllm.py"), timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    m = rows(run_dir / "metrics.jsonl")
    assert [x["version"] for x in m] == [1, 2, 3, 4, 5, 6]
    assert all(x["kl_behaviour"] < 1e-4 for x in m), [x["kl_behaviour"] for x in m]
    assert max(x["grad_norm"] for x in m) > 0
    adapter = next((run_dir / "vllm").glob("inference-*/adapter/adapter_config.json"))
    assert json.loads(adapter.read_text())["r"] == 8
