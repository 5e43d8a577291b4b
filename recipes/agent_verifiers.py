"""A verifiers v1 environment trained as it is, offline: the demo's sums as a taskset, GRPO on CPU.

    make run                                          # once: builds runs/arith-sft
    meshrl run recipes/agent_verifiers.py *.model=runs/arith-sft

The taskset is meshrl's own (meshrl/tasks/vf_sums.py, taskset id `meshrl-vf-sums`): its harness makes
the episode's one model call in-process, so nothing is downloaded and no sandbox is needed (the
subprocess runtime, below). Four services: rollout feeds the taskset's tasks (`dataset="verifiers:..."`:
its `load()`, in the wire form verifiers sends, 20 held out); the agents service plays each as one
verifiers episode (meshrl/envs/verifiers.py: `run_episode`) with verifiers' training client, which
renders the messages with the policy's tokenizer and posts token ids to the agents' endpoint
(`/inference/v1/generate`); inference generates every call; the episode's named rewards
(`reward/env_correct` in rewards.jsonl) are the trajectory's reward. `rollout.dataset_kwargs` is the
taskset's config (`{"two_digit": 100}` adds 100 two-digit sums the warm start cannot do).

Measured on a fresh clone, offline, on 2 cores (runs/arith-sft by the demo's warm start): reward mean
over the first 10 steps -> the last 10, 0.070 -> 0.185 in 642 s, 0 of 5120 episodes failed (an earlier
run, before the endpoint kept idle connections open past a client's keep-alive: 0.090 -> 0.175, 662 s,
19 failed with a connection error). `meshrl eval` on the 20 held-out tasks: greedy 0.00 -> 0.20,
sampled 0.05 -> 0.25.
"""

from meshrl.engines.settings import OptimConfig
from meshrl.planning.recipe import Recipe, ServiceGroup
from meshrl.roles.agents.config import AgentsConfig
from meshrl.roles.inference.config import InferenceConfig
from meshrl.roles.rollout.config import RolloutConfig
from meshrl.roles.trainer.config import TrainerConfig

MODEL = "runs/arith-sft"  # made by `make run` (meshrl demo); override with *.model=PATH
TASKSET = "meshrl-vf-sums"
ENVIRONMENT = {"agent": {"runtime": {"type": "subprocess"}}}
"""The rest of the env's config (v1's `[env]`): the harness runs on this host, in-process."""


def recipe() -> Recipe:
    return Recipe(
        name="agent_verifiers",
        total_steps=40,
        seed=0,
        prompts_per_step=16,
        group_size=8,
        temperature=1.0,
        groups=(
            ServiceGroup(
                id="rollout",
                config=RolloutConfig(
                    model=MODEL,
                    dataset=f"verifiers:{TASKSET}",
                    eval_size=20,
                    rewards={"env": 1.0},
                    window=1,
                    eval_every=0,
                ),
            ),
            ServiceGroup(
                id="agents",
                config=AgentsConfig(model=MODEL, verifiers=TASKSET, args=ENVIRONMENT, name="policy"),
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
