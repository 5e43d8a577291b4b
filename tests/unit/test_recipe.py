"""Recipes and overrides: every problem listed at once, settings stated once, Literal settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshrl.planning import prepare
from meshrl.planning.config import RecipeError
from meshrl.planning.recipe import load_recipe, read_recipe
from meshrl.roles.inference.config import InferenceConfig
from meshrl.roles.trainer.config import TrainerConfig

REPO = Path(__file__).resolve().parents[2]
GRPO = REPO / "recipes" / "grpo_arith.py"


def listed(e: pytest.ExceptionInfo[RecipeError]) -> list[str]:
    return e.value.problems


def test_several_bad_fields_are_all_listed_with_the_plan_problems():
    """As a new user types it: a missing model, a negative learning rate and a zero window."""
    with pytest.raises(RecipeError) as e:
        prepare(GRPO, ["*.model=/nonexistent", "trainer.lr=-1", "rollout.window=0"])
    problems = listed(e)
    assert "override 'trainer.lr=-1': lr: must be > 0" in problems
    assert "override 'rollout.window=0': window: must be >= 1 or None" in problems
    for group in ("rollout", "inference", "trainer"):
        assert f"groups['{group}'].config.model: path '/nonexistent' does not exist" in "\n".join(problems)


def test_a_config_lists_every_problem_of_its_own_fields():
    with pytest.raises(RecipeError) as e:
        TrainerConfig(model="m", lr=0, epochs=0, is_cap=-1, loss_agg="mean")  # type: ignore[arg-type]
    problems = listed(e)
    assert "lr: must be > 0" in problems and "is_cap: must be > 0" in problems
    assert "micro_batch, mini_batches, epochs: must be >= 1" in problems
    assert any(p.startswith("loss_agg: 'mean' is not one of 'token-mean'") for p in problems), problems


def test_literal_settings_are_checked_with_their_allowed_values():
    with pytest.raises(RecipeError) as e:
        load_recipe(GRPO, ["inference.engine=vlm"])
    assert listed(e) == ["override 'inference.engine=vlm': 'vlm' is not one of 'hf', 'vllm', 'sglang', 'sim'"]
    r = load_recipe(GRPO, ["inference.engine=sim", "rollout.window=none", "trainer.restart.mode=on-failure"])
    assert r.group("inference").config.engine == "sim"  # type: ignore[attr-defined]
    assert r.group("rollout").config.window is None  # type: ignore[attr-defined]
    assert r.group("trainer").restart.mode == "on-failure"
    with pytest.raises(RecipeError, match="interrupt: 'later' is not one of 'finish', 'continue'"):
        InferenceConfig(model="m", interrupt="later")  # type: ignore[arg-type]


def test_settings_stated_once_and_the_old_paths_say_where_they_went():
    r = load_recipe(GRPO, ["prompts_per_step=32", "temperature=0.7", "group_size=4"])
    assert (r.prompts_per_step, r.group_size, r.temperature, r.batch_size) == (32, 4, 0.7, 128)
    for old in (
        "rollout.prompts_per_step=32",
        "trainer.temperature=0.7",
        "*.temperature=0.7",
        "*.group_size=4",
    ):
        with pytest.raises(RecipeError) as e:
            load_recipe(GRPO, [old])
        name, value = old.split(".", 1)[1].split("=")
        assert listed(e) == [
            f"override {old!r}: {name} is set once for the whole recipe and read by every service that needs "
            f"it: write {name}={value}"
        ]


def test_a_recipe_file_that_sets_a_moved_field_in_a_config_says_where_it_went(tmp_path):
    old = tmp_path / "old_style.py"
    old.write_text(
        "from meshrl.planning.recipe import Recipe, ServiceGroup\n"
        "from meshrl.roles.inference.config import InferenceConfig\n"
        "def recipe():\n"
        "    return Recipe(name='x', groups=(ServiceGroup(id='inference', config=InferenceConfig(\n"
        "        model='m', temperature=0.5)),))\n"
    )
    with pytest.raises(RecipeError, match=r"InferenceConfig\(temperature=...\): temperature is set once for "
                       r"the whole recipe: Recipe\(temperature=...\)"):  # fmt: skip
        read_recipe(old)


def test_the_trainers_mini_batches_must_hold_whole_groups_on_every_rank(tiny_model):
    with pytest.raises(RecipeError) as e:
        prepare(GRPO, [f"*.model={tiny_model}", "prompts_per_step=10"])
    assert listed(e) == [
        "groups['trainer'].config.mini_batches: the recipe's prompts_per_step (10) must divide into 4 "
        "mini-batches of whole groups on each of 1 trainer rank(s)"
    ]
    recipe, topology = prepare(
        GRPO, [f"*.model={tiny_model}", "prompts_per_step=12", "trainer.mini_batches=3"]
    )
    assert recipe.batch_size == 96 and topology.replicas_of("trainer")


def test_a_lora_trainer_publishes_adapters_alone_only_when_every_inference_group_runs_vllm() -> None:
    def publishes(*overrides: str) -> bool:
        recipe = read_recipe(REPO / "recipes" / "grpo_arith.py").with_overrides(list(overrides))
        trainer = recipe.group("trainer").config
        assert isinstance(trainer, TrainerConfig)
        return trainer.publishes_adapters(recipe)

    assert publishes("trainer.lora.rank=8", "inference.engine=vllm")
    assert not publishes("trainer.lora.rank=8")  # the HF engine loads merged weights
    assert not publishes("inference.engine=vllm")  # full fine-tuning


def test_vllm_gpu_memory_fraction_is_checked() -> None:
    recipe = read_recipe(REPO / "recipes" / "grpo_arith.py")
    with pytest.raises(RecipeError, match=r"vllm.gpu_memory_fraction: must be in \(0, 1\]"):
        recipe.with_overrides(["inference.vllm.gpu_memory_fraction=0"])
