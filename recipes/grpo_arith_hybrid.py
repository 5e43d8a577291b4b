"""GRPO on arithmetic with inference and training in one process, sharing one copy of the weights.

    meshrl run recipes/grpo_arith_hybrid.py *.model=runs/arith-sft

recipes/grpo_arith.py plus a hybrid colocation ring: on the one device slot, the trainer and inference
run as two threads of one process. Inference generates with the trainer's own model, so publishing a
version moves no bytes (it sets the version), and turns need no offload; the ring still lets one of them
use the device at a time. With the same seed the run trains on the same samples as the disaggregated
recipe: its per-step losses equal grpo_arith's.
"""

import dataclasses

from grpo_arith import recipe as grpo_recipe

from meshrl.planning.recipe import ColocationRing, Recipe, RingMember, Scheduling


def recipe() -> Recipe:
    base = grpo_recipe()
    ring = ColocationRing(
        id="actor",
        members=(RingMember(group="inference", mode=Scheduling.FALLBACK), RingMember(group="trainer")),
        hybrid=True,
    )
    return dataclasses.replace(base, name="grpo_arith_hybrid", rings=(ring,))
