"""plan(recipe, devices, members) -> Topology: who runs where, on which ports. A pure function.

Every launcher calls it with the same recipe and the same gathered device list and gets the same plan,
whatever order the devices were gathered in, so nothing is ever negotiated or exchanged at run time.

Rules:
- Devices are taken in global-rank order. Device groups are placed in recipe order, each replica on
  `devices_per_replica` consecutive devices. A colocation ring's members reuse the devices of the
  member that comes first in the recipe. CPU-only replicas (0 devices) go round-robin over launchers.
- A launcher numbers the processes it starts (its slots) in plan order; replicas that joined the
  running run take slots from SLOTS on (meshrl/planning/members.py). Process ports are
  `base_port + 2 + (index * (SLOTS + EXTRA_SLOTS) + slot) * PORTS + k`, k in 0..PORTS-1 (health,
  the replica's torch.distributed master, the weight-sync group, spare), where `index` is the launcher's position
  among the launchers of its host in rank order. Ports need only be unique per host, and they are by
  construction, also when two torchrun agents share a machine.
- The data plane's controller runs on the host of rank 0 at `base_port`; every host runs a storage
  server at `base_port + 1`. A launcher that joined the running run (`meshrl join`) takes its rank as
  its position, so its ports are the run's own whatever host it is on; a host it brings has its
  storage server at its band's first port.
- Each group's wiring gets what follows from the placement (`placed`): a weight group's meeting point
  and members, a ring's processes, a checkpoint's participants, the replicas serving a needed setting.
  A service is handed its group's wiring, never the topology.

All problems are collected and raised together as one RecipeError, each naming the recipe field
(`meshrl/planning/checks.py` finds them); placement and ports are `place` and `ports`.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from meshrl.planning import checks
from meshrl.planning.checks import devices_needed
from meshrl.planning.config import RecipeError
from meshrl.planning.members import EXTRA_SLOTS, Membership
from meshrl.planning.recipe import Recipe, Scheduling
from meshrl.planning.wiring import Peer, Ring, Weights, Wiring, partitions, wire
from meshrl.schema import CHECKPOINT, CHECKPOINT_ACKS, CONTROL

SLOTS = 128  # processes a launcher may start
PORTS = 4  # ports per process
HEALTH, MASTER, WEIGHTS, HTTP = range(PORTS)
"""A process's ports: its health endpoint, its torch.distributed group's master, the weights it
receives or serves, and the agents' OpenAI-compatible endpoint."""


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
    def ranks(self) -> tuple[int, ...]:
        return tuple(p.rank for p in self.processes)


@dataclass(frozen=True)
class Topology:
    devices: tuple[Device, ...]
    replicas: tuple[Replica, ...]
    controller_host: str
    controller_port: int
    storage: tuple[tuple[str, int, int], ...]  # (host, launcher rank that runs it, port)
    wiring: dict[str, Wiring]
    """Each group's part of the run's wiring (meshrl/planning/wiring.py), with what follows from the
    placement (`placed`): all a service is handed about other groups."""

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


def plan(recipe: Recipe, devices: Sequence[Device], members: Membership | None = None) -> Topology:
    """Who runs where, on which ports; every problem of the recipe on these devices is raised at once.
    `members`: the replicas that joined or left the running run (meshrl/planning/members.py)."""
    devs = sorted(devices)
    wiring, found = wire(recipe)
    found += checks.problems(recipe, devs, wiring)
    if found:
        raise RecipeError(found)
    members = members or Membership()
    replicas = place(recipe, devs, members)
    found = _port_problems(recipe, replicas)
    if found:
        raise RecipeError(found)
    hosts: dict[str, int] = {}
    for d in devs:
        hosts.setdefault(d.host, d.rank)
    hosts = hosts or {"localhost": 0}
    controller_host = devs[0].host if devs else "localhost"
    storage = [(h, r, recipe.ports_from + 1) for h, r in sorted(hosts.items(), key=lambda x: x[1])]
    for h in members.hosts:  # a joined host's storage: at the first port of its launcher's band
        if h.name not in hosts:
            hosts[h.name] = h.rank
            storage.append((h.name, h.rank, ports(recipe, h.rank, 0)[0]))
    return Topology(
        (*devs, *joined_devices(members)), replicas, controller_host, recipe.ports_from, tuple(storage),
        placed(recipe, wiring, replicas),
    )  # fmt: skip


