"""Recipes: what a run is, as frozen keyword-only dataclasses.

A recipe is a Python file with a function `recipe() -> Recipe`. Variants import a base recipe and
change fields with `dataclasses.replace` (or `Recipe.with_overrides`). Every config is validated when
constructed, so a malformed recipe fails before anything starts; the message names the field and says
what to change.

Services declare the columns they read and write (`ServiceConfig.reads/writes`); the planner checks
that every column someone reads is written by someone.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import importlib.util
import json
import sys
import types
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

Columns = dict[str, tuple[str, ...]]  # partition -> column names


class RecipeError(ValueError):
    """A recipe that cannot run. The message lists every problem found, each naming its field."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("invalid recipe:\n" + "\n".join(f"  - {p}" for p in problems))


def require(ok: bool, where: str, message: str) -> None:
    if not ok:
        raise RecipeError([f"{where}: {message}"])


@dataclass(frozen=True, kw_only=True)
class ServiceConfig:
    """Base of every service's config. A subclass names the class that runs it by import path."""

    service: ClassVar[str] = ""  # "package.module:Class" of the Service subclass
    stateful: ClassVar[bool] = False
    """Takes part in checkpoints (saves its own state when the trainer asks; see meshrl/state/checkpoint.py)."""
    rejoins: ClassVar[bool] = False
    """A replica restarted on its own re-joins the running run: it keeps no state of the run (a frozen
    scorer; inference, which gets the current weights when it re-joins the weight group), or takes
    over the state its predecessor wrote ahead of every change (rollout). Under an on-failure policy
    its launcher restarts just that process, outside colocation rings; any other failure restarts the
    whole run from a checkpoint."""

    def reads(self) -> Columns:
        """Columns this service consumes, per partition."""
        return {}

    def writes(self) -> Columns:
        """Columns this service produces, per partition."""
        return {}

    def retention(self) -> Columns:
        """Per partition, the consumers after whose acks a row is deleted (this service is terminal)."""
        return {}

    def check(self, recipe: Recipe, group: ServiceGroup) -> list[str]:
        """Problems of this config in the context of the whole recipe (paths, settings other services
        must agree with). Each message names the field. Called by the planner before anything starts."""
        return []


class Scheduling(enum.Enum):
    ON_DEMAND = "on_demand"
    """Asks for the ring's devices when it has work."""
    FALLBACK = "fallback"
    """Holds the devices whenever nobody else asks (typically inference)."""


@dataclass(frozen=True, kw_only=True)
class RingMember:
    group: str
    """Id of a service group."""
    mode: Scheduling = Scheduling.ON_DEMAND


@dataclass(frozen=True, kw_only=True)
class ColocationRing:
    """Service groups that take turns on the same devices."""

    id: str
    members: tuple[RingMember, ...]
    hybrid: bool = False
    """Co-process mode: on each device the members' processes are one OS process (a thread per service),
    so they share memory: inference generates with the trainer's live weights (a weight sync is a
    version bump) and turns need no offload. Members use one device per replica."""


@dataclass(frozen=True, kw_only=True)
class RestartPolicy:
    mode: str = "never"
    """"never": a failure stops the run. "on-failure": restart (up to max_restarts): the one process
    when its service re-joins (`ServiceConfig.rejoins`), else the whole run from its latest checkpoint."""
    max_restarts: int = 3
    backoff_s: float = 2.0
    """Seconds before the first restart; doubles each time."""

    def __post_init__(self) -> None:
        require(
            self.mode in ("never", "on-failure"),
            "restart.mode",
            f"{self.mode!r} is not 'never' or 'on-failure'",
        )
        require(self.max_restarts >= 0, "restart.max_restarts", "must be >= 0")


@dataclass(frozen=True, kw_only=True)
class ServiceGroup:
    """Replicas of one service. A replica with devices runs one process per device."""

    id: str
    """Stable name: log files, ports and overrides (`<id>.<field>=...`) use it."""
    config: ServiceConfig
    replicas: int = 1
    devices_per_replica: int = 0
    """0 for CPU-only roles (rollout); their one process per replica runs beside the device roles."""
    restart: RestartPolicy = RestartPolicy()


@dataclass(frozen=True, kw_only=True)
class DataPlaneConfig:
    capacity: int = 65536
    """Rows per partition; producers wait (back-pressure) when a partition is full."""
    bind_all: bool = False
    """Bind the controller and storage on every interface (needed across hosts; requires the run secret)."""


