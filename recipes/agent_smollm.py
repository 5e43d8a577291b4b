"""An agent on a real chat model, on CPU: SmolLM2-135M-Instruct learns to use a calculator tool.

    meshrl models smollm2-135m                                               # the model (once)
    python -m meshrl.tasks.calculator --out runs/calculator_demos.jsonl      # demonstrations
    meshrl sft --model runs/smollm2-135m --data runs/calculator_demos.jsonl --out runs/smollm2-calculator \
      --steps 12 optim.lr=5e-5                                               # the warm start
    meshrl eval recipes/agent_smollm.py                                      # held-out, before RL
    meshrl run recipes/agent_smollm.py                                       # RL
    meshrl eval recipes/agent_smollm.py --model runs/agent_smollm            # and after

The task (meshrl/tasks/calculator.py): reasoning-gym's `basic_arithmetic` with two- and three-digit
numbers, products included, which the model cannot do in its head, and a `calculator` tool called in
the Hermes format (<tool_call>{"name": ..., "arguments": {...}}</tool_call>), described in the system
prompt. The warm start is `meshrl sft` on demonstrations of which half use the tool and half answer at
once; RL (GRPO on whole trajectories, the environment's reward) then finds that the tool is what
makes answers right. The README ("An agent on a real chat model") gives the figures measured here.
"""

from meshrl.engines.settings import MemoryConfig, OptimConfig
from meshrl.planning.recipe import Recipe, ServiceGroup
from meshrl.roles.agents.config import AgentsConfig
from meshrl.roles.inference.config import InferenceConfig
from meshrl.roles.rollout.config import RolloutConfig
from meshrl.roles.trainer.config import TrainerConfig
from meshrl.tasks.calculator import ARITHMETIC

MODEL = "runs/smollm2-calculator"  # the warm start (`meshrl sft`, above); override with *.model=PATH
TASK = "reasoning_gym:basic_arithmetic"


def recipe() -> Recipe:
    return Recipe(
        name="agent_smollm",
        total_steps=30,
        seed=0,
        prompts_per_step=8,
        group_size=4,
        temperature=1.0,
        groups=(
            ServiceGroup(
                id="rollout",
                config=RolloutConfig(
                    model=MODEL,
                    dataset=TASK,
                    eval_dataset=TASK,
                    dataset_kwargs=ARITHMETIC,
                    eval_size=100,
                    rewards={"env": 1.0},
                    window=1,
                    eval_every=0,
                    eval_samples=1,
                ),
            ),
            ServiceGroup(
                id="agents",
                config=AgentsConfig(
                    model=MODEL,
                    environment="meshrl.tasks.calculator:CalculatorEnv",
                    parser="hermes",
                    max_turns=3,
                    max_tokens=512,
                    tool_timeout_s=5.0,
                ),
            ),
            ServiceGroup(
                id="inference",
                config=InferenceConfig(model=MODEL, max_new_tokens=48, max_batch=64, threads=2),
                devices_per_replica=1,
            ),
            ServiceGroup(
                id="trainer",
                config=TrainerConfig(
                    model=MODEL,
                    optim=OptimConfig(lr=5e-6, warmup_steps=3),
                    memory=MemoryConfig(micro_batch=8),
                    mini_batches=1,
                    threads=2,
                ),
                devices_per_replica=1,
            ),
        ),
    )
