"""plan(recipe, devices): determinism, validation messages, port uniqueness, shipped recipes."""

from __future__ import annotations

import dataclasses
import random
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from meshrl.planning.config import RecipeError, ServiceConfig
from meshrl.planning.recipe import ColocationRing, Recipe, RingMember, Scheduling, ServiceGroup, load_recipe
from meshrl.planning.topology import Device, devices_needed, plan
from meshrl.planning.wiring import Read, Write

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True, kw_only=True)
class Writer(ServiceConfig):
    service = "x:Writer"
    columns: tuple[str, ...] = ("tokens",)

    def writes(self) -> tuple[Write, ...]:
        return (Write("out", "samples", self.columns),)


@dataclass(frozen=True, kw_only=True)
class Reader(ServiceConfig):
    service = "x:Reader"
    columns: tuple[str, ...] = ("tokens",)

    def reads(self) -> tuple[Read, ...]:
        return (Read("in", "samples", self.columns),)


@dataclass(frozen=True, kw_only=True)
class Trainer(Reader):
    """A reader that publishes weights (inference groups follow it)."""

    service = "x:Trainer"
    publishes_weights = True


def cluster(hosts: int, per_host: int) -> list[Device]:
    return [Device(h * per_host + i, f"node{h:03d}", i) for h in range(hosts) for i in range(per_host)]


def recipe(**kw) -> Recipe:
    base = {
        "name": "t",
        "groups": (
            ServiceGroup(id="rollout", config=Writer(), replicas=3),
            ServiceGroup(
                id="inference", config=Writer(columns=("response",)), replicas=2, devices_per_replica=2
            ),
            ServiceGroup(id="trainer", config=Reader(columns=("tokens", "response")), devices_per_replica=4),
        ),
    }
    return Recipe(**{**base, **kw})


def test_same_plan_whatever_the_gathering_order():
    devs = cluster(2, 4)
    first = plan(recipe(), devs)
    for seed in range(5):
        shuffled = devs[:]
        random.Random(seed).shuffle(shuffled)
        assert plan(recipe(), shuffled) == first
    trainer = first.replicas_of("trainer")[0]
    assert trainer.ranks == (4, 5, 6, 7) and trainer.master == ("node001", trainer.processes[0].ports[1])
    assert [r.ranks for r in first.replicas_of("inference")] == [(0, 1), (2, 3)]
    assert [r.ranks for r in first.replicas_of("rollout")] == [(0,), (1,), (2,)]
    assert first.controller_host == "node000" and [s[:2] for s in first.storage] == [
        ("node000", 0),
        ("node001", 4),
    ]


@pytest.mark.parametrize("hosts", [1, 2, 3, 7, 16, 33, 64])
def test_ports_never_collide_on_a_host(hosts):
    groups = (
        ServiceGroup(id="rollout", config=Writer(), replicas=hosts * 3),
        ServiceGroup(id="ref", config=Writer(columns=("ref",)), replicas=hosts * 2, devices_per_replica=2),
        ServiceGroup(
            id="inference", config=Writer(columns=("response",)), replicas=hosts * 2, devices_per_replica=2
        ),
        ServiceGroup(
            id="trainer", config=Reader(columns=("tokens", "ref", "response")), devices_per_replica=hosts * 4
        ),
    )
    rings = (
        ColocationRing(
            id="gen",
            members=(RingMember(group="inference", mode=Scheduling.FALLBACK), RingMember(group="ref")),
        ),
    )
    r = Recipe(name="t", groups=groups, rings=rings)
    topo = plan(r, cluster(hosts, 8))
    per_host: dict[str, list[int]] = {}
    for rep in topo.replicas:
        for p in rep.processes:
            per_host.setdefault(p.host, []).extend(p.ports)
    for host, ports in per_host.items():
        ports += [topo.controller_port] if host == topo.controller_host else []
        ports += [port for h, _, port in topo.storage if h == host]
        dup = [p for p, n in Counter(ports).items() if n > 1]
        assert not dup, f"{host}: ports {dup[:5]} used twice"
        assert max(ports) <= 65535
    # ring members share devices, one process per device each
    assert [r.ranks for r in topo.replicas_of("ref")] == [r.ranks for r in topo.replicas_of("inference")]


