"""The environment service: multi-turn trajectories stepped between the data plane's turn rows.

No orchestrator: a turn is a row. Rollout's feed writes a trajectory start into `tasks` (paced by the
window, as single-turn prompts are). A replica claims it, resets the environment on the dataset row and
writes the first context as a row of `turns`; inference claims that row like any generation work and
writes the response; a replica claims the finished turn, appends the model's tokens exactly as
generated, steps the environment (tools run concurrently, under timeouts) and writes either the next
turn row (the trajectory's ids so far, its history per token and the environment's state in the
row's metadata) or, when the trajectory is over, the trained sample into `samples`, with its loss mask,
behaviour logprobs, per-token weight versions and the environment's reward. Each replica steps many
trajectories at once on asyncio; one waiting on a slow tool holds an env slot, never a generation slot.

Exactly once: every row this service writes carries an idempotency key (turn k of trajectory t,
or the sample of t) and its claim is acknowledged only after the write. A replica killed mid-step
loses nothing: its claimed rows return to the pool when its connection closes, and whichever replica
takes them (its successor, or another) steps that turn again from the row, i.e. the trajectory resumes
from its last written turn; a write its predecessor already made is not made twice (the data plane
applies a key once; it remembers the last 4096 keys). The environment's own side effects in that
step (a tool that wrote somewhere) are repeated: tools that must not repeat need keys of their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import time
from collections import Counter
from typing import Any

import torch

from meshrl.dataplane import AsyncClient, Batch
from meshrl.envs import Environment
from meshrl.envs.episode import Outcome, advance, start
from meshrl.envs.parsers import build_parser
from meshrl.envs.render import Renderer
from meshrl.envs.trajectory import Trajectory
from meshrl.planning.wiring import Claim
from meshrl.roles.env.config import EnvConfig
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
    TASK,
    TOKEN_VERSIONS,
    TOOL_CALLS,
    TOOL_ERRORS,
    TRAJ_FAILED,
    TRAJ_LOGPROBS,
    TRUNCATED,
    TURN,
    VERSION,
)

# the environment's own keys in its turn rows' metadata (besides schema's CARRIED, TURN, ENV_S,
# TOOL_CALLS and TOOL_ERRORS, which are the trajectory's so far)
TRAJ, STARTED, STATE, TRANSCRIPT = "traj", "t0", "state", "transcript"
"""The trajectory's id (its start row), its start time, the environment's JSON state, its transcript."""
PROMPT_LEN, GEN_S_TOTAL = "prompt_len", "gen_s_total"
"""How many of the turn row's tokens are the first context; its seconds generating so far."""

SAMPLE_DTYPES = {
    PROMPT: torch.int64, RESPONSE: torch.int64, LOGPROBS: torch.float32, LOSS_MASK: torch.int8,
    TOKEN_VERSIONS: torch.int64,
}  # fmt: skip
"""The dtypes of a finished trajectory's columns (`Trajectory.sample`)."""


