"""Simulated engines for pipeline measurements: real services and data plane, sleeps for the model math.

    meshrl run recipes/pipeline_sim.py *.model=PATH inference.replicas=16 rollout.window=2

Inference replicas generate lognormal-length responses (median 100 tokens, 99th percentile ~10x) at
0.5 ms per decoding step; the trainer spends 25 us per trained token. `benchmarks/pipeline_sim.py`
runs it synchronously and asynchronously and compares with the ideal overlap. PATH only provides a
tokenizer (any local model directory).
"""

from meshrl.engines.settings import SimGeneration, SimTraining
from meshrl.planning.recipe import Recipe, ServiceGroup
from meshrl.roles.inference.config import InferenceConfig
from meshrl.roles.rollout.config import RolloutConfig
from meshrl.roles.trainer.config import TrainerConfig

MODEL = "runs/arith-sft"
GROUP = 8


def recipe() -> Recipe:
    return Recipe(
        name="pipeline_sim",
        total_steps=20,
        prompts_per_step=16,
        group_size=GROUP,
        groups=(
            ServiceGroup(
                id="rollout",
                config=RolloutConfig(model=MODEL, rewards={"meshrl.tasks.arith:reward": 1.0}, window=1),
            ),
            ServiceGroup(
                id="inference",
                config=InferenceConfig(
                    model=MODEL,
                    engine="sim",
                    sim=SimGeneration(token_s=0.0005, median_tokens=100, sigma=1.0),
                    max_new_tokens=1000,
                    max_batch=GROUP,
                ),
                replicas=16,
            ),
            ServiceGroup(
                id="trainer",
                config=TrainerConfig(
                    model=MODEL,
                    engine="sim",
                    sim=SimTraining(token_s=25e-6),
                    save_final=False,
                ),
                devices_per_replica=1,
            ),
        ),
    )