def test_two_agents_on_one_machine_get_distinct_ports():
    devs = [Device(0, "box", 0), Device(1, "box", 0)]  # two torchrun agents, one slot each
    r = Recipe(
        name="t",
        groups=(
            ServiceGroup(id="a", config=Writer(), devices_per_replica=1),
            ServiceGroup(id="b", config=Reader(), devices_per_replica=1),
        ),
    )
    topo = plan(r, devs)
    ports = [port for rep in topo.replicas for p in rep.processes for port in p.ports]
    assert len(ports) == len(set(ports))


def problems(r: Recipe, devs: list[Device]) -> str:
    with pytest.raises(RecipeError) as e:
        plan(r, devs)
    return str(e.value)


def test_too_few_and_too_many_devices():
    assert devices_needed(recipe()) == 8
    assert "needs 8 devices (inference 2x2, trainer 1x4), only 6 available" in problems(
        recipe(), cluster(1, 6)
    )
    assert "9 devices but the recipe uses 8" in problems(recipe(), cluster(1, 9))


def test_ring_errors_name_the_ring_and_member():
    groups = (
        ServiceGroup(id="inference", config=Writer(columns=("response",)), devices_per_replica=2),
        ServiceGroup(id="trainer", config=Reader(columns=("tokens", "response")), devices_per_replica=4),
        ServiceGroup(id="tokens", config=Writer(), devices_per_replica=0),
    )
    rings = (
        ColocationRing(
            id="r1",
            members=(
                RingMember(group="inference", mode=Scheduling.FALLBACK),
                RingMember(group="trainer", mode=Scheduling.FALLBACK),
            ),
        ),
        ColocationRing(id="r2", members=(RingMember(group="trainer"), RingMember(group="ghost"))),
        ColocationRing(id="r3", members=(RingMember(group="tokens"), RingMember(group="inference"))),
    )
    msg = problems(Recipe(name="t", groups=groups, rings=rings), cluster(1, 6))
    assert "rings['r1'].members: at most one FALLBACK member" in msg
    assert "rings['r1'].members: 'trainer' (1 x 4 devices) does not share devices with 'inference'" in msg
    assert "rings['r2'].members: group 'trainer' is already in ring 'r1'" in msg
    assert "rings['r2'].members: unknown group 'ghost'" in msg
    assert "rings['r3'].members: 'tokens' uses no devices" in msg


@dataclass(frozen=True, kw_only=True)
class Prompts(ServiceConfig):
    service = "x:Prompts"

    def writes(self) -> tuple[Write, ...]:
        return (Write("feed", "samples", ("prompt",)), Write("evaluate", "eval", ("prompt",)))

    def reads(self) -> tuple[Read, ...]:
        return (Read("evaluate", "eval", ("prompt", "response")),)


def test_a_vllm_engine_cannot_take_turns_in_a_ring(tmp_path):
    """vLLM's engine does not offload: in a ring it would keep the devices' memory through the other
    members' turns. The same ring with the hf engine plans."""
    from meshrl.roles.inference.config import InferenceConfig

    def ring_recipe(engine: str) -> Recipe:
        groups = (
            ServiceGroup(id="rollout", config=Prompts()),
            ServiceGroup(id="inference", config=InferenceConfig(model=str(tmp_path), engine=engine),
                         devices_per_replica=1),
            ServiceGroup(id="trainer", config=Trainer(columns=("prompt", "response")), devices_per_replica=1),
        )  # fmt: skip
        members = (RingMember(group="inference", mode=Scheduling.FALLBACK), RingMember(group="trainer"))
        return Recipe(name="t", groups=groups, rings=(ColocationRing(id="shared", members=members),))

    msg = problems(ring_recipe("vllm"), cluster(1, 1))
    assert (
        "rings['shared'].members: 'inference' cannot take turns on shared devices: its engine is vllm, which "
        "cannot offload (its weights and KV cache would stay on the devices through the other members' turns)"
    ) in msg, msg
    assert plan(ring_recipe("hf"), cluster(1, 1)).replicas


