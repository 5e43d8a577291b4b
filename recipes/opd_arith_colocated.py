"""On-policy distillation with inference, teacher and trainer taking turns on one device slot.

    meshrl sft --model runs/arith-base --data runs/arith-sft.jsonl --out runs/arith-teacher --steps 200 \
      --batch 40 --eval-fraction 0 memory.micro_batch=40 optim.lr=3e-3 optim.warmup_steps=10   # once
    meshrl run recipes/opd_arith_colocated.py *.model=runs/arith-sft teacher.model=runs/arith-teacher

recipes/opd_arith.py plus one colocation ring: inference is the FALLBACK member (it holds the slot
whenever nobody else asks); the teacher (when it has samples to score) and the trainer (when a step's
samples are scored) are ON_DEMAND and take the slot in ring order. Only the recipe changes.
"""

import dataclasses

from opd_arith import recipe as opd_recipe

from meshrl.planning.recipe import ColocationRing, Recipe, RingMember, Scheduling


def recipe() -> Recipe:
    base = opd_recipe()
    ring = ColocationRing(
        id="shared",
        members=(
            RingMember(group="inference", mode=Scheduling.FALLBACK),
            RingMember(group="teacher"),
            RingMember(group="trainer"),
        ),
    )
    return dataclasses.replace(base, name="opd_arith_colocated", rings=(ring,))
