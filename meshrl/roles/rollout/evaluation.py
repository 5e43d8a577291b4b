"""Rollout's third job: evaluate the policy on held-out prompts at chosen weight versions.

At version 0, every `eval_every` versions and at the final version, rollout writes each held-out prompt
into the `eval` partition once for a greedy completion and `eval_samples` times for sampled ones, all
tagged with that version, when it counts that version's gate. In lock-step inference generates them
with exactly it and off the critical path: it generates the step's training rows first, then claims
the evaluation's rows all at once and generates them in one call while the trainer trains, and new
weights wait for that call (`roles/inference/`). Rollout scores nothing generated with a version before
that version's evaluation rows are put (`scoring.py`), so the trainer cannot publish the next version
before inference has them. A run that goes ahead of its trainer (window > 1 or none) may evaluate on a
newer version; the log says how many rows were. When
every row of a version is back, its greedy and sampled reward (the mean reward trained on), accuracy (the
share of answers the recipe's correctness check accepts), pass@k and each reward function's mean are
appended to <run_dir>/eval.jsonl (`summarize`, which `meshrl eval` shares).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

from meshrl.dataplane import AsyncClient, Batch
from meshrl.dataplane.protocol import Meta
from meshrl.models.vision import Images
from meshrl.models.vision import columns as image_columns
from meshrl.observe.metrics import JsonlSink, Metrics
from meshrl.planning.wiring import Claim
from meshrl.roles.rollout.config import RolloutConfig
from meshrl.roles.rollout.data import Prompt
from meshrl.roles.rollout.reward_functions import Scored
from meshrl.roles.rollout.state import EvalResult, RolloutState
from meshrl.runtime.service import WATCH_S
from meshrl.schema import (
    EVAL_VERSION,
    GREEDY,
    MEMBER,
    MIN_VERSION,
    PROMPT,
    PROMPT_ID,
    VERSION,
)
from meshrl.state.checkpoint import Pause

log = logging.getLogger("meshrl.rollout")


class Evaluation:
    def __init__(
        self,
        cfg: RolloutConfig,
        state: RolloutState,
        rows: list[dict[str, Any]],
        prompts: list[Prompt],
        rewards: Callable[[Batch, list[dict[str, Any]]], Awaitable[Scored]],
        sink: JsonlSink,
        claim: Claim,
        no_images: Images | None = None,
    ) -> None:
        """Puts `rows` (whose prompts are `prompts`) into the evaluation partition and collects them back
        through `claim` (with their images, `no_images` standing for none, for a vision-language model)."""
        self.cfg, self.state, self.rows, self.prompts, self.rewards = cfg, state, rows, prompts, rewards
        self.no_images = no_images
        self.claim = claim
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
        prompts: list[Prompt] = []
        meta: list[Meta] = []
        for index, tokens in enumerate(self.prompts):
            for k in range(1 + self.cfg.eval_samples):
                prompts.append(tokens)
                meta.append({EVAL_VERSION: version, GREEDY: k == 0, PROMPT_ID: index, MEMBER: k,
                             MIN_VERSION: version})  # fmt: skip
        columns: dict[str, Any] = {PROMPT: [p.ids for p in prompts]}
        if self.no_images is not None:
            columns |= image_columns([p.images for p in prompts], self.no_images)
        await client.put(self.claim.partition, columns, meta=meta, timeout=3600, key=key)

    async def run(
        self, client: AsyncClient, pause: Pause, persist: Callable[[], None], after: Callable[[], None]
    ) -> None:
        """Collect evaluation rows forever; `after` runs after each batch of them."""
        while True:
            c = self.claim
            batch = await client.claim(c.partition, c.consumer, list(c.columns), 4096, timeout=WATCH_S)
            if not batch:
                continue
            async with pause.work():
                await self.collect(client, batch, persist)
                after()

    async def collect(self, client: AsyncClient, batch: Batch, persist: Callable[[], None]) -> bool:
        """Count the rows, record the evaluations they complete, persist, delete, acknowledge."""
        st = self.state
        ids = batch.ids.tolist()
        asked = batch.meta_of(EVAL_VERSION)
        newer = [
            (a, int(last))
            for a, (_, last) in zip(asked, batch.tensor(VERSION).tolist(), strict=True)
            if last != a
        ]
        if newer:
            log.warning(
                "%d evaluation rows of version %d were generated with version %d", len(newer), *newer[0]
            )
        for rid, version, result in zip(
            ids, batch.meta_of(EVAL_VERSION), await results(self.rewards, batch, self.rows), strict=True
        ):
            if rid in st.replay_eval:  # a predecessor counted it
                continue
            st.eval_results[version].append(result)
            st.eval_pending[version] -= 1
        st.handling_eval = set(ids)
        st.replay_eval -= st.handling_eval
        complete = [v for v, left in st.eval_pending.items() if left == 0]
        for version in complete:
            del st.eval_pending[version]
            self.record(version, st.eval_results.pop(version))
        persist()
        await client.delete(batch.partition, batch.ids)  # before the ack, as in scoring
        await client.ack(batch)
        st.handling_eval = set()
        return bool(complete)

    def record(self, version: int, results: list[EvalResult]) -> None:
        if version in self.recorded:  # by a predecessor that died before its state said so
            return
        self.recorded.add(version)
        row = {"version": version, **summarize(results, self.cfg.correctness_name), "time": time.time()}
        log.info("eval at version %d: %s", version, row)
        self.sink.write(row)

    def read_recorded(self) -> None:
        """The versions already in the file (a re-joining process's predecessor may have written one its
        state does not know of)."""
        if self.path.exists():
            self.recorded = {json.loads(line)["version"] for line in self.path.read_text().splitlines()}

    def lines(self) -> int:
        return len(self.path.read_text().splitlines()) if self.path.exists() else 0


async def results(
    rewards: Callable[[Batch, list[dict[str, Any]]], Awaitable[Scored]],
    batch: Batch,
    rows: list[dict[str, Any]],
) -> list[EvalResult]:
    """Each evaluation row's result (a sample whose reward failed counts as reward 0)."""
    scored = await rewards(batch, rows)
    per_sample: list[dict[str, float]] = [{} for _ in range(len(batch))]
    for name, values in scored.applied.items():
        for i, v in values.items():
            per_sample[i][name] = v
    return [
        (bool(greedy), r if ok else 0.0, int(pid), f)
        for greedy, pid, r, ok, f in zip(
            batch.meta_of(GREEDY), batch.meta_of(PROMPT_ID), scored.total.tolist(), scored.valid.tolist(),
            per_sample, strict=True,
        )
    ]  # fmt: skip


