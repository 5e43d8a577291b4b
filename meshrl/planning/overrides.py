"""`key=value` overrides of a recipe, as typed on the command line.

    seed=3   total_steps=50   temperature=0.7                    a field of the recipe
    trainer.optim.lr=1e-4   inference.vllm.kv_cache_gb=4          a field of a group's config (or of one of its sections)
    trainer.devices_per_replica=2   critic.restart.mode=on-failure  a field of the group itself
    *.model=/path                                                 every group whose config has the field

`meshrl sft` takes the trainer's sections by the same parser, addressed from the sections down
(`optim.lr=3e-3`, `memory.precision=bf16-mixed`, `lora.rank=8`: meshrl/commands/sft_config.py).

Each value is parsed as the field's type (Literal fields accept only their allowed values; tuples and
lists take `a,b` or JSON) and the changed config checks itself again. Every bad override is reported,
not only the first: `apply_overrides` applies the good ones and returns the problems of the others.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import types
import typing
from dataclasses import fields
from typing import Any, TypeVar

from meshrl.planning.config import RecipeError, literal_values
from meshrl.planning.recipe import RECIPE_WIDE, Recipe

C = TypeVar("C")


def apply_overrides(config: C, overrides: list[str]) -> tuple[C, list[str]]:
    """(`config`, a recipe or any config dataclass, with every valid override applied, the problems of
    the others)."""
    problems: list[str] = []
    for item in overrides:
        key, sep, value = item.partition("=")
        try:
            if not sep:
                raise RecipeError([f"override {item!r}: expected key=value"])
            config = _override(config, key.split("."), value, item)
        except RecipeError as e:
            problems += [p if p.startswith("override ") else f"override {item!r}: {p}" for p in e.problems]
    return config, problems


def _override(obj: Any, path: list[str], value: str, full: str) -> Any:
    if isinstance(obj, Recipe):
        return _override_recipe(obj, path, value, full)
    head, rest = path[0], path[1:]
    if not dataclasses.is_dataclass(obj):
        raise RecipeError([f"override {full!r}: {head!r} is not a config field"])
    by_name = {f.name: f for f in fields(obj)}
    if head not in by_name:
        if head in RECIPE_WIDE:
            raise RecipeError([_moved(head, value, full)])
        instead = getattr(type(obj), "moved", {}).get(head)
        if instead is not None:
            raise RecipeError([f"override {full!r}: {head} has moved: set {instead}"])
        raise RecipeError([f"override {full!r}: {type(obj).__name__} has no field {head!r} ({_keys(obj)})"])
    if rest:
        return dataclasses.replace(obj, **{head: _override(getattr(obj, head), rest, value, full)})  # type: ignore[type-var]
    return _override_leaf(obj, head, value, full)


def _override_recipe(recipe: Recipe, path: list[str], value: str, full: str) -> Recipe:
    head, rest = path[0], path[1:]
    if head == "*":  # every group whose config has that field
        hits = [g for g in recipe.groups if rest and rest[0] in {f.name for f in fields(g.config)}]
        if not hits:
            if rest and rest[0] in RECIPE_WIDE:
                raise RecipeError([_moved(rest[0], value, full)])
            raise RecipeError([f"override {full!r}: no group config has a field {'.'.join(rest)!r}"])
        for g in hits:
            recipe = _override_recipe(recipe, [g.id, *rest], value, full)
        return recipe
    if head in {f.name for f in fields(recipe)}:
        if not rest:
            return _override_leaf(recipe, head, value, full)
        return dataclasses.replace(recipe, **{head: _override(getattr(recipe, head), rest, value, full)})
    try:
        g = recipe.group(head)
    except KeyError:
        raise RecipeError(
            [f"override {full!r}: no recipe field or group {head!r} ({_keys(recipe)})"]
        ) from None
    if not rest:
        raise RecipeError([f"override {full!r}: name a field of group {head!r}"])
    if rest[0] in {f.name for f in fields(g)}:
        new_group = _override(g, rest, value, full)
    else:
        new_group = dataclasses.replace(g, config=_override(g.config, rest, value, full))
    return dataclasses.replace(recipe, groups=tuple(new_group if x.id == head else x for x in recipe.groups))


def _override_leaf(obj: Any, name: str, value: str, full: str) -> Any:
    hint = typing.get_type_hints(type(obj))[name]
    try:
        parsed = parse_value(hint, value)
    except (ValueError, TypeError) as e:
        raise RecipeError([f"override {full!r}: {e}"]) from None
    return dataclasses.replace(obj, **{name: parsed})


def _moved(name: str, value: str, full: str) -> str:
    return (
        f"override {full!r}: {name} is set once for the whole recipe and read by every service that needs "
        f"it: write {name}={value}"
    )


def _keys(obj: Any) -> str:
    names = [f.name for f in fields(obj)]
    if isinstance(obj, Recipe):
        names += [g.id for g in obj.groups]
    return "choose from " + ", ".join(names)


def parse_value(hint: Any, text: str) -> Any:
    """Parse an override's text as the field's type."""
    allowed = literal_values(hint)
    if allowed is not None:
        for option in allowed:
            if (option is None and text.lower() in ("none", "null")) or str(option) == text:
                return option
        raise ValueError(f"{text!r} is not one of {', '.join(map(repr, allowed))}")
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return _parse_union(typing.get_args(hint), text)
    if hint in (bool, int, float, str):
        return _parse_scalar(hint, text)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return hint[text.upper()]
        except KeyError:
            raise ValueError(f"{text!r} is not one of {[m.name for m in hint]}") from None
    if origin in (tuple, list, dict) or hint in (dict, list):
        data = json.loads(text) if text.strip().startswith(("[", "{")) else [t for t in text.split(",") if t]
        if origin is tuple:
            args = typing.get_args(hint)
            item = args[0] if args else str
            return tuple(
                parse_value(item, str(x)) if not isinstance(x, (int, float)) or item is str else x
                for x in data
            )
        return data
    raise TypeError(f"cannot set a field of type {hint} from the command line; edit the recipe")


def _parse_union(args: tuple[Any, ...], text: str) -> Any:
    if type(None) in args and text.lower() in ("none", "null"):
        return None
    errors = []
    for arg in args:
        if arg is type(None):
            continue
        try:
            return parse_value(arg, text)
        except (ValueError, TypeError) as e:
            errors.append(str(e))
    raise ValueError("; ".join(errors))


def _parse_scalar(hint: type, text: str) -> Any:
    if hint is bool:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{text!r} is not a boolean")
    if hint is str:
        return text
    try:
        return hint(text)
    except ValueError:
        kind = "an integer" if hint is int else "a number"
        raise ValueError(f"{text!r} is not {kind}") from None
