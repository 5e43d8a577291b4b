"""GRPO on arithmetic, variant: RLOO (Ahmadian et al. 2024): each sample's baseline is the mean reward of
the other samples of its group.

    meshrl run recipes/rloo_arith.py *.model=runs/arith-sft

recipes/grpo_arith.py with: rollout.advantage=rloo.
"""

import dataclasses

from grpo_arith import recipe as grpo_recipe

from meshrl.planning.recipe import Recipe


def recipe() -> Recipe:
    base = grpo_recipe().with_overrides(["rollout.advantage=rloo"])
    return dataclasses.replace(base, name="rloo_arith")
