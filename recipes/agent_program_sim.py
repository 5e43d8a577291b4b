"""Simulated agent programs through the endpoint, for pipeline measurements: recipes/agent_sim.py's work
(the same simulated engines, turn counts and tool latencies) done by an agent program that calls the
model through the OpenAI SDK (meshrl.tasks.sim:sim_program) instead of by an environment.

    meshrl run recipes/agent_program_sim.py *.model=PATH   # PATH only provides a tokenizer and chat template

`benchmarks/agent_gateway.py` runs it beside recipes/agent_sim.py.
"""

from meshrl.engines.settings import SimGeneration, SimTraining
from meshrl.planning.recipe import Recipe, ServiceGroup
from meshrl.roles.agents.config import AgentsConfig
from meshrl.roles.inference.config import InferenceConfig
from meshrl.roles.rollout.config import RolloutConfig
from meshrl.roles.trainer.config import TrainerConfig

MODEL = "runs/arith-base"


def recipe() -> Recipe:
    return Recipe(
        name="agent_program_sim",
        total_steps=6,
        prompts_per_step=16,
        group_size=8,
        groups=(
            ServiceGroup(
                id="rollout",
                config=RolloutConfig(model=MODEL, rewards={"env": 1.0}, window=None, eval_every=0),
            ),
            ServiceGroup(
                id="agents",
                # the simulated engine has no context limit: the model only lends its tokenizer
                config=AgentsConfig(
                    model=MODEL,
                    program="meshrl.tasks.sim:sim_program",
                    name="policy",
                    tool_role="user",
                    max_tokens=1_000_000,
                    concurrency=512,
                ),
            ),
            ServiceGroup(
                id="inference",
                config=InferenceConfig(
                    model=MODEL,
                    engine="sim",
                    sim=SimGeneration(token_s=0.001, median_tokens=30, sigma=1.0),
                    max_new_tokens=300,
                    max_batch=8,
                ),
                replicas=4,
            ),
            ServiceGroup(
                id="trainer",
                config=TrainerConfig(
                    model=MODEL, engine="sim", sim=SimTraining(token_s=1e-6), save_final=False
                ),
                devices_per_replica=1,
            ),
        ),
    )