def joined_devices(members: Membership) -> list[Device]:
    """The launcher ranks of the hosts that joined the run, as devices (a host without devices: one)."""
    return [Device(r, h.name, i) for h in members.hosts for i, r in enumerate(h.ranks)]


def placed(recipe: Recipe, wiring: dict[str, Wiring], replicas: Sequence[Replica]) -> dict[str, Wiring]:
    """Each group's wiring with what it needs of the placement, so that no service looks at the topology:
    where its weight group meets and who is in it, its colocation ring's processes, the processes a
    checkpoint it takes waits for."""
    of: dict[str, list[Replica]] = {}
    for r in replicas:
        of.setdefault(r.group, []).append(r)
    stateful = tuple(p.name for r in replicas if recipe.group(r.group).config.stateful for p in r.processes)
    out = {}
    for g in recipe.groups:
        w = wiring[g.id]
        out[g.id] = dataclasses.replace(
            w,
            weights=None if w.weights is None else _placed_weights(w.weights, replicas),
            ring=_ring(recipe, g.id, of),
            checkpoint=stateful if g.config.takes_checkpoints else (),
        )
    return out


def _placed_weights(link: Weights, replicas: Sequence[Replica]) -> Weights:
    """A weight group, placed: the source's first process meets its receiving replicas (in plan order)."""
    source = next(r for r in replicas if r.group == link.source)
    members = [r for r in replicas if r.group in link.receivers]
    return dataclasses.replace(
        link,
        endpoint=_peer(source.processes[0], WEIGHTS),
        members=tuple(m.name for m in members),
        receiving=tuple(_peer(p) for m in members for p in m.processes),
    )


def _ring(recipe: Recipe, gid: str, of: dict[str, list[Replica]]) -> Ring | None:
    """The colocation ring group `gid` takes turns in, with every member's processes."""
    ring = next((r for r in recipe.rings if gid in {m.group for m in r.members}), None)
    if ring is None:
        return None
    return Ring(
        id=ring.id,
        members=tuple(m.group for m in ring.members),
        modes=tuple(m.mode for m in ring.members),
        processes=tuple(
            tuple(p.name for r in of.get(m.group, ()) for p in r.processes) for m in ring.members
        ),
        hybrid=ring.hybrid,
    )


def _peer(p: Process, k: int | None = None) -> Peer:
    """Process `p` as another group is handed it, reached at its port k (of PORTS), if any."""
    return Peer(
        name=p.name, host=p.host, port=0 if k is None else p.ports[k], local_rank=p.local_rank,
        uses_device=p.uses_device,
    )  # fmt: skip


def place(recipe: Recipe, devs: Sequence[Device], members: Membership | None = None) -> tuple[Replica, ...]:
    """Every replica's processes: devices in recipe order (ring members reuse their leader's), CPU-only
    replicas round-robin over the launchers, slots numbered per launcher in plan order, ports from
    each launcher's position on its host. A replica of the recipe that left keeps its slots (unused);
    one that joined is where `members` placed it."""
    members = members or Membership()
    alloc = _allocate(recipe, devs)
    world = max(1, len(devs))
    by_rank = {d.rank: d for d in devs} or {0: Device(0, "localhost", 0)}
    host_index = _host_index(devs)
    for d in joined_devices(members):  # a joined launcher's ports: a band of its own (its rank's)
        by_rank[d.rank], host_index[d.rank] = d, d.rank
    slots: Counter[int] = Counter()
    cpu_next = 0
    replicas = []
    for g in recipe.groups:
        ring = next((r for r in recipe.rings if g.id in {m.group for m in r.members}), None)
        mode = next((m.mode for m in ring.members if m.group == g.id), None) if ring else None
        for i in range(g.replicas):
            if g.devices_per_replica:
                placed = [(d, True) for d in alloc[(g.id, i)]]
            else:
                placed = [(by_rank[cpu_next % world], False)]
                cpu_next += 1
            procs = []
            for w, (d, uses) in enumerate(placed):
                slot = slots[d.rank]
                slots[d.rank] += 1
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
                        ports(recipe, host_index[d.rank], slot),
                    )
                )
            if (g.id, i) not in members.left:
                replicas.append(Replica(g.id, i, tuple(procs), ring.id if ring else None, mode))
        for j in sorted((j for j in members.joined if j.group == g.id), key=lambda j: j.index):
            procs = [
                Process(g.id, j.index, w, rank, by_rank[rank].host, by_rank[rank].local_rank, j.devices,
                        SLOTS + slot, ports(recipe, host_index[rank], SLOTS + slot))
                for w, (rank, slot) in enumerate(j.places)
            ]  # fmt: skip
            replicas.append(Replica(g.id, j.index, tuple(procs), None, None))
    return tuple(replicas)