class EnvService(Service):
    def setup(self) -> None:
        from transformers import AutoTokenizer

        cfg, wiring = self.config, self.ctx.wiring
        module, _, name = cfg.environment.partition(":")
        self.env: Environment = getattr(importlib.import_module(module), name)(**cfg.environment_args)
        tokenizer = AutoTokenizer.from_pretrained(cfg.model)
        self.renderer = Renderer(tokenizer, self.env.tools, tool_role=cfg.tool_role)
        self.parser = build_parser(cfg.parser, [t.name for t in self.env.tools])
        self.limits = cfg.limits(int(wiring.inputs["turn_tokens"]))  # inference's max_new_tokens
        self.env.limits = self.limits
        self.counts = {"started": 0, "turns": 0, "finished": 0, "truncated": 0, "failed": 0}
        self.reward_sums: dict[str, float] = {}
        # where finished trajectories' time went (logged at close; benchmarks/agent_sim.py reads it)
        self.times = {"life_s": 0.0, "gen_s": 0.0, "env_s": 0.0}
        self.span: list[float] = []  # first start, last finish (wall clock)

    @property
    def config(self) -> EnvConfig:
        cfg = self.ctx.config
        assert isinstance(cfg, EnvConfig)
        return cfg

    def run(self) -> None:
        asyncio.run(self.serve())

    async def serve(self) -> None:
        client = await AsyncClient.connect(self.ctx.controller, secret=self.ctx.secret, name=self.ctx.name)
        self.slots = asyncio.Semaphore(self.config.concurrency)
        self.steps: set[asyncio.Task[None]] = set()
        self.acks: dict[int, tuple[Batch, list[int]]] = {}  # by id(claim)
        self.failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        jobs = [
            asyncio.create_task(self.pump(client, self.ctx.wiring.claim("tasks"), self.begin)),
            asyncio.create_task(self.pump(client, self.ctx.wiring.claim("turns"), self.turn)),
        ]
        run_over = asyncio.create_task(self.watch_run(client))
        try:
            done, _ = await asyncio.wait([*jobs, run_over, self.failed], return_when="FIRST_COMPLETED")
            for t in done:
                t.result()  # a failure of ours, or of the run elsewhere
        finally:
            for t in [*jobs, run_over, *self.steps]:
                t.cancel()
            await asyncio.gather(*jobs, run_over, *self.steps, return_exceptions=True)
            if self.failed.done() and not self.failed.cancelled():
                self.failed.exception()  # retrieved (re-raised above when it was the first to end)
            with contextlib.suppress(Exception):
                await client.close()

    async def pump(self, client: AsyncClient, claim: Claim, handle: Any) -> None:
        """Claim as many rows as there are free slots, and handle each in a task of its own."""
        while True:
            await self.slots.acquire()
            n = 1
            while n < 64 and not self.slots.locked():
                await self.slots.acquire()
                n += 1
            try:
                batch = await client.claim(
                    claim.partition,
                    claim.consumer,
                    list(claim.columns),
                    n,
                    timeout=WATCH_S,
                    lease=self.config.lease_s,
                )
            except BaseException:
                for _ in range(n):
                    self.slots.release()
                raise
            for _ in range(n - len(batch)):
                self.slots.release()
            for i in range(len(batch)):
                self.track(asyncio.create_task(self.guarded(client, batch, i, handle)))

    async def guarded(self, client: AsyncClient, batch: Batch, i: int, handle: Any) -> None:
        """Handle row `i`, then acknowledge it (only after its write: a kill in between replays the row).
        Anything failing here (the data plane, a bug) stops the service; its rows return to the pool."""
        try:
            await handle(client, batch, i)
            if not self.acks:  # the first of this turn of the event loop: flush after it
                self.track(asyncio.create_task(self.flush_acks(client)))
            self.acks.setdefault(id(batch), (batch, []))[1].append(int(batch.ids[i]))
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            self.log.exception("row %d of %s failed", int(batch.ids[i]), batch.partition)
            if not self.failed.done():
                self.failed.set_exception(e)
        finally:
            self.slots.release()
            self.ctx.health.info.update(self.counts, active=len(self.steps))
            self.phase(f"{len(self.steps)} trajectories in flight ({self.counts['finished']} finished)")

    async def flush_acks(self, client: AsyncClient) -> None:
        """One acknowledgement per claim for the rows finished in the same turn of the event loop."""
        await asyncio.sleep(0)
        acks, self.acks = self.acks, {}
        try:
            for batch, ids in acks.values():
                await client.ack(batch, ids)
        except BaseException as e:
            if not self.failed.done() and not isinstance(e, asyncio.CancelledError):
                self.failed.set_exception(e)
            raise

    def track(self, task: asyncio.Task[None]) -> None:
        self.steps.add(task)
        task.add_done_callback(self.steps.discard)

    # ---------------------------------------------------------------------------------------------------

    async def begin(self, client: AsyncClient, batch: Batch, i: int) -> None:
        """A trajectory start: reset, then its first turn row (or, if reset failed, its sample)."""
        row = (batch.meta or [{}])[i] or {}
        meta = {k: row.get(k) for k in CARRIED}
        meta[TRAJ] = int(batch.ids[i])
        meta[STARTED] = t0 = time.time()
        self.span = self.span or [t0, t0]
        out = await start(self.env, self.renderer, json.loads(str(row.get(TASK) or "{}")))
        meta[ENV_S] = time.time() - t0
        self.counts["started"] += 1
        await (self.finish(client, out, meta, 0) if out.done else self.write_turn(client, out, meta))

    async def turn(self, client: AsyncClient, batch: Batch, i: int) -> None:
        """A generated turn: append it, step the environment, write the next turn or the sample."""
        meta = dict((batch.meta or [{}])[i] or {})
        out = Outcome(
            _trajectory(batch, i, meta),
            json.loads(str(meta.pop(STATE))),
            transcript=json.loads(str(meta.pop(TRANSCRIPT, None) or "[]")),
            tool_calls=int(meta.pop(TOOL_CALLS, 0) or 0),
            tool_errors=Counter(json.loads(str(meta.pop(TOOL_ERRORS, None) or "{}"))),
        )
        out.trajectory.gen_s += float(batch.tensor(GEN_S)[i])
        first, last = batch.tensor(VERSION)[i].tolist()
        response = batch.ragged(RESPONSE)[i].tolist()
        logprobs = batch.ragged(LOGPROBS)[i].tolist()
        t0 = time.time()
        out = await advance(self.env, self.renderer, self.parser, out, response, logprobs, int(last))
        meta[ENV_S] = float(meta.get(ENV_S) or 0.0) + time.time() - t0
        self.counts["turns"] += 1
        if first != last:  # interrupted by a weight update: record the first version of the turn
            out.trajectory.versions[-len(response) :] = [int(first)] * len(response)
        gen_batch = int(batch.tensor(GEN_BATCH)[i])
        await (self.finish(client, out, meta, gen_batch) if out.done else self.write_turn(client, out, meta))

    async def write_turn(self, client: AsyncClient, out: Outcome, meta: dict[str, Any]) -> None:
        traj = out.trajectory
        columns: dict[str, Any] = {
            PROMPT: [torch.tensor(traj.ids, dtype=torch.int64)],
            LOSS_MASK: [torch.tensor([0] * traj.prompt_len + traj.mask, dtype=torch.int8)],
            TRAJ_LOGPROBS: [torch.tensor([0.0] * traj.prompt_len + traj.logprobs, dtype=torch.float32)],
            TOKEN_VERSIONS: [torch.tensor([-1] * traj.prompt_len + traj.versions, dtype=torch.int64)],
        }
        row = {**meta, TURN: traj.turns, PROMPT_LEN: traj.prompt_len, GEN_S_TOTAL: traj.gen_s,
               STATE: json.dumps(out.state), TRANSCRIPT: json.dumps(out.transcript),
               TOOL_CALLS: out.tool_calls, TOOL_ERRORS: json.dumps(out.tool_errors)}  # fmt: skip
        await client.put(
            self.ctx.wiring.partition("turns"),
            columns,
            meta=[row],
            timeout=3600,
            key=f"turn/{meta['traj']}/{traj.turns}",
        )

    async def finish(self, client: AsyncClient, out: Outcome, meta: dict[str, Any], gen_batch: int) -> None:
        """The trajectory's sample into `samples` (reward NaN when it failed: rollout counts it)."""
        traj = out.trajectory
        if len(traj.ids) == traj.prompt_len:  # ended before any turn: one masked token to carry the row
            traj.add_env([self.renderer.stop])
        first, last = traj.version_range
        need = int(meta.get(MIN_VERSION) or 0)
        columns: dict[str, Any] = {
            k: [torch.tensor(v, dtype=SAMPLE_DTYPES[k])] for k, v in traj.sample().items()
        }
        columns[VERSION] = torch.tensor([[max(first, need), max(last, need)]], dtype=torch.int64)
        columns[GEN_S] = torch.tensor([traj.gen_s], dtype=torch.float32)
        columns[GEN_BATCH] = torch.tensor([gen_batch], dtype=torch.int64)
        columns[ENV_REWARD] = torch.tensor([out.reward], dtype=torch.float32)
        now = time.time()
        env_s = float(meta.get(ENV_S) or 0.0)
        life_s = now - float(meta.get(STARTED) or now)
        row = {**{k: meta.get(k) for k in CARRIED}, MODEL_TURNS: traj.turns, TRUNCATED: out.truncated,
               TRAJ_FAILED: out.failed is not None, TOOL_CALLS: out.tool_calls,
               TOOL_ERRORS: json.dumps(out.tool_errors), ENV_REWARDS: json.dumps(out.rewards), ENV_S: env_s,
               QUEUED_S: max(life_s - traj.gen_s - env_s, 0.0)}  # fmt: skip
        self.count(out, int(meta[TRAJ]))
        if STARTED in meta:
            self.times["life_s"] += life_s
            self.times["gen_s"] += traj.gen_s
            self.times["env_s"] += env_s
            self.span = [self.span[0] if self.span else float(meta[STARTED]), now]
        await client.put(
            self.ctx.wiring.partition("samples"),
            columns,
            meta=[row],
            timeout=3600,
            key=f"traj/{meta['traj']}",
        )

    def close(self) -> None:
        if getattr(self, "span", None):
            c, t = self.counts, self.times
            self.log.info(
                "%d trajectories, %d turns, %.3f s from the first start to the last finish (%.3f to %.3f); "
                "trajectories' time: %.3f s alive, %.3f s generating, %.3f s in the environment",
                c["finished"], c["turns"], self.span[1] - self.span[0], *self.span, t["life_s"], t["gen_s"], t["env_s"],
            )  # fmt: skip
        super().close()

    def count(self, out: Outcome, traj: int) -> None:
        c = self.counts
        c["finished"] += 1
        c["truncated"] += out.truncated is not None
        if out.failed is not None:
            c["failed"] += 1
            if c["failed"] <= 5 or c["failed"] % 100 == 0:
                self.log.warning("trajectory %d failed (%d so far): %s", traj, c["failed"], out.failed)
        for name, value in out.rewards.items():
            self.reward_sums[name] = self.reward_sums.get(name, 0.0) + value
        if c["finished"] % 50 == 0:
            means = {k: round(v / c["finished"], 4) for k, v in self.reward_sums.items()}
            self.log.info("trajectories: %s; mean rewards %s", c, means)
            self.ctx.health.info["rewards"] = means


def _trajectory(batch: Batch, i: int, meta: dict[str, Any]) -> Trajectory:
    """The trajectory recorded in turn row `i` (its ids so far and their history)."""
    n = int(meta.pop(PROMPT_LEN))
    ids = batch.ragged(PROMPT)[i].tolist()
    return Trajectory(
        ids=ids,
        prompt_len=n,
        mask=batch.ragged(LOSS_MASK)[i][n:].tolist(),
        logprobs=batch.ragged(TRAJ_LOGPROBS)[i][n:].tolist(),
        versions=batch.ragged(TOKEN_VERSIONS)[i][n:].tolist(),
        turns=int(meta.pop(TURN)),
        gen_s=float(meta.pop(GEN_S_TOTAL, 0.0)),
    )
