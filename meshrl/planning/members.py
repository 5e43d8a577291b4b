"""A run's membership: the replicas that joined a running run, and the recipe's replicas that left it.

A run starts with the recipe's shape. `meshrl scale RUN_DIR inference=3` changes it while it runs, and
a replica that vanishes in a group whose `restart.mode` is "leave" leaves it smaller. What changed is a
`Membership`; `meshrl/planning/topology.py` plans a run from (recipe, devices, membership), a pure
function, so every process that plans gets the same identities: a joining replica's index, its
launcher and device, its ports.

- A new replica takes the lowest index that is free; a recipe's replica that left comes back in its old
  place (ports, device). One beyond the recipe's count takes the first free devices in rank order (a
  CPU-only one goes to the launchers round-robin by index) and, on its launcher, the first free slot of
  the band after the recipe's slots (`EXTRA_SLOTS` of them): its ports never change while it lives.
- Scaling in removes the highest indices first.
- Only stateless groups that re-join a running run can change: inference, env / agents, endpoint, and
  the frozen scorers (reference, reward model, teacher). `fixed` says why any other cannot.
- A launcher on another host that joins the run (`meshrl join`) is a `Host`: launcher ranks after
  every rank of the run, devices or one CPU-only rank, and the replicas the join asked for placed on
  them (`join_host`). When it goes, its replicas and its ranks go with it (`host_gone`).

The lead launcher keeps the membership in `RUN_DIR/members.json` with every change (`meshrl/runtime/
elastic.py`). Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from meshrl.planning.checks import ring_leader
from meshrl.planning.recipe import Recipe

EXTRA_SLOTS = 64
"""Per launcher: processes of replicas beyond the recipe's, their ports after the recipe's slots."""


class ScaleRefused(ValueError):
    """A change the run cannot make; the message says why, in one line."""


@dataclass(frozen=True)
class Joined:
    """A replica beyond the recipe's count that joined the running run."""

    group: str
    index: int
    places: tuple[tuple[int, int], ...]
    """(launcher rank, slot) of each of its processes; the launcher rank is its device's rank."""
    devices: bool = False
    """Its processes run on the devices of their launcher ranks (else on CPU beside them)."""


@dataclass(frozen=True)
class Host:
    """A launcher that joined the running run from a host of its own (`meshrl join`)."""

    name: str
    """Its host id (the data plane's: one storage server per host)."""
    rank: int
    """Its first launcher rank; its ranks follow every rank of the run when it joined."""
    devices: int = 0
    """Its devices, ranks `rank`...; with none it has one CPU-only launcher rank."""

    @property
    def ranks(self) -> range:
        return range(self.rank, self.rank + max(self.devices, 1))


