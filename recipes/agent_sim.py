"""Simulated agents for pipeline measurements: real services and data plane, sleeps for the model and
the tools.

    meshrl run recipes/agent_sim.py *.model=PATH     # PATH only provides a tokenizer and chat template

Each trajectory lasts 2-8 turns (meshrl/tasks/sim.py); each tool call waits a lognormal time (median
50 ms, 99th percentile ~2 s) and times out at 2.5 s (`tool_timeout_s`). Four inference replicas generate lognormal-length turns (median 30
tokens) at 1 ms per decoding step of a batch of up to 8; the trainer sleeps 1 us per token. Rollout
starts trajectories without waiting for the trainer (window None). `benchmarks/agent_sim.py` runs it
and the same work as a global loop with a barrier per turn.
"""

from meshrl.engines.settings import SimGeneration, SimTraining
from meshrl.planning.recipe import Recipe, ServiceGroup
from meshrl.roles.agents.config import AgentsConfig
from meshrl.roles.inference.config import InferenceConfig
from meshrl.roles.rollout.config import RolloutConfig
from meshrl.roles.trainer.config import TrainerConfig
from meshrl.tasks.sim import TOOL_TIMEOUT_S

MODEL = "runs/arith-base"


def recipe() -> Recipe:
    return Recipe(
        name="agent_sim",
        total_steps=6,
        prompts_per_step=16,
        group_size=8,
        groups=(
            ServiceGroup(
                id="rollout",
                config=RolloutConfig(model=MODEL, rewards={"env": 1.0}, window=None),
            ),
            ServiceGroup(
                id="agents",
                config=AgentsConfig(
                    model=MODEL,
                    environment="meshrl.tasks.sim:SimToolEnv",
                    parser="plain",
                    tool_role="user",
                    max_turns=8,
                    max_tokens=1_000_000,
                    tool_timeout_s=TOOL_TIMEOUT_S,
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
