"""The agents service's recipe checks: each problem named by its field, before anything starts."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from meshrl.envs import Environment, Limits, State, Turn
from meshrl.planning.config import RecipeError
from meshrl.planning.recipe import load_recipe
from meshrl.planning.topology import Device, devices_needed, plan
from meshrl.roles.agents.config import AgentsConfig

REPO = Path(__file__).resolve().parents[3]


def planned(tiny_model: Path, *overrides: str, recipe: str = "agent_calc.py") -> None:
    r = load_recipe(REPO / "recipes" / recipe, [f"*.model={tiny_model}", *overrides])
    plan(r, [Device(i, "localhost", i) for i in range(devices_needed(r))])


def test_bad_fields_are_listed_at_once() -> None:
    with pytest.raises(RecipeError) as e:
        AgentsConfig(model="m", environment="no_colon", max_turns=0, concurrency=0, step_timeout_s=4000.0)
    assert e.value.problems == [
        "environment: 'no_colon' must look like 'package.module:name'",
        "max_turns: must be >= 1",
        "concurrency: must be >= 1",
        "step_timeout_s: must be > 0 and below lease_s (1800)",
    ]
    with pytest.raises(RecipeError, match="set exactly one"):
        AgentsConfig(model="m", environment="a:B", program="a:f")
    with pytest.raises(RecipeError, match="set exactly one"):
        AgentsConfig(model="m")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("agents.environment=meshrl.tasks.agent_calc:calc", "is not a subclass of meshrl.envs.Environment"),
        ("agents.environment=meshrl.nope:Env", "environment: cannot import 'meshrl.nope'"),
        (
            "agents.max_tokens=16",
            "max_tokens: a budget of 16 tokens leaves no room for a prompt beside a turn of 16",
        ),
        (
            'agents.args={"level": 3}',
            r"args: CalcEnv cannot take \{'level': 3\}: got an unexpected keyword argument 'level'",
        ),
        (
            "agents.environment=tests.unit.envs.test_agents_config:OldReward",
            r"OldReward.reward must take \(self, state, final, transcript\)",
        ),
        (
            "agents.environment=tests.unit.envs.test_agents_config:OldLimits",
            r"OldLimits sets tool_timeout_s, which no longer configures an environment: it is the recipe's "
            r"agents.tool_timeout_s \(read it here as self.limits.tool_timeout_s\)",
        ),
        (
            "inference.trainer=rollout",
            "inference'].config.trainer: 'rollout' is not a trainer of this recipe",
        ),
    ],
)
def test_recipe_problems_name_the_field(tiny_model: Path, override: str, message: str) -> None:
    with pytest.raises(RecipeError, match=message):
        planned(tiny_model, override)


def test_a_program_recipe_is_checked_too(tiny_model: Path) -> None:
    planned(tiny_model, recipe="agent_program.py")
    with pytest.raises(
        RecipeError, match="program 'meshrl.tasks.arith.agent:nope': meshrl.tasks.arith.agent has no function"
    ):
        planned(tiny_model, "agents.program=meshrl.tasks.arith.agent:nope", recipe="agent_program.py")
    with pytest.raises(RecipeError, match=r"args: meshrl.tasks.arith.agent:solve cannot take \{'laps': 2\}"):
        planned(tiny_model, 'agents.args={"laps": 2}', recipe="agent_program.py")


class OldReward(Environment):
    async def reward(self, state: State, final: Turn | None) -> float:  # type: ignore[override]
        return 0.0


class OldLimits(Environment):
    """Sets a class attribute that once was a setting of its own and now is the recipe's limit."""

    tool_timeout_s = 3.0


class Sized(Environment):
    def __init__(self, size: int, hard: bool = False) -> None:
        self.size, self.hard = size, hard


def test_args_build_the_environment_and_limits_come_from_the_recipe(tiny_model: Path) -> None:
    planned(
        tiny_model, "agents.environment=tests.unit.envs.test_agents_config:Sized", 'agents.args={"size": 3}'
    )
    with pytest.raises(RecipeError, match="Sized cannot take \\{\\}: missing a required argument: 'size'"):
        planned(tiny_model, "agents.environment=tests.unit.envs.test_agents_config:Sized")
    cfg = AgentsConfig(model="m", environment="x:Sized", max_turns=3, tool_timeout_s=2.0, max_tokens=2048)
    assert cfg.limits(16) == Limits(max_turns=3, max_tokens=2048, max_new_tokens=16, tool_timeout_s=2.0)
    assert AgentsConfig(model=str(tiny_model), environment="x:Sized").budget() == 128  # the model's context


def test_env_reward_without_an_agents_group_says_what_to_add(tiny_model: Path) -> None:
    r = load_recipe(REPO / "recipes" / "agent_calc.py", [f"*.model={tiny_model}"])
    r = dataclasses.replace(r, groups=tuple(g for g in r.groups if g.id != "agents"))
    with pytest.raises(
        RecipeError, match=r"reads samples.env_reward, which no service writes: add an agents group"
    ):
        plan(r, [Device(i, "localhost", i) for i in range(devices_needed(r))])
