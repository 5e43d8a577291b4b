"""The environment service's recipe checks: each problem named by its field, before anything starts."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from meshrl.envs import Environment, Limits, State, Turn
from meshrl.planning.config import RecipeError
from meshrl.planning.recipe import load_recipe
from meshrl.planning.topology import Device, devices_needed, plan
from meshrl.roles.env.config import EnvConfig

REPO = Path(__file__).resolve().parents[3]


def planned(tiny_model: Path, *overrides: str) -> None:
    r = load_recipe(REPO / "recipes" / "agent_calc.py", [f"*.model={tiny_model}", *overrides])
    plan(r, [Device(i, "localhost", i) for i in range(devices_needed(r))])


def test_bad_fields_are_listed_at_once() -> None:
    with pytest.raises(RecipeError) as e:
        EnvConfig(model="m", environment="no_colon", max_turns=0, concurrency=0, step_timeout_s=1000.0)
    assert e.value.problems == [
        "environment: 'no_colon' must look like 'package.module:Class'",
        "max_turns: must be >= 1",
        "concurrency: must be >= 1",
        "step_timeout_s: must be > 0 and below lease_s",
    ]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("env.environment=meshrl.tasks.agent_calc:calc", "is not a subclass of meshrl.envs.Environment"),
        ("env.environment=meshrl.nope:Env", "environment: cannot import 'meshrl.nope'"),
        ("env.max_tokens=16", "max_tokens: 16 leaves no room for one turn of 16"),
        (
            'env.environment_args={"level": 3}',
            r"environment_args: CalcEnv cannot take \{'level': 3\}: got an unexpected keyword argument 'level'",
        ),
        (
            "env.environment=tests.unit.envs.test_env_config:OldReward",
            r"OldReward.reward must take \(self, state, final, transcript\)",
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


class OldReward(Environment):
    async def reward(self, state: State, final: Turn | None) -> float:  # type: ignore[override]
        return 0.0


class Sized(Environment):
    def __init__(self, size: int, hard: bool = False) -> None:
        self.size, self.hard = size, hard


def test_environment_args_build_the_environment_and_limits_come_from_the_recipe(tiny_model: Path) -> None:
    planned(
        tiny_model,
        "env.environment=tests.unit.envs.test_env_config:Sized",
        'env.environment_args={"size": 3}',
    )
    with pytest.raises(RecipeError, match="Sized cannot take \\{\\}: missing a required argument: 'size'"):
        planned(tiny_model, "env.environment=tests.unit.envs.test_env_config:Sized")
    cfg = EnvConfig(model="m", environment="x:Sized", max_turns=3, tool_timeout_s=2.0)
    assert cfg.limits(16) == Limits(max_turns=3, max_tokens=2048, max_new_tokens=16, tool_timeout_s=2.0)


def test_env_reward_without_an_environment_says_what_to_add(tiny_model: Path) -> None:
    r = load_recipe(REPO / "recipes" / "agent_calc.py", [f"*.model={tiny_model}"])
    r = dataclasses.replace(r, groups=tuple(g for g in r.groups if g.id != "env"))
    with pytest.raises(
        RecipeError, match=r"reads samples.env_reward, which no service writes: add an environment"
    ):
        plan(r, [Device(i, "localhost", i) for i in range(devices_needed(r))])
