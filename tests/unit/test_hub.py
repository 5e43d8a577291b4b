"""Models by hub id: found in the local huggingface_hub cache offline, or a start-up error saying how
to fetch them; every group of a recipe gets the same local folder."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from meshrl.models.hub import local
from meshrl.planning import prepare
from meshrl.planning.config import RecipeError
from meshrl.planning.models import resolve_models
from meshrl.planning.recipe import read_recipe

RECIPE = Path(__file__).parents[2] / "recipes" / "grpo_arith.py"


@pytest.fixture
def offline_cache(tmp_path, tiny_model, monkeypatch):
    """A huggingface_hub cache holding `meshrl-test/tiny` (the tiny model), offline."""
    from huggingface_hub import constants

    repo = tmp_path / "hub" / "models--meshrl-test--tiny"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(tiny_model, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return repo / "snapshots" / commit


def test_a_hub_id_resolves_to_its_cached_snapshot_for_every_group(offline_cache):
    assert local("meshrl-test/tiny") == offline_cache
    recipe = resolve_models(read_recipe(RECIPE).with_overrides(["*.model=meshrl-test/tiny"]))
    assert {g.config.model for g in recipe.groups} == {str(offline_cache)}


def test_a_model_found_nowhere_is_a_start_up_error_saying_how_to_fetch_it(offline_cache):
    with pytest.raises(RecipeError) as e:
        prepare(RECIPE, ["*.model=meshrl-test/absent"])
    assert "groups['rollout'].config.model: 'meshrl-test/absent' is neither a local path nor" in str(e.value)
    assert "hf download meshrl-test/absent" in str(e.value)
    assert local("./no/such/dir") is None
