"""GRPO on a real pretrained chat model, on CPU: SmolLM2-135M-Instruct counts animals' legs.

    meshrl models smollm2-135m                                 # the model, as an HF folder (once)
    meshrl eval recipes/grpo_smollm.py                         # held-out accuracy before
    meshrl run recipes/grpo_smollm.py                          # train (total_steps=..., trainer.optim.lr=...)
    meshrl eval recipes/grpo_smollm.py --model runs/grpo_smollm   # and after, on its final checkpoint

What a TRL user writes, the meshrl way: the chat template with a system prompt, a procedurally
generated task (reasoning-gym's `leg_counting`, one or two kinds of animal so a 135M model can learn
it), and two reward functions: the math answer checker (math-verify) and a small format reward that
keeps the `<answer>` tag from being trained away. Any model works in its place: a hub id
(`*.model=HuggingFaceTB/SmolLM2-135M-Instruct`, from the local cache) or a GGUF file.
"""

from meshrl.engines.settings import MemoryConfig, OptimConfig
from meshrl.planning.recipe import Recipe, ServiceGroup
from meshrl.roles.inference.config import InferenceConfig
from meshrl.roles.rollout.config import RolloutConfig
from meshrl.roles.trainer.config import TrainerConfig

MODEL = "runs/smollm2-135m"  # made by `meshrl models smollm2-135m`; override with *.model=PATH_OR_HUB_ID
TASK = "reasoning_gym:leg_counting"
LEGS = {"size": 2000, "seed": 0, "min_animals": 1, "max_animals": 2, "max_instances": 3}
"""reasoning_gym.create_dataset's settings: one or two kinds of animal, at most three of each."""
SYSTEM = (
    "You count legs. Think step by step in one or two short sentences, then give the total as a "
    "number inside <answer></answer> tags, e.g. <answer>12</answer>."
)


def recipe() -> Recipe:
    return Recipe(
        name="grpo_smollm",
        total_steps=30,
        seed=0,
        prompts_per_step=8,
        group_size=8,
        temperature=1.0,
        groups=(
            ServiceGroup(
                id="rollout",
                config=RolloutConfig(
                    model=MODEL,
                    dataset=TASK,
                    eval_dataset=TASK,
                    dataset_kwargs=LEGS,
                    eval_size=32,
                    system_prompt=SYSTEM,
                    rewards={"meshrl.rewards:math_answer": 1.0, "meshrl.rewards:answer_format": 0.2},
                    correctness="meshrl.rewards:math_answer",
                    max_prompt_len=256,
                    window=1,
                    eval_every=0,
                    eval_samples=2,
                ),
            ),
            ServiceGroup(
                id="inference",
                config=InferenceConfig(model=MODEL, max_new_tokens=64, max_batch=64, threads=2),
                devices_per_replica=1,
            ),
            ServiceGroup(
                id="trainer",
                config=TrainerConfig(
                    model=MODEL,
                    optim=OptimConfig(lr=2e-6, warmup_steps=3),
                    memory=MemoryConfig(micro_batch=8),
                    mini_batches=2,
                    threads=2,
                ),
                devices_per_replica=1,
            ),
        ),
    )
