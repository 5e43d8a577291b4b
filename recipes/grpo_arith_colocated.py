"""GRPO on arithmetic with inference and training taking turns on the same device slot.

    meshrl run recipes/grpo_arith_colocated.py *.model=runs/arith-sft

recipes/grpo_arith.py plus one colocation ring: inference is the FALLBACK member (it holds the slot
whenever nobody else asks), the trainer ON_DEMAND (it asks once a step's samples are all there). Each
hand-over offloads the leaving service's weights (and the trainer's optimizer state) out of memory and
restores the arriving one's; inference comes back with the newest published weights. The run needs one
device slot instead of two; nothing else in the recipe changes.
"""

import dataclasses

from grpo_arith import recipe as grpo_recipe

from meshrl.planning.recipe import ColocationRing, Recipe, RingMember, Scheduling


def recipe() -> Recipe:
    base = grpo_recipe()
    ring = ColocationRing(
        id="actor",
        members=(RingMember(group="inference", mode=Scheduling.FALLBACK), RingMember(group="trainer")),
    )
    return dataclasses.replace(base, name="grpo_arith_colocated", rings=(ring,))
