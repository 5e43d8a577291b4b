"""GRPO on single-digit addition with a tiny model, synchronous (lock-step): the main CPU job.

    make run                                   # builds the model, warm-starts it, runs this recipe
    meshrl run recipes/grpo_arith.py *.model=runs/arith-sft total_steps=50 trainer.optim.lr=3e-4

Three services on CPU: inference (1 device slot), trainer (1 device slot), rollout (no device). One
torch thread each: on a ~1M-parameter model a second thread costs more in synchronisation than it
gives (`benchmarks/e2e_cpu.py`: 855 samples/s with one thread each, 535-570 with two; the same
numbers learned either way).
"""

from meshrl.engines.settings import OptimConfig
from meshrl.planning.recipe import Recipe, ServiceGroup
from meshrl.roles.inference.config import InferenceConfig
from meshrl.roles.rollout.config import RolloutConfig
from meshrl.roles.trainer.config import TrainerConfig

MODEL = "runs/arith-sft"  # made by `make run` (meshrl demo); override with *.model=PATH


def recipe() -> Recipe:
    return Recipe(
        name="grpo_arith",
        total_steps=100,
        seed=0,
        prompts_per_step=16,
        group_size=8,
        temperature=1.0,
        groups=(
            ServiceGroup(
                id="rollout",
                config=RolloutConfig(
                    model=MODEL,
                    dataset="arith",
                    rewards={"meshrl.tasks.arith:reward": 1.0},
                    window=1,
                    eval_every=25,
                    eval_samples=10,
                ),
            ),
            ServiceGroup(
                id="inference",
                config=InferenceConfig(model=MODEL, max_new_tokens=4, threads=1),
                devices_per_replica=1,
            ),
            ServiceGroup(
                id="trainer",
                config=TrainerConfig(
                    model=MODEL,
                    optim=OptimConfig(lr=3e-4, warmup_steps=5),
                    mini_batches=4,
                    threads=1,
                ),
                devices_per_replica=1,
            ),
        ),
    )
