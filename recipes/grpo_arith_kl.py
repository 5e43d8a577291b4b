"""GRPO on arithmetic with a KL penalty to the initial policy: recipes/grpo_arith.py plus a reference.

    meshrl run recipes/grpo_arith_kl.py *.model=runs/arith-sft

The reference service (a frozen copy of the initial weights) writes `ref_logprobs` into every sample's
row; the trainer adds kl_coef * KL(policy || reference) (k3 estimator) to its loss and reports kl_ref.
Nothing else changes: no other service knows the reference is there.
"""

import dataclasses

from grpo_arith import MODEL
from grpo_arith import recipe as grpo_recipe

from meshrl.planning.recipe import Recipe, ServiceGroup
from meshrl.roles.reference.config import ReferenceConfig


def recipe() -> Recipe:
    base = grpo_recipe().with_overrides(["trainer.kl.coef=0.05", "trainer.kl.estimator=k3"])
    reference = ServiceGroup(
        id="reference",
        config=ReferenceConfig(model=MODEL, threads=1),
        devices_per_replica=1,
    )
    return dataclasses.replace(base, name="grpo_arith_kl", groups=(*base.groups, reference))