@dataclass(frozen=True, kw_only=True)
class Recipe:
    name: str
    groups: tuple[ServiceGroup, ...]
    rings: tuple[ColocationRing, ...] = ()
    seed: int = 0
    run_dir: str = ""
    """Where logs, metrics, checkpoints go. Default: runs/<name>."""
    total_steps: int = 1
    base_port: int = 29600
    """Every port of the run follows from this and each process's device (see topology.py)."""
    dataplane: DataPlaneConfig = DataPlaneConfig()
    checkpoint_every: int = 0
    """Checkpoint the whole run every this many steps (0: never); see meshrl/state/checkpoint.py."""
    keep_checkpoints: int = 2
    """Complete checkpoints kept (older ones are deleted once a newer one is complete)."""

    def __post_init__(self) -> None:
        problems = []
        if self.checkpoint_every < 0 or self.keep_checkpoints < 1:
            problems.append("checkpoint_every: must be >= 0, keep_checkpoints >= 1")
        if not self.groups:
            problems.append("groups: a recipe needs at least one service group")
        ids = [g.id for g in self.groups]
        for dup in sorted({i for i in ids if ids.count(i) > 1}):
            problems.append(f"groups: id {dup!r} is used twice")
        for g in self.groups:
            if not g.id.replace("_", "").replace("-", "").isalnum():
                problems.append(f"groups[{g.id!r}].id: use letters, digits, '-' and '_' only")
            if g.replicas < 1:
                problems.append(f"groups[{g.id!r}].replicas: must be >= 1, got {g.replicas}")
            if g.devices_per_replica < 0:
                problems.append(f"groups[{g.id!r}].devices_per_replica: must be >= 0")
            if not isinstance(g.config, ServiceConfig) or not type(g.config).service:
                problems.append(
                    f"groups[{g.id!r}].config: {type(g.config).__name__} is not a known service type "
                    "(a ServiceConfig subclass naming its service)"
                )
        if self.total_steps < 1:
            problems.append(f"total_steps: must be >= 1, got {self.total_steps}")
        if not 1024 <= self.base_port <= 60000:
            problems.append(f"base_port: {self.base_port} must be in 1024..60000")
        if problems:
            raise RecipeError(problems)

    @property
    def resolved_run_dir(self) -> Path:
        return Path(self.run_dir or f"runs/{self.name}")

    def group(self, gid: str) -> ServiceGroup:
        for g in self.groups:
            if g.id == gid:
                return g
        raise KeyError(gid)

    def with_overrides(self, overrides: list[str]) -> Recipe:
        """Apply `key=value` overrides: `seed=3`, `<group id>.<config field>=...`, `<group id>.replicas=2`,
        `*.<config field>=...` (every group whose config has that field, e.g. `*.model=/path`)."""
        out = self
        for item in overrides:
            key, sep, value = item.partition("=")
            if not sep:
                raise RecipeError([f"override {item!r}: expected key=value"])
            out = _override(out, key.split("."), value, item)
        return out


# ---------------------------------------------------------------------------------------------------------
# overrides


def _override(obj: Any, path: list[str], value: str, full: str) -> Any:
    head, rest = path[0], path[1:]
    if isinstance(obj, Recipe) and head == "*":  # every group whose config has that field
        hits = [g for g in obj.groups if rest and rest[0] in {f.name for f in fields(g.config)}]
        if not hits:
            raise RecipeError([f"override {full!r}: no group config has a field {'.'.join(rest)!r}"])
        for g in hits:
            obj = _override(obj, [g.id, *rest], value, full)
        return obj
    if isinstance(obj, Recipe) and head not in {f.name for f in fields(obj)}:
        try:
            g = obj.group(head)
        except KeyError:
            raise RecipeError(
                [f"override {full!r}: no recipe field or group {head!r} ({_keys(obj)})"]
            ) from None
        if not rest:
            raise RecipeError([f"override {full!r}: name a field of group {head!r}"])
        target = g if rest[0] in {f.name for f in fields(g)} else None
        if target is not None:
            new_group = _override(g, rest, value, full)
        else:
            new_group = dataclasses.replace(g, config=_override(g.config, rest, value, full))
        return dataclasses.replace(obj, groups=tuple(new_group if x.id == head else x for x in obj.groups))
    if not dataclasses.is_dataclass(obj):
        raise RecipeError([f"override {full!r}: {head!r} is not a config field"])
    by_name = {f.name: f for f in fields(obj)}
    if head not in by_name:
        raise RecipeError([f"override {full!r}: {type(obj).__name__} has no field {head!r} ({_keys(obj)})"])
    if rest:
        return dataclasses.replace(obj, **{head: _override(getattr(obj, head), rest, value, full)})  # type: ignore[type-var]
    hint = typing.get_type_hints(type(obj))[head]
    try:
        parsed = parse_value(hint, value)
    except (ValueError, TypeError) as e:
        raise RecipeError([f"override {full!r}: {e}"]) from None
    return dataclasses.replace(obj, **{head: parsed})  # type: ignore[type-var]


def _keys(obj: Any) -> str:
    names = [f.name for f in fields(obj)]
    if isinstance(obj, Recipe):
        names += [g.id for g in obj.groups]
    return "choose from " + ", ".join(names)


def parse_value(hint: Any, text: str) -> Any:
    """Parse an override's text as the field's type."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
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
    if hint is bool:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{text!r} is not a boolean")
    if hint is int:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{text!r} is not an integer") from None
    if hint is float:
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"{text!r} is not a number") from None
    if hint is str:
        return text
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


# ---------------------------------------------------------------------------------------------------------
# loading


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Run a recipe file's `recipe()` and apply overrides."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError([f"recipe file {path} does not exist"])
    directory = str(path.resolve().parent)
    added = directory not in sys.path
    if added:
        sys.path.insert(0, directory)
    try:
        spec = importlib.util.spec_from_file_location(f"meshrl_recipe_{path.stem}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        if added:
            sys.path.remove(directory)
    fn = getattr(module, "recipe", None)
    if not callable(fn):
        raise RecipeError([f"{path}: a recipe file must define a function recipe() -> Recipe"])
    recipe = fn()
    if not isinstance(recipe, Recipe):
        raise RecipeError([f"{path}: recipe() returned {type(recipe).__name__}, not a Recipe"])
    return recipe.with_overrides(overrides or [])


def service_class(config: ServiceConfig) -> type:
    """Import the Service subclass a config names (heavy imports happen here, after parsing)."""
    module, _, name = type(config).service.partition(":")
    return getattr(importlib.import_module(module), name)


def to_jsonable(obj: Any) -> Any:
    """A recipe as plain JSON (the run directory's config.json), with each config's type recorded."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {f.name: to_jsonable(getattr(obj, f.name)) for f in fields(obj)}
        if isinstance(obj, ServiceConfig):
            out = {"type": f"{type(obj).__module__}:{type(obj).__qualname__}", **out}
        return out
    if isinstance(obj, enum.Enum):
        return obj.name
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(x) for x in obj]
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, Path):
        return str(obj)
    return obj
