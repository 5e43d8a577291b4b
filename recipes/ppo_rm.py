"""PPO on arithmetic trained on a reward model's score instead of the rule.

    meshrl run recipes/ppo_rm.py *.model=runs/arith-sft reward_model.model=PATH_TO_RM

recipes/ppo_arith.py plus a reward-model service (an HF sequence-classification checkpoint with one
label) that writes `rm_score` into every completion's row. Rollout trains on the reward model's score
(`rollout.rewards`'s "rm" source; the rule reward keeps scoring the held-out evaluation only: its weight
is 0); give both weights to mix them.
"""

import dataclasses

from ppo_arith import recipe as ppo_recipe

from meshrl.planning.recipe import Recipe, ServiceGroup
from meshrl.roles.reward_model.config import RewardModelConfig

REWARD_MODEL = "runs/arith-rm"


def recipe() -> Recipe:
    base = ppo_recipe().with_overrides(['rollout.rewards={"rm": 1, "meshrl.tasks.arith:reward": 0}'])
    rm = ServiceGroup(id="reward_model", config=RewardModelConfig(model=REWARD_MODEL, threads=1))
    return dataclasses.replace(base, name="ppo_rm", groups=(*base.groups, rm))
