"""Rollout's first job: feed prompts into `samples`, paced by the trainer's gate rows.

Rollout writes `group_size` rows per prompt (into `samples`, or `tasks` for agents: the wiring's), one batch ahead of what the gates allow, each row tagged
with `min_version`, the oldest weight version it may be generated with: for sample s of batch
b = s // batch_size, `min_version = b - window + 1` (window 1 = lock-step, k = bounded staleness,
None = never wait). Inference enforces it, so a row starts generating the moment its version lands,
with no round trip through rollout, and after g gate rows at most (g - 1 + window) * batch_size
samples have started.

Every put carries an idempotency key and is recorded in the state before it is made, so a successor
can repeat it blindly (the data plane applies a key once).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import Callable, Iterator
from typing import Any

from meshrl.dataplane import AsyncClient
from meshrl.dataplane.protocol import Meta
from meshrl.models.vision import Images
from meshrl.models.vision import columns as image_columns
from meshrl.planning.recipe import RunSettings
from meshrl.roles.rollout.config import RolloutConfig
from meshrl.roles.rollout.data import Prompt
from meshrl.roles.rollout.state import RolloutState
from meshrl.schema import EPOCH, GROUP, MEMBER, MIN_VERSION, PROMPT, PROMPT_ID, TASK
from meshrl.state.checkpoint import Pause

Group = tuple[int, int, int, int]  # (group id, prompt index, epoch, min_version)

log = logging.getLogger("meshrl.rollout")


def feed_seed(run_seed: int, replica: int) -> int:
    """The seed of rollout replica `replica`'s prompt order."""
    return run_seed * 7919 + replica


def passes(rows: int, seed: int) -> Iterator[list[int]]:
    """The order a feed draws `rows` training rows in, pass after pass: one shuffle per pass, all from
    one generator seeded with `seed` (a benchmark hands another trainer the same prompts this way)."""
    rng = random.Random(seed)
    while True:
        order = list(range(rows))
        rng.shuffle(order)
        yield order


class Feed:
    def __init__(
        self,
        cfg: RolloutConfig,
        settings: RunSettings,
        state: RolloutState,
        rows: list[dict[str, Any]],
        encode: Callable[[dict[str, Any], int], Prompt],
        *,
        seed: int,
        name: str,
        partition: str,
        no_images: Images | None = None,
    ) -> None:
        """Writes prompt rows into `partition` (samples, or agents' trajectory starts: the wiring's);
        with `no_images` (a vision-language model's), their images too (that, for a row without)."""
        self.cfg, self.settings, self.state = cfg, settings, state
        self.no_images = no_images
        self.rows, self.encode, self.name = rows, encode, name
        self.total = settings.total_steps * settings.batch_size
        self.passes = passes(len(rows), seed)
        self.order: list[int] = []
        for _ in range(state.epoch + 1):  # this epoch's order: the same shuffles from the same seed
            self.reshuffle()
        self.changed = asyncio.Event()  # gates counted, or samples handed back: there may be room
        self.partition = partition

    def reshuffle(self) -> None:
        self.order = next(self.passes)

    # ---------------------------------------------------------------------------------------------------
    # pacing

    def allowed(self) -> int:
        """Samples that may have started generating after the gates seen so far."""
        window = self.cfg.window
        if window is None:
            return self.total
        return min(self.total, max(0, self.state.gates - 1 + window) * self.settings.batch_size)

    def min_version(self, sample: int) -> int:
        """Oldest weight version sample number `sample` may be generated with (enforced by inference)."""
        window = self.cfg.window
        return 0 if window is None else max(0, sample // self.settings.batch_size - window + 1)

    # ---------------------------------------------------------------------------------------------------

    async def run(self, client: AsyncClient, pause: Pause, persist: Callable[[], None]) -> None:
        """Write prompts one batch ahead of what the gates allow, forever (dynamic sampling can hand
        back started samples after the last prompt was fed)."""
        group, st = self.settings.group_size, self.state
        ahead = 0 if self.cfg.window is None else self.settings.batch_size
        while True:
            room = min(self.total, self.allowed() + ahead) - st.started
            if room < group:
                self.changed.clear()
                await self.changed.wait()
                continue
            async with pause.work():  # a checkpoint may pause us here
                room = min(self.total, self.allowed() + ahead) - st.started
                if room < group:
                    continue
                groups, tokens = self.draw(min(room // group, self.settings.prompts_per_step))
                st.started += len(groups) * group
                key = f"{self.name}/feed/{groups[0][0]}"
                st.pending[key] = {"kind": "feed", "groups": groups}
                persist()
                await self.put(client, key, groups, tokens)
                del st.pending[key]

    def draw(self, prompts: int) -> tuple[list[Group], dict[int, Prompt]]:
        """The next `prompts` groups and their prompts."""
        st = self.state
        groups: list[Group] = []
        tokens: dict[int, Prompt] = {}
        while len(groups) < prompts:
            index, tokens[index] = self.next_prompt()
            st.group_seq += 1
            # a group replacing one that dynamic sampling dropped belongs to the dropped one's batch
            started = st.started + len(groups) * self.settings.group_size
            need = st.refill.pop(0) if st.refill else self.min_version(started)
            groups.append((st.group_seq, index, st.epoch, need))
        return groups, tokens

    async def put(
        self,
        client: AsyncClient,
        key: str,
        groups: list[Group],
        tokens: dict[int, Prompt] | None = None,
    ) -> None:
        """`group_size` rows per group into `samples`, under the idempotency key `key`."""
        n = self.settings.group_size
        rows: list[Prompt] = []
        meta: list[Meta] = []
        for group, index, epoch, need in groups:
            rows += [tokens[index] if tokens else self.encode(self.rows[index], index)] * n
            task = self.task(index)
            meta += [{GROUP: group, MEMBER: k, PROMPT_ID: index, EPOCH: epoch, MIN_VERSION: need, TASK: task}
                     for k in range(n)]  # fmt: skip
        columns: dict[str, Any] = {PROMPT: [p.ids for p in rows]}
        if self.no_images is not None:
            columns |= image_columns([p.images for p in rows], self.no_images)
        await client.put(self.partition, columns, meta=meta, timeout=3600, key=key)

    def task(self, index: int) -> str:
        """Dataset row `index` as JSON text (an environment resets from it), without meshrl's own keys."""
        return json.dumps({k: v for k, v in self.rows[index].items() if not k.startswith("_")}, default=str)

    def next_prompt(self) -> tuple[int, Prompt]:
        """The next usable training prompt (reshuffled every epoch); too-long prompts, and those that
        cannot be encoded (an image that does not decode), are skipped and counted, with the reason."""
        st = self.state
        for _ in range(len(self.rows) + 1):
            if st.cursor >= len(self.order):
                self.reshuffle()
                st.epoch += 1 if st.cursor else 0
                st.cursor = 0
            index = self.order[st.cursor]
            st.cursor += 1
            try:
                tokens = self.encode(self.rows[index], index)
            except ValueError as e:
                st.skipped += 1
                if st.skipped <= 5:
                    log.warning("prompt %d skipped: %s", index, e)
                continue
            if len(tokens) <= self.cfg.max_prompt_len:
                return index, tokens
            st.skipped += 1
            if st.skipped <= 5:
                log.warning("prompt %d skipped: %d tokens > max_prompt_len", index, len(tokens))
        raise RuntimeError(f"no prompt of the dataset fits max_prompt_len={self.cfg.max_prompt_len}")
