"""Everything that can be wrong with a recipe on a given device list, found before anything starts.

`problems(recipe, devices, wiring)` lists them all, each naming the recipe field to change: the device
list itself, the colocation rings (each member able to share devices: `shares_devices`), the number of
devices, and each service config's own `check` against the run's settings, its group and its wiring
(paths, engines, batch arithmetic, the settings handed to it). The wiring's own
problems (a column someone reads that nobody writes, a write nobody reads: meshrl/planning/wiring.py)
come with them. Rules that belong to one role or engine live in that config's `check`, not here.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from meshrl.planning.recipe import ColocationRing, Recipe, RunSettings, Scheduling, ServiceGroup

if TYPE_CHECKING:
    from meshrl.planning.topology import Device
    from meshrl.planning.wiring import Wiring


def problems(recipe: Recipe, devices: Sequence[Device], wiring: dict[str, Wiring]) -> list[str]:
    """Every problem of `recipe` on `devices` with its `wiring` (the wiring's own not included), in a
    stable order."""
    out = list(_devices(devices))
    ring_of: dict[str, str] = {}
    for ring in recipe.rings:
        out += _ring(recipe, ring, ring_of, wiring)
    out += _device_count(recipe, len(devices))
    run = RunSettings.of(recipe)
    for g in recipe.groups:
        out += [f"groups[{g.id!r}].config.{p}" for p in g.config.check(run, g, wiring[g.id])]
    from meshrl.planning.members import fixed  # it places by these rules

    for g in recipe.groups:
        if g.restart.mode == "leave" and (why := fixed(recipe, g.id)) is not None:
            out.append(f"groups[{g.id!r}].restart.mode: 'leave' needs a group that can shrink, and {why}")
    return out


def devices_needed(recipe: Recipe) -> int:
    """Devices the recipe occupies: ring members share their devices."""
    return sum(g.replicas * g.devices_per_replica for g in recipe.groups if ring_leader(recipe, g.id) is None)


def ring_leader(recipe: Recipe, group: str) -> str | None:
    """The group whose devices `group` reuses (the ring member placed first, in recipe order), or None
    when `group` takes devices of its own."""
    order = [g.id for g in recipe.groups]
    for ring in recipe.rings:
        members = sorted((m.group for m in ring.members if m.group in order), key=order.index)
        if group in members[1:]:
            return members[0]
    return None


def _devices(devices: Sequence[Device]) -> Iterator[str]:
    ranks = sorted(d.rank for d in devices)
    if ranks != list(range(len(devices))):
        yield f"devices: global ranks must be 0..{len(devices) - 1} exactly once, got {ranks[:16]}"


def _ring(
    recipe: Recipe, ring: ColocationRing, ring_of: dict[str, str], wiring: dict[str, Wiring]
) -> Iterator[str]:
    """Problems of one ring; `ring_of` collects group -> ring over the recipe's rings."""
    where = f"rings[{ring.id!r}]"
    groups = {g.id: g for g in recipe.groups}
    if len(ring.members) < 2:
        yield f"{where}.members: a ring needs at least two members"
    fallbacks = [m.group for m in ring.members if m.mode is Scheduling.FALLBACK]
    if len(fallbacks) > 1:
        yield f"{where}.members: at most one FALLBACK member, got {fallbacks}"
    for m in ring.members:
        if m.group not in groups:
            yield f"{where}.members: unknown group {m.group!r} (groups: {sorted(groups)})"
        elif m.group in ring_of:
            yield f"{where}.members: group {m.group!r} is already in ring {ring_of[m.group]!r}"
        else:
            ring_of[m.group] = ring.id
    order = {g.id: i for i, g in enumerate(recipe.groups)}
    known = sorted((groups[m.group] for m in ring.members if m.group in groups), key=lambda g: order[g.id])
    for g in known[1:]:  # the member placed first takes devices; the others reuse them
        first = known[0]
        if (g.replicas, g.devices_per_replica) != (first.replicas, first.devices_per_replica):
            yield (
                f"{where}.members: {g.id!r} ({g.replicas} x {g.devices_per_replica} devices) does not share "
                f"devices with {first.id!r} ({first.replicas} x {first.devices_per_replica}); ring members "
                "need the same replicas and devices_per_replica"
            )
    for g in known:
        yield from _ring_member(where, ring, g)
    if ring.hybrid:
        yield from _hybrid_weights(recipe, where, ring, wiring)


def _ring_member(where: str, ring: ColocationRing, g: ServiceGroup) -> Iterator[str]:
    if (why := g.config.shares_devices()) is not None:
        yield f"{where}.members: {g.id!r} cannot take turns on shared devices: {why}"
    if g.devices_per_replica == 0:
        yield f"{where}.members: {g.id!r} uses no devices; only device roles take turns"
    elif ring.hybrid and g.devices_per_replica != 1:
        yield (
            f"{where}.hybrid: {g.id!r} has {g.devices_per_replica} devices per replica; co-process members "
            "use one (a sharded trainer cannot lend its weights yet)"
        )


def _hybrid_weights(
    recipe: Recipe, where: str, ring: ColocationRing, wiring: dict[str, Wiring]
) -> Iterator[str]:
    """A trainer in a hybrid ring lends its model to the inference in its own process: every group it
    publishes to must be in the ring, and it must publish whole weights (merged, not LoRA adapters)."""
    members = {m.group for m in ring.members}
    for gid in sorted(members & set(wiring)):
        link = wiring[gid].weights
        if link is None or link.source != gid:
            continue
        missing = [r for r in link.receivers if r not in members]
        if missing:
            yield (
                f"{where}.members: {missing} must be in the hybrid ring with {gid!r} (it publishes by lending "
                "its model to the inference in its own process)"
            )
        if recipe.group(gid).config.adapters() is not None:
            yield (
                f"{where}.hybrid: {gid!r} trains LoRA adapters; the ring lends its model to inference, which "
                "would generate with the adapters unmerged (publish to inference instead)"
            )


def _spare_devices_used(recipe: Recipe) -> bool:
    """Whether devices beyond the recipe's can serve: a device group that can grow (`meshrl scale`)."""
    from meshrl.planning.members import fixed

    return any(g.devices_per_replica and fixed(recipe, g.id) is None for g in recipe.groups)


def _device_count(recipe: Recipe, available: int) -> Iterator[str]:
    need = devices_needed(recipe)
    demand = ", ".join(
        f"{g.id} {g.replicas}x{g.devices_per_replica}" for g in recipe.groups if g.devices_per_replica
    )
    if available and need > available:
        yield f"groups: the recipe needs {need} devices ({demand}), only {available} available"
    elif available and 0 < need < available and not _spare_devices_used(recipe):
        yield (
            f"groups: {available} devices but the recipe uses {need} ({demand}); "
            f"run with {need} devices or add replicas"
        )
