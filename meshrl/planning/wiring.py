"""How a run's services are joined, worked out from the recipe before anything starts.

Every service config declares its side of the run (`ServiceConfig`, meshrl/planning/config.py):

- `reads()`: the rows it claims, as `Read`s: a partition, the columns every claimed row must have, the
  consumer name its replicas share (their claims split the rows), columns it also takes when someone
  writes them (`optional`), whether its acknowledgement ends a row's life (`retains`);
- `writes()`: the columns it adds, as `Write`s;
- `follows()`: the group whose weights it receives (inference: its trainer);
- `needs()` / `offers()`: settings it takes from another group, or offers to them, by name (the
  trainer's value head needs the rollout's GAE settings, the environment the length of a turn).

A read or write may name several partitions, in order of preference: a write goes to the first
partition that another group reads its columns from, a read comes from the first partition that some
group writes its columns to. So rollout feeds `tasks` when an environment takes trajectory starts from
there and `samples` otherwise, and inference generates in `turns` or in `samples` accordingly, without
either knowing the other.

`wire(recipe)` resolves the declarations into one `Wiring` per group, with every problem found: a
column someone reads that nobody writes, a write nobody reads, a setting nobody offers (each naming
both sides and what to add). Once the processes are placed, the planner adds what follows from the
placement (`meshrl/planning/topology.py`): where a weight group meets and who is in it, a ring's
processes, the processes a checkpoint waits for, the replicas serving a setting a group needs. A
service gets its `Wiring` in its context (`ctx.wiring`) and nothing of another group besides it.
Adding a role touches its package and, if it needs a new kind of link, this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from meshrl.schema import (
    ADVANTAGE,
    ENV_REWARD,
    REF_LOGPROBS,
    RETURNS,
    RM_SCORE,
    TOKEN_REWARDS,
    VALUES,
    teacher_columns,
)

if TYPE_CHECKING:
    from meshrl.planning.recipe import Recipe, Scheduling

Partitions = str | tuple[str, ...]


@dataclass(frozen=True)
class Read:
    """Rows a service claims: those of `partition` that have every column of `columns`."""

    port: str
    """The name the service asks its wiring for (`ctx.wiring.claim(port)`)."""
    partition: Partitions
    """A partition, or several in order of preference: the first some group writes `columns` to."""
    columns: tuple[str, ...]
    consumer: str | None = None
    """The consumer name its replicas share, splitting the rows between them (None: the group's id)."""
    optional: tuple[str, ...] = ()
    """Columns it also claims when some group writes them there (the trainer's loss mask of agents'
    trajectories); a row never waits for one nobody writes."""
    retains: bool = False
    """A row is deleted once this consumer (and every other retaining one) has acknowledged it."""
    per_replica: bool = False
    """Every replica reads every row (rollout counts every gate), under "<replica>-<consumer>"."""
    addressed: bool = False
    """Each replica reads only the rows addressed to it (their TO metadata names the replica), under
    "<replica>-<consumer>": the answers to the model calls an agents replica made for its programs."""
    deletes: bool = False
    """The service deletes rows it claimed before others are done writing into them (dynamic
    sampling): the planner checks that nobody writes a column there that this read does not wait for."""


@dataclass(frozen=True)
class Write:
    """Columns a service adds to rows of `partition`."""

    port: str
    partition: Partitions
    """A partition, or several in order of preference: the first another group reads `columns` from."""
    columns: tuple[str, ...]


@dataclass(frozen=True)
class Claim:
    """A read, resolved: what the service passes to the data plane's claim."""

    partition: str
    consumer: str
    columns: tuple[str, ...]
    per_replica: bool = False
    retains: bool = False
    addressed: bool = False

    def consumer_of(self, replica: str) -> str:
        """The consumer name replica `replica` claims under."""
        return f"{replica}-{self.consumer}" if self.per_replica or self.addressed else self.consumer

    def address_of(self, replica: str) -> str | None:
        """The address replica `replica` claims with (None: every row)."""
        return replica if self.addressed else None


@dataclass(frozen=True, kw_only=True)
class Peer:
    """A process of the run as another group is handed it: where it runs, and where it is reached."""

    name: str
    """Its process name ("inference-1-0")."""
    host: str
    """Its host id (`ServiceContext.address` turns it into an address to connect to)."""
    port: int = 0
    """The port this link reaches it at (0: none)."""
    local_rank: int = 0
    """Its device on its host (cuda:<local_rank>), when it uses one."""
    uses_device: bool = False
    """Whether it runs on a device (else on CPU beside the device processes)."""


@dataclass(frozen=True)
class Weights:
    """A weight group: the trainer `source` publishes every version to the groups `receivers`."""

    source: str
    receivers: tuple[str, ...]
    adapters: Any = None
    """The source's LoRA settings when it publishes the adapters alone (every receiver applies them
    itself); None: it publishes whole weights."""
    endpoint: Peer | None = None
    """Where the group meets: the source's first process, at its weight-sync port (set once placed)."""
    members: tuple[str, ...] = ()
    """The receiving replicas ("inference-0", ...) in the group's rank order: member i has rank 1 + i,
    the source rank 0 (set once placed)."""
    receiving: tuple[Peer, ...] = ()
    """Every process of the receiving replicas (the source sends over shared memory when all are on
    its host; set once placed)."""


@dataclass(frozen=True, kw_only=True)
class Ring:
    """A colocation ring as its members are handed it (meshrl/runtime/colocation.py takes the turns)."""

    id: str
    """The ring's id in the recipe."""
    members: tuple[str, ...]
    """Its member groups, in ring order."""
    modes: tuple[Scheduling, ...]
    """Each member's scheduling (ON_DEMAND or FALLBACK), in ring order."""
    processes: tuple[tuple[str, ...], ...]
    """Each member's process names, in ring order."""
    hybrid: bool = False
    """The members share one process per device: turns without offload."""


@dataclass(frozen=True)
class Wiring:
    """One group's part of the run's wiring."""

    group: str
    claims: dict[str, Claim] = field(default_factory=dict)
    """By read port."""
    outputs: dict[str, tuple[str, tuple[str, ...]]] = field(default_factory=dict)
    """By write port: (partition, columns)."""
    weights: Weights | None = None
    """The weight group this group publishes to or receives from."""
    inputs: dict[str, Any] = field(default_factory=dict)
    """The settings it needs, by name, from the group that offers them."""
    ring: Ring | None = None
    """The colocation ring this group takes turns in (set once placed; None: it is in none)."""
    checkpoint: tuple[str, ...] = ()
    """The processes a checkpoint this group takes waits for, each saving its own state (a group that
    `takes_checkpoints`: every process of the stateful groups; set once placed)."""

    def claim(self, port: str) -> Claim:
        try:
            return self.claims[port]
        except KeyError:
            raise KeyError(f"{self.group} has no read {port!r} (it declares {sorted(self.claims)})") from None

    def partition(self, port: str) -> str:
        """Where write `port` goes."""
        try:
            return self.outputs[port][0]
        except KeyError:
            raise KeyError(
                f"{self.group} has no write {port!r} (it declares {sorted(self.outputs)})"
            ) from None


# Hints for a column nobody writes, and for one nobody reads.
PRODUCER_HINTS = {
    ADVANTAGE: "rollout writes them, unless rollout.values='trainer' (then trainer.value.head=true computes them)",
    TOKEN_REWARDS: "rollout.advantage='gae' with rollout.values='trainer' writes them",
    RETURNS: "rollout.advantage='gae' with rollout.values='critic' writes them",
    VALUES: "add a critic service group (or enable the trainer's value head)",
    REF_LOGPROBS: "add a reference service group",
    RM_SCORE: "add a reward-model service group",
    ENV_REWARD: "add an agents group (meshrl.roles.agents.config.AgentsConfig: an environment, a program or a "
    "verifiers taskset)",
    **dict.fromkeys(teacher_columns("teacher"), "add a teacher service group"),
}
READER_HINTS = {
    VALUES: "rollout.advantage='gae' with rollout.values='critic' reads them",
    REF_LOGPROBS: "trainer.kl.coef > 0 (or trainer.kl.metric) or rollout.kl_penalty.coef > 0 reads them",
    RM_SCORE: 'rollout.rewards={"rm": <weight>, ...} reads it',
    TOKEN_REWARDS: "trainer.value.head=true reads them",
}


def wire(recipe: Recipe) -> tuple[dict[str, Wiring], list[str]]:
    """Every group's wiring, and every problem of it (empty when the recipe is wired completely)."""
    reads = {g.id: g.config.reads() for g in recipe.groups}
    writes = {g.id: g.config.writes() for g in recipe.groups}
    problems: list[str] = []
    outputs = {gid: _outputs(gid, ws, reads, problems) for gid, ws in writes.items()}
    written: dict[tuple[str, str], list[str]] = {}  # (partition, column) -> writing groups
    for gid, ports in outputs.items():
        for part, cols in ports.values():
            for c in cols:
                written.setdefault((part, c), []).append(gid)
    claims = {gid: _claims(gid, rs, written, problems) for gid, rs in reads.items()}
    problems += _unread(outputs, claims)
    problems += _late_writers(reads, claims, outputs)
    weights = _weights(recipe, problems)
    inputs = _inputs(recipe, problems)
    wiring = {
        g.id: Wiring(
            g.id,
            claims[g.id],
            outputs[g.id],
            weights.get(g.id),
            inputs.get(g.id, {}),
        )
        for g in recipe.groups
    }
    return wiring, problems


def partitions(wiring: dict[str, Wiring]) -> dict[str, list[str]]:
    """Every partition the run's services write, with the consumers whose acknowledgements delete a row."""
    out: dict[str, set[str]] = {}
    for w in wiring.values():
        for part, _ in w.outputs.values():
            out.setdefault(part, set())
    for w in wiring.values():
        for c in w.claims.values():
            if c.retains:
                out.setdefault(c.partition, set()).add(c.consumer)
    return {p: sorted(c) for p, c in sorted(out.items())}


def _outputs(
    gid: str, ws: tuple[Write, ...], reads: dict[str, tuple[Read, ...]], problems: list[str]
) -> dict[str, tuple[str, tuple[str, ...]]]:
    """Group `gid`'s writes, each to its partition: a choice goes to the first partition that another
    group reads (one of) its columns from, by a read of one partition."""
    out = {}
    for w in ws:
        if isinstance(w.partition, str):
            out[w.port] = (w.partition, w.columns)
            continue
        for part in w.partition:
            readers = [
                other for other, rs in reads.items() if other != gid
                for r in rs if r.partition == part and set(r.columns) & set(w.columns)
            ]  # fmt: skip
            if readers:
                out[w.port] = (part, w.columns)
                break
        else:
            problems.append(
                f"groups[{gid!r}].config writes {', '.join(w.columns)} into {' or '.join(w.partition)}, which no "
                "service reads"
            )
    return out


def _claims(
    gid: str, rs: tuple[Read, ...], written: dict[tuple[str, str], list[str]], problems: list[str]
) -> dict[str, Claim]:
    """Group `gid`'s reads, resolved; a required column nobody writes is a problem (with a hint)."""
    out = {}
    for r in rs:
        options = (r.partition,) if isinstance(r.partition, str) else r.partition
        part = next((p for p in options if all((p, c) in written for c in r.columns)), None)
        if part is None:
            part = options[0]
            for c in r.columns:
                if (part, c) not in written:
                    where = part if len(options) == 1 else " or ".join(options)
                    hint = PRODUCER_HINTS.get(c, "add a service that writes it")
                    problems.append(
                        f"groups[{gid!r}].config reads {where}.{c}, which no service writes: {hint}"
                    )
        columns = r.columns + tuple(c for c in r.optional if (part, c) in written and c not in r.columns)
        out[r.port] = Claim(part, r.consumer or gid, columns, r.per_replica, r.retains, r.addressed)
    return out


def _unread(
    outputs: dict[str, dict[str, tuple[str, tuple[str, ...]]]], claims: dict[str, dict[str, Claim]]
) -> list[str]:
    """A write none of whose columns any other group reads is a problem: a service working for nobody."""
    problems = []
    for gid, ports in outputs.items():
        read = {
            (c.partition, col)
            for other, cs in claims.items()
            if other != gid
            for c in cs.values()
            for col in c.columns
        }
        for part, cols in ports.values():
            if not any((part, c) in read for c in cols):
                hint = next(
                    (READER_HINTS[c] for c in cols if c in READER_HINTS), "add a service that reads it"
                )
                problems.append(
                    f"groups[{gid!r}].config writes {part}.{', '.join(cols)}, which no service reads: {hint}"
                )
    return problems


def _late_writers(
    reads: dict[str, tuple[Read, ...]],
    claims: dict[str, dict[str, Claim]],
    outputs: dict[str, dict[str, tuple[str, tuple[str, ...]]]],
) -> list[str]:
    """A read that deletes the rows it claimed (dynamic sampling) must wait for every column written
    there: a group that writes none of the columns it waits for may still be writing into a deleted row."""
    problems = []
    for gid, rs in reads.items():
        for r in rs:
            if not r.deletes:
                continue
            claim = claims[gid][r.port]
            for other, ports in outputs.items():
                for part, cols in ports.values():
                    late = [c for c in cols if c not in claim.columns]
                    if other != gid and part == claim.partition and late and len(late) == len(cols):
                        problems.append(
                            f"groups[{gid!r}].config deletes rows of {part} that {other} may still be writing "
                            f"{', '.join(late)} into; it only works with services whose columns it waits for"
                        )
    return problems


def _weights(recipe: Recipe, problems: list[str]) -> dict[str, Weights]:
    """The weight groups: each trainer and the groups that follow it."""
    by_id = {g.id: g for g in recipe.groups}
    followers: dict[str, list[str]] = {}
    for g in recipe.groups:
        source = g.config.follows()
        if source is None:
            continue
        if source not in by_id or not by_id[source].config.publishes_weights:
            trainers = sorted(x.id for x in recipe.groups if x.config.publishes_weights)
            problems.append(f"groups[{g.id!r}].config.trainer: {source!r} is not a trainer of this recipe "
                            f"(trainers: {trainers})")  # fmt: skip
            continue
        followers.setdefault(source, []).append(g.id)
    out = {}
    for g in recipe.groups:
        if not g.config.publishes_weights:
            continue
        receivers = tuple(followers.get(g.id, ()))
        alone = bool(receivers) and all(by_id[r].config.applies_adapters() for r in receivers)
        link = Weights(g.id, receivers, g.config.adapters() if alone else None)
        for gid in (g.id, *receivers):
            out[gid] = link
    return out


def _inputs(recipe: Recipe, problems: list[str]) -> dict[str, dict[str, Any]]:
    """What each group needs from others, from the groups that offer it (all of which must agree)."""
    offered: dict[str, dict[str, Any]] = {}  # name -> group -> value
    for g in recipe.groups:
        for name, value in g.config.offers().items():
            offered.setdefault(name, {})[g.id] = value
    out: dict[str, dict[str, Any]] = {}
    for g in recipe.groups:
        for name, hint in g.config.needs().items():
            offers = {gid: v for gid, v in offered.get(name, {}).items() if gid != g.id}
            values = list(offers.values())
            if not offers:
                problems.append(f"groups[{g.id!r}].config needs {name}, which no other group offers: {hint}")
            elif any(v != values[0] for v in values):
                problems.append(
                    f"groups[{g.id!r}].config needs one {name}, and the groups offering it disagree: {offers}"
                )
            else:
                out.setdefault(g.id, {})[name] = values[0]
    return out
