"""An agent program trained as it is: the arithmetic task asked through the OpenAI API, GRPO on CPU.

    make run                                          # once: builds runs/arith-sft
    meshrl run recipes/agent_program.py *.model=runs/arith-sft

Four services: rollout feeds tasks and scores trajectories by the program's reward; the agents service
runs the program (meshrl/tasks/arith/agent.py: `solve`) on each task, many at once; the program calls
the model through the agents service's endpoint (OpenAI-compatible, `/v1/chat/completions`), whose
every call is a row that inference generates; a session's calls join into one trained sample. Any program written against the OpenAI SDK trains this way (README, "Train an agent you
already have").
"""

from meshrl.engines.settings import OptimConfig
from meshrl.planning.recipe import Recipe, ServiceGroup
from meshrl.roles.agents.config import AgentsConfig
from meshrl.roles.inference.config import InferenceConfig
from meshrl.roles.rollout.config import RolloutConfig
from meshrl.roles.trainer.config import TrainerConfig

MODEL = "runs/arith-sft"  # made by `make run` (meshrl demo); override with *.model=PATH


def recipe() -> Recipe:
    return Recipe(
        name="agent_program",
        total_steps=100,
        seed=0,
        prompts_per_step=16,
        group_size=8,
        temperature=1.0,
        groups=(
            ServiceGroup(
                id="rollout",
                config=RolloutConfig(
                    model=MODEL, dataset="arith", rewards={"env": 1.0}, window=1, eval_every=0
                ),
            ),
            ServiceGroup(
                id="agents",
                config=AgentsConfig(
                    model=MODEL, program="meshrl.tasks.arith.agent:solve", name="policy", tool_role="user"
                ),
            ),
            ServiceGroup(
                id="inference",
                config=InferenceConfig(model=MODEL, max_new_tokens=4, threads=2),
                devices_per_replica=1,
            ),
            ServiceGroup(
                id="trainer",
                config=TrainerConfig(
                    model=MODEL, optim=OptimConfig(lr=3e-4, warmup_steps=5), mini_batches=4, threads=2
                ),
                devices_per_replica=1,
            ),
        ),
    )
