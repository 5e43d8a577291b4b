"""The agents service: every kind of agent episode on one loop (docs/architecture.md, "Agents").

A replica claims trajectory starts from `tasks` and plays many at once on asyncio, as the recipe's kind
of episode: an `Environment` stepped between its call rows (environments.py), or an agent program or
verifiers episode calling the model through this replica's endpoint (programs.py). Every model call is
a row of `calls` that inference generates like any prompt; a trajectory's calls join into one sample
(meshrl/envs/trajectory.py), written to `samples` under the task's key with its reward and figures
(`Outcome`) before the row that finished it is acknowledged, so a killed replica loses and repeats
nothing: an environment's trajectory resumes from its last call row on whichever replica takes it, a
program runs again from its start.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from meshrl.dataplane import AsyncClient, Batch
from meshrl.envs.parsers import build_parser
from meshrl.envs.render import Renderer
from meshrl.envs.trajectory import Trajectory
from meshrl.models import vision
from meshrl.roles.agents.config import AgentsConfig
from meshrl.runtime.service import WATCH_S, Service
from meshrl.schema import (
    CARRIED,
    ENV_REWARD,
    ENV_REWARDS,
    ENV_S,
    GEN_BATCH,
    GEN_S,
    LOGPROBS,
    LOSS_MASK,
    MIN_VERSION,
    MODEL_TURNS,
    PROMPT,
    QUEUED_S,
    RESPONSE,
    SEGMENTS,
    SEQUENCES,
    TOKEN_VERSIONS,
    TOOL_CALLS,
    TOOL_ERRORS,
    TRAJ_FAILED,
    TRUNCATED,
    VERSION,
)

DTYPES = {PROMPT: torch.int64, RESPONSE: torch.int64, LOGPROBS: torch.float32, LOSS_MASK: torch.int8,
          TOKEN_VERSIONS: torch.int64, SEGMENTS: torch.int64}  # fmt: skip
"""The dtypes of a trajectory's columns (`Trajectory.sample`)."""
LOG_EVERY = 50
"""Trajectories between the lines that log the counts and mean rewards."""


@dataclass
class Outcome:
    """A finished trajectory: its tokens, reward and figures, whichever kind of episode played it."""

    trajectory: Trajectory
    rewards: dict[str, float] = field(default_factory=dict)
    failed: tuple[str, str] | None = None
    """(kind, reason) of a failed episode (its reward is NaN), or None."""
    truncated: str | None = None
    tool_calls: int = 0
    tool_errors: Counter[str] = field(default_factory=Counter)
    started: float = 0.0
    """Wall clock at the trajectory's start."""
    gen_s: float = 0.0
    gen_batch: int = 0
    env_s: float = 0.0
    """Seconds in the environment (a program: its own time)."""

    @property
    def reward(self) -> float:
        return math.nan if self.failed is not None else math.fsum(self.rewards.values())