def test_missing_column_names_the_reader_and_a_fix():
    r = Recipe(
        name="t",
        groups=(
            ServiceGroup(id="rollout", config=Writer()),
            ServiceGroup(id="trainer", config=Reader(columns=("tokens", "values"))),
        ),
    )
    msg = problems(r, cluster(1, 1))
    assert "groups['trainer'].config reads samples.values, which no service writes: add a critic" in msg


def test_recipe_level_errors_are_collected():
    class NotAService:
        pass

    with pytest.raises(RecipeError) as e:
        Recipe(
            name="t",
            groups=(
                ServiceGroup(id="a", config=NotAService(), replicas=0),  # type: ignore[arg-type]
                ServiceGroup(id="a", config=Writer()),
            ),
            total_steps=0,
        )
    msg = str(e.value)
    assert "groups: id 'a' is used twice" in msg
    assert "groups['a'].replicas: must be >= 1" in msg
    assert "groups['a'].config: NotAService is not a known service type" in msg
    assert "total_steps: must be >= 1" in msg


def test_overrides_reach_nested_fields_and_reject_unknown_keys():
    r = recipe().with_overrides(["seed=7", "trainer.columns=tokens,response,extra", "rollout.replicas=5"])
    assert r.seed == 7 and r.group("rollout").replicas == 5
    assert r.group("trainer").config.columns == ("tokens", "response", "extra")  # type: ignore[attr-defined]
    with pytest.raises(RecipeError, match="no recipe field or group 'traner'"):
        recipe().with_overrides(["traner.lr=1"])
    with pytest.raises(RecipeError, match="Reader has no field 'lr'"):
        recipe().with_overrides(["trainer.lr=1"])
    with pytest.raises(RecipeError, match="override 'seed=abc': 'abc' is not an integer"):
        recipe().with_overrides(["seed=abc"])
    assert dataclasses.replace(recipe(), seed=1) != recipe()


@pytest.mark.parametrize("path", sorted((REPO / "recipes").glob("*.py")), ids=lambda p: p.name)
def test_every_shipped_recipe_loads_and_plans(path, tiny_model):
    from meshrl.engines import vllm

    r = load_recipe(path)
    if any(hasattr(g.config, "model") for g in r.groups):  # point model paths at a real local model
        r = r.with_overrides([f"*.model={tiny_model}"])
    n = max(1, devices_needed(r))
    devices = [Device(i, "localhost", i) for i in range(n)]
    if any(getattr(g.config, "engine", None) == "vllm" for g in r.groups) and not vllm.available():
        # without the extra, the recipe fails at start-up and says how to install it
        with pytest.raises(
            RecipeError, match=r"needs vLLM, which is not installed: pip install 'meshrl\[vllm\]'"
        ):
            plan(r, devices)
        return
    topo = plan(r, devices)
    assert topo.replicas


@pytest.mark.parametrize(
    ("path", "drop", "overrides", "message"),
    [
        (
            "ppo_arith.py",
            "critic",
            [],
            "reads samples.values, which no service writes: add a critic service group",
        ),
        (
            "ppo_arith.py",
            "reference",
            [],
            "reads samples.ref_logprobs, which no service writes: add a reference",
        ),
        ("grpo_arith.py", None, ["trainer.kl.coef=0.1"], "trainer'].config reads samples.ref_logprobs"),
        (
            "ppo_rm.py",
            "reward_model",
            [],
            "reads samples.rm_score, which no service writes: add a reward-model",
        ),
    ],
)
def test_a_missing_scoring_service_fails_at_start_up_saying_which_to_add(
    path, drop, overrides, message, tiny_model
):
    r = load_recipe(REPO / "recipes" / path, [f"*.model={tiny_model}", *overrides])
    if drop is not None:
        r = dataclasses.replace(r, groups=tuple(g for g in r.groups if g.id != drop))
    with pytest.raises(RecipeError, match=re.escape(message)):
        plan(r, [Device(i, "localhost", i) for i in range(max(1, devices_needed(r)))])


