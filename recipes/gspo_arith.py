"""GRPO on arithmetic, variant: GSPO (Zheng et al. 2025): one importance ratio per sequence (the geometric
mean of token ratios), clipped per sequence.

    meshrl run recipes/gspo_arith.py *.model=runs/arith-sft

recipes/grpo_arith.py with: trainer.loss.policy=gspo trainer.loss.clip_low=3e-4 trainer.loss.clip_high=4e-4.
"""

import dataclasses

from grpo_arith import recipe as grpo_recipe

from meshrl.planning.recipe import Recipe


def recipe() -> Recipe:
    base = grpo_recipe().with_overrides(
        ["trainer.loss.policy=gspo", "trainer.loss.clip_low=3e-4", "trainer.loss.clip_high=4e-4"]
    )
    return dataclasses.replace(base, name="gspo_arith")
