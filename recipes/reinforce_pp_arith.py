"""GRPO on arithmetic, variant: REINFORCE++ (Hu 2025): rewards normalised over the whole batch instead of
per group.

    meshrl run recipes/reinforce_pp_arith.py *.model=runs/arith-sft

recipes/grpo_arith.py with: rollout.advantage=reinforce_pp.
"""

import dataclasses

from grpo_arith import recipe as grpo_recipe

from meshrl.planning.recipe import Recipe


def recipe() -> Recipe:
    base = grpo_recipe().with_overrides(["rollout.advantage=reinforce_pp"])
    return dataclasses.replace(base, name="reinforce_pp_arith")
