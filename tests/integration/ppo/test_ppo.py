"""PPO through real services: actor, critic, reference and reward model only add columns to the rows."""

from __future__ import annotations

import json
import math

import pytest

from tests.integration.grpo.test_grpo import REPO, rows, run

PPO = str(REPO / "recipes" / "ppo_arith.py")
EVEN = 'rollout.rewards={"tests.integration.ppo.rewards:even_first_digit": 1}'


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def assert_drifts(kl: list[float]) -> None:
    """The policy drifts from the reference as it learns: the KL of the last 5 steps is well above that
    of the first 3. (A step's KL is the mean over its mini-batches, so step 0's is not 0: Adam's first
    updates are its largest; that it starts from the reference's weights is checked above.)"""
    assert mean(kl[-5:]) > 3 * mean(kl[:3]), kl


def test_ppo_is_reproducible_and_every_service_adds_its_column(tmp_path, arith_model):
    """Two runs with one seed agree to the last bit: the critic's values for step n's samples come
    from the critic trained on steps 0..n-1 in both, whatever the processes' timing."""
    out = []
    for name in ("a", "b"):
        r = run(tmp_path, f"*.model={arith_model}", f"run_dir={tmp_path / name}", "total_steps=5",
                "rollout.eval_every=0", recipe=PPO)  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        out.append((rows(tmp_path / name / "metrics.jsonl"), rows(tmp_path / name / "critic.jsonl")))
    (actor, critic), (actor2, critic2) = out
    assert [m["step"] for m in actor] == list(range(5)) and [c["version"] for c in critic] == [1, 2, 3, 4, 5]
    for x, y in zip(actor, actor2, strict=True):
        assert (x["reward_mean"], x["loss"], x["kl_ref"]) == (y["reward_mean"], y["loss"], y["kl_ref"])
    assert [c["value_loss"] for c in critic] == [c["value_loss"] for c in critic2]
    assert actor[0]["kl_ref"] < 0.05  # the first mini-batch starts from the reference's own weights
    assert all(c["valued"] >= 128 * c["version"] for c in critic)
    assert (tmp_path / "a" / "critic" / "config.json").exists()


@pytest.mark.slow
def test_ppo_learns_a_reward_the_critic_can_read_and_drifts_from_the_reference(tmp_path, arith_model):
    r = run(tmp_path, f"*.model={arith_model}", f"run_dir={tmp_path / 'run'}", "total_steps=30",
            "rollout.eval_every=0", EVEN, "critic.optim.lr=1e-4", recipe=PPO)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    actor, critic = rows(tmp_path / "run" / "metrics.jsonl"), rows(tmp_path / "run" / "critic.jsonl")
    first, last = mean([m["reward_mean"] for m in actor[:5]]), mean([m["reward_mean"] for m in actor[-5:]])
    assert last >= first + 0.2, (first, last)
    assert_drifts([m["kl_ref"] for m in actor])  # measured: first 3 steps 0.08, last 5 1.15
    loss = [c["value_loss"] for c in critic]
    assert mean(loss[-5:]) < 0.5 * mean(loss[:5]), loss
    # the critic follows the value of the improving policy (explained variance is no measure here: the
    # returns' variance collapses as the policy converges)
    assert abs(mean([c["values_mean"] - c["returns_mean"] for c in critic[-5:]])) < 0.1


