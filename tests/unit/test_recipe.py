"""Recipes and overrides: every problem listed at once, settings stated once, Literal settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshrl.engines.settings import LossConfig, OptimConfig
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
        prepare(
            GRPO, ["*.model=/nonexistent", "trainer.optim.lr=-1", "rollout.window=0", "rollout.eval_size=-1"]
        )
    problems = listed(e)
    assert "override 'trainer.optim.lr=-1': lr: must be > 0, got -1.0" in problems
    assert "override 'rollout.window=0': window: must be >= 1 or None" in problems
    assert "override 'rollout.eval_size=-1': eval_size: must be >= 0 (0: no evaluation) or None" in problems
    for group in ("rollout", "inference", "trainer"):
        assert f"groups['{group}'].config.model: path '/nonexistent' does not exist" in "\n".join(problems)


def test_a_config_lists_every_problem_of_its_own_fields():
    with pytest.raises(RecipeError) as e:
        LossConfig(is_cap=-1, aggregation="mean", dual_clip=0.5)  # type: ignore[arg-type]
    problems = listed(e)
    assert "is_cap: must be > 0" in problems and "dual_clip: must be > 1 (or None)" in problems
    assert any(p.startswith("aggregation: 'mean' is not one of 'token-mean'") for p in problems), problems
    with pytest.raises(RecipeError) as e:
        TrainerConfig(model="m", epochs=0, max_staleness=-1)
    assert listed(e) == ["mini_batches, epochs: must be >= 1", "max_staleness: must be >= 0"]
    with pytest.raises(RecipeError, match="lr: must be > 0"):
        OptimConfig(lr=0)


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


def test_the_trainer_settings_in_sections_and_the_old_flat_paths_say_where_they_went():
    r = load_recipe(
        GRPO, ["trainer.optim.lr=1e-4", "trainer.memory.precision=bf16-mixed", "trainer.kl.coef=0.1"]
    )
    trainer = r.group("trainer").config
    assert isinstance(trainer, TrainerConfig)
    assert (trainer.optim.lr, trainer.memory.precision, trainer.kl.coef) == (1e-4, "bf16-mixed", 0.1)
    for old, new in (
        ("trainer.lr=1e-4", "optim.lr"),
        ("trainer.micro_batch=8", "memory.micro_batch"),
        ("trainer.kl_coef=0.1", "kl.coef"),
        ("trainer.loss_agg=token-mean", "loss.aggregation"),
        ("trainer.value_head=true", "value.head"),
        ("trainer.distill_coef=1", "distill.coef"),
        ("rollout.kl_in_reward=0.1", "kl_penalty.coef"),
    ):
        with pytest.raises(RecipeError) as e:
            load_recipe(GRPO, [old])
        assert listed(e) == [f"override {old!r}: {old.split('.')[1].split('=')[0]} has moved: set {new}"]


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


def test_a_recipe_file_with_the_old_flat_trainer_config_says_where_each_field_went(tmp_path):
    old = tmp_path / "flat.py"
    old.write_text(
        "from meshrl.planning.recipe import Recipe, ServiceGroup\n"
        "from meshrl.roles.trainer.config import TrainerConfig\n"
        "def recipe():\n"
        "    return Recipe(name='x', groups=(ServiceGroup(id='trainer', config=TrainerConfig(\n"
        "        model='m', lr=1e-5)),))\n"
    )
    with pytest.raises(RecipeError, match=r"TrainerConfig\(lr=...\): lr has moved: set optim.lr"):
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
    from meshrl.planning.wiring import wire

    def publishes(*overrides: str) -> bool:
        recipe = read_recipe(REPO / "recipes" / "grpo_arith.py").with_overrides(list(overrides))
        link = wire(recipe)[0]["trainer"].weights
        assert link is not None and link.receivers == ("inference",)
        assert wire(recipe)[0]["inference"].weights == link
        return link.adapters is not None

    assert publishes("trainer.lora.rank=8", "inference.engine=vllm")
    assert not publishes("trainer.lora.rank=8")  # the HF engine loads merged weights
    assert not publishes("inference.engine=vllm")  # full fine-tuning


def test_vllm_gpu_memory_fraction_is_checked() -> None:
    recipe = read_recipe(REPO / "recipes" / "grpo_arith.py")
    with pytest.raises(
        RecipeError, match=r"gpu_memory_fraction=0': gpu_memory_fraction: must be in \(0, 1\]"
    ):
        recipe.with_overrides(["inference.vllm.gpu_memory_fraction=0"])
