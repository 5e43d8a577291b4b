"""Recipes: what a run is, as frozen keyword-only dataclasses.

A recipe is a Python file with a function `recipe() -> Recipe`. Variants import a base recipe and
change fields with `dataclasses.replace` (or `Recipe.with_overrides`). Every config is validated when
constructed, so a malformed recipe fails before anything starts; the message names the field and says
what to change.

Settings that several services must agree on are stated once, here on the recipe, and every service
is handed them (`RunSettings`, with the other recipe-wide settings; a service sees nothing else of the
recipe but its own config): the batch shape (`prompts_per_step`, `group_size`) and the sampling
`temperature` (inference samples with it; the trainer, the reference and the teacher take
log-probabilities under it). A recipe cannot disagree with itself about them.

Services declare the columns they read and write (`ServiceConfig.reads/writes`); the planner checks
that every column someone reads is written by someone.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import importlib.util
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

from meshrl.planning.config import Config, RecipeError, ServiceConfig

DEFAULT_BASE_PORT = 29600
"""The base port of a run over several hosts whose recipe names none."""

RECIPE_WIDE = ("prompts_per_step", "group_size", "temperature")
"""Recipe fields that services used to state each in their own config (an override of the old path
says where it went)."""


class Scheduling(enum.Enum):
    ON_DEMAND = "on_demand"
    """Asks for the ring's devices when it has work."""
    FALLBACK = "fallback"
    """Holds the devices whenever nobody else asks (typically inference)."""


@dataclass(frozen=True, kw_only=True)
class RingMember(Config):
    group: str
    """Id of a service group."""
    mode: Scheduling = Scheduling.ON_DEMAND


@dataclass(frozen=True, kw_only=True)
class ColocationRing(Config):
    """Service groups that take turns on the same devices."""

    id: str
    members: tuple[RingMember, ...]
    hybrid: bool = False
    """Co-process mode: on each device the members' processes are one OS process (a thread per service),
    so they share memory: inference generates with the trainer's live weights (a weight sync is a
    version bump) and turns need no offload. Members use one device per replica."""


@dataclass(frozen=True, kw_only=True)
class RestartPolicy(Config):
    mode: Literal["never", "on-failure", "leave"] = "never"
    """"never": a failure stops the run. "on-failure": restart (up to max_restarts): the one process
    when its service re-joins (`ServiceConfig.rejoins`), else the whole run from its latest checkpoint.
    "leave" (groups that can change while the run goes on, meshrl/planning/members.py): a failed
    replica is not restarted and the run goes on without it, smaller; its last replica's failure stops
    the run."""
    max_restarts: int = 3
    backoff_s: float = 2.0
    """Seconds before the first restart; doubles each time."""

    def validate(self) -> Iterator[str]:
        if self.max_restarts < 0:
            yield "restart.max_restarts: must be >= 0"


@dataclass(frozen=True, kw_only=True)
class ServiceGroup(Config):
    """Replicas of one service. A replica with devices runs one process per device."""

    id: str
    """Stable name: log files, ports and overrides (`<id>.<field>=...`) use it."""
    config: ServiceConfig
    replicas: int = 1
    devices_per_replica: int = 0
    """0 for CPU-only roles (rollout); their one process per replica runs beside the device roles."""
    restart: RestartPolicy = RestartPolicy()


@dataclass(frozen=True, kw_only=True)
class DataPlaneConfig(Config):
    capacity: int = 65536
    """Rows per partition; producers wait (back-pressure) when a partition is full."""
    bind_all: bool = False
    """Bind the controller and storage on every interface (needed across hosts; requires the run secret)."""


@dataclass(frozen=True, kw_only=True)
class WandbConfig(Config):
    project: str = ""
    """Weights & Biases project; empty: no W&B run."""
    entity: str = ""
    mode: Literal["auto", "online", "offline"] = "auto"
    """"auto": online when an API key is configured (WANDB_API_KEY or `wandb login`), else offline (the run
    directory's wandb/ folder; `wandb sync` uploads it later)."""


@dataclass(frozen=True, kw_only=True)
class MlflowConfig(Config):
    experiment: str = ""
    """MLflow experiment; empty: no MLflow run."""
    tracking_uri: str = ""
    """Default: a file store in the run directory (<run_dir>/mlruns)."""


