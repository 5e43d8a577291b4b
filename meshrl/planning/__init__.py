"""Planning: from a recipe file and command-line overrides to a checked recipe and its topology.

- `config.py`    the base of every config: validation when built, Literal settings, RecipeError;
- `recipe.py`    Recipe, service groups, colocation rings, loading a recipe file;
- `overrides.py` `key=value` overrides;
- `checks.py`    every problem of a recipe on a device list, before anything starts;
- `topology.py`  `plan()`: who runs where, on which ports (a pure function every launcher calls).

`prepare` is what a command calls: it reports every problem at once, the overrides' and the plan's.
Models named by hub id or GGUF file are found on disk first (meshrl/models/hub.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from meshrl.planning.config import RecipeError
from meshrl.planning.overrides import apply_overrides
from meshrl.planning.recipe import Recipe, read_recipe
from meshrl.planning.topology import Device, Topology, devices_needed, plan


def prepare(
    path: str | Path, overrides: list[str], devices: Sequence[Device] | None = None
) -> tuple[Recipe, Topology]:
    """Load a recipe file, apply `overrides` and plan it on `devices` (None: the devices it needs, on
    this host). Raises one RecipeError listing every bad override and every problem of the plan (a
    recipe with an invalid override is planned without it, so its other problems show too)."""
    from meshrl.planning.models import resolve_models

    recipe, problems = apply_overrides(read_recipe(path), overrides)
    recipe = resolve_models(recipe)  # hub ids and GGUF files become local folders, before the checks
    if devices is None:
        from meshrl.dataplane.wire import host_id

        devices = local_devices(max(1, devices_needed(recipe)), host_id())
    try:
        topology = plan(recipe, devices)
    except RecipeError as e:
        problems += e.problems
    if problems:
        raise RecipeError(problems)
    return recipe, topology


def local_devices(n: int, host: str = "localhost") -> list[Device]:
    """`n` device slots of one host (on CPU, virtual ones)."""
    return [Device(r, host, r) for r in range(n)]