@pytest.mark.slow
def test_ppo_improves_arithmetic(tmp_path, arith_model):
    r = run(tmp_path, f"*.model={arith_model}", f"run_dir={tmp_path / 'run'}", "total_steps=100", recipe=PPO)
    assert r.returncode == 0, r.stderr[-3000:]
    actor = rows(tmp_path / "run" / "metrics.jsonl")
    first, last = mean([m["reward_mean"] for m in actor[:10]]), mean([m["reward_mean"] for m in actor[-10:]])
    assert last >= first + 0.1, (first, last)
    evals = [json.loads(x) for x in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    assert evals[-1]["sampled_accuracy"] > evals[0]["sampled_accuracy"]


def test_adding_a_reference_to_grpo_changes_only_the_recipe(tmp_path, arith_model):
    r = run(tmp_path, f"*.model={arith_model}", f"run_dir={tmp_path / 'run'}", "total_steps=4",
            "rollout.eval_every=0", recipe=str(REPO / "recipes" / "grpo_arith_kl.py"))  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    actor = rows(tmp_path / "run" / "metrics.jsonl")
    assert actor[0]["kl_ref"] < 0.05 and actor[-1]["kl_ref"] > actor[0]["kl_ref"], [
        m["kl_ref"] for m in actor
    ]


def test_reward_model_scores_are_what_rollout_trains_on(tmp_path, arith_model):
    from meshrl.models.tiny import build_tiny_model

    rm = build_tiny_model(tmp_path / "rm", reward_model=True, seed=5)
    r = run(tmp_path, f"*.model={arith_model}", f"reward_model.model={rm}", f"run_dir={tmp_path / 'run'}",
            "total_steps=3", "rollout.eval_every=0", recipe=str(REPO / "recipes" / "ppo_rm.py"))  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    actor = rows(tmp_path / "run" / "metrics.jsonl")
    # a random reward model scores every completion differently; the rule's rewards are only 0 or 1
    assert all(m["reward_std"] > 0 for m in actor)
    assert any(abs(m["reward_mean"] * 128 - round(m["reward_mean"] * 128)) > 1e-3 for m in actor)


def test_ppo_resumes_actor_and_critic_from_a_checkpoint(tmp_path, arith_model):
    common = [f"*.model={arith_model}", f"run_dir={tmp_path / 'run'}", "total_steps=4", "checkpoint_every=2",
              "rollout.eval_every=0"]  # fmt: skip
    r = run(tmp_path, *common, recipe=PPO)
    assert r.returncode == 0, r.stderr[-3000:]
    actor, critic = rows(tmp_path / "run" / "metrics.jsonl"), rows(tmp_path / "run" / "critic.jsonl")
    r = run(tmp_path, "--resume", *common, recipe=PPO)  # steps 2 and 3 again, from the checkpoint
    assert r.returncode == 0, r.stderr[-3000:]
    resumed = rows(tmp_path / "run" / "metrics.jsonl")
    assert [(a["loss"], a["reward_mean"]) for a in resumed] == [(a["loss"], a["reward_mean"]) for a in actor]
    again = rows(tmp_path / "run" / "critic.jsonl")
    assert [c["value_loss"] for c in again] == [c["value_loss"] for c in critic]


SHARED = str(REPO / "recipes" / "ppo_arith_shared.py")


def test_actor_critic_trains_its_value_head_and_resumes_it_from_a_checkpoint(tmp_path, arith_model):
    """The trainer's own value head: no critic service, values and GAE in the trainer, and the head is
    part of the checkpoint (a resumed run repeats the value losses to the last bit) and of the final
    model directory."""
    common = [f"*.model={arith_model}", f"run_dir={tmp_path / 'run'}", "total_steps=6", "checkpoint_every=3",
              "rollout.eval_every=0"]  # fmt: skip
    r = run(tmp_path, *common, recipe=SHARED)
    assert r.returncode == 0, r.stderr[-3000:]
    actor = rows(tmp_path / "run" / "metrics.jsonl")
    assert not (tmp_path / "run" / "critic.jsonl").exists()
    assert (tmp_path / "run" / "final" / "value_head.safetensors").exists()
    loss = [m["value_loss"] for m in actor]
    assert loss[0] > 0 and actor[0]["values_mean"] == pytest.approx(0.0, abs=0.05)  # a fresh head: all 0
    assert mean(loss[-2:]) < mean(loss[:2]), loss
    # at most 1 (a perfect value), unbounded below: a batch whose returns barely vary gives -12 (seen)
    assert all(math.isfinite(m["explained_variance"]) and m["explained_variance"] <= 1 and "kl_ref" in m
               for m in actor)  # fmt: skip
    r = run(tmp_path, "--resume", *common, recipe=SHARED)  # steps 3..5 again, from the checkpoint
    assert r.returncode == 0, r.stderr[-3000:]
    resumed = rows(tmp_path / "run" / "metrics.jsonl")
    key = lambda m: (m["loss"], m["value_loss"], m["reward_mean"])  # noqa: E731
    assert [key(m) for m in resumed] == [key(m) for m in actor]


@pytest.mark.slow
def test_actor_critic_learns_a_reward_its_value_head_can_read(tmp_path, arith_model):
    r = run(tmp_path, f"*.model={arith_model}", f"run_dir={tmp_path / 'run'}", "total_steps=30",
            "rollout.eval_every=0", EVEN, recipe=SHARED)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    actor = rows(tmp_path / "run" / "metrics.jsonl")
    first, last = mean([m["reward_mean"] for m in actor[:5]]), mean([m["reward_mean"] for m in actor[-5:]])
    assert last >= first + 0.2, (first, last)
    loss = [m["value_loss"] for m in actor]
    assert mean(loss[-5:]) < 0.5 * mean(loss[:5]), loss
    assert_drifts([m["kl_ref"] for m in actor])  # measured: first 3 steps 0.19, last 5 1.70


MEMORY = ("trainer.memory.precision=bf16-mixed", "trainer.memory.activation_checkpointing=true",
          "trainer.memory.max_tokens_per_micro_batch=128")  # fmt: skip


@pytest.mark.parametrize("settings", [(), MEMORY], ids=["fp32", "memory-settings"])
def test_two_trainer_ranks_shard_the_actor_critic(tmp_path, arith_model, settings):
    """FSDP2 over two gloo ranks: each claims half of every mini-batch, values and whitening are taken
    over both halves, and the final model (policy + head) is gathered from the shards; also with
    bf16 mixed precision (FSDP's policy), checkpointed layers inside FSDP's units and packed rows."""
    r = run(tmp_path, f"*.model={arith_model}", f"run_dir={tmp_path / 'run'}", "total_steps=3",
            "checkpoint_every=2", "rollout.eval_every=0", "trainer.devices_per_replica=2", *settings,
            recipe=SHARED)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    actor = rows(tmp_path / "run" / "metrics.jsonl")
    assert [m["samples"] for m in actor] == [128, 128, 128] and all(m["value_loss"] > 0 for m in actor)
    assert (tmp_path / "run" / "logs" / "trainer-0-2.log").exists()  # the second rank's process
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final") is not None
    head = load_file(tmp_path / "run" / "final" / "value_head.safetensors")
    assert head["weight"].shape[0] == 1 and head["weight"].abs().sum() > 0  # trained away from zero
