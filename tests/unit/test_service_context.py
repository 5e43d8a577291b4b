"""What a service is handed (meshrl/runtime/worker.py `context`): its own config, its own wiring, the
recipe-wide settings and its identity; never the recipe or the topology. What a role used to look up
in them is in its wiring, resolved by the planner (meshrl/planning/topology.py `placed`)."""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path

import pytest

from meshrl.planning.recipe import Recipe, RunSettings, load_recipe
from meshrl.planning.topology import WEIGHTS, Device, Topology, devices_needed, plan
from meshrl.planning.wiring import Peer
from meshrl.runtime.colocation import RingPlan
from meshrl.runtime.service import ServiceContext
from meshrl.runtime.worker import context

REPO = Path(__file__).resolve().parents[2]
ENV = {"MESHRL_RUN_DIR": "/tmp/run", "MESHRL_CONTROLLER": "tcp://127.0.0.1:1", "MESHRL_LAUNCH": "ab12"}


def planned(name: str, model: Path, *overrides: str) -> tuple[Recipe, Topology]:
    recipe = load_recipe(REPO / "recipes" / f"{name}.py", [f"*.model={model}", *overrides])
    devices = [Device(i, "localhost", i) for i in range(max(1, devices_needed(recipe)))]
    return recipe, plan(recipe, devices)


def names(topology: Topology, *groups: str) -> tuple[str, ...]:
    return tuple(p.name for r in topology.replicas if r.group in groups for p in r.processes)


def test_a_context_holds_its_config_its_wiring_the_run_settings_and_its_identity_only(tiny_model):
    hints = typing.get_type_hints(ServiceContext)
    fields = {f.name: hints[f.name] for f in dataclasses.fields(ServiceContext)}
    assert "recipe" not in fields and "topology" not in fields
    assert not {Recipe, Topology} & set(fields.values())
    assert set(fields) == {
        "config", "wiring", "run", "replica", "process", "run_dir", "controller", "secret", "health",
        "single_host", "launch", "resume", "addresses",
    }  # fmt: skip
    settings = {f.name for f in dataclasses.fields(RunSettings)}  # recipe-wide values, no group's
    assert settings and not {"groups", "rings", "dataplane", "base_port"} & settings
    recipe, topology = planned("ppo_arith", tiny_model, "seed=3", "total_steps=7", "checkpoint_every=2")
    for r in topology.replicas:
        for w, p in enumerate(r.processes):
            ctx = context(recipe, topology, r.group, r.index, w, ENV)
            assert ctx.config is recipe.group(r.group).config and ctx.wiring is topology.wiring[r.group]
            assert (ctx.replica, ctx.process, ctx.name, ctx.launch) == (r, p, p.name, "ab12")
            values = [getattr(ctx, f) for f in fields]
            assert not any(isinstance(v, (Recipe, Topology)) for v in values)
            assert not hasattr(ctx, "recipe") and not hasattr(ctx, "topology")
    run = RunSettings.of(recipe)
    assert (run.seed, run.total_steps, run.checkpoint_every, run.log) == (3, 7, 2, recipe.log)
    assert all(getattr(run, f.name) == getattr(recipe, f.name) for f in dataclasses.fields(RunSettings))
    assert run.batch_size == recipe.batch_size == recipe.prompts_per_step * recipe.group_size
    assert ctx.address("localhost") == "127.0.0.1" and ctx.single_host


def test_the_weight_group_and_the_checkpoint_participants_are_in_the_wiring(tiny_model):
    """The trainer and its inference replicas are handed the same weight group, placed: where it meets
    (the trainer's first process, at its weight-sync port) and its members in rank order; the trainer
    the processes its checkpoints wait for (every process of the stateful groups: rollout, critic)."""
    _, topology = planned("ppo_arith", tiny_model, "inference.replicas=2")
    trainer, inference = topology.wiring["trainer"], topology.wiring["inference"]
    assert trainer.weights == inference.weights and trainer.weights is not None
    link = trainer.weights
    source = topology.replica("trainer", 0).processes[0]
    assert link.endpoint == Peer(name=source.name, host=source.host, port=source.ports[WEIGHTS],
                                 local_rank=source.local_rank, uses_device=True)  # fmt: skip
    assert link.members == ("inference-0", "inference-1")
    assert tuple(p.name for p in link.receiving) == names(topology, "inference")
    assert all(p.uses_device for p in link.receiving)
    assert trainer.checkpoint == names(topology, "rollout", "critic") and len(trainer.checkpoint) == 2
    assert all(topology.wiring[g].checkpoint == () for g in topology.wiring if g != "trainer")
    assert topology.wiring["rollout"].weights is None and topology.wiring["rollout"].ring is None
    # topology.json holds it, as the launcher writes it
    written = json.loads(json.dumps(dataclasses.asdict(topology), default=str))
    assert written["wiring"]["trainer"]["checkpoint"] == list(trainer.checkpoint)
    assert written["wiring"]["inference"]["weights"]["members"] == ["inference-0", "inference-1"]


@pytest.mark.parametrize("name", ["grpo_arith_colocated", "grpo_arith_hybrid"])
def test_each_ring_member_is_handed_its_ring_with_every_members_processes(name, tiny_model):
    recipe, topology = planned(name, tiny_model)
    (ring,) = recipe.rings
    handed = {m.group: topology.wiring[m.group].ring for m in ring.members}
    assert len(set(handed.values())) == 1  # every member the same ring
    got = next(iter(handed.values()))
    assert got is not None and got.id == ring.id and got.hybrid == ring.hybrid
    assert got.members == tuple(m.group for m in ring.members)
    assert got.modes == tuple(m.mode for m in ring.members)
    assert got.processes == tuple(names(topology, m.group) for m in ring.members)
    assert all(topology.wiring[g].ring is None for g in topology.wiring if g not in handed)
    plan_ = RingPlan.of(got, "ab12")
    assert (plan_.partition, plan_.arbiter) == (f"ring.{ring.id}.ab12", got.processes[0][0])