def summarize(results: list[EvalResult], correctness: str | None = None) -> dict[str, float]:
    """An evaluation's line: the mean reward of the greedy and of the sampled completions
    (`greedy_reward`, `sampled_reward`: what training maximises, format bonuses included), each reward
    function's mean over the greedy completions it applied to, and, when the recipe has a correctness
    check (`correctness`: the name of the reward function that says whether an answer is right), the
    share of correct completions (`greedy_accuracy`, `sampled_accuracy`: a value of at least 0.5 is
    correct; a completion it does not apply to is left out), how many sampled answers that share counts
    and its binomial standard error (`sampled_answers`, `sampled_stderr`: sqrt(p (1 - p) / n), the
    spread of the share from sampling alone, the held-out prompts fixed), and pass@k (the share of
    prompts with at least one correct sampled completion of their k)."""
    m = Metrics()
    solved: dict[int, bool] = {}
    for greedy, reward, prompt, functions in results:
        kind = "greedy" if greedy else "sampled"
        m.add(f"{kind}_reward", reward)
        m.add("prompts", float(greedy))
        if greedy:
            for name, value in functions.items():
                m.add(f"reward/{name}", value)
        check = functions.get(correctness) if correctness is not None else None
        if check is not None:
            m.add(f"{kind}_accuracy", float(check >= 0.5))
            if not greedy:
                solved[prompt] = solved.get(prompt, False) or check >= 0.5
    values = m.reduce()
    out: dict[str, float] = {"prompts": int(values.pop("prompts", 0))}
    for key in ("greedy_accuracy", "sampled_accuracy", "greedy_reward", "sampled_reward"):
        if key in values:
            out[key] = values.pop(key)
    answers = sum(not g and correctness in f for g, _, _, f in results) if correctness else 0
    if answers and "sampled_accuracy" in out:
        p = out["sampled_accuracy"]
        out["sampled_answers"], out["sampled_stderr"] = answers, math.sqrt(p * (1 - p) / answers)
    if solved:
        k = sum(not g for g, *_ in results) // max(len({p for g, _, p, _ in results if not g}), 1)
        out[f"pass@{k}"] = sum(solved.values()) / len(solved)
    return {**out, **values}
