"""plan(recipe, devices) -> Topology: who runs where, on which ports. A pure function.

Every launcher calls it with the same recipe and the same gathered device list and gets the same plan,
whatever order the devices were gathered in, so nothing is ever negotiated or exchanged at run time.

Rules:
- Devices are taken in global-rank order. Device groups are placed in recipe order, each replica on
  `devices_per_replica` consecutive devices. A colocation ring's members reuse the devices of the
  member that comes first in the recipe. CPU-only replicas (0 devices) go round-robin over launchers.
- A launcher numbers the processes it starts (its slots) in plan order. Process ports are
  `base_port + 2 + (index * SLOTS + slot) * PORTS + k`, k in 0..PORTS-1 (health, the replica's
  torch.distributed master, the weight-sync group, spare), where `index` is the launcher's position
  among the launchers of its host in rank order. Ports need only be unique per host, and they are by
  construction, also when two torchrun agents share a machine.
- The data plane's controller runs on the host of rank 0 at `base_port`; every host runs a storage
  server at `base_port + 1`.

All problems are collected and raised together as one RecipeError, each naming the recipe field.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from meshrl.planning.recipe import Recipe, RecipeError, Scheduling, ServiceConfig
from meshrl.roles.inference.config import InferenceConfig

SLOTS = 128  # processes a launcher may start
PORTS = 4  # ports per process
HEALTH, MASTER, WEIGHTS, SPARE = range(PORTS)

# Friendly hints for a column nobody writes.
PRODUCER_HINTS = {
    "values": "add a critic service group (or enable the trainer's value head)",
    "ref_logprobs": "add a reference service group",
    "rm_score": "add a reward-model service group",
    "teacher_topk_ids": "add a teacher service group",
    "teacher_topk_logprobs": "add a teacher service group",
    "teacher_logprobs": "add a teacher service group",
}


@dataclass(frozen=True, order=True)
class Device:
    rank: int
    host: str
    local_rank: int


@dataclass(frozen=True)
class Process:
    """One OS process: worker `worker` of replica `replica` of group `group`."""

    group: str
    replica: int
    worker: int
    rank: int  # the launcher that starts it (its device's rank, or the owner of a CPU-only replica)
    host: str
    local_rank: int  # the launcher's device on its host (cuda:<local_rank>)
    uses_device: bool
    slot: int
    ports: tuple[int, ...]

    @property
    def name(self) -> str:
        return f"{self.group}-{self.replica}-{self.rank}"


@dataclass(frozen=True)
class Replica:
    group: str
    index: int
    processes: tuple[Process, ...]
    ring: str | None
    mode: Scheduling | None

    @property
    def name(self) -> str:
        return f"{self.group}-{self.index}"

    @property
    def world_size(self) -> int:
        return len(self.processes)

    @property
    def master(self) -> tuple[str, int]:
        """Rendezvous of this replica's own torch.distributed group."""
        p = self.processes[0]
        return p.host, p.ports[MASTER]

    @property
    def weights_endpoint(self) -> tuple[str, int]:
        """Rendezvous of the weight-sync group this replica leads (trainers)."""
        p = self.processes[0]
        return p.host, p.ports[WEIGHTS]

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(p.rank for p in self.processes)


@dataclass(frozen=True)
class Topology:
    devices: tuple[Device, ...]
    replicas: tuple[Replica, ...]
    controller_host: str
    controller_port: int
    storage: tuple[tuple[str, int, int], ...]  # (host, launcher rank that runs it, port)

    def processes_on(self, rank: int) -> list[Process]:
        return [p for r in self.replicas for p in r.processes if p.rank == rank]

    def replicas_of(self, group: str) -> list[Replica]:
        return [r for r in self.replicas if r.group == group]

    def replica(self, group: str, index: int) -> Replica:
        for r in self.replicas:
            if r.group == group and r.index == index:
                return r
        raise KeyError(f"{group}-{index}")

    def controller_endpoint(self, bind_all: bool = False) -> str:
        host = "127.0.0.1" if self.single_host and not bind_all else self.controller_host
        return f"tcp://{host}:{self.controller_port}"

    @property
    def single_host(self) -> bool:
        return len({d.host for d in self.devices}) == 1


