"""GRPO on arithmetic, variant: DAPO (Yu et al. 2025): clip-higher, token-mean aggregation, dynamic
sampling (groups whose rewards all agree are dropped and replaced) and a soft overlong penalty.

    meshrl run recipes/dapo_arith.py *.model=runs/arith-sft

recipes/grpo_arith.py with: trainer.loss.clip_high=0.28 rollout.dynamic_sampling=true
rollout.overlong_max_len=4 rollout.overlong_buffer=1 rollout.overlong_penalty=0.5.
"""

import dataclasses

from grpo_arith import recipe as grpo_recipe

from meshrl.planning.recipe import Recipe


def recipe() -> Recipe:
    base = grpo_recipe().with_overrides(
        [
            "trainer.loss.clip_high=0.28",
            "rollout.dynamic_sampling=true",
            "rollout.overlong_max_len=4",
            "rollout.overlong_buffer=1",
            "rollout.overlong_penalty=0.5",
        ]
    )
    return dataclasses.replace(base, name="dapo_arith")