@dataclass(frozen=True, kw_only=True)
class LogConfig(Config):
    """Where a run's metrics go besides its files (metrics.jsonl, eval.jsonl, critic.jsonl, samples.jsonl):
    experiment trackers, each optional (`pip install meshrl[trackers]`), fed by the lead launcher from
    those files (meshrl/observe/follow.py), so a tracker costs the services nothing and one that fails
    stops only itself."""

    tensorboard: bool = False
    """TensorBoard event files in <run_dir>/tensorboard."""
    wandb: WandbConfig = WandbConfig()
    mlflow: MlflowConfig = MlflowConfig()
    samples_per_step: int = 4
    """Sample completions the trainer writes to samples.jsonl each step (0: none)."""

    def validate(self) -> Iterator[str]:
        if self.samples_per_step < 0:
            yield f"log.samples_per_step: must be >= 0, got {self.samples_per_step}"


@dataclass(frozen=True, kw_only=True)
class Recipe(Config):
    name: str
    groups: tuple[ServiceGroup, ...]
    rings: tuple[ColocationRing, ...] = ()
    seed: int = 0
    run_dir: str = ""
    """Where logs, metrics, checkpoints go. Default: runs/<name>."""
    total_steps: int = 1
    prompts_per_step: int = 16
    """Prompts drawn per training step (one weight version)."""
    group_size: int = 8
    """Completions per prompt (a GRPO group); a step trains on prompts_per_step x group_size samples."""
    temperature: float = 1.0
    """Sampling temperature of inference; every log-probability of a sampled token (trainer, reference,
    teacher) is taken under logits / temperature, so that they match the sampling distribution."""
    base_port: int | None = None
    """Every port of the run follows from this and each process's device (see topology.py). None: a
    single-host `meshrl run` takes a free range (and records it: the run's overrides get
    base_port=...); launchers over several hosts use DEFAULT_BASE_PORT."""
    dataplane: DataPlaneConfig = DataPlaneConfig()
    checkpoint_every: int = 0
    """Checkpoint the whole run every this many steps (0: never); see meshrl/state/checkpoint.py."""
    keep_checkpoints: int = 2
    """Complete checkpoints kept (older ones are deleted once a newer one is complete)."""
    log: LogConfig = LogConfig()

    def validate(self) -> Iterator[str]:
        if self.checkpoint_every < 0 or self.keep_checkpoints < 1:
            yield "checkpoint_every: must be >= 0, keep_checkpoints >= 1"
        if not self.groups:
            yield "groups: a recipe needs at least one service group"
        ids = [g.id for g in self.groups]
        for dup in sorted({i for i in ids if ids.count(i) > 1}):
            yield f"groups: id {dup!r} is used twice"
        for g in self.groups:
            yield from _group_problems(g)
        if self.total_steps < 1:
            yield f"total_steps: must be >= 1, got {self.total_steps}"
        if self.prompts_per_step < 1 or self.group_size < 1:
            yield "prompts_per_step, group_size: must be >= 1"
        if not self.temperature >= 0:
            yield f"temperature: must be >= 0, got {self.temperature}"
        if self.base_port is not None and not 1024 <= self.base_port <= 60000:
            yield f"base_port: {self.base_port} must be in 1024..60000"

    @property
    def ports_from(self) -> int:
        """The base port the plan uses: base_port, or DEFAULT_BASE_PORT when the recipe leaves it unset."""
        return DEFAULT_BASE_PORT if self.base_port is None else self.base_port

    @property
    def batch_size(self) -> int:
        """Samples per training step."""
        return self.prompts_per_step * self.group_size

    @property
    def resolved_run_dir(self) -> Path:
        return Path(self.run_dir or f"runs/{self.name}")

    def group(self, gid: str) -> ServiceGroup:
        for g in self.groups:
            if g.id == gid:
                return g
        raise KeyError(gid)

    def configs(self, kind: type[Any]) -> list[Any]:
        """The configs of type `kind` in this recipe, in group order."""
        return [g.config for g in self.groups if isinstance(g.config, kind)]

    def with_overrides(self, overrides: list[str]) -> Recipe:
        """Apply `key=value` overrides (see meshrl/planning/overrides.py); every bad one is listed."""
        from meshrl.planning.overrides import apply_overrides

        recipe, problems = apply_overrides(self, overrides)
        if problems:
            raise RecipeError(problems)
        return recipe


