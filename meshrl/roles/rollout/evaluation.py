"""Rollout's third job: evaluate the policy on held-out prompts at chosen weight versions.

At version 0, every `eval_every` versions and at the final version, rollout writes each held-out prompt
into the `eval` partition once for a greedy completion and `eval_samples` times for sampled ones, all
tagged with that version (inference generates them with exactly it). When every row of a version is
back, its greedy and sampled accuracy (the mean rule reward) is appended to <run_dir>/eval.jsonl.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from meshrl.columns import EVAL, PROMPT, RESPONSE
from meshrl.dataplane import AsyncClient, Batch
from meshrl.dataplane.protocol import Meta
from meshrl.observe.metrics import JsonlSink, Metrics
from meshrl.roles.rollout.config import RolloutConfig
from meshrl.roles.rollout.state import RolloutState
from meshrl.runtime.service import WATCH_S
from meshrl.state.checkpoint import Pause

log = logging.getLogger("meshrl.rollout")


class Evaluation:
    def __init__(
        self,
        cfg: RolloutConfig,
        state: RolloutState,
        rows: list[dict[str, Any]],
        encode: Callable[[dict[str, Any]], torch.Tensor],
        rewards: Callable[[Batch, list[dict[str, Any]]], tuple[torch.Tensor, torch.Tensor]],
        sink: JsonlSink,
    ) -> None:
        self.cfg, self.state, self.rows, self.encode, self.rewards = cfg, state, rows, encode, rewards
        self.sink, self.path = sink, sink.path
        self.recorded: set[int] = set()  # versions whose line is in the file (a re-joining process reads it)

    def due(self, version: int, final: bool) -> bool:
        """Whether weight version `version` is evaluated."""
        every = self.cfg.eval_every
        return bool(self.rows) and (version == 0 or final or bool(every and version % every == 0))

    def start(self, version: int) -> None:
        """Expect the rows of `version`'s evaluation (before they are put)."""
        self.state.eval_pending[version] = len(self.rows) * (1 + self.cfg.eval_samples)
        self.state.eval_results[version] = []

    async def put(self, client: AsyncClient, key: str, version: int) -> None:
        """The held-out prompts for `version`: one greedy and `eval_samples` sampled rows each."""
        prompts: list[torch.Tensor] = []
        meta: list[Meta] = []
        for index, row in enumerate(self.rows):
            tokens = self.encode(row)
            for k in range(1 + self.cfg.eval_samples):
                prompts.append(tokens)
                meta.append({"eval_version": version, "greedy": k == 0, "prompt_id": index, "member": k,
                             "min_version": version})  # fmt: skip
        await client.put(EVAL, {PROMPT: prompts}, meta=meta, timeout=3600, key=key)

    async def run(
        self, client: AsyncClient, pause: Pause, persist: Callable[[], None], after: Callable[[], None]
    ) -> None:
        """Collect evaluation rows forever; `after` runs when an evaluation completed."""
        while True:
            batch = await client.claim(EVAL, "rollout", [PROMPT, RESPONSE], 4096, timeout=WATCH_S)
            if not batch:
                continue
            async with pause.work():
                if await self.collect(client, batch, persist):
                    after()

    async def collect(self, client: AsyncClient, batch: Batch, persist: Callable[[], None]) -> bool:
        """Count the rows, record the evaluations they complete, persist, delete, acknowledge."""
        st = self.state
        rewards, valid = self.rewards(batch, self.rows)
        ids = batch.ids.tolist()
        for rid, version, greedy, r, ok in zip(
            ids, batch.meta_of("eval_version"), batch.meta_of("greedy"), rewards.tolist(), valid.tolist(),
            strict=True,
        ):  # fmt: skip
            if rid in st.replay_eval:  # a predecessor counted it
                continue
            st.eval_results[version].append((bool(greedy), r if ok else 0.0))
            st.eval_pending[version] -= 1
        st.handling_eval = set(ids)
        st.replay_eval -= st.handling_eval
        complete = [v for v, left in st.eval_pending.items() if left == 0]
        for version in complete:
            del st.eval_pending[version]
            self.record(version, st.eval_results.pop(version))
        persist()
        await client.delete(EVAL, batch.ids)  # before the ack, as in scoring
        await client.ack(batch)
        st.handling_eval = set()
        return bool(complete)

    def record(self, version: int, results: list[tuple[bool, float]]) -> None:
        if version in self.recorded:  # by a predecessor that died before its state said so
            return
        self.recorded.add(version)
        m = Metrics()
        for greedy, reward in results:
            m.add("greedy_accuracy" if greedy else "sampled_accuracy", reward)
            m.add("prompts", float(greedy))
        values = m.reduce()
        row = {
            "version": version,
            "greedy_accuracy": values.get("greedy_accuracy", 0.0),
            "sampled_accuracy": values.get("sampled_accuracy", 0.0),
            "prompts": int(values.get("prompts", 0)),
            "time": time.time(),
        }
        log.info("eval at version %d: %s", version, row)
        self.sink.write(row)

    def read_recorded(self) -> None:
        """The versions already in the file (a re-joining process's predecessor may have written one its
        state does not know of)."""
        if self.path.exists():
            self.recorded = {json.loads(line)["version"] for line in self.path.read_text().splitlines()}

    def lines(self) -> int:
        return len(self.path.read_text().splitlines()) if self.path.exists() else 0
