"""recipes/agent_calc.py, asynchronous: trajectories start up to one weight version ahead of training,
and one may span versions (each model token records its own); decoupled PPO corrects for it.

    meshrl run recipes/agent_calc_async.py *.model=runs/agent-calc-sft
"""

import dataclasses

from agent_calc import recipe as sync_recipe

from meshrl.planning.recipe import Recipe


def recipe() -> Recipe:
    base = sync_recipe().with_overrides(
        ["rollout.window=2", "trainer.loss.off_policy=decoupled", "trainer.loss.is_cap=5"]
    )
    return dataclasses.replace(base, name="agent_calc_async")