def cohosts(recipe: Recipe, topology: Topology) -> dict[str, tuple[Process, ...]]:
    """Every process that runs as its own OS process -> the service processes it hosts (itself first).
    Members of a hybrid ring on the same device are hosted by the first member's process."""
    hosted: dict[str, list[Process]] = {}
    host_of: dict[tuple[str, int], str] = {}  # (ring, device rank) -> hosting process
    ring_of = {m.group: r for r in recipe.rings if r.hybrid for m in r.members}
    for r in topology.replicas:
        for p in r.processes:
            ring = ring_of.get(p.group)
            if ring is None:
                hosted[p.name] = [p]
                continue
            key = (ring.id, p.rank)
            if key not in host_of:
                host_of[key] = p.name
                hosted[p.name] = []
            hosted[host_of[key]].append(p)
    return {name: tuple(ps) for name, ps in hosted.items()}


def devices_needed(recipe: Recipe) -> int:
    """Devices the recipe occupies: ring members share their devices."""
    shared: set[str] = set()
    for ring in recipe.rings:
        names = {m.group for m in ring.members}
        in_order = [g.id for g in recipe.groups if g.id in names]
        shared |= set(in_order[1:])
    return sum(g.replicas * g.devices_per_replica for g in recipe.groups if g.id not in shared)


