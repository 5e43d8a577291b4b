"""Every model a recipe names, found on disk before the checks: hub ids and GGUF files become local
folders (meshrl/models/hub.py), so every role loads, saves and syncs the same kind of model."""

from __future__ import annotations

import dataclasses
from typing import Any

from meshrl.models.hub import local
from meshrl.planning.recipe import Recipe

MODEL_FIELDS = ("model", "policy")
"""Config fields that name a model."""


def resolve_models(recipe: Recipe) -> Recipe:
    """The recipe with every model that can be found replaced by its local folder (and the GGUF file
    setting dropped once dequantized); a model not found is left as it is, for the checks to report."""
    gguf = gguf_files(recipe)
    groups = []
    for g in recipe.groups:
        changes: dict[str, Any] = {}
        for name in MODEL_FIELDS:
            value = getattr(g.config, name, None)
            if isinstance(value, str) and (path := local(value, gguf.get(value))) is not None:
                changes[name] = str(path)
        kwargs = getattr(g.config, "loader_kwargs", None)
        if kwargs and "gguf_file" in kwargs and "model" in changes:
            changes["loader_kwargs"] = {k: v for k, v in kwargs.items() if k != "gguf_file"}
        groups.append(
            dataclasses.replace(g, config=dataclasses.replace(g.config, **changes)) if changes else g
        )
    return dataclasses.replace(recipe, groups=tuple(groups))


def gguf_files(recipe: Recipe) -> dict[str, str]:
    """Model name -> GGUF file, from any group's `loader_kwargs.gguf_file`: every group naming the
    same model (rollout's tokenizer too, which has no loader_kwargs) gets the same dequantized folder."""
    out = {}
    for g in recipe.groups:
        file = (getattr(g.config, "loader_kwargs", None) or {}).get("gguf_file")
        model = getattr(g.config, "model", None)
        if file and isinstance(model, str):
            out[model] = str(file)
    return out
