"""PPO with a critic and a KL penalty to a frozen reference, on single-digit addition.

    meshrl run recipes/ppo_arith.py *.model=runs/arith-sft

Five services: inference, rollout, trainer (the actor), critic (its own model, optimizer and version)
and reference (the initial policy, frozen). Rollout waits for each completion's `values` (critic) and
`ref_logprobs` (reference), puts a per-token KL(behaviour || reference) penalty into the reward, and
computes GAE advantages and returns; the actor trains on the advantages, the critic on the returns.
Every service only adds columns to the same rows. Compare with recipes/grpo_arith.py.
"""

from meshrl.recipe import Recipe, ServiceGroup
from meshrl.roles.critic.config import CriticConfig
from meshrl.roles.inference.config import InferenceConfig
from meshrl.roles.reference.config import ReferenceConfig
from meshrl.roles.rollout.config import RolloutConfig
from meshrl.roles.trainer.config import TrainerConfig

MODEL = "runs/arith-sft"  # made by `make run` (meshrl demo); override with *.model=PATH
PROMPTS, GROUP, TEMPERATURE = 16, 8, 1.0


def recipe() -> Recipe:
    return Recipe(
        name="ppo_arith",
        total_steps=100,
        seed=0,
        groups=(
            ServiceGroup(
                id="rollout",
                config=RolloutConfig(
                    model=MODEL,
                    reward="meshrl.tasks.arith:reward",
                    prompts_per_step=PROMPTS,
                    group_size=GROUP,
                    advantage="gae",
                    gamma=1.0,
                    lam=0.95,
                    kl_in_reward=0.01,
                    eval_every=25,
                    eval_samples=4,
                ),
            ),
            ServiceGroup(
                id="inference",
                config=InferenceConfig(model=MODEL, temperature=TEMPERATURE, max_new_tokens=4, threads=2),
                devices_per_replica=1,
            ),
            ServiceGroup(
                id="trainer",
                config=TrainerConfig(
                    model=MODEL,
                    prompts_per_step=PROMPTS,
                    group_size=GROUP,
                    temperature=TEMPERATURE,
                    lr=3e-4,
                    warmup_steps=5,
                    mini_batches=4,
                    micro_batch=32,
                    kl_metric=True,
                    threads=2,
                ),
                devices_per_replica=1,
            ),
            ServiceGroup(
                id="critic",
                config=CriticConfig(
                    model=MODEL,
                    prompts_per_step=PROMPTS,
                    group_size=GROUP,
                    lr=1e-4,
                    warmup_steps=5,
                    mini_batches=4,
                    micro_batch=32,
                    threads=1,
                ),
                devices_per_replica=1,
            ),
            ServiceGroup(
                id="reference",
                config=ReferenceConfig(model=MODEL, temperature=TEMPERATURE, threads=1),
                devices_per_replica=1,
            ),
        ),
    )
