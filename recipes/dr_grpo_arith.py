"""GRPO on arithmetic, variant: Dr. GRPO (Liu et al. 2025): no std scaling of group advantages and
sequence-sum-token aggregation with a constant normaliser, removing GRPO's length and difficulty biases.

    meshrl run recipes/dr_grpo_arith.py *.model=runs/arith-sft

recipes/grpo_arith.py with: rollout.advantage=dr_grpo trainer.loss.aggregation=seq-mean-token-sum.
"""

import dataclasses

from grpo_arith import recipe as grpo_recipe

from meshrl.planning.recipe import Recipe


def recipe() -> Recipe:
    base = grpo_recipe().with_overrides(
        ["rollout.advantage=dr_grpo", "trainer.loss.aggregation=seq-mean-token-sum"]
    )
    return dataclasses.replace(base, name="dr_grpo_arith")
