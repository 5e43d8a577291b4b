"""The rollout service: feed prompts, score completions, compute advantages, evaluate.

Four asyncio tasks share one data-plane client:
- gates: reads the trainer's gate rows (this replica's own consumer name) and counts them;
- feed: writes `group_size` rows per prompt into `samples`, one batch ahead of the pacing window, each
  row tagged with the oldest weight version it may be generated with, so that after g gate rows at
  most (g - 1 + window) * batch_size samples have started (window None: no limit); inference enforces it;
- score: claims whole groups that inference completed, calls the reward function on each completion,
  computes group advantages and writes `reward`, `advantage`, `valid` back into the same rows;
- evaluate: at version 0, every `eval_every` versions and at the final version, writes the held-out
  prompts (one greedy and `eval_samples` sampled rows each) into `eval` and records the accuracy in
  <run_dir>/eval.jsonl.
After the final gate and its evaluation, rollout ends the run.

Re-joining: a rollout process restarted on its own (an on-failure policy) continues where its
predecessor stopped, while the others run on. Before each change takes effect in the data plane, the
service writes its whole state to `<run_dir>/rejoin/<process>.<launch>.{0,1}.json`, with the puts in flight
(under idempotency keys, so the successor repeats them safely) and the groups and evaluation rows being
handled (counted already: when their rows come back, the rows the predecessor had claimed, they are
finished without being counted twice).

A reward function that raises marks that sample failed (valid = False, excluded from the loss); more
than `max_failed_fraction` failures stop the run with the first traceback.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import random
import time
from pathlib import Path
from typing import Any

import torch

from meshrl.algorithms import advantages as adv
from meshrl.algorithms import filters
from meshrl.algorithms.losses import AdaptiveKL, kl
from meshrl.dataplane import AsyncClient, Batch, Ragged
from meshrl.dataplane.protocol import Meta
from meshrl.roles import EVAL, GATE, SAMPLES
from meshrl.roles.rollout.config import RolloutConfig
from meshrl.roles.rollout.data import RewardFn, load_rows, rule_rewards
from meshrl.roles.scorer import put_missing_async
from meshrl.runtime.service import WATCH_S, Service
from meshrl.state import checkpoint as ckpt
from meshrl.state.statefile import StateFile


class RolloutService(Service):
    def setup(self) -> None:
        from transformers import AutoTokenizer

        cfg = self.config
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model)
        bad: list[str] = []
        self.train_rows, self.eval_rows = load_rows(cfg, bad)
        if bad:
            self.log.warning("%d dataset rows skipped; the first: %s", len(bad), "; ".join(bad[:5]))
        self.ctx.health.info["bad_rows"] = len(bad)
        self.reward_fn: RewardFn | None = None
        if cfg.reward is not None:
            module, _, fn = cfg.reward.partition(":")
            self.reward_fn = getattr(importlib.import_module(module), fn)
        self.kl = AdaptiveKL(cfg.kl_in_reward, cfg.kl_target, cfg.kl_horizon)
        self.kl_measured = 0.0
        self.filtered = 0
        self.refill: list[int] = []  # min_version of each group dynamic sampling dropped, to replace
        self.rng = random.Random(self.ctx.recipe.seed * 7919 + self.ctx.replica.index)
        self.order: list[int] = []
        self.epoch = 0
        self.cursor = 0
        self.total = self.ctx.recipe.total_steps * self.ctx.recipe.batch_size
        self.started = self.scored = self.failed = self.skipped = 0
        self.first_failure: str | None = None
        self.gates = 0
        self.last_gate = -1  # version of the last gate row counted (a restarted process sees it again)
        self.final_version: int | None = None
        self.changed = asyncio.Event()
        self.eval_pending: dict[int, int] = {}  # version -> rows not back yet
        self.eval_results: dict[int, list[tuple[bool, float]]] = {}
        self.group_seq = self.ctx.replica.index * 10**12
        self.eval_file = self.ctx.run_dir / "eval.jsonl"
        self.recorded: set[int] = set()  # versions whose evaluation is in eval.jsonl
        # effects in flight, in the state file so that a successor completes them: puts by key, and the
        # groups / evaluation rows whose counts are in but whose rows are not acknowledged yet
        self.pending: dict[str, dict[str, Any]] = {}
        self.handling: set[int] = set()
        self.handling_eval: set[int] = set()
        self.replay: set[int] = set()  # groups a predecessor counted: finish them, do not count them
        self.replay_eval: set[int] = set()  # evaluation row ids likewise
        self.state = StateFile(self.ctx.run_dir / "rejoin" / f"{self.ctx.name}.{self.ctx.launch}")
        resume = self.ctx.resume
        predecessor = self.state.read()
        if predecessor is not None:
            self.rejoin(predecessor)
            return
        for old in (self.ctx.run_dir / "rejoin").glob(f"{self.ctx.name}.*.json"):  # earlier launches'
            old.unlink()
        if resume is not None:
            self.load_state(resume / f"{self.ctx.name}.json")
        elif self.ctx.replica.index == 0:
            self.eval_file.write_text("")

    @property
    def config(self) -> RolloutConfig:
        cfg = self.ctx.config
        assert isinstance(cfg, RolloutConfig)
        return cfg

    def run(self) -> None:
        asyncio.run(self.serve())

    async def serve(self) -> None:
        self.client = await AsyncClient.connect(
            self.ctx.controller, secret=self.ctx.secret, name=self.ctx.name
        )
        self.done = asyncio.Event()
        self.pause = ckpt.Pause()
        run_over = asyncio.create_task(self.watch_run(self.client))
        all_done = asyncio.create_task(self.done.wait())
        checkpoints = ckpt.take_part(self.client, self.ctx.name, self.pause, self.save_state)
        tasks = {
            asyncio.create_task(t)
            for t in (self.watch_gates(), self.feed(), self.score(), self.collect_eval(), checkpoints)
        }
        async with self.pause.work():  # not paused for a checkpoint until they are in the data plane
            for key in list(self.pending):  # a predecessor's puts that may not have happened
                await self.put_pending(key)
        try:
            while not (run_over.done() or all_done.done()):
                finished, _ = await asyncio.wait([*tasks, run_over, all_done], return_when="FIRST_COMPLETED")
                for t in finished & tasks:
                    t.result()  # re-raise a failure; a task that simply ended (feed) leaves the set
                    tasks.discard(t)
            if run_over.done():
                run_over.result()  # ended by someone else, or failed elsewhere
            else:
                self.finish_run()
                self.state.remove()
        finally:
            for t in [*tasks, run_over, all_done]:
                t.cancel()
            await asyncio.gather(*tasks, run_over, all_done, return_exceptions=True)
            await self.client.close()

    # ---------------------------------------------------------------------------------------------------
    # checkpoints

    STATE = ("order", "epoch", "cursor", "started", "scored", "failed", "skipped", "filtered", "refill",
             "group_seq", "gates", "last_gate", "final_version")  # fmt: skip

    def save_state(self, directory: Path) -> None:
        """Everything needed to continue exactly here (called paused, between pieces of work)."""
        state = {k: getattr(self, k) for k in self.STATE}
        state.update(
            rng=self.rng.getstate(),
            kl_coef=self.kl.coef,
            eval_pending={str(k): v for k, v in self.eval_pending.items()},
            eval_results={str(k): v for k, v in self.eval_results.items()},
            eval_lines=len(self.eval_file.read_text().splitlines()) if self.eval_file.exists() else 0,
            # a successor's rows still to finish uncounted (the snapshot holds their claims)
            replay=sorted(self.replay),
            replay_eval=sorted(self.replay_eval),
        )
        ckpt.save_json(directory / f"{self.ctx.name}.json", state)

    def load_state(self, path: Path) -> None:
        state = ckpt.load_json(path)
        for k in self.STATE:
            setattr(self, k, state[k])
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self.kl.coef = state["kl_coef"]
        self.eval_pending = {int(k): v for k, v in state["eval_pending"].items()}
        self.eval_results = {int(k): [tuple(x) for x in v] for k, v in state["eval_results"].items()}
        self.replay, self.replay_eval = set(state.get("replay", ())), set(state.get("replay_eval", ()))
        if self.ctx.replica.index == 0:
            ckpt.truncate_jsonl(self.eval_file, state["eval_lines"])
        self.log.info("resumed from %s: %d samples started, %d scored", path, self.started, self.scored)

    # ---------------------------------------------------------------------------------------------------
    # re-joining

    def persist(self) -> None:
        """Write the state, ahead of the data-plane effect about to happen (see meshrl/state/statefile.py)."""
        state = {k: getattr(self, k) for k in self.STATE if k != "order"}
        state.update(
            kl_coef=self.kl.coef,
            eval_pending={str(k): v for k, v in self.eval_pending.items()},
            eval_results={str(k): v for k, v in self.eval_results.items()},
            pending=self.pending,
            replay=sorted(self.replay | self.handling),
            replay_eval=sorted(self.replay_eval | self.handling_eval),
        )
        self.state.write(state)

    def rejoin(self, state: dict[str, Any]) -> None:
        """Take over from a predecessor of this launch: its state, the dataset order at its epoch (the same
        shuffles from the same seed), and what it left in flight."""
        for k in self.STATE:
            if k != "order":
                setattr(self, k, state[k])
        for _ in range(self.epoch + 1):
            self.order = list(range(len(self.train_rows)))
            self.rng.shuffle(self.order)
        self.kl.coef = state["kl_coef"]
        self.eval_pending = {int(k): v for k, v in state["eval_pending"].items()}
        self.eval_results = {int(k): [tuple(x) for x in v] for k, v in state["eval_results"].items()}
        self.pending = state["pending"]
        self.replay, self.replay_eval = set(state["replay"]), set(state["replay_eval"])
        if self.eval_file.exists():
            self.recorded = {json.loads(line)["version"] for line in self.eval_file.read_text().splitlines()}
        self.log.info(
            "re-joined the run: %d samples started, %d scored, %d gates, %d puts to repeat",
            self.started, self.scored, self.gates, len(self.pending),
        )  # fmt: skip

    async def put_pending(self, key: str) -> None:
        """Make the put recorded under `key` (again: the data plane applies a key once), then forget it."""
        what = self.pending[key]
        if what["kind"] == "feed":
            await self.put_groups(key, [tuple(g) for g in what["groups"]])
        else:
            await self.put_eval(key, int(what["version"]))
        del self.pending[key]

    def check_done(self) -> None:
        """The run is over for rollout once the final version is in and its evaluation recorded."""
        if self.final_version is not None and not self.eval_pending and self.scored >= self.total:
            self.done.set()

    # ---------------------------------------------------------------------------------------------------
    # pacing

    async def watch_gates(self) -> None:
        consumer = f"{self.ctx.replica.name}-gate"
        while True:
            batch = await self.client.claim(GATE, consumer, ["version"], 64, timeout=WATCH_S)
            if not batch:
                continue
            async with self.pause.work():
                for version, meta in zip(batch.tensor("version").tolist(), batch.meta or [], strict=False):
                    if version <= self.last_gate:  # counted by a predecessor that died before its ack
                        continue
                    self.gates += 1
                    self.last_gate = int(version)
                    final = bool(meta and meta.get("final"))
                    key = None
                    if self.eval_rows and (
                        version == 0
                        or final
                        or (self.config.eval_every and version % self.config.eval_every == 0)
                    ):
                        self.eval_pending[version] = len(self.eval_rows) * (1 + self.config.eval_samples)
                        self.eval_results[version] = []
                        key = f"{self.ctx.name}/eval/{version}"
                        self.pending[key] = {"kind": "eval", "version": int(version)}
                    if final:
                        self.final_version = int(version)
                    self.persist()
                    if key is not None:
                        await self.put_pending(key)
                    if final:
                        self.check_done()
                self.ctx.health.info.update(
                    gates=self.gates, started=self.started, scored=self.scored, failed=self.failed
                )
                await self.client.ack(batch)
                self.changed.set()

    def allowed(self) -> int:
        """Samples that may have started generating after the gates seen so far."""
        window = self.config.window
        if window is None:
            return self.total
        return min(self.total, max(0, self.gates - 1 + window) * self.ctx.recipe.batch_size)

    def min_version(self, sample: int) -> int:
        """Oldest weight version sample number `sample` may be generated with (enforced by inference)."""
        window = self.config.window
        return 0 if window is None else max(0, sample // self.ctx.recipe.batch_size - window + 1)

    async def feed(self) -> None:
        """Write prompts one batch ahead of what the gates allow, each row tagged with its min_version:
        inference starts a row the moment its weight version lands, with no round trip through here."""
        cfg = self.config
        ahead = 0 if cfg.window is None else self.ctx.recipe.batch_size
        while True:  # dynamic sampling can hand back started samples after the last prompt was fed
            room = min(self.total, self.allowed() + ahead) - self.started
            if room < self.ctx.recipe.group_size:
                self.changed.clear()
                await self.changed.wait()
                continue
            async with self.pause.work():  # a checkpoint may pause us here
                room = min(self.total, self.allowed() + ahead) - self.started
                if room < self.ctx.recipe.group_size:
                    continue
                prompts = min(room // self.ctx.recipe.group_size, self.ctx.recipe.prompts_per_step)
                groups: list[tuple[int, int, int, int]] = []  # (group, prompt id, epoch, min version)
                tokens: dict[int, torch.Tensor] = {}
                while len(groups) < prompts:
                    index, tokens[index] = self.next_prompt()
                    self.group_seq += 1
                    # a group replacing one that dynamic sampling dropped belongs to the dropped one's batch
                    started = self.started + len(groups) * self.ctx.recipe.group_size
                    need = self.refill.pop(0) if self.refill else self.min_version(started)
                    groups.append((self.group_seq, index, self.epoch, need))
                self.started += len(groups) * self.ctx.recipe.group_size
                key = f"{self.ctx.name}/feed/{groups[0][0]}"
                self.pending[key] = {"kind": "feed", "groups": groups}
                self.persist()
                await self.put_groups(key, groups, tokens)
                del self.pending[key]

    async def put_groups(
        self, key: str, groups: list[tuple[int, int, int, int]], tokens: dict[int, torch.Tensor] | None = None
    ) -> None:
        """`group_size` rows per group into `samples`, under the idempotency key `key`."""
        n = self.ctx.recipe.group_size
        rows: list[torch.Tensor] = []
        meta: list[Meta] = []
        for group, index, epoch, need in groups:
            rows += [tokens[index] if tokens else self.encode(self.train_rows[index])] * n
            meta += [{"group": group, "member": k, "prompt_id": index, "epoch": epoch, "min_version": need}
                     for k in range(n)]  # fmt: skip
        await self.client.put(SAMPLES, {"prompt": rows}, meta=meta, timeout=3600, key=key)

    def next_prompt(self) -> tuple[int, torch.Tensor]:
        """The next usable training prompt (reshuffled every epoch); too-long prompts are skipped."""
        for _ in range(len(self.train_rows) + 1):
            if self.cursor >= len(self.order):
                self.order = list(range(len(self.train_rows)))
                self.rng.shuffle(self.order)
                self.epoch += 1 if self.cursor else 0
                self.cursor = 0
            index = self.order[self.cursor]
            self.cursor += 1
            row = self.train_rows[index]
            tokens = self.encode(row)
            if len(tokens) <= self.config.max_prompt_len:
                return index, tokens
            self.skipped += 1
            if self.skipped <= 5:
                self.log.warning("prompt %d skipped: %d tokens > max_prompt_len", index, len(tokens))
        raise RuntimeError(f"no prompt of the dataset fits max_prompt_len={self.config.max_prompt_len}")

    def encode(self, row: dict[str, Any]) -> torch.Tensor:
        text = str(row[self.config.prompt_field])
        ids: Any
        if self.config.chat_template:
            ids = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
            )
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        else:
            ids = self.tokenizer(text)["input_ids"]
        return torch.tensor(list(ids), dtype=torch.int64)

    # ---------------------------------------------------------------------------------------------------
    # scoring

    async def score(self) -> None:
        cfg = self.config
        columns = list(cfg.score_columns())
        # Estimators normalised over the batch (REINFORCE++, whitened GAE) score a whole batch at once, so
        # that the statistics do not depend on which groups happened to be ready together.
        whole = cfg.advantage == "reinforce_pp" or (
            cfg.advantage == "gae" and cfg.values == "critic" and cfg.whiten
        )
        while True:
            batch = await self.client.claim(
                SAMPLES, "rollout", columns, self.ctx.recipe.batch_size, min_n=self.ctx.recipe.batch_size if whole else 1,
                group_size=self.ctx.recipe.group_size, timeout=WATCH_S, lease=600,
            )  # fmt: skip
            if not batch:
                continue
            async with self.pause.work():
                reward, valid = self.total_rewards(batch)
                groups = torch.tensor(batch.meta_of("group"), dtype=torch.int64)
                keep = torch.ones(len(batch), dtype=torch.bool)
                if cfg.dynamic_sampling:
                    keep = filters.groups_with_signal(reward, groups, valid)
                # in (group, member) order: the trainer's groups become ready in the order of this put, so
                # its mini-batches do not depend on which service finished a row last
                members = torch.tensor(batch.meta_of("member", 0), dtype=torch.int64)
                index = keep.nonzero().squeeze(-1)
                index = index[torch.argsort(groups[index] * 65536 + members[index], stable=True)]
                out = (
                    self.advantages(batch, index, reward[index], groups[index], valid[index])
                    if len(index)
                    else {}
                )
                # counted here, before the effects: rows of groups a predecessor counted are only finished
                new = torch.tensor([int(g) not in self.replay for g in groups.tolist()], dtype=torch.bool)
                self.failed += int((~valid & new).sum())
                self.handling = set(groups.tolist())
                self.replay -= self.handling
                drop = ~keep & new
                dropped = batch.ids[(~keep).numpy()]
                if bool(drop.any()):  # DAPO: no signal in these groups; feed draws new prompts in their place
                    needs = batch.meta_of("min_version", 0)
                    lost = {int(groups[i]): int(needs[i] or 0) for i in drop.nonzero().squeeze(-1).tolist()}
                    self.refill += list(lost.values())
                    self.filtered += int(drop.sum())
                    self.started -= int(drop.sum())
                    self.changed.set()
                self.scored += int((keep & new).sum())
                self.persist()
                if len(index):
                    await put_missing_async(self.client, SAMPLES, out, batch.ids[index.numpy()])
                # delete before the ack: a process killed in between gets the rows back (a successor
                # deletes them again), never rows acknowledged but left behind
                if len(dropped):
                    await self.client.delete(SAMPLES, dropped)
                await self.client.ack(batch)
                self.handling = set()
                if bool(drop.any()):
                    drawn = self.scored + self.filtered
                    if (
                        drawn >= 4 * self.ctx.recipe.batch_size
                        and self.filtered > cfg.max_filtered_fraction * drawn
                    ):
                        raise RuntimeError(
                            f"dynamic sampling dropped {self.filtered} of {drawn} samples (max_filtered_fraction="
                            f"{cfg.max_filtered_fraction}): nearly every group's rewards agree"
                        )
                self.check_done()
                self.ctx.health.info.update(
                    scored=self.scored, failed=self.failed, skipped=self.skipped, filtered=self.filtered
                )
                if (
                    self.scored >= 4 * self.ctx.recipe.group_size
                    and self.failed > cfg.max_failed_fraction * self.scored
                ):
                    raise RuntimeError(
                        f"{self.failed} of {self.scored} samples could not be scored (max_failed_fraction="
                        f"{cfg.max_failed_fraction}); first failure:\n{self.first_failure}"
                    )

    def rewards(self, batch: Batch, rows: list[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.reward_fn is None:  # no rule: evaluation has nothing to measure
            return torch.zeros(len(batch), dtype=torch.float32), torch.ones(len(batch), dtype=torch.bool)
        reward, valid, failure = rule_rewards(
            self.tokenizer, self.reward_fn, self.config.prompt_field, batch, rows
        )
        if failure is not None and self.first_failure is None:
            self.first_failure = failure
            self.log.error("reward function failed %s", failure)
        return reward, valid

    def total_rewards(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The reward trained on: weighted rule reward + weighted reward-model score + overlong penalty."""
        cfg = self.config
        reward = torch.zeros(len(batch), dtype=torch.float32)
        valid = torch.ones(len(batch), dtype=torch.bool)
        if cfg.reward_weight > 0:
            rule, valid = self.rewards(batch, self.train_rows)
            reward += cfg.reward_weight * rule
        if cfg.rm_weight > 0:
            reward += cfg.rm_weight * batch.tensor("rm_score").float()
        if cfg.overlong_max_len is not None:
            lengths = batch.ragged("response").lengths
            reward += filters.overlong_penalty(
                lengths,
                max_len=cfg.overlong_max_len,
                buffer=cfg.overlong_buffer,
                penalty=cfg.overlong_penalty,
            )
        return reward, valid

    def advantages(
        self,
        batch: Batch,
        index: torch.Tensor,
        reward: torch.Tensor,
        groups: torch.Tensor,
        valid: torch.Tensor,
    ) -> dict[str, Any]:
        """Columns `reward`, `advantage`, `valid` (and `returns` for gae) for rows `index` of `batch`."""
        cfg = self.config
        pick = index.tolist()
        lengths = batch.ragged("response").lengths[index]
        mask = (torch.arange(int(lengths.max()) if len(lengths) else 0)[None, :] < lengths[:, None]) & valid[
            :, None
        ]

        def padded(name: str) -> torch.Tensor:
            return Ragged.from_list([batch.ragged(name)[i] for i in pick], dtype=torch.float32).padded()[0]

        penalty = None
        if cfg.kl_in_reward > 0:
            per_token = torch.where(
                mask, kl(padded("logprobs"), padded("ref_logprobs"), cfg.kl_estimator), 0.0
            )
            per_sample = per_token.sum(1)
            penalty = self.kl.coef * per_token
            n = int(valid.sum())
            self.kl_measured = float(per_sample[valid].mean()) if n else 0.0
            self.kl.update(self.kl_measured, n)
        out: dict[str, Any] = {"valid": valid}
        if cfg.advantage == "gae":
            rewards = adv.token_rewards(reward, mask, penalty)
            out["reward"] = reward
            if cfg.values == "trainer":  # its value head: it computes the advantages
                out["token_rewards"] = [rewards[k, : lengths[k]] for k in range(len(pick))]
                return out
            advantage, returns = adv.gae(rewards, padded("values"), mask, gamma=cfg.gamma, lam=cfg.lam)
            if cfg.whiten:
                advantage = adv.whiten(advantage, mask)
            out["advantage"] = [advantage[k, : lengths[k]] for k in range(len(pick))]
            out["returns"] = [returns[k, : lengths[k]] for k in range(len(pick))]
            return out
        if penalty is not None:
            reward = reward - penalty.sum(1)
        out["reward"] = reward
        if cfg.advantage == "grpo":
            out["advantage"] = adv.grpo(reward, groups, valid, scale=cfg.normalize_std)
        elif cfg.advantage == "dr_grpo":
            out["advantage"] = adv.dr_grpo(reward, groups, valid)
        elif cfg.advantage == "rloo":
            out["advantage"] = adv.rloo(reward, groups, valid)
        else:
            out["advantage"] = adv.reinforce_pp(reward, valid)
        return out

    # ---------------------------------------------------------------------------------------------------
    # evaluation

    async def put_eval(self, key: str, version: int) -> None:
        """The held-out prompts for `version`: one greedy and `eval_samples` sampled rows each."""
        prompts: list[torch.Tensor] = []
        meta: list[Meta] = []
        for index, row in enumerate(self.eval_rows):
            tokens = self.encode(row)
            for k in range(1 + self.config.eval_samples):
                prompts.append(tokens)
                meta.append({"eval_version": version, "greedy": k == 0, "prompt_id": index, "member": k,
                             "min_version": version})  # fmt: skip
        await self.client.put(EVAL, {"prompt": prompts}, meta=meta, timeout=3600, key=key)

    async def collect_eval(self) -> None:
        while True:
            batch = await self.client.claim(EVAL, "rollout", ["prompt", "response"], 4096, timeout=WATCH_S)
            if not batch:
                continue
            async with self.pause.work():
                rewards, valid = self.rewards(batch, self.eval_rows)
                ids = batch.ids.tolist()
                for rid, version, greedy, r, ok in zip(
                    ids,
                    batch.meta_of("eval_version"),
                    batch.meta_of("greedy"),
                    rewards.tolist(),
                    valid.tolist(),
                    strict=True,
                ):
                    if rid in self.replay_eval:  # a predecessor counted it
                        continue
                    self.eval_results[version].append((bool(greedy), r if ok else 0.0))
                    self.eval_pending[version] -= 1
                self.handling_eval = set(ids)
                self.replay_eval -= self.handling_eval
                complete = [v for v, left in self.eval_pending.items() if left == 0]
                for version in complete:
                    del self.eval_pending[version]
                    self.record_eval(version, self.eval_results.pop(version))
                self.persist()
                await self.client.delete(EVAL, batch.ids)  # before the ack, as in scoring
                await self.client.ack(batch)
                self.handling_eval = set()
                if complete:
                    self.check_done()

    def record_eval(self, version: int, results: list[tuple[bool, float]]) -> None:
        if version in self.recorded:  # by a predecessor that died before its state said so
            return
        self.recorded.add(version)
        greedy = [r for g, r in results if g]
        sampled = [r for g, r in results if not g]
        row = {
            "version": version,
            "greedy_accuracy": sum(greedy) / max(1, len(greedy)),
            "sampled_accuracy": sum(sampled) / max(1, len(sampled)),
            "prompts": len(greedy),
            "time": time.time(),
        }
        self.log.info("eval at version %d: %s", version, row)
        with open(self.eval_file, "a") as f:
            f.write(json.dumps(row) + "\n")