@pytest.mark.parametrize(
    ("path", "overrides", "message"),
    [
        ("ppo_arith_shared.py", ["trainer.value.head=false"], "groups['trainer'].config reads samples.advantage, which no service writes: rollout writes them, unless rollout.values='trainer' (then trainer.value.head=true computes them)"),
        ("ppo_arith_shared.py", ["rollout.values=critic"], "reads samples.values, which no service writes: add a critic service group (or enable the trainer's value head)"),
        ("grpo_arith.py", ["trainer.value.head=true"], "groups['trainer'].config needs gae, which no other group offers: the value head computes GAE: set rollout.advantage=gae and rollout.values=trainer"),
        ("ppo_arith.py", ["rollout.values=trainer", "trainer.value.head=true"], "groups['critic'].config writes samples.values, which no service reads: rollout.advantage='gae' with rollout.values='critic' reads them"),
    ],
)  # fmt: skip
def test_values_come_from_exactly_one_critic(path, overrides, message, tiny_model):
    r = load_recipe(REPO / "recipes" / path, [f"*.model={tiny_model}", *overrides])
    with pytest.raises(RecipeError, match=re.escape(message)):
        plan(r, [Device(i, "localhost", i) for i in range(max(1, devices_needed(r)))])


def test_hybrid_ring_members_share_one_process_per_device():
    from meshrl.planning.topology import cohosts

    groups = (
        ServiceGroup(id="rollout", config=Writer()),
        ServiceGroup(id="inference", config=Writer(columns=("response",)), replicas=2, devices_per_replica=1),
        ServiceGroup(id="ref", config=Writer(columns=("ref",)), replicas=2, devices_per_replica=1),
        ServiceGroup(
            id="trainer", config=Reader(columns=("tokens", "response", "ref")), devices_per_replica=2
        ),
    )
    ring = ColocationRing(
        id="h",
        members=(RingMember(group="inference", mode=Scheduling.FALLBACK), RingMember(group="ref")),
        hybrid=True,
    )
    r = Recipe(name="t", groups=groups, rings=(ring,))
    topo = plan(r, cluster(1, 4))
    hosts = cohosts(r, topo)
    assert [p.name for p in hosts["inference-0-0"]] == ["inference-0-0", "ref-0-0"]
    assert [p.name for p in hosts["inference-1-1"]] == ["inference-1-1", "ref-1-1"]
    assert "ref-0-0" not in hosts and [p.name for p in hosts["rollout-0-0"]] == ["rollout-0-0"]
    # a member with several devices per replica cannot lend its weights within one process
    wide = Recipe(name="t", groups=groups, rings=(dataclasses.replace(ring, members=(
        RingMember(group="trainer"), RingMember(group="ref"))),))  # fmt: skip
    msg = problems(wide, cluster(1, 4))
    assert "rings['h'].hybrid: 'trainer' has 2 devices per replica" in msg


def test_weights_go_through_shared_memory_on_cpu_or_to_a_replica_on_the_trainers_own_gpu() -> None:
    import torch

    from meshrl.planning.topology import Process
    from meshrl.planning.wiring import Peer
    from meshrl.roles.trainer.publish import over_shared_memory
    from meshrl.runtime.weights_packing import buckets, pack, unpack

    def proc(host: str, gpu: int) -> Peer:  # a receiver, as the trainer's wiring hands it
        return Peer(name="inference-0-0", host=host, local_rank=gpu, uses_device=True)

    trainer = Process("g", 0, 0, 0, "a", 0, True, 0, ())
    assert over_shared_memory("cpu", trainer, [proc("a", 1)])
    assert over_shared_memory("cuda", trainer, [proc("a", 0), proc("a", 1)])  # --devices 0,0[,1]
    assert not over_shared_memory("cuda", trainer, [proc("a", 1)])  # NCCL between GPUs
    assert not over_shared_memory("cpu", trainer, [proc("b", 0)])  # another host
    manifest = [("w", (2, 3), "float32"), ("b", (3,), "bfloat16")]
    tensors = [torch.randn(2, 3), torch.randn(3).bfloat16()]
    ((size, members),) = buckets(manifest, 1 << 20)
    out = torch.empty(size, dtype=torch.uint8)
    pack(manifest, tensors, members, out)  # (from a GPU trainer's tensors the copy crosses devices)
    assert all(torch.equal(t, u) for t, (_, u) in zip(tensors, unpack(manifest, members, out), strict=True))