class AgentsService(Service):
    def setup(self) -> None:
        from transformers import AutoTokenizer

        from meshrl.roles.agents import environments, programs

        logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per model call otherwise
        cfg = self.config
        self.turn_tokens = int(self.ctx.wiring.inputs["turn_tokens"])  # inference's max_new_tokens
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model)
        # a vision-language model's processor renders messages with images and makes their pixels
        self.processor = vision.load_processor(cfg.model) if vision.is_vision(cfg.model) else None
        self.no_images = None if self.processor is None else vision.blank(self.processor)
        self.kind = environments.Environments(self) if cfg.kind == "environment" else programs.Programs(self)
        self.counts: Counter[str] = Counter()
        self.parts: dict[str, float] = {}
        self.times = {"life_s": 0.0, "gen_s": 0.0, "env_s": 0.0}
        self.span: list[float] = []  # first start, last finish (wall clock; the agent benchmarks read it)

    def renderer_for(self, tools: list[str]) -> Renderer:
        """The renderer of this recipe's messages, reading calls of the tools named `tools`."""
        cfg = self.config
        parser = build_parser(cfg.parser, tools)
        return Renderer(self.tokenizer, parser, tool_role=cfg.tool_role, keep_reasoning=cfg.keep_reasoning,
                        processor=self.processor)  # fmt: skip

    def image_columns(self, images: list[str]) -> dict[str, Any]:
        """The IMAGES / IMAGE_MASK / PICTURES columns of one row whose tokens hold `images` (a vision-language
        model's; nothing for a text model)."""
        if self.no_images is None:
            return {}
        return vision.columns([vision.pixels(self.processor, images) if images else None], self.no_images)

    @property
    def config(self) -> AgentsConfig:
        cfg = self.ctx.config
        assert isinstance(cfg, AgentsConfig)
        return cfg

    def run(self) -> None:
        asyncio.run(self.serve())

    async def serve(self) -> None:
        self.client = client = await AsyncClient.connect(
            self.ctx.controller, secret=self.ctx.secret, name=self.ctx.name
        )
        self.slots = asyncio.Semaphore(self.config.concurrency)
        self.tasks: set[asyncio.Task[None]] = set()
        self.acks: dict[int, tuple[Batch, list[int], bool]] = {}  # by id(batch): its rows done, delete them
        self.failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        jobs = [asyncio.create_task(self.pump(self.ctx.wiring.claim("tasks"), self.kind.begin)),
                *[asyncio.create_task(j) for j in self.kind.jobs()],
                asyncio.create_task(self.watch_run(client))]  # fmt: skip
        self.phase("waiting for tasks")
        try:
            done, _ = await asyncio.wait([*jobs, self.failed], return_when="FIRST_COMPLETED")
            for t in done:
                t.result()  # a failure of ours, or of the run elsewhere
        finally:
            for t in [*jobs, *self.tasks]:
                t.cancel()
            await asyncio.gather(*jobs, *self.tasks, return_exceptions=True)
            if self.failed.done() and not self.failed.cancelled():
                self.failed.exception()  # retrieved (re-raised above when it was the first to end)
            with contextlib.suppress(Exception):
                await client.close()

    async def pump(self, claim: Any, handle: Callable[[Batch, int], Awaitable[None]]) -> None:
        """Claim as many rows as there are free slots, and handle each in a task of its own."""
        while True:
            await self.slots.acquire()
            n = 1
            while n < 64 and not self.slots.locked():
                await self.slots.acquire()
                n += 1
            try:
                batch = await self.client.claim(claim.partition, claim.consumer_of(self.ctx.replica.name),
                                                list(claim.columns), n, timeout=WATCH_S, lease=self.config.lease_s,
                                                address=claim.address_of(self.ctx.replica.name))  # fmt: skip
            except BaseException:
                for _ in range(n):
                    self.slots.release()
                raise
            for _ in range(n - len(batch)):
                self.slots.release()
            for i in range(len(batch)):
                self.spawn(self.guarded(batch, i, handle))

    def spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def guarded(self, batch: Batch, i: int, handle: Callable[[Batch, int], Awaitable[None]]) -> None:
        """Handle row `i`, then acknowledge it (only after its writes: a kill in between replays the row).
        Anything failing here (the data plane, a bug) stops the service; its rows return to the pool."""
        try:
            await handle(batch, i)
            self.done(batch, i)
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            self.log.exception("row %d of %s failed", int(batch.ids[i]), batch.partition)
            if not self.failed.done():
                self.failed.set_exception(e)
        finally:
            self.slots.release()
            self.ctx.health.info.update(self.counts, active=len(self.tasks))
            self.phase(f"{len(self.tasks)} trajectories in flight ({self.counts['finished']} finished)")

    def done(self, batch: Batch, i: int, delete: bool = False) -> None:
        """Acknowledge row `i` (and delete it), with the other rows done in this turn of the event loop."""
        if not self.acks:
            self.spawn(self.flush())
        self.acks.setdefault(id(batch), (batch, [], delete))[1].append(int(batch.ids[i]))

    async def flush(self) -> None:
        await asyncio.sleep(0)
        acks, self.acks = self.acks, {}
        try:
            for batch, ids, delete in acks.values():
                # deleted first: killed between the two, a row acknowledged but not deleted would stay
                # for good (no one claims it again); deleted and not acknowledged, its lease just ends
                if delete:
                    await self.client.delete(batch.partition, ids)
                await self.client.ack(batch, ids)
        except BaseException as e:
            if not self.failed.done() and not isinstance(e, asyncio.CancelledError):
                self.failed.set_exception(e)
            raise

    async def finish(self, row: dict[str, Any], traj: int, out: Outcome) -> None:
        """The trajectory's sample into `samples` (reward NaN when its episode failed: rollout counts it)."""
        t = out.trajectory
        columns: dict[str, Any] = {
            k: [torch.tensor(v, dtype=DTYPES[k])] for k, v in t.sample(self.kind.renderer.stop).items()
        }
        first, last = t.version_range
        need = int(row.get(MIN_VERSION) or 0)
        columns[VERSION] = torch.tensor([[max(first, need), max(last, need)]], dtype=torch.int64)
        columns[GEN_S] = torch.tensor([out.gen_s], dtype=torch.float32)
        columns[GEN_BATCH] = torch.tensor([out.gen_batch], dtype=torch.int64)
        columns[ENV_REWARD] = torch.tensor([out.reward], dtype=torch.float32)
        columns |= self.image_columns(t.images)
        now = time.time()
        life_s = now - (out.started or now)
        meta = {**{k: row.get(k) for k in CARRIED}, MODEL_TURNS: t.calls, SEQUENCES: len(t.segments),
                TRUNCATED: out.truncated, TRAJ_FAILED: out.failed is not None, TOOL_CALLS: out.tool_calls,
                TOOL_ERRORS: json.dumps(out.tool_errors), ENV_REWARDS: json.dumps(out.rewards), ENV_S: out.env_s,
                QUEUED_S: max(life_s - out.gen_s - out.env_s, 0.0)}  # fmt: skip
        self.count(traj, out, life_s)
        await self.client.put(
            self.ctx.wiring.partition("samples"), columns, meta=[meta], timeout=3600, key=f"traj/{traj}"
        )

    def count(self, traj: int, out: Outcome, life_s: float) -> None:
        c = self.counts
        c["finished"] += 1
        c["turns"] += out.trajectory.calls
        c["splits"] += out.trajectory.splits
        c["truncated"] += out.truncated is not None
        c["tool_calls"] += out.tool_calls
        self.times["life_s"] += life_s
        self.times["gen_s"] += out.gen_s
        self.times["env_s"] += out.env_s
        self.span = [self.span[0] if self.span else out.started, time.time()]
        if out.failed is not None:
            kind, reason = out.failed
            c["failed"] += 1
            c[f"failed_{kind}"] += 1
            if c[f"failed_{kind}"] <= 3 or c["failed"] % 100 == 0:
                self.log.warning("trajectory %d failed (%d so far): %s", traj, c["failed"], reason)
        for name, value in out.rewards.items():
            self.parts[name] = self.parts.get(name, 0.0) + value
        if c["finished"] % LOG_EVERY == 0:
            means = {k: round(v / max(c["finished"] - c["failed"], 1), 4) for k, v in self.parts.items()}
            self.log.info("trajectories: %s; mean rewards %s%s", dict(c), means, self.kind.report())
            self.ctx.health.info["rewards"] = means

    def close(self) -> None:
        if getattr(self, "span", None):
            c, t = self.counts, self.times
            self.log.info(
                "agents: %s; %d trajectories, %d turns, %.3f s from the first start to the last finish (%.3f to "
                "%.3f); trajectories' time: %.3f s alive, %.3f s generating, %.3f s in the environment%s",
                dict(c), c["finished"], c["turns"], self.span[1] - self.span[0], *self.span, t["life_s"],
                t["gen_s"], t["env_s"], self.kind.report(),
            )  # fmt: skip
        super().close()
