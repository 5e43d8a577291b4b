"""`meshrl eval` on an agents recipe: each held-out row played as a run plays it, by every kind of agent,
with an engine of this process's own instead of the run's inference service.

- An environment: the recipe's environment (its `args` and limits), chat template and tool-call format,
  the episode functions the agents service uses (meshrl/envs/episode.py), turns generated in batches.
- A program or a verifiers episode: the recipe's program, run as the agents service runs it, against
  the same endpoint (meshrl/roles/agents/endpoint.py) served in-process, whose model is the engine:
  the calls programs make at once are generated together.

Greedy and `rollout.eval_samples` sampled trajectories per row, seeded as a run's evaluation seeds its
rows. The report, the same for every kind: the reward (greedy / sampled), each named part of it
(`greedy/env_<part>`: a part named "correct" is the accuracy), turns, tool calls and the share that
worked, truncations and failures per trajectory.
"""

from __future__ import annotations

import asyncio
import importlib
import math
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from meshrl.commands.eval import sampling_params, seed_of
from meshrl.models import vision


@dataclass
class Played:
    """One held-out trajectory's figures."""

    rewards: dict[str, float] = field(default_factory=dict)
    failed: bool = False
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    truncated: bool = False


def evaluate_agents(
    rows: list[dict[str, Any]], agents: Any, inference: Any, recipe: Any, samples: int
) -> dict[str, Any]:
    """Every row played greedily and `samples` times sampled; the report (see the module docstring)."""
    from transformers import AutoTokenizer

    from meshrl.envs.parsers import build_parser
    from meshrl.envs.render import Renderer
    from meshrl.roles.inference.engine import build_engine

    tool_names: list[str] = []
    env = None
    if agents.kind == "environment":
        module, _, name = str(agents.environment).partition(":")
        env = getattr(importlib.import_module(module), name)(**agents.args)
        env.limits = agents.limits(inference.max_new_tokens)
        tool_names = [t.name for t in env.tools]
    tokenizer = AutoTokenizer.from_pretrained(agents.model)
    processor = vision.load_processor(agents.model) if vision.is_vision(agents.model) else None
    renderer = Renderer(tokenizer, build_parser(agents.parser, tool_names), tool_role=agents.tool_role,
                        keep_reasoning=agents.keep_reasoning, processor=processor)  # fmt: skip
    engine = build_engine(inference, device=_device(), seed=recipe.seed, work_dir=None)
    members = [(i, k) for i in range(len(rows)) for k in range(1 + samples)]
    if env is not None:
        played = asyncio.run(_environments(env, renderer, engine, inference, recipe, rows, members))
    else:
        played = asyncio.run(_programs(agents, renderer, engine, inference, recipe, rows, members))
    return report(members, played)


async def _environments(env: Any, renderer: Any, engine: Any, inference: Any, recipe: Any,
                        rows: list[dict[str, Any]], members: list[tuple[int, int]]) -> list[Played]:  # fmt: skip
    """Every member's trajectory, its turns generated in batches of `inference.max_batch`."""
    from meshrl.envs.episode import advance, start

    eps = list(await asyncio.gather(*(start(env, renderer, rows[i]) for i, _ in members)))
    while todo := [j for j, e in enumerate(eps) if not e.done]:
        for greedy in (False, True):
            part = [j for j in todo if (members[j][1] == 0) == greedy]
            params = sampling_params(inference, recipe, greedy)
            for b in range(0, len(part), inference.max_batch):
                some = part[b : b + inference.max_batch]
                seeds = [(seed_of(recipe, *members[j]) + eps[j].turns) % 2**63 for j in some]
                images = None
                if renderer.processor is not None:  # a vision-language model's pictures, per turn
                    tails = [eps[j].trajectory.tail_images for j in some]
                    images = [vision.pixels(renderer.processor, t) if t else None for t in tails]
                done = engine.generate(
                    [eps[j].trajectory.tail for j in some], params, seeds=seeds, images=images
                )
                turns = [
                    advance(env, renderer, eps[j], c.tokens, c.logprobs, 0)
                    for j, c in zip(some, done, strict=True)
                ]
                for j, e in zip(some, await asyncio.gather(*turns), strict=True):
                    eps[j] = e
    return [Played(e.rewards, e.failed is not None, e.turns, e.tool_calls, sum(e.tool_errors.values()),
                   e.truncated is not None) for e in eps]  # fmt: skip


