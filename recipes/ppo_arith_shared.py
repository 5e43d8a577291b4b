"""PPO with a shared-backbone actor-critic and a KL penalty to a frozen reference, on single-digit addition.

    meshrl run recipes/ppo_arith_shared.py *.model=runs/arith-sft

recipes/ppo_arith.py without the critic service: the trainer's policy carries a value head on its last
hidden state (trainer.value.head). Rollout writes per-token rewards (the score on the last token, minus
the KL penalty to the reference on every token) instead of advantages; the trainer computes each
mini-batch's values, GAE advantages and returns with the weights it is about to update, and trains
policy and value head in one backward (value_coef x the clipped value loss). One model fewer to hold.
"""

import dataclasses

from grpo_arith import MODEL
from grpo_arith import recipe as grpo_recipe

from meshrl.planning.recipe import Recipe, ServiceGroup
from meshrl.roles.reference.config import ReferenceConfig


def recipe() -> Recipe:
    base = grpo_recipe().with_overrides(
        ["rollout.advantage=gae", "rollout.values=trainer", "rollout.gamma=1.0", "rollout.lam=0.95",
         "rollout.kl_penalty.coef=0.01", "trainer.kl.metric=true", "trainer.value.head=true",
         "trainer.value.coef=0.5"]
    )  # fmt: skip
    reference = ReferenceConfig(model=MODEL, threads=1)
    return dataclasses.replace(
        base,
        name="ppo_arith_shared",
        groups=(*base.groups, ServiceGroup(id="reference", config=reference, devices_per_replica=1)),
    )