@dataclass(frozen=True, kw_only=True)
class RunSettings:
    """The recipe-wide settings every service is handed (`ServiceContext.run`): all a service sees of the
    recipe besides its own config and its wiring (meshrl/planning/wiring.py)."""

    name: str
    """The recipe's name."""
    seed: int
    """The run's seed (each service derives its own streams from it)."""
    total_steps: int
    """Training steps (weight versions) of the run."""
    prompts_per_step: int
    """Prompts drawn per training step."""
    group_size: int
    """Completions per prompt (a GRPO group)."""
    temperature: float
    """The sampling temperature every log-probability of a sampled token is taken under."""
    checkpoint_every: int
    """Checkpoint the whole run every this many steps (0: never)."""
    keep_checkpoints: int
    """Complete checkpoints kept."""
    log: LogConfig
    """Where metrics go besides the run's files, and how many samples a step shows."""

    @property
    def batch_size(self) -> int:
        """Samples per training step."""
        return self.prompts_per_step * self.group_size

    @classmethod
    def of(cls, recipe: Recipe) -> RunSettings:
        return cls(
            name=recipe.name, seed=recipe.seed, total_steps=recipe.total_steps,
            prompts_per_step=recipe.prompts_per_step, group_size=recipe.group_size,
            temperature=recipe.temperature, checkpoint_every=recipe.checkpoint_every,
            keep_checkpoints=recipe.keep_checkpoints, log=recipe.log,
        )  # fmt: skip


def _group_problems(g: ServiceGroup) -> Iterator[str]:
    if not g.id.replace("_", "").replace("-", "").isalnum():
        yield f"groups[{g.id!r}].id: use letters, digits, '-' and '_' only"
    if g.replicas < 1:
        yield f"groups[{g.id!r}].replicas: must be >= 1, got {g.replicas}"
    if g.devices_per_replica < 0:
        yield f"groups[{g.id!r}].devices_per_replica: must be >= 0"
    if not isinstance(g.config, ServiceConfig) or not type(g.config).service:
        yield (
            f"groups[{g.id!r}].config: {type(g.config).__name__} is not a known service type "
            "(a ServiceConfig subclass naming its service)"
        )


# ---------------------------------------------------------------------------------------------------------
# loading


def read_recipe(path: str | Path) -> Recipe:
    """Run a recipe file's `recipe()` (no overrides)."""
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
        fn = getattr(module, "recipe", None)
        if not callable(fn):
            raise RecipeError([f"{path}: a recipe file must define a function recipe() -> Recipe"])
        recipe = _call(fn, path)
    finally:
        if added:
            sys.path.remove(directory)
    if not isinstance(recipe, Recipe):
        raise RecipeError([f"{path}: recipe() returned {type(recipe).__name__}, not a Recipe"])
    return recipe


def _call(fn: Any, path: Path) -> Any:
    """`fn()`, with the message of a config built with a field that moved (to the recipe, or into a
    section of the config: `ServiceConfig.moved`)."""
    try:
        return fn()
    except TypeError as e:
        found = re.search(r"(\w+)\.__init__\(\) got an unexpected keyword argument '(\w+)'", str(e))
        if found is None:
            raise
        config, name = found.groups()
        if name in RECIPE_WIDE:
            raise RecipeError(
                [f"{path}: {config}({name}=...): {name} is set once for the whole recipe: Recipe({name}=...)"]
            ) from None
        instead = next(
            (c.moved[name] for c in _subclasses(ServiceConfig) if c.__name__ == config and name in c.moved),
            None,
        )
        if instead is None:
            raise
        raise RecipeError([f"{path}: {config}({name}=...): {name} has moved: set {instead}"]) from None


def _subclasses(cls: type[Any]) -> list[type[Any]]:
    out: list[type[Any]] = []
    for sub in type.__subclasses__(cls):
        out += [sub, *_subclasses(sub)]
    return out


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Run a recipe file's `recipe()`, apply overrides, and find its models on disk (hub ids, GGUF)."""
    from meshrl.planning.models import resolve_models

    return resolve_models(read_recipe(path).with_overrides(overrides or []))


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