class EngineModel:
    """The endpoint's model in `meshrl eval`: the engine, generating together the calls that programs
    make at once (each member's calls seeded by the member and the call's number)."""

    def __init__(self, engine: Any, inference: Any, recipe: Any, processor: Any = None) -> None:
        self.engine, self.inference, self.recipe, self.processor = engine, inference, recipe, processor
        self.pending: list[tuple[list[int], dict[str, Any], Any, asyncio.Future[Any], Any]] = []
        self.seeds: Counter[str] = Counter()
        self.wake = asyncio.Event()

    async def complete(
        self, ids: list[int], sampling: dict[str, Any], session: Any, images: list[str]
    ) -> Any:
        future = asyncio.get_running_loop().create_future()
        pixels = vision.pixels(self.processor, images) if images else None
        self.pending.append((ids, sampling, session, future, pixels))
        self.wake.set()
        return await future

    async def run(self) -> None:
        from meshrl.engines.base import SamplingParams
        from meshrl.roles.agents.chat import Generated

        while True:
            await self.wake.wait()
            await asyncio.sleep(0.01)  # the other programs' calls of this moment join the batch
            self.wake.clear()
            todo, self.pending = self.pending, []
            groups: dict[tuple[float, float, int], list[Any]] = {}
            for call in todo:
                greedy = call[2].key.endswith(".0")
                s = call[1]
                key = (
                    0.0 if greedy else s.get("temperature", self.recipe.temperature),
                    s.get("top_p", self.inference.top_p),
                    s["max_tokens"],
                )
                groups.setdefault(key, []).append(call)
            for (temperature, top_p, max_new), calls in groups.items():
                params = SamplingParams(
                    temperature=temperature, top_k=self.inference.top_k, top_p=top_p, max_new_tokens=max_new
                )
                for b in range(0, len(calls), self.inference.max_batch):
                    some = calls[b : b + self.inference.max_batch]
                    seeds = [self.seed(c) for c in some]
                    try:
                        images = [c[4] for c in some] if self.processor is not None else None
                        done = await asyncio.to_thread(
                            self.engine.generate, [c[0] for c in some], params, seeds=seeds, images=images
                        )
                    except Exception as e:
                        for _, _, _, future, _ in some:
                            future.set_exception(e)
                        continue
                    for (_, _, _, future, _), c in zip(some, done, strict=True):
                        future.set_result(Generated(c.tokens, c.logprobs, (0, 0), ""))

    def seed(self, call: tuple[list[int], dict[str, Any], Any, Any, Any]) -> int:
        _, sampling, session, _, _ = call
        if "seed" in sampling:
            return int(sampling["seed"]) % 2**63
        prompt, member = (int(x) for x in session.key.split("."))
        self.seeds[session.key] += 1
        return (seed_of(self.recipe, prompt, member) + self.seeds[session.key]) % 2**63


async def _programs(agents: Any, renderer: Any, engine: Any, inference: Any, recipe: Any,
                    rows: list[dict[str, Any]], members: list[tuple[int, int]]) -> list[Played]:  # fmt: skip
    """Every member's program, all at once, against the endpoint served by the engine (in-process to the
    session's clients, over HTTP on a free loopback port to a program's own: verifiers' client is one)."""
    import socket

    import httpx

    from meshrl.envs.base import reward_parts
    from meshrl.envs.programs import AgentRun, load_program, skip_chat_transform
    from meshrl.roles.agents.endpoint import Endpoint, Session

    skip_chat_transform()
    if agents.kind == "program":
        program, args = load_program(str(agents.program)), dict(agents.args)
    else:
        from meshrl.envs.verifiers import run_episode

        program, args = run_episode, {"environment": agents.verifiers, "environment_args": agents.args}
    model = EngineModel(engine, inference, recipe, renderer.processor)
    endpoint = Endpoint(renderer, model, names=agents.names, budget=agents.budget(), max_new=inference.max_new_tokens,
                        call_timeout_s=agents.call_timeout_s)  # fmt: skip
    transport = httpx.ASGITransport(app=endpoint.app())
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]

    async def play(i: int, k: int) -> Played:
        session = endpoint.sessions[f"{i}.{k}"] = Session(f"{i}.{k}")
        run = AgentRun(task=rows[i], model=agents.names[0], base_url=f"http://127.0.0.1:{port}/s/{session.key}/v1",
                       api_key="meshrl", tokenizer=agents.model, transport=transport)  # fmt: skip
        try:
            if asyncio.iscoroutinefunction(program):
                value = await program(run, **args)
            else:
                value = await asyncio.to_thread(program, run, **args)
            rewards = reward_parts(value)
        except Exception as e:
            rewards = {}
            failures.append(f"{type(e).__name__}: {e}")
        finally:
            await run.aclose()
        return Played(
            rewards,
            not rewards or not session.calls,
            len(session.calls),
            session.tool_calls,
            session.malformed,
        )

    failures: list[str] = []
    listening = asyncio.Event()
    jobs = [
        asyncio.create_task(model.run()),
        asyncio.create_task(endpoint.serve("127.0.0.1", port, listening)),
    ]
    try:
        await listening.wait()
        return list(await asyncio.gather(*(play(i, k) for i, k in members)))
    finally:
        for j in jobs:
            j.cancel()
        await asyncio.gather(*jobs, return_exceptions=True)
        for why in failures[:3]:
            print(f"meshrl eval: a trajectory failed ({len(failures)} in all): {why}", file=sys.stderr)


def report(members: list[tuple[int, int]], played: list[Played]) -> dict[str, Any]:
    result: dict[str, Any] = {"prompts": len({i for i, _ in members})}
    for label, greedy in (("greedy", True), ("sampled", False)):
        mine = [p for (_, k), p in zip(members, played, strict=True) if (k == 0) == greedy]
        if not mine:
            continue
        ok = [p for p in mine if not p.failed]
        result[f"{label}_reward"] = round(sum(math.fsum(p.rewards.values()) for p in ok) / max(len(ok), 1), 4)
        for part in sorted({n for p in ok for n in p.rewards} - {"reward"}):  # "reward": one unnamed number
            result[f"{label}/env_{part}"] = round(
                sum(p.rewards.get(part, 0.0) for p in ok) / max(len(ok), 1), 4
            )
        calls, errors = sum(p.tool_calls for p in mine), sum(p.tool_errors for p in mine)
        result[f"{label}/turns_mean"] = round(sum(p.turns for p in mine) / len(mine), 3)
        result[f"{label}/tool_calls_mean"] = round(calls / len(mine), 3)
        result[f"{label}/tool_success"] = round((calls - errors) / calls, 4) if calls else None
        result[f"{label}/truncated"] = sum(p.truncated for p in mine)
        result[f"{label}/failed"] = len(mine) - len(ok)
    return result


def _device() -> str:
    import torch

    return "cuda:0" if torch.cuda.is_available() else "cpu"
