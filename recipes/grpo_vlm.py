"""GRPO for a vision-language model on CPU: a tiny Idefics3 (SmolVLM family) learns to name the colour
of the largest shape in a generated picture (meshrl/tasks/shapes), synchronous (lock-step).

    meshrl demo vlm                              # builds the model, warm-starts it, runs this recipe
    meshrl run recipes/grpo_vlm.py *.model=runs/vlm-sft total_steps=60 trainer.optim.lr=1e-4
    meshrl eval recipes/grpo_vlm.py --model runs/grpo_vlm

Three services on CPU, as grpo_arith's: inference (1 device slot), trainer (1 device slot), rollout (no
device). Rollout encodes each row's picture once with the model's processor (the IMAGES / IMAGE_MASK
columns); inference and the trainer read those pixels. The vision tower stays frozen (random-init, as
built): the connector and the language model learn to read its features.
"""

from meshrl.engines.settings import OptimConfig
from meshrl.planning.recipe import Recipe, ServiceGroup
from meshrl.roles.inference.config import InferenceConfig
from meshrl.roles.rollout.config import RolloutConfig
from meshrl.roles.trainer.config import TrainerConfig

MODEL = "runs/vlm-sft"  # made by `meshrl demo vlm`; override with *.model=PATH


def recipe() -> Recipe:
    return Recipe(
        name="grpo_vlm",
        total_steps=120,
        seed=0,
        prompts_per_step=16,
        group_size=8,
        temperature=0.7,
        groups=(
            ServiceGroup(
                id="rollout",
                config=RolloutConfig(
                    model=MODEL,
                    dataset="shapes",
                    rewards={"meshrl.tasks.shapes:reward": 1.0},
                    window=1,
                    eval_every=20,
                    eval_samples=0,
                ),
            ),
            ServiceGroup(
                id="inference",
                config=InferenceConfig(model=MODEL, max_new_tokens=8, threads=2),
                devices_per_replica=1,
            ),
            ServiceGroup(
                id="trainer",
                config=TrainerConfig(
                    model=MODEL,
                    optim=OptimConfig(lr=1e-4, warmup_steps=5),
                    mini_batches=2,
                    threads=2,
                ),
                devices_per_replica=1,
            ),
        ),
    )