def ports(recipe: Recipe, launcher_on_host: int, slot: int) -> tuple[int, ...]:
    """The PORTS ports of process `slot` of the launcher at position `launcher_on_host` of its host (slots
    from SLOTS on: replicas that joined the running run)."""
    start = recipe.ports_from + 2 + (launcher_on_host * (SLOTS + EXTRA_SLOTS) + slot) * PORTS
    return tuple(range(start, start + PORTS))


def _allocate(recipe: Recipe, devs: Sequence[Device]) -> dict[tuple[str, int], list[Device]]:
    """(group, replica) -> its devices, in recipe order; ring members reuse their leader's devices."""
    next_dev = 0
    alloc: dict[tuple[str, int], list[Device]] = {}
    for g in recipe.groups:
        if g.devices_per_replica == 0:
            continue
        leader = checks.ring_leader(recipe, g.id)
        for i in range(g.replicas):
            if leader is not None:
                alloc[(g.id, i)] = alloc[(leader, i)]
            else:
                alloc[(g.id, i)] = list(devs[next_dev : next_dev + g.devices_per_replica])
                next_dev += g.devices_per_replica
    return alloc


def _host_index(devs: Sequence[Device]) -> dict[int, int]:
    """rank -> the launcher's position among the launchers of its host, in rank order."""
    index: dict[int, int] = {0: 0}
    seen: Counter[str] = Counter()
    for d in devs:
        index[d.rank] = seen[d.host]
        seen[d.host] += 1
    return index


def _port_problems(recipe: Recipe, replicas: Sequence[Replica]) -> list[str]:
    found = []
    slots = Counter(p.rank for r in replicas for p in r.processes if p.slot < SLOTS)
    crowded = sorted(r for r, n in slots.items() if n > SLOTS)
    if crowded:
        found.append(
            f"groups: launcher ranks {crowded[:8]} would start more than {SLOTS} processes each; "
            "use fewer CPU-only replicas or more devices"
        )
    top = max((p for r in replicas for p in r.processes), key=lambda p: p.ports[-1], default=None)
    if top is not None and top.ports[-1] > 65535:
        found.append(f"base_port: {recipe.ports_from} leaves no room for the ports of {top.name}; lower it")
    elif top is not None and top.ports[-1] - top.slot * PORTS + (SLOTS + EXTRA_SLOTS) * PORTS > 65536:
        found.append(
            f"base_port: {recipe.ports_from} leaves no room for replicas that join the run; lower it"
        )
    return found


def run_partitions(recipe: Recipe, topology: Topology) -> list[tuple[str, int, list[str]]]:
    """(name, capacity, consumers whose acks delete a row) of every partition of the run: the control
    and checkpoint partitions, and every partition a service writes (meshrl/planning/wiring.py)."""
    wired = partitions(topology.wiring)
    out: list[tuple[str, int, list[str]]] = [(CONTROL, 4096, [])]
    for p in (CHECKPOINT, CHECKPOINT_ACKS):
        wired.setdefault(p, [])
    return out + [
        (p, recipe.dataplane.capacity, retain) for p, retain in sorted(wired.items()) if p != CONTROL
    ]


__all__ = [
    "Device", "Process", "Replica", "Topology", "cohosts", "devices_needed", "place", "placed", "plan",
    "ports", "run_partitions",
]  # fmt: skip
