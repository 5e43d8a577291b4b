"""Environments in the agents service: a trajectory is stepped between its call rows, each of which holds
the whole trajectory so far, so any replica takes any answer (service.py, "Exactly once").

A start (a row of `tasks`) is reset and becomes the trajectory's first call row, under the key
`turn/<t>/0`; an answered call row is the trajectory so far plus the model's turn: the episode is
rebuilt from the row, advanced (meshrl/envs/episode.py), and written as the next call row
(`turn/<t>/<k>`) or, once over, as the trajectory's sample (`traj/<t>`).
"""

from __future__ import annotations

import importlib
import json
import time
from typing import TYPE_CHECKING, Any

import torch

from meshrl.dataplane import Batch
from meshrl.envs import Environment
from meshrl.envs.episode import Episode, advance, start
from meshrl.envs.trajectory import Trajectory
from meshrl.roles.agents.service import Outcome
from meshrl.schema import (
    CARRIED,
    EARLIER,
    GEN_BATCH,
    GEN_S,
    LOGPROBS,
    LOSS_MASK,
    PROMPT,
    RESPONSE,
    SEGMENTS,
    TASK,
    TOKEN_VERSIONS,
    TRAJ_LOGPROBS,
    TURN,
    VERSION,
)

if TYPE_CHECKING:
    from meshrl.roles.agents.service import AgentsService

# an environment's keys in its call rows' metadata (besides schema's CARRIED and TURN)
TRAJ, STARTED, EPISODE, TRAJ_SHAPE, TIMES = "traj", "t0", "episode", "shape", "times"
"""The trajectory's id (its start row), its start time, the episode (`Episode.state_json`), the
trajectory's first prompt length, calls and splits, and its seconds generating and in the environment
with its last generation batch."""


class Environments:
    def __init__(self, service: AgentsService) -> None:
        cfg = service.config
        module, _, name = str(cfg.environment).partition(":")
        self.env: Environment = getattr(importlib.import_module(module), name)(**cfg.args)
        self.env.limits = cfg.limits(service.turn_tokens)
        self.service = service
        self.renderer = service.renderer_for([t.name for t in self.env.tools])

    def jobs(self) -> list[Any]:
        s = self.service
        return [s.pump(s.ctx.wiring.claim("answers"), self.turn)]

    def report(self) -> str:
        return ""

    async def begin(self, batch: Batch, i: int) -> None:
        """A trajectory's start: reset, then its first call row (or, if reset failed, its sample)."""
        row = (batch.meta or [{}])[i] or {}
        t0 = time.time()
        meta: dict[str, Any] = {k: row.get(k) for k in CARRIED}
        meta[TRAJ], meta[STARTED] = int(batch.ids[i]), t0
        ep = await start(self.env, self.renderer, json.loads(str(row.get(TASK) or "{}")))
        times = {"gen_s": 0.0, "env_s": time.time() - t0, "gen_batch": 0}
        await (self.over(ep, meta, times) if ep.done else self.write(ep, meta, times))

    async def turn(self, batch: Batch, i: int) -> None:
        """An answered call: the model's turn added, the environment stepped, the next call or the sample."""
        meta: dict[str, Any] = dict((batch.meta or [{}])[i] or {})
        ep = Episode.resume(
            trajectory_of(batch, i, json.loads(meta.pop(TRAJ_SHAPE))), json.loads(meta.pop(EPISODE))
        )
        times = json.loads(meta.pop(TIMES))
        times["gen_s"] += float(batch.tensor(GEN_S)[i])
        times["gen_batch"] = int(batch.tensor(GEN_BATCH)[i])
        first, _ = batch.tensor(VERSION)[i].tolist()  # a turn a weight update interrupted: its first version
        t0 = time.time()
        ep = await advance(self.env, self.renderer, ep, batch.ragged(RESPONSE)[i].tolist(),
                           batch.ragged(LOGPROBS)[i].tolist(), int(first))  # fmt: skip
        times["env_s"] += time.time() - t0
        await (self.over(ep, meta, times) if ep.done else self.write(ep, meta, times))

    async def write(self, ep: Episode, meta: dict[str, Any], times: dict[str, Any]) -> None:
        t = ep.trajectory
        tail = len(t.ids) - t.segments[-1]
        columns = {
            PROMPT: [torch.tensor(t.ids[tail:], dtype=torch.int64)],
            EARLIER: [torch.tensor(t.ids[:tail], dtype=torch.int64)],
            LOSS_MASK: [torch.tensor(t.mask, dtype=torch.int8)],
            TRAJ_LOGPROBS: [torch.tensor(t.logprobs, dtype=torch.float32)],
            TOKEN_VERSIONS: [torch.tensor(t.versions, dtype=torch.int64)],
            SEGMENTS: [torch.tensor(t.segments, dtype=torch.int64)],
        }
        columns |= self.service.image_columns(t.tail_images)
        shape = [t.prompt_len, t.calls, t.splits, t.images, t.image_segments]
        row = {**meta, TURN: t.calls, TRAJ_SHAPE: json.dumps(shape),
               EPISODE: json.dumps(ep.state_json()), TIMES: json.dumps(times)}  # fmt: skip
        s = self.service
        await s.client.put(s.ctx.wiring.partition("calls"), columns, meta=[row], timeout=3600,
                           key=f"turn/{meta[TRAJ]}/{t.calls}")  # fmt: skip

    async def over(self, ep: Episode, meta: dict[str, Any], times: dict[str, Any]) -> None:
        failed = ("environment", ep.failed) if ep.failed is not None else None
        out = Outcome(ep.trajectory, ep.rewards, failed, ep.truncated, ep.tool_calls, ep.tool_errors,
                      float(meta[STARTED]), times["gen_s"], times["gen_batch"], times["env_s"])  # fmt: skip
        await self.service.finish(meta, int(meta[TRAJ]), out)


def trajectory_of(batch: Batch, i: int, shape: list[Any]) -> Trajectory:
    """The trajectory recorded in call row `i` (`Environments.write`): `shape` is its first prompt length,
    calls, splits, pictures and pictures per segment."""
    prompt_len, calls, splits, images, image_segments = shape
    return Trajectory(
        ids=batch.ragged(EARLIER)[i].tolist() + batch.ragged(PROMPT)[i].tolist(), prompt_len=prompt_len,
        mask=batch.ragged(LOSS_MASK)[i].tolist(), logprobs=batch.ragged(TRAJ_LOGPROBS)[i].tolist(),
        versions=batch.ragged(TOKEN_VERSIONS)[i].tolist(), segments=batch.ragged(SEGMENTS)[i].tolist(),
        calls=calls, splits=splits, images=images, image_segments=image_segments,
    )  # fmt: skip
