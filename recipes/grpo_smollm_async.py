"""recipes/grpo_smollm.py, bounded-async: generation runs up to one step ahead of the trainer.

    meshrl run recipes/grpo_smollm_async.py
    python benchmarks/e2e_cpu.py --recipe grpo_smollm --async-vs-sync --json   # seconds per step, gain

With `rollout.window=2` inference generates the next step's samples while the trainer trains on this
step's, with the weights it has (at most one version old); the loss corrects for the stale samples with
decoupled PPO (the ratio against the trainer's own weights at the start of the step, the importance
weight behaviour -> proximal truncated at `trainer.loss.is_cap`).
"""

import dataclasses

from grpo_smollm import recipe as sync_recipe

from meshrl.planning.recipe import Recipe


def recipe() -> Recipe:
    base = sync_recipe().with_overrides(
        ["rollout.window=2", "trainer.loss.off_policy=decoupled", "trainer.loss.is_cap=5"]
    )
    return dataclasses.replace(base, name="grpo_smollm_async")
