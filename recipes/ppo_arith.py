"""PPO with a critic and a KL penalty to a frozen reference, on single-digit addition.

    meshrl run recipes/ppo_arith.py *.model=runs/arith-sft

recipes/grpo_arith.py plus two services: a critic (its own model, optimizer and version) and a
reference (the initial policy, frozen). Rollout waits for each completion's `values` (critic) and
`ref_logprobs` (reference), puts a per-token KL(behaviour || reference) penalty into the reward, and
computes GAE advantages and returns; the actor trains on the advantages, the critic on the returns.
Every service only adds columns to the same rows.
"""

import dataclasses

from grpo_arith import MODEL
from grpo_arith import recipe as grpo_recipe

from meshrl.engines.settings import OptimConfig
from meshrl.planning.recipe import Recipe, ServiceGroup
from meshrl.roles.critic.config import CriticConfig
from meshrl.roles.reference.config import ReferenceConfig


def recipe() -> Recipe:
    base = grpo_recipe().with_overrides(
        ["rollout.advantage=gae", "rollout.gamma=1.0", "rollout.lam=0.95", "rollout.kl_penalty.coef=0.01",
         "trainer.kl.metric=true"]
    )  # fmt: skip
    critic = CriticConfig(model=MODEL, optim=OptimConfig(lr=1e-4, warmup_steps=5), mini_batches=4, threads=1)
    reference = ReferenceConfig(model=MODEL, threads=1)
    return dataclasses.replace(
        base,
        name="ppo_arith",
        groups=(
            *base.groups,
            ServiceGroup(id="critic", config=critic, devices_per_replica=1),
            ServiceGroup(id="reference", config=reference, devices_per_replica=1),
        ),
    )
