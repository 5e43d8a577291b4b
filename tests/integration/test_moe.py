"""A mixture of experts trains with GRPO through the paths a dense model takes: a random-init Qwen3-MoE of
the tiny model's size (4 experts, 2 per token: `build_tiny_model(arch="qwen3_moe")`), on the real
services (recipes/grpo_arith.py), with a reward a random model earns now and then (an even first digit).

Two runs and a resume: two FSDP ranks under bf16-mixed with activation checkpointing, packing and the
routers' auxiliary loss, whose final folder transformers loads and generates with; then LoRA (on the
experts and the router too) on one rank, checkpointed and resumed. Each step's expert load is in
metrics.jsonl. (vLLM: tests/integration/vllm/test_vllm.py.)"""

from __future__ import annotations

import json

import pytest
import torch

from tests.integration.grpo.test_grpo import rows, run

EVEN = 'rollout.rewards={"tests.integration.ppo.rewards:even_first_digit": 1}'
SMALL = ("rollout.eval_every=0", "prompts_per_step=8", EVEN)
TOKENS = [f"moe/tokens_per_expert/{e}" for e in range(4)]


def assert_expert_load(metrics: list[dict]) -> None:
    """Every step has the expert load: tokens per expert (each token to 2 experts in each of 4 layers),
    each layer's busiest expert over the mean between 1 (even) and 2 (the most top-2 routing allows)."""
    for m in metrics:
        assert sum(m[k] for k in TOKENS) % 8 == 0 and all(m[k] > 0 for k in TOKENS), m
        assert 1 <= m["moe/load_max_over_mean"] <= m["moe/load_max_over_mean_max"] <= 2
        assert 1 <= m["moe/aux_loss"] <= 2


def test_two_ranks_in_bf16_with_checkpointing_packing_and_the_aux_loss(tiny_moe, tmp_path):
    from transformers import AutoModelForCausalLM

    run_dir = tmp_path / "run"
    r = run(tmp_path, f"*.model={tiny_moe}", f"run_dir={run_dir}", "total_steps=3", "checkpoint_every=2", *SMALL,
            "trainer.devices_per_replica=2", "trainer.memory.precision=bf16-mixed",
            "trainer.memory.activation_checkpointing=true", "trainer.memory.max_tokens_per_micro_batch=256",
            "trainer.moe.aux_loss_coef=0.01")  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    metrics = rows(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2]
    assert_expert_load(metrics)
    for m in metrics:  # the aux loss is in the loss; inference generated with the published bf16 weights
        assert m["loss"] == pytest.approx(m["pg_loss"] + 0.01 * m["moe/aux_loss"], abs=1e-6)
        assert m["kl_behaviour"] < 0.05 and m["grad_norm"] > 0
    assert (run_dir / "checkpoints").is_dir()
    final = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    start = AutoModelForCausalLM.from_pretrained(tiny_moe)
    assert type(final).__name__ == "Qwen3MoeForCausalLM"
    experts = "model.layers.0.mlp.experts.gate_up_proj"
    assert not torch.equal(final.get_parameter(experts), start.get_parameter(experts))  # trained
    out = final.generate(torch.tensor([[5, 41, 6, 45]]), max_new_tokens=3, do_sample=False,
                         return_dict_in_generate=True)  # fmt: skip
    assert out.past_key_values is not None and out.sequences.shape[1] > 4


def test_lora_checkpoints_and_resumes(tiny_moe, tmp_path):
    """LoRA adapters on attention, the stacked experts and the router (PEFT's "all-linear"), published
    merged; a resumed run repeats the uninterrupted one to the last bit. The aux loss is off: not in the
    loss, and the expert load is still reported."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    common = (f"*.model={tiny_moe}", f"run_dir={tmp_path / 'run'}", "total_steps=4", "checkpoint_every=2", *SMALL,
              "trainer.mini_batches=1", "trainer.lora.rank=8", "trainer.lora.alpha=32", "trainer.optim.lr=1e-3",
              "trainer.lora.save_merged=true")  # fmt: skip
    r = run(tmp_path, *common)
    assert r.returncode == 0, r.stderr[-4000:]
    first = rows(tmp_path / "run" / "metrics.jsonl")
    assert_expert_load(first)
    assert all(m["loss"] == m["pg_loss"] for m in first)
    # one mini-batch a step: the trainer scores the samples with the weights inference generated them with
    # (merged, published, loaded by the HF engine), every token routed alike (measured: 4e-14)
    assert all(m["kl_behaviour"] < 1e-6 for m in first), [m["kl_behaviour"] for m in first]
    r = run(tmp_path, "--resume", *common)  # steps 2 and 3 again, from the checkpoint
    assert r.returncode == 0, r.stderr[-4000:]
    again = rows(tmp_path / "run" / "metrics.jsonl")
    key = lambda m: (m["loss"], m["reward_mean"], *(m[k] for k in TOKENS))  # noqa: E731
    assert [key(m) for m in again] == [key(m) for m in first]
    final = tmp_path / "run" / "final"
    adapter = json.loads((final / "adapter_config.json").read_text())
    assert {"gate_up_proj", "down_proj"} <= set(adapter["target_parameters"])  # the experts have adapters
    ours = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_moe), final).merge_and_unload()
    merged = AutoModelForCausalLM.from_pretrained(final / "merged")  # written in the hub's per-expert layout
    for name, tensor in ours.state_dict().items():
        torch.testing.assert_close(merged.state_dict()[name], tensor, rtol=1e-5, atol=1e-6)
    assert merged.generate(torch.tensor([[5, 41, 6, 45]]), max_new_tokens=3, do_sample=False).shape[1] > 4


def test_the_aux_loss_needs_a_mixture_of_experts(tiny_model, tmp_path):
    r = run(tmp_path, f"*.model={tiny_model}", "trainer.moe.aux_loss_coef=0.01")
    assert r.returncode == 2
    assert (
        "trainer'].config.moe.aux_loss_coef: the model" in r.stderr
        and "is not a mixture of experts" in r.stderr
    )
