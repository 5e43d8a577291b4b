"""Rollout's second job: score completed groups and write their advantages.

Rollout claims whole groups of `samples` once every column its reward and advantage need is there,
computes the reward trained on (the reward functions' weighted sum, `reward_functions.py`, + weighted
reward-model score + DAPO's overlong penalty, minus an optional KL(behaviour || reference) penalty) and the advantages, and writes `reward`,
`advantage`, `valid` (+ `returns` for GAE from a critic; `token_rewards` instead for the trainer's value
head) into the same rows. Estimators normalised over the batch (REINFORCE++, whitened GAE) score a
whole batch at once, so their statistics do not depend on which groups happened to be ready together.

DAPO's dynamic sampling deletes groups whose rewards all agree and hands their places back to the
feed, with the same `min_version`. A reward function that raises marks that sample failed (valid =
False, excluded from the loss); each function's mean goes to <run_dir>/rewards.jsonl; more than `max_failed_fraction` failures, or dynamic sampling that
drops more than `max_filtered_fraction` of the groups, stop the run.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from meshrl.algorithms import advantages as adv
from meshrl.algorithms import filters
from meshrl.algorithms.losses import AdaptiveKL, kl
from meshrl.dataplane import AsyncClient, Batch, Ragged
from meshrl.dataplane.missing import put_missing_async
from meshrl.observe.metrics import Metrics, Sink
from meshrl.planning.recipe import RunSettings
from meshrl.planning.wiring import Claim
from meshrl.roles.rollout.config import RolloutConfig
from meshrl.roles.rollout.reward_functions import RewardFunction, Scored, Workers, completions, score
from meshrl.roles.rollout.state import RolloutState
from meshrl.runtime.service import WATCH_S
from meshrl.schema import (
    ADVANTAGE,
    ENV_REWARD,
    ENV_REWARDS,
    GROUP,
    LOGPROBS,
    MEMBER,
    MIN_VERSION,
    PROMPT_ID,
    REF_LOGPROBS,
    RESPONSE,
    RETURNS,
    REWARD,
    RM_SCORE,
    TOKEN_REWARDS,
    VALID,
    VALUES,
)
from meshrl.state.checkpoint import Pause

log = logging.getLogger("meshrl.rollout")


class Rewards:
    """The reward functions on a batch's completions (also what evaluation measures), run on `workers`;
    the first failure is kept and logged."""

    def __init__(
        self,
        tokenizer: Any,
        functions: list[RewardFunction],
        prompt_field: str,
        workers: Workers | None = None,
    ) -> None:
        self.tokenizer, self.functions, self.prompt_field = tokenizer, functions, prompt_field
        self.workers = workers or Workers()
        self.first_failure: str | None = None

    async def __call__(self, batch: Batch, rows: list[dict[str, Any]]) -> Scored:
        picked = [rows[int(pid)] for pid in batch.meta_of(PROMPT_ID)]
        prompts = [r[self.prompt_field] for r in picked]
        conversational = bool(prompts) and isinstance(prompts[0], list)
        texts = completions(self.tokenizer, batch, conversational)
        scored = await score(self.functions, prompts, texts, picked, self.prompt_field, self.workers)
        if scored.failure is not None and self.first_failure is None:
            self.first_failure = scored.failure
            log.error("reward function failed: %s", scored.failure)
        return scored

    def close(self) -> None:
        self.workers.close()


class Scoring:
    def __init__(
        self,
        cfg: RolloutConfig,
        settings: RunSettings,
        state: RolloutState,
        rewards: Rewards,
        rows: list[dict[str, Any]],
        claim: Claim,
        on_refill: Callable[[], None],
        sink: Sink,
        until_gated: Callable[[int], Awaitable[None]],
    ) -> None:
        """Scores the rows of `claim` (its columns: what the reward and advantage read)."""
        self.cfg, self.settings, self.state, self.rewards, self.rows = cfg, settings, state, rewards, rows
        self.claim = claim
        self.until_gated = until_gated  # a version's gate counted and its evaluation rows put
        self.sink, self.metrics, self.counted = sink, Metrics(), 0  # per-function means, a row per step
        self.on_refill = on_refill  # dynamic sampling handed samples back: the feed may draw again
        self.kl = AdaptiveKL(state.kl_coef, cfg.kl_penalty.target, cfg.kl_penalty.horizon)
        self.kl_measured = 0.0

    async def run(
        self, client: AsyncClient, pause: Pause, persist: Callable[[], None], after: Callable[[], None]
    ) -> None:
        """Claim and score forever; `persist` before the effects, `after` each scored claim."""
        cfg, batch_size = self.cfg, self.settings.batch_size
        whole = cfg.advantage == "reinforce_pp" or (
            cfg.advantage == "gae" and cfg.values == "critic" and cfg.whiten
        )
        while True:
            c = self.claim
            batch = await client.claim(
                c.partition, c.consumer, list(c.columns), batch_size, min_n=batch_size if whole else 1,
                group_size=self.settings.group_size, timeout=WATCH_S, lease=600,
            )  # fmt: skip
            if not batch:
                continue
            # a version's evaluation rows are put before anything generated with it is scored: inference
            # has them (and generates them with that version) before the trainer can publish the next
            await self.until_gated(generated_with(batch))
            async with pause.work():
                if await self.score(client, batch, persist):
                    self.check_filtered()
                after()
                self.check_failed()

    async def score(self, client: AsyncClient, batch: Batch, persist: Callable[[], None]) -> bool:
        """Count, persist, then write the columns of the kept rows, delete the dropped ones, acknowledge.
        Returns whether dynamic sampling dropped groups."""
        st = self.state
        reward, valid = await self.total_rewards(batch)
        groups = torch.tensor(batch.meta_of(GROUP), dtype=torch.int64)
        keep = torch.ones(len(batch), dtype=torch.bool)
        if self.cfg.dynamic_sampling:
            keep = filters.groups_with_signal(reward, groups, valid)
        # in (group, member) order: the trainer's groups become ready in the order of this put, so its
        # mini-batches do not depend on which service finished a row last
        members = torch.tensor(batch.meta_of(MEMBER, 0), dtype=torch.int64)
        index = keep.nonzero().squeeze(-1)
        index = index[torch.argsort(groups[index] * 65536 + members[index], stable=True)]
        out = self.advantages(batch, index, reward[index], groups[index], valid[index]) if len(index) else {}
        # counted here, before the effects: rows of groups a predecessor counted are only finished
        new = torch.tensor([int(g) not in st.replay for g in groups.tolist()], dtype=torch.bool)
        st.failed += int((~valid & new).sum())
        st.handling = set(groups.tolist())
        st.replay -= st.handling
        drop = ~keep & new
        dropped = batch.ids[(~keep).numpy()]
        if bool(drop.any()):  # DAPO: no signal in these groups; the feed draws new prompts in their place
            needs = batch.meta_of(MIN_VERSION, 0)
            lost = {int(groups[i]): int(needs[i] or 0) for i in drop.nonzero().squeeze(-1).tolist()}
            st.refill += list(lost.values())
            st.filtered += int(drop.sum())
            st.started -= int(drop.sum())
            self.on_refill()
        st.scored += int((keep & new).sum())
        st.kl_coef = self.kl.coef
        persist()
        if len(index):
            await put_missing_async(client, batch.partition, out, batch.ids[index.numpy()])
        # delete before the ack: a process killed in between gets the rows back (a successor deletes
        # them again), never rows acknowledged but left behind
        if len(dropped):
            await client.delete(batch.partition, dropped)
        await client.ack(batch)
        st.handling = set()
        return bool(drop.any())

    def check_filtered(self) -> None:
        """Stop the run when dynamic sampling drops nearly every group."""
        cfg, st = self.cfg, self.state
        drawn = st.scored + st.filtered
        if drawn >= 4 * self.settings.batch_size and st.filtered > cfg.max_filtered_fraction * drawn:
            raise RuntimeError(
                f"dynamic sampling dropped {st.filtered} of {drawn} samples (max_filtered_fraction="
                f"{cfg.max_filtered_fraction}): nearly every group's rewards agree"
            )

    def check_failed(self) -> None:
        """Stop the run when more than max_failed_fraction of the samples could not be scored."""
        cfg, st = self.cfg, self.state
        if st.scored >= 4 * self.settings.group_size and st.failed > cfg.max_failed_fraction * st.scored:
            raise RuntimeError(
                f"{st.failed} of {st.scored} samples could not be scored (max_failed_fraction="
                f"{cfg.max_failed_fraction}); first failure:\n"
                f"{self.rewards.first_failure or 'the environment or agent program (its service log says why)'}"
            )

    async def total_rewards(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The reward trained on: the weighted sum of its sources (the reward functions, the reward
        model's score, the environment's reward) + the overlong penalty."""
        cfg = self.cfg
        scored = await self.rewards(batch, self.rows)
        reward, valid = scored.total.clone(), scored.valid
        if "rm" in cfg.rewards:
            rm = batch.tensor(RM_SCORE).float()
            reward += cfg.rewards["rm"] * rm
            self.metrics.add("reward/rm", rm)
        if "env" in cfg.rewards:  # NaN: the environment failed on that trajectory
            env = batch.tensor(ENV_REWARD).float()
            valid = valid & env.isfinite()
            reward += cfg.rewards["env"] * env.nan_to_num(0.0)
            if bool(env.isfinite().any()):
                self.metrics.add("reward/env", env[env.isfinite()])
            self.log_env_parts(batch)
        self.log_functions(scored, len(batch))
        if cfg.overlong_max_len is not None:
            lengths = batch.ragged(RESPONSE).lengths
            reward += filters.overlong_penalty(
                lengths,
                max_len=cfg.overlong_max_len,
                buffer=cfg.overlong_buffer,
                penalty=cfg.overlong_penalty,
            )
        return reward, valid

    def log_env_parts(self, batch: Batch) -> None:
        """Each named part of the environment's (or agent program's) reward: `reward/env_<part>` (a
        reward of one unnamed number is reward/env alone)."""
        parts: dict[str, list[float]] = {}
        for named in batch.meta_of(ENV_REWARDS):
            named = json.loads(named or "{}")
            for name, value in ({} if list(named) == ["reward"] else named).items():
                parts.setdefault(re.sub(r"[^A-Za-z0-9_]", "_", name), []).append(float(value))
        for name, values in sorted(parts.items()):
            self.metrics.add(f"reward/env_{name}", torch.tensor(values))

    def log_functions(self, scored: Scored, n: int) -> None:
        """Each reward function's mean into rewards.jsonl, a row per `batch_size` samples scored."""
        for name, values in scored.applied.items():
            if values:
                self.metrics.add(f"reward/{name}", torch.tensor(list(values.values())))
        self.counted += n
        if self.counted >= self.settings.batch_size and self.metrics.acc:
            done = self.state.scored + n  # the step those samples train (exactly so in lock-step)
            self.sink.write(
                {"step": done // self.settings.batch_size - 1, "scored": done, **self.metrics.reduce()}
            )
            self.metrics, self.counted = Metrics(), 0

    def advantages(
        self,
        batch: Batch,
        index: torch.Tensor,
        reward: torch.Tensor,
        groups: torch.Tensor,
        valid: torch.Tensor,
    ) -> dict[str, Any]:
        """Columns `reward`, `advantage`, `valid` (and `returns` for gae) for rows `index` of `batch`."""
        cfg = self.cfg
        pick = index.tolist()
        lengths = batch.ragged(RESPONSE).lengths[index]
        width = int(lengths.max()) if len(lengths) else 0
        mask = (torch.arange(width)[None, :] < lengths[:, None]) & valid[:, None]

        def padded(name: str) -> torch.Tensor:
            return Ragged.from_list([batch.ragged(name)[i] for i in pick], dtype=torch.float32).padded()[0]

        penalty = None
        if cfg.kl_penalty.coef > 0:
            per_token = torch.where(
                mask, kl(padded(LOGPROBS), padded(REF_LOGPROBS), cfg.kl_penalty.estimator), 0.0
            )
            per_sample = per_token.sum(1)
            penalty = self.kl.coef * per_token
            n = int(valid.sum())
            self.kl_measured = float(per_sample[valid].mean()) if n else 0.0
            self.kl.update(self.kl_measured, n)
        out: dict[str, Any] = {VALID: valid}
        if cfg.advantage == "gae":
            return {**out, **self._gae(reward, mask, penalty, lengths, padded)}
        if penalty is not None:
            reward = reward - penalty.sum(1)
        out[REWARD] = reward
        out[ADVANTAGE] = outcome_advantages(cfg, reward, groups, valid)
        return out

    def _gae(
        self,
        reward: torch.Tensor,
        mask: torch.Tensor,
        penalty: torch.Tensor | None,
        lengths: torch.Tensor,
        padded: Callable[[str], torch.Tensor],
    ) -> dict[str, Any]:
        cfg = self.cfg
        rewards = adv.token_rewards(reward, mask, penalty)
        rows = range(len(lengths))
        if cfg.values == "trainer":  # its value head: the trainer computes the advantages
            return {REWARD: reward, TOKEN_REWARDS: [rewards[k, : lengths[k]] for k in rows]}
        advantage, returns = adv.gae(rewards, padded(VALUES), mask, gamma=cfg.gamma, lam=cfg.lam)
        if cfg.whiten:
            advantage = adv.whiten(advantage, mask)
        return {
            REWARD: reward,
            ADVANTAGE: [advantage[k, : lengths[k]] for k in rows],
            RETURNS: [returns[k, : lengths[k]] for k in rows],
        }


def generated_with(batch: Batch) -> int:
    """The newest weight version any row of `batch` was generated with at the earliest (its MIN_VERSION),
    over the rows whose environment or agent program did not fail them (a NaN ENV_REWARD). A failed
    trajectory can be written before the version it was fed for exists (a program that fails at once,
    an episode whose connection timed out): waiting for that version's gate would hold this loop, and
    with it the rest of the current step, which the trainer needs to publish that version."""
    needs = [int(v or 0) for v in batch.meta_of(MIN_VERSION, 0)]
    if ENV_REWARD in batch:
        played = batch.tensor(ENV_REWARD).isfinite().tolist()
        needs = [n for n, ok in zip(needs, played, strict=True) if ok]
    return max(needs, default=0)


def outcome_advantages(
    cfg: RolloutConfig, reward: torch.Tensor, groups: torch.Tensor, valid: torch.Tensor
) -> torch.Tensor:
    """One advantage per sample from its (penalised) reward, by the config's estimator."""
    if cfg.advantage == "grpo":
        return adv.grpo(reward, groups, valid, scale=cfg.normalize_std)
    if cfg.advantage == "dr_grpo":
        return adv.dr_grpo(reward, groups, valid)
    if cfg.advantage == "rloo":
        return adv.rloo(reward, groups, valid)
    return adv.reinforce_pp(reward, valid)