def plan(recipe: Recipe, devices: list[Device] | tuple[Device, ...]) -> Topology:
    problems: list[str] = []
    devs = sorted(devices)
    _check_devices(devs, problems)
    groups = {g.id: g for g in recipe.groups}

    # rings
    ring_of: dict[str, tuple[str, Scheduling]] = {}
    leader_of: dict[str, str] = {}
    for ring in recipe.rings:
        where = f"rings[{ring.id!r}]"
        if len(ring.members) < 2:
            problems.append(f"{where}.members: a ring needs at least two members")
        fallbacks = [m.group for m in ring.members if m.mode is Scheduling.FALLBACK]
        if len(fallbacks) > 1:
            problems.append(f"{where}.members: at most one FALLBACK member, got {fallbacks}")
        for m in ring.members:
            if m.group not in groups:
                problems.append(f"{where}.members: unknown group {m.group!r} (groups: {sorted(groups)})")
                continue
            if m.group in ring_of:
                problems.append(
                    f"{where}.members: group {m.group!r} is already in ring {ring_of[m.group][0]!r}"
                )
                continue
            ring_of[m.group] = (ring.id, m.mode)
        order = {g.id: i for i, g in enumerate(recipe.groups)}
        known = sorted((m for m in ring.members if m.group in groups), key=lambda m: order[m.group])
        if known:  # the member placed first (recipe order) takes devices; the others reuse them
            first = groups[known[0].group]
            for m in known[1:]:
                g = groups[m.group]
                leader_of.setdefault(m.group, first.id)
                if (g.replicas, g.devices_per_replica) != (first.replicas, first.devices_per_replica):
                    problems.append(
                        f"{where}.members: {m.group!r} ({g.replicas} x {g.devices_per_replica} devices) does not "
                        f"share devices with {first.id!r} ({first.replicas} x {first.devices_per_replica}); ring "
                        "members need the same replicas and devices_per_replica"
                    )
            for m in known:
                config = groups[m.group].config
                if isinstance(config, InferenceConfig) and config.engine == "vllm":
                    problems.append(
                        f"{where}.members: {m.group!r} uses the vllm engine, which cannot offload (its weights "
                        "and KV cache would stay on the devices through the other members' turns); use the "
                        "hf engine in a ring or give the group devices of its own"
                    )
                if groups[m.group].devices_per_replica == 0:
                    problems.append(
                        f"{where}.members: {m.group!r} uses no devices; only device roles take turns"
                    )
                elif ring.hybrid and groups[m.group].devices_per_replica != 1:
                    problems.append(
                        f"{where}.hybrid: {m.group!r} has {groups[m.group].devices_per_replica} devices per "
                        "replica; co-process members use one (a sharded trainer cannot lend its weights yet)"
                    )

    need = devices_needed(recipe)
    if devs and need > len(devs):
        problems.append(
            f"groups: the recipe needs {need} devices ({_demand(recipe)}), only {len(devs)} available"
        )
    elif devs and need < len(devs) and need > 0:
        problems.append(
            f"groups: {len(devs)} devices but the recipe uses {need} ({_demand(recipe)}); "
            f"run with {need} devices or add replicas"
        )

    _check_columns(recipe, problems)
    for g in recipe.groups:
        if isinstance(g.config, ServiceConfig):
            problems += [f"groups[{g.id!r}].config.{p}" for p in g.config.check(recipe, g)]
    if problems:
        raise RecipeError(problems)

    # placement
    next_dev = 0
    alloc: dict[tuple[str, int], list[Device]] = {}
    for g in recipe.groups:
        if g.devices_per_replica == 0:
            continue
        leader = leader_of.get(g.id)
        for i in range(g.replicas):
            if leader is not None:
                alloc[(g.id, i)] = alloc[(leader, i)]
            else:
                alloc[(g.id, i)] = list(devs[next_dev : next_dev + g.devices_per_replica])
                next_dev += g.devices_per_replica
    world = max(1, len(devs))
    host_index: dict[int, int] = {}
    seen: Counter[str] = Counter()
    for d in devs:
        host_index[d.rank] = seen[d.host]
        seen[d.host] += 1
    slot_count: Counter[int] = Counter()
    by_rank = {d.rank: d for d in devs} or {0: Device(0, "localhost", 0)}
    cpu_next = 0
    replicas = []
    for g in recipe.groups:
        ring_id, mode = ring_of.get(g.id, (None, None))
        for i in range(g.replicas):
            if g.devices_per_replica:
                placed = [(d, True) for d in alloc[(g.id, i)]]
            else:
                placed = [(by_rank[cpu_next % world], False)]
                cpu_next += 1
            procs = []
            for w, (d, uses) in enumerate(placed):
                slot = slot_count[d.rank]
                slot_count[d.rank] += 1
                start = recipe.base_port + 2 + (host_index.get(d.rank, 0) * SLOTS + slot) * PORTS
                procs.append(
                    Process(
                        g.id,
                        i,
                        w,
                        d.rank,
                        d.host,
                        d.local_rank,
                        uses,
                        slot,
                        tuple(range(start, start + PORTS)),
                    )
                )
            replicas.append(Replica(g.id, i, tuple(procs), ring_id, mode))

    crowded = sorted(r for r, n in slot_count.items() if n > SLOTS)
    if crowded:
        problems.append(
            f"groups: launcher ranks {crowded[:8]} would start more than {SLOTS} processes each; "
            "use fewer CPU-only replicas or more devices"
        )
    top = max((p for r in replicas for p in r.processes), key=lambda p: p.ports[-1], default=None)
    if top is not None and top.ports[-1] > 65535:
        problems.append(f"base_port: {recipe.base_port} leaves no room for the ports of {top.name}; lower it")
    if problems:
        raise RecipeError(problems)

    hosts: dict[str, int] = {}
    for d in devs:
        hosts.setdefault(d.host, d.rank)
    if not hosts:
        hosts = {"localhost": 0}
    controller_host = by_rank[min(by_rank)].host
    storage = tuple((h, r, recipe.base_port + 1) for h, r in sorted(hosts.items(), key=lambda x: x[1]))
    return Topology(tuple(devs), tuple(replicas), controller_host, recipe.base_port, storage)


def _check_devices(devs: list[Device], problems: list[str]) -> None:
    ranks = [d.rank for d in devs]
    if ranks != list(range(len(devs))):
        problems.append(f"devices: global ranks must be 0..{len(devs) - 1} exactly once, got {ranks[:16]}")


def _check_columns(recipe: Recipe, problems: list[str]) -> None:
    written: set[tuple[str, str]] = set()
    for g in recipe.groups:
        if isinstance(g.config, ServiceConfig):
            for part, cols in g.config.writes().items():
                written |= {(part, c) for c in cols}
    for g in recipe.groups:
        if not isinstance(g.config, ServiceConfig):
            continue
        for part, cols in g.config.reads().items():
            for c in cols:
                if (part, c) not in written:
                    hint = PRODUCER_HINTS.get(c, "add a service that writes it")
                    problems.append(
                        f"groups[{g.id!r}].config reads {part}.{c}, which no service writes: {hint}"
                    )


def _demand(recipe: Recipe) -> str:
    return ", ".join(
        f"{g.id} {g.replicas}x{g.devices_per_replica}" for g in recipe.groups if g.devices_per_replica
    )
