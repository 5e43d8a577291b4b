"""The base of every config in a recipe: a frozen keyword-only dataclass that checks itself when built.

A config lists every problem of its own fields at once (`validate`), each as "field: what to change";
fields typed `Literal[...]` are checked against their allowed values here, for every config, so no
config repeats that check. A service's config also declares its side of the run's wiring (what it
reads and writes, whose weights it follows, the settings it needs and offers: meshrl/planning/wiring.py)
and checks itself against what its service will be handed (`check`: the run's settings, its group, its
wiring; never another group's config), which the planner calls before anything starts.
"""

from __future__ import annotations

import functools
import types
import typing
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar, Literal

if TYPE_CHECKING:
    from meshrl.planning.recipe import RunSettings, ServiceGroup
    from meshrl.planning.wiring import Read, Wiring, Write


class RecipeError(ValueError):
    """A recipe that cannot run. The message lists every problem found, each naming its field."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("invalid recipe:\n" + "\n".join(f"  - {p}" for p in problems))


class Config:
    """Mixin of every recipe dataclass: on construction, the Literal fields and `validate()`."""

    def __post_init__(self) -> None:
        problems = [*literal_problems(self), *self.validate()]
        if problems:
            raise RecipeError(problems)

    def validate(self) -> Iterable[str]:
        """Problems of this config's own fields, each "field: what is wrong / what to do"."""
        return ()


@dataclass(frozen=True, kw_only=True)
class ServiceConfig(Config):
    """Base of every service's config. A subclass names the class that runs it by import path."""

    service: ClassVar[str] = ""  # "package.module:Class" of the Service subclass
    stateful: ClassVar[bool] = False
    """Takes part in checkpoints (saves its own state when the trainer asks; see
    meshrl/state/checkpoint.py)."""
    takes_checkpoints: ClassVar[bool] = False
    """Takes the run's checkpoints (the trainer): it asks every process of the stateful groups to save
    and waits for them all; the planner lists those processes in its wiring (`Wiring.checkpoint`)."""
    rejoins: ClassVar[bool] = False
    """A replica restarted on its own re-joins the running run: it keeps no state of the run (a frozen
    scorer; inference, which gets the current weights when it re-joins the weight group), or takes
    over the state its predecessor wrote ahead of every change (rollout). Under an on-failure policy
    its launcher restarts just that process, outside colocation rings; any other failure restarts the
    whole run from a checkpoint."""
    moved: ClassVar[dict[str, str]] = {}
    """Fields that are gone, by old name: what to write instead (an override naming one says so)."""
    publishes_weights: ClassVar[bool] = False
    """A weight source: the groups that follow it receive every version it publishes (the trainer)."""

    def imports(self) -> tuple[str, ...]:
        """The modules its processes import (a launcher's zygote imports them once, before forking)."""
        return (type(self).service.partition(":")[0],)

    def reads(self) -> tuple[Read, ...]:
        """The rows this service claims (meshrl/planning/wiring.py)."""
        return ()

    def writes(self) -> tuple[Write, ...]:
        """The columns this service adds to rows."""
        return ()

    def follows(self) -> str | None:
        """The group whose weights this service receives (inference: its trainer), if any."""
        return None

    def applies_adapters(self) -> bool:
        """Whether this receiver applies LoRA adapters itself (so a trainer may publish them alone)."""
        return False

    def adapters(self) -> Any:
        """A weight source's LoRA settings, when it trains adapters (else None)."""
        return None

    def needs(self) -> dict[str, str]:
        """Settings this service takes from another group, by name, each with what to do when no
        group offers it; they arrive in its wiring's `inputs`."""
        return {}

    def offers(self) -> dict[str, Any]:
        """Settings this service offers to groups that need them, by name."""
        return {}

    def check(self, run: RunSettings, group: ServiceGroup, wiring: Wiring) -> list[str]:
        """Problems of this config given what its service will be handed (the recipe-wide settings, its
        wiring: the settings handed to it) and its group (devices, replicas): paths, engines, batch
        arithmetic. Each message names the field. Called by the planner before anything starts; problems
        between groups are the planner's (meshrl/planning/checks.py, wiring.py)."""
        return []

    def shares_devices(self) -> str | None:
        """Why this service cannot take turns on devices it shares in a colocation ring (it cannot
        offload what it holds there), or None when it can."""
        return None


def literal_problems(obj: Any) -> list[str]:
    """A problem for every Literal-typed field of dataclass `obj` whose value is not allowed."""
    return [
        f"{name}: {getattr(obj, name)!r} is not one of {', '.join(map(repr, allowed))}"
        for name, allowed in _literal_fields(type(obj))  # type: ignore[arg-type]
        if getattr(obj, name) not in allowed
    ]


def literal_values(hint: Any) -> tuple[Any, ...] | None:
    """The allowed values of a Literal type (or of Optional[Literal]: None included), else None."""
    if typing.get_origin(hint) is Literal:
        return typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        parts = [literal_values(a) if a is not type(None) else (None,) for a in typing.get_args(hint)]
        if all(p is not None for p in parts):
            return tuple(v for p in parts if p is not None for v in p)
    return None


@functools.cache
def _literal_fields(cls: type) -> tuple[tuple[str, tuple[Any, ...]], ...]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in fields(cls):
        allowed = literal_values(hints[f.name])
        if allowed is not None:
            out.append((f.name, allowed))
    return tuple(out)
