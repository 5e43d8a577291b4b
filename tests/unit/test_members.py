"""A run's membership (meshrl/planning/members.py): joins and departures as pure functions of the recipe,
the devices and the current membership; the plan that follows; the requests that are refused."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from meshrl.planning.config import RecipeError
from meshrl.planning.members import Host, Membership, ScaleRefused, host_gone, join_host, scale, without
from meshrl.planning.recipe import load_recipe
from meshrl.planning.topology import Device, plan

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def sim(tiny_model):
    """recipes/pipeline_sim.py with one inference replica, and `overrides`."""

    def load(*overrides: str):
        return load_recipe(
            REPO / "recipes" / "pipeline_sim.py",
            [f"*.model={tiny_model}", "inference.replicas=1", *overrides],
        )

    return load


def names(topology, group: str) -> list[str]:
    return [p.name for r in topology.replicas if r.group == group for p in r.processes]


def test_replicas_join_and_leave_with_identities_every_launcher_agrees_on(sim):
    r, devices = sim(), [Device(0, "h", 0)]
    ranks = [(0, True)]
    before = plan(r, devices)
    grown = scale(r, ranks, Membership(), "inference", 3)
    assert grown == scale(r, ranks, Membership(), "inference", 3)  # a pure function
    assert grown.live(r, "inference") == [0, 1, 2]
    after = plan(r, devices, grown)
    assert names(after, "inference") == ["inference-0-0", "inference-1-0", "inference-2-0"]
    # the processes already running keep their identity (ports) when others join
    old = {p.name: p.ports for rep in before.replicas for p in rep.processes}
    assert all(p.ports == old[p.name] for rep in after.replicas for p in rep.processes if p.name in old)
    ports = [port for rep in after.replicas for p in rep.processes for port in p.ports]
    assert len(ports) == len(set(ports))
    # the joined replicas are weight receivers of the plan (a joiner plans the run it joins)
    assert after.wiring["inference"].weights.members == ("inference-0", "inference-1", "inference-2")
    # scaling in: the highest index leaves; the others keep their ports
    shrunk = scale(r, ranks, grown, "inference", 2)
    assert shrunk.live(r, "inference") == [0, 1]
    smaller = plan(r, devices, shrunk)
    assert {p.name: p.ports for rep in smaller.replicas for p in rep.processes} == {
        n: ports for n, ports in {p.name: p.ports for rep in after.replicas for p in rep.processes}.items()
        if n != "inference-2-0"
    }  # fmt: skip


def test_a_vanished_replica_leaves_a_gap_that_the_next_join_fills_in_its_old_place(sim):
    r = sim("inference.replicas=2")
    devices = [Device(0, "h", 0)]
    gone = without(r, Membership(), "inference", 0)  # one of the recipe's replicas vanished
    assert gone.live(r, "inference") == [1]
    assert names(plan(r, devices, gone), "inference") == ["inference-1-0"]
    back = scale(r, [(0, True)], gone, "inference", 2)
    assert back == Membership()  # the recipe's replica comes back where it was
    assert plan(r, devices, back) == plan(r, devices)


def test_cpu_replicas_spread_over_the_launchers_and_their_ports_never_collide(sim):
    r = sim("trainer.devices_per_replica=2")
    devices = [Device(0, "h", 0), Device(1, "h", 1)]  # two launchers on one host (torchrun)
    members = scale(r, [(0, True), (1, True)], Membership(), "inference", 5)
    topology = plan(r, devices, members)
    owners = Counter(p.rank for rep in topology.replicas if rep.group == "inference" for p in rep.processes)
    assert sorted(owners.values()) == [2, 3]  # round-robin by index
    ports = [port for rep in topology.replicas for p in rep.processes for port in p.ports]
    assert len(ports) == len(set(ports))


def test_a_device_group_takes_a_free_device_or_is_refused(tiny_model):
    r = load_recipe(
        REPO / "recipes" / "grpo_arith.py", [f"*.model={tiny_model}"]
    )  # inference and trainer on a device each
    two = [(0, True), (1, True)]
    with pytest.raises(
        ScaleRefused, match=r"inference: no free device for another replica \(1 per replica, 0 free of 2\)"
    ):
        scale(r, two, Membership(), "inference", 2)
    three = [*two, (2, True)]  # `meshrl run --devices 3`: a device to spare (inference can grow)
    members = scale(r, three, Membership(), "inference", 2)
    topology = plan(r, [Device(i, "h", i) for i in range(3)], members)
    (joined,) = [
        p for rep in topology.replicas if rep.group == "inference" and rep.index == 1 for p in rep.processes
    ]
    assert (joined.rank, joined.uses_device) == (2, True)


@pytest.mark.parametrize(
    ("recipe", "group", "n", "why"),
    [
        ("pipeline_sim.py", "trainer", 2, "trainer publishes the weights and takes the checkpoints"),
        ("pipeline_sim.py", "rollout", 2, "rollout keeps the run's progress"),
        ("pipeline_sim.py", "inference", 0, "inference: at least one replica"),
        ("pipeline_sim.py", "critic", 2, "no group 'critic' in this run"),
        ("grpo_arith_colocated.py", "inference", 2, "takes turns in colocation ring"),
    ],
)
def test_a_change_the_run_cannot_make_is_refused_in_one_line(recipe, group, n, why):
    r = load_recipe(
        REPO / "recipes" / recipe, ["inference.replicas=1"] if recipe == "pipeline_sim.py" else []
    )
    with pytest.raises(ScaleRefused, match=why) as e:
        scale(r, [(0, True), (1, True), (2, True)], Membership(), group, n)
    assert "\n" not in str(e.value)


def test_restart_mode_leave_needs_a_group_that_can_shrink(sim):
    with pytest.raises(
        RecipeError, match=r"groups\['trainer'\]\.restart\.mode: 'leave' needs a group that can shrink"
    ):
        plan(sim("trainer.restart.mode=leave"), [Device(0, "h", 0)])
    plan(sim("inference.restart.mode=leave"), [Device(0, "h", 0)])


def test_a_host_joins_with_replicas_on_its_own_ranks_and_leaves_with_them(sim, tiny_model):
    r, devices = sim(), [Device(0, "h", 0)]
    before = plan(r, devices)
    members, host = join_host(r, devices, Membership(), "h2", 0, {"inference": 2})
    assert host == Host("h2", 1, 0) and list(host.ranks) == [1]
    assert join_host(r, devices, Membership(), "h2", 0, {"inference": 2}) == (members, host)  # pure
    topology = plan(r, devices, members)
    joined = [
        p for rep in topology.replicas if rep.group == "inference" and rep.index > 0 for p in rep.processes
    ]
    assert [(p.name, p.host, p.rank) for p in joined] == [
        ("inference-1-1", "h2", 1),
        ("inference-2-1", "h2", 1),
    ]
    # the new host runs a storage server; no process of the run changes ports; none collide, even with
    # the new host on the same machine as the first (its ports are its rank's band)
    assert [h for h, _, _ in topology.storage] == ["h", "h2"]
    old = {p.name: p.ports for rep in before.replicas for p in rep.processes}
    assert all(p.ports == old[p.name] for rep in topology.replicas for p in rep.processes if p.name in old)
    used = [port for rep in topology.replicas for p in rep.processes for port in p.ports]
    used += [topology.controller_port, *(port for _, _, port in topology.storage)]
    assert len(used) == len(set(used))
    # the planner's default: the devices filled with the first group that can grow and takes weights
    default, _ = join_host(r, devices, Membership(), "h2", 0, {})
    assert default.live(r, "inference") == [0, 1]
    # a later scale-out may place a CPU replica on the joined launcher (round-robin by index)
    grown = scale(r, members.ranks(devices), members, "inference", 4)
    assert [j.places for j in grown.joined if j.index == 3] == [((1, 2),)]
    # the host goes: its replicas and ranks with it, the rest as it was
    gone = host_gone(r, members, 1)
    assert gone == Membership() and plan(r, devices, gone) == before
    for asked, why in [
        ({"trainer": 1}, "trainer publishes the weights"),
        ({"inference": 0}, "at least one replica on the joining host"),
    ]:
        with pytest.raises(ScaleRefused, match=why):
            join_host(r, devices, Membership(), "h2", 0, asked)
    with pytest.raises(ScaleRefused, match="a launcher of host 'h2' has joined already"):
        join_host(r, devices, members, "h2", 0, {})
    g = load_recipe(REPO / "recipes" / "grpo_arith.py", [f"*.model={tiny_model}"])  # inference on a device
    two = [Device(0, "h", 0), Device(1, "h", 1)]
    members, host = join_host(g, two, Membership(), "h2", 2, {})
    assert list(host.ranks) == [2, 3] and members.live(g, "inference") == [0, 1, 2]
    placed = plan(g, two, members)
    assert {(p.rank, p.host, p.local_rank, p.uses_device) for rep in placed.replicas if rep.index > 0
            for p in rep.processes} == {(2, "h2", 0, True), (3, "h2", 1, True)}  # fmt: skip


def test_the_membership_survives_its_json(sim):
    r = sim()
    members = scale(r, [(0, True)], without(r, Membership(), "inference", 0), "inference", 3)
    members, _ = join_host(r, [Device(0, "h", 0)], members, "h2", 1, {"inference": 1})
    assert Membership.from_json(members.to_json()) == members
    assert Membership.from_json(None) == Membership()