@dataclass(frozen=True)
class Membership:
    left: tuple[tuple[str, int], ...] = ()
    """The recipe's replicas (group, index) that left the run."""
    joined: tuple[Joined, ...] = field(default_factory=tuple)
    hosts: tuple[Host, ...] = ()
    """Launchers that joined the run (`meshrl join`), in the order they joined."""

    def ranks(self, devices: Sequence[Any]) -> list[tuple[int, bool]]:
        """(rank, is a device) of every launcher rank of the run: the recipe's `devices` (objects with a
        `rank`) and the joined hosts'."""
        own = [(d.rank, True) for d in devices] or [(0, False)]
        return own + [(r, h.devices > 0) for h in self.hosts for r in h.ranks]

    def live(self, recipe: Recipe, group: str) -> list[int]:
        """The indices of `group`'s replicas in the run now."""
        base = [i for i in range(recipe.group(group).replicas) if (group, i) not in self.left]
        return sorted(base + [j.index for j in self.joined if j.group == group])

    def to_json(self) -> dict[str, Any]:
        return {
            "left": [list(x) for x in self.left],
            "joined": [
                {
                    "group": j.group,
                    "index": j.index,
                    "places": [list(p) for p in j.places],
                    "devices": j.devices,
                }
                for j in self.joined
            ],
            "hosts": [{"name": h.name, "rank": h.rank, "devices": h.devices} for h in self.hosts],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> Membership:
        if not data:
            return cls()
        joined = tuple(
            Joined(str(j["group"]), int(j["index"]), tuple((int(r), int(s)) for r, s in j["places"]),
                   bool(j.get("devices", False)))
            for j in data.get("joined", ())
        )  # fmt: skip
        hosts = tuple(Host(str(h["name"]), int(h["rank"]), int(h["devices"])) for h in data.get("hosts", ()))
        return cls(tuple((str(g), int(i)) for g, i in data.get("left", ())), joined, hosts)


def fixed(recipe: Recipe, group: str) -> str | None:
    """Why `group`'s replica count cannot change in a running run (None: it can)."""
    g = recipe.group(group)
    cfg = g.config
    if cfg.publishes_weights or cfg.takes_checkpoints:
        return f"{group} publishes the weights and takes the checkpoints: one replica, fixed at start"
    if cfg.stateful:
        return (f"{group} keeps the run's progress (its replicas share their claims and checkpoints): "
                "its replica count is fixed at start")  # fmt: skip
    if not cfg.rejoins:
        return f"{group}'s service cannot join a running run"
    ring = next((r.id for r in recipe.rings if group in {m.group for m in r.members}), None)
    if ring is not None:
        return f"{group} takes turns in colocation ring {ring!r}: its replicas share fixed devices"
    return None


def scale(
    recipe: Recipe,
    ranks: Sequence[tuple[int, bool]],
    members: Membership,
    group: str,
    n: int,
    on: Sequence[int] | None = None,
) -> Membership:
    """`members` with `group` at `n` replicas. `ranks`: (rank, is a device) of every launcher rank of the
    run, in rank order (`Membership.ranks`); `on`: the ranks new replicas go to (default: any).
    Raises ScaleRefused (nothing changes) when it cannot be done."""
    if group not in {g.id for g in recipe.groups}:
        raise ScaleRefused(
            f"no group {group!r} in this run (groups: {', '.join(g.id for g in recipe.groups)})"
        )
    why = fixed(recipe, group)
    if why is not None:
        raise ScaleRefused(why)
    if n < 1:
        raise ScaleRefused(f"{group}: at least one replica (asked for {n})")
    live = members.live(recipe, group)
    while len(live) > n:  # the highest index leaves first
        members = without(recipe, members, group, live.pop())
    while len(live) < n:
        index = next(i for i in range(len(live) + 1) if i not in live)
        if on is not None:  # a joining host's replicas: new ones, beyond the recipe's places
            index = max([*live, recipe.group(group).replicas - 1]) + 1
            ranks = [(r, dev) for r, dev in ranks if r in on]
        members = _join(recipe, ranks, members, group, index)
        live = members.live(recipe, group)
    return members


def without(recipe: Recipe, members: Membership, group: str, index: int) -> Membership:
    """`members` after replica `index` of `group` left the run."""
    if index < recipe.group(group).replicas:
        return replace(members, left=tuple(sorted({*members.left, (group, index)})))
    return replace(members, joined=tuple(j for j in members.joined if (j.group, j.index) != (group, index)))


def join_host(
    recipe: Recipe,
    devices: Sequence[Any],
    members: Membership,
    host: str,
    n_devices: int,
    groups: dict[str, int],
) -> tuple[Membership, Host]:
    """`members` after a launcher of host `host` with `n_devices` devices joined, running `groups`
    (group -> replicas on it; empty: its devices filled with the first group that can grow and
    receives weights, or one replica of it on a host without devices). `devices`: the recipe's."""
    if n_devices < 0:
        raise ScaleRefused(f"devices: {n_devices} is not a count")
    if host in {h.name for h in members.hosts}:
        raise ScaleRefused(f"a launcher of host {host!r} has joined already")
    rank = 1 + max(r for r, _ in members.ranks(devices))
    new = Host(host, rank, n_devices)
    members = replace(members, hosts=(*members.hosts, new))
    if not groups:
        growable = [g for g in recipe.groups if fixed(recipe, g.id) is None]
        pick = [g for g in growable if g.config.follows() is not None] or growable
        if not pick:
            raise ScaleRefused("no group of this run can grow")
        g = pick[0]
        groups = {g.id: n_devices // g.devices_per_replica if g.devices_per_replica else 1}
    for group, k in groups.items():
        if k < 1:
            raise ScaleRefused(f"{group}: at least one replica on the joining host (asked for {k})")
        live = len(members.live(recipe, group)) if group in {g.id for g in recipe.groups} else 0
        members = scale(recipe, members.ranks(devices), members, group, live + k, on=new.ranks)
    return members, new


def host_gone(recipe: Recipe, members: Membership, rank: int) -> Membership:
    """`members` after the joined launcher whose first rank is `rank` went, with its replicas."""
    host = next(h for h in members.hosts if h.rank == rank)
    joined = tuple(j for j in members.joined if not any(r in host.ranks for r, _ in j.places))
    return replace(members, joined=joined, hosts=tuple(h for h in members.hosts if h is not host))


def _join(
    recipe: Recipe, ranks: Sequence[tuple[int, bool]], members: Membership, group: str, index: int
) -> Membership:
    g = recipe.group(group)
    if index < g.replicas:  # one of the recipe's comes back in its old place
        return replace(members, left=tuple(x for x in members.left if x != (group, index)))
    if g.devices_per_replica:
        free = [r for r, dev in ranks if dev and r not in used_devices(recipe, members)]
        if len(free) < g.devices_per_replica:
            raise ScaleRefused(
                f"{group}: no free device for another replica ({g.devices_per_replica} per replica, "
                f"{len(free)} free of {sum(dev for _, dev in ranks)})"
            )
        owners = free[: g.devices_per_replica]
    else:
        launchers = sorted({r for r, _ in ranks}) or [0]
        owners = [launchers[index % len(launchers)]]
        if not ranks:
            raise ScaleRefused(f"{group}: no launcher to run another replica on")
    places: list[tuple[int, int]] = []
    for rank in owners:
        taken = {s for j in members.joined for r, s in j.places if r == rank} | {
            s for r, s in places if r == rank
        }
        slot = next((s for s in range(EXTRA_SLOTS) if s not in taken), None)
        if slot is None:
            raise ScaleRefused(f"{group}: launcher {rank} runs {EXTRA_SLOTS} joined processes already")
        places.append((rank, slot))
    joined = Joined(group, index, tuple(places), devices=g.devices_per_replica > 0)
    return replace(members, joined=(*members.joined, joined))


def used_devices(recipe: Recipe, members: Membership) -> set[int]:
    """Device ranks held by a live replica: the recipe's, in recipe order (ring members reuse their
    leader's; one that left still holds its place) and the joined ones'."""
    used: set[int] = set()
    at = 0
    for g in recipe.groups:
        if not g.devices_per_replica or ring_leader(recipe, g.id) is not None:
            continue
        for _ in range(g.replicas):
            used.update(range(at, at + g.devices_per_replica))
            at += g.devices_per_replica
    return used | {r for j in members.joined if j.devices for r, _ in j.places}
