"""GRPO on arithmetic, asynchronous: generation runs up to one weight version ahead of training.

    meshrl run recipes/grpo_arith_async.py *.model=runs/arith-sft

Identical to recipes/grpo_arith.py but for pacing (rollout.window=2: a sample may be generated with
weights one version older than the batch it trains in), the loss (decoupled PPO: the ratio is taken
against the trainer's own proximal policy, the behaviour -> proximal importance weight truncated) and a
gentler learning rate (2e-4 instead of 3e-4: with samples a version old, 3e-4 oscillates on this task).
With rollout.window=1 and trainer.optim.lr=3e-4 it reproduces the synchronous recipe step for step.
"""

import dataclasses

from grpo_arith import recipe as sync_recipe

from meshrl.planning.recipe import Recipe


def recipe() -> Recipe:
    base = sync_recipe().with_overrides(
        [
            "rollout.window=2",
            "trainer.loss.off_policy=decoupled",
            "trainer.loss.is_cap=5",
            "trainer.optim.lr=2e-4",
        ]
    )
    return dataclasses.replace(base, name="grpo_arith_async")
