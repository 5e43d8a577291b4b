"""The rollout service: the loop that wires rollout's jobs over one asyncio data-plane client.

- feed (`feed.py`): prompts into `samples`, paced by the gate rows counted here;
- scoring (`scoring.py`): rewards and advantages of completed groups, dynamic sampling, failure limits;
- evaluation (`evaluation.py`): held-out prompts at chosen versions, accuracy into eval.jsonl;
- gates (here): the trainer's gate rows (this replica's own consumer name), counted once each; they
  open the feed's window, start evaluations, and the final one ends the run once its evaluation is in;
- checkpoints (meshrl/state/checkpoint.py): paused between pieces of work, the state saved.
All of rollout's state is one `RolloutState` (`state.py`).

Re-joining: a rollout process restarted on its own (an on-failure policy) continues where its
predecessor stopped, while the others run on. Before each change takes effect in the data plane, the
service writes its whole state to `<run_dir>/rejoin/<process>.<launch>.{0,1}.json`, with the puts in
flight (under idempotency keys, so the successor repeats them safely) and the groups and evaluation
rows being handled (counted already: when their rows come back, the rows the predecessor had claimed,
they are finished without being counted twice).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

from meshrl.dataplane import AsyncClient
from meshrl.models import vision
from meshrl.observe.metrics import JsonlSink
from meshrl.roles.rollout import reward_functions
from meshrl.roles.rollout.config import RolloutConfig
from meshrl.roles.rollout.data import Prompt, check_lengths, encode, load_rows
from meshrl.roles.rollout.evaluation import Evaluation
from meshrl.roles.rollout.feed import Feed, Group, feed_seed
from meshrl.roles.rollout.scoring import Rewards, Scoring
from meshrl.roles.rollout.state import RolloutState
from meshrl.runtime.service import WATCH_S, Service
from meshrl.schema import FINAL, SAMPLES, VERSION
from meshrl.state import checkpoint as ckpt
from meshrl.state.statefile import StateFile


class RolloutService(Service):
    def setup(self) -> None:
        from transformers import AutoTokenizer

        cfg, ctx = self.config, self.ctx
        tokenizer = AutoTokenizer.from_pretrained(cfg.model)
        # a vision-language model's prompts go through its processor, which also makes their pixels
        processor = vision.load_processor(cfg.model) if vision.is_vision(cfg.model) else None
        no_images = None if processor is None else vision.blank(processor)
        bad: list[str] = []
        train_rows, eval_rows = load_rows(cfg, bad)
        if bad:
            self.log.warning("%d dataset rows skipped; the first: %s", len(bad), "; ".join(bad[:5]))
        ctx.health.info["bad_rows"] = len(bad)
        if "env" in cfg.rewards and eval_rows:  # an agent's: played whole by `meshrl eval`, not here
            self.log.info("held-out rows of an agent are evaluated by `meshrl eval`, not in the run")
            eval_rows = []

        self.statefile = StateFile(ctx.run_dir / "rejoin" / f"{ctx.name}.{ctx.launch}")
        predecessor = self.statefile.read()
        if predecessor is not None:
            self.state = RolloutState.from_json(predecessor)
        else:
            for old in (ctx.run_dir / "rejoin").glob(f"{ctx.name}.*.json"):  # earlier launches'
                old.unlink()
            self.state = self.load(ctx.resume) if ctx.resume is not None else self.fresh()

        def encoded(row: dict[str, Any], index: int | None = None) -> Prompt:
            where = "" if index is None else f"{cfg.dataset}: row {row.get('_line', index)}"
            return encode(processor or tokenizer, cfg, row, where)

        unusable = check_lengths(train_rows, encoded, cfg.max_prompt_len)
        if unusable:
            self.log.warning("%d of the first prompts cannot be encoded and will be skipped; the first: %s",
                             len(unusable), "; ".join(unusable[:5]))  # fmt: skip
        eval_rows, eval_prompts = self.encodable(eval_rows, encoded)
        workers = reward_functions.Workers(cfg.reward_threads, cfg.reward_timeout_s)
        self.rewards = rewards = Rewards(
            tokenizer, reward_functions.load(cfg.functions), cfg.prompt_field, workers
        )
        wiring = ctx.wiring
        self.feed = Feed(
            cfg, ctx.run, self.state, train_rows, encoded, seed=feed_seed(ctx.run.seed, ctx.replica.index),
            name=ctx.name, partition=wiring.partition("feed"),
            no_images=no_images if wiring.partition("feed") == SAMPLES else None,  # agents render their own
        )  # fmt: skip
        self.scoring = Scoring(
            cfg, ctx.run, self.state, rewards, train_rows, wiring.claim("score"),
            on_refill=self.feed.changed.set,
            sink=self.sink("rewards.jsonl", predecessor), until_gated=self.until_gated,
        )  # fmt: skip
        self.evaluation = Evaluation(
            cfg,
            self.state,
            eval_rows,
            eval_prompts,
            rewards,
            self.sink("eval.jsonl", predecessor),
            wiring.claim("evaluate"),
            no_images,
        )
        if predecessor is not None:
            self.evaluation.read_recorded()
            st = self.state
            self.log.info(
                "re-joined the run: %d samples started, %d scored, %d gates, %d puts to repeat",
                st.started, st.scored, st.gates, len(st.pending),
            )  # fmt: skip

    def encodable(
        self, rows: list[dict[str, Any]], encoded: Callable[[dict[str, Any], int], Prompt]
    ) -> tuple[list[dict[str, Any]], list[Prompt]]:
        """The held-out rows whose prompts encode, and their prompts (encoded once: every evaluation puts
        them all); the others are left out of the evaluation, with the reason."""
        keep, prompts = [], []
        for i, row in enumerate(rows):
            try:
                prompts.append(encoded(row, i))
                keep.append(row)
            except ValueError as e:
                self.log.warning("held-out row left out of the evaluation: %s", e)
        return keep, prompts

    def fresh(self) -> RolloutState:
        return RolloutState(group_seq=self.ctx.replica.index * 10**12, kl_coef=self.config.kl_penalty.coef)

    def sink(self, name: str, predecessor: object) -> JsonlSink:
        """eval.jsonl / rewards.jsonl: replica 0 starts it afresh; a re-joining process appends to what
        its predecessor wrote. A resumed run cuts eval.jsonl back to the checkpoint it resumes from
        (rewards.jsonl is appended to: its rows are counted by samples scored)."""
        keep: int | None = None
        if self.ctx.replica.index == 0 and predecessor is None:
            keep = 0 if self.ctx.resume is None else (self.state.eval_lines if name == "eval.jsonl" else None)
        return JsonlSink(self.ctx.run_dir / name, keep=keep)

    def load(self, checkpoint: Path) -> RolloutState:
        """The state saved in `checkpoint` (eval.jsonl is cut back to what it held then: `eval_sink`)."""
        path = checkpoint / f"{self.ctx.name}.json"
        state = RolloutState.from_json(ckpt.load_json(path))
        self.log.info("resumed from %s: %d samples started, %d scored", path, state.started, state.scored)
        return state

    def save(self, directory: Path) -> None:
        """Checkpoint: everything needed to continue exactly here (called paused, between pieces of work)."""
        self.state.eval_lines = self.evaluation.lines()
        ckpt.save_json(directory / f"{self.ctx.name}.json", self.state.to_json())

    def persist(self) -> None:
        """Write the state, ahead of the data-plane effect about to happen (see meshrl/state/statefile.py)."""
        self.statefile.write(self.state.to_json())

    @property
    def config(self) -> RolloutConfig:
        cfg = self.ctx.config
        assert isinstance(cfg, RolloutConfig)
        return cfg

    # ---------------------------------------------------------------------------------------------------

    def run(self) -> None:
        asyncio.run(self.serve())

    async def serve(self) -> None:
        self.client = client = await AsyncClient.connect(
            self.ctx.controller, secret=self.ctx.secret, name=self.ctx.name
        )
        self.done = asyncio.Event()
        self.pause = pause = ckpt.Pause()
        run_over = asyncio.create_task(self.watch_run(client))
        all_done = asyncio.create_task(self.done.wait())
        self.progress = asyncio.Event()  # a gate counted, or an evaluation complete
        tasks: set[asyncio.Task[None]] = set()
        try:
            for key in list(self.state.pending):  # a predecessor's puts that may not have happened, first
                await self.put_pending(key)
            jobs = (
                self.watch_gates(),
                self.feed.run(client, pause, self.persist),
                self.scoring.run(client, pause, self.persist, after=self.scored),
                self.evaluation.run(client, pause, self.persist, after=self.evaluated),
                ckpt.take_part(client, self.ctx.name, pause, self.save),
            )
            tasks = {asyncio.create_task(job) for job in jobs}
            while not (run_over.done() or all_done.done()):
                finished, _ = await asyncio.wait([*tasks, run_over, all_done], return_when="FIRST_COMPLETED")
                for t in finished & tasks:
                    t.result()  # re-raise a failure; a task that simply ended leaves the set
                    tasks.discard(t)
            if run_over.done():
                run_over.result()  # ended by someone else, or failed elsewhere
            else:
                self.finish_run()
                self.statefile.remove()
        finally:
            for t in [*tasks, run_over, all_done]:
                t.cancel()
            await asyncio.gather(*tasks, run_over, all_done, return_exceptions=True)
            await client.close()

    async def put_pending(self, key: str) -> None:
        """Make the put recorded under `key` (again: the data plane applies a key once), then forget it."""
        what = self.state.pending[key]
        if what["kind"] == "feed":
            groups: list[Group] = [tuple(g) for g in what["groups"]]
            await self.feed.put(self.client, key, groups)
        else:
            await self.evaluation.put(self.client, key, int(what["version"]))
        del self.state.pending[key]

    def report(self) -> None:
        """Its phase: the evaluation under way, else how far scoring is."""
        st = self.state
        if st.eval_pending:
            version = min(st.eval_pending)
            expected = len(self.evaluation.rows) * (1 + self.config.eval_samples)
            self.phase(
                f"evaluating version {version}: {expected - st.eval_pending[version]}/{expected} rows back"
            )
        else:
            self.phase(f"{st.scored}/{self.feed.total} samples scored, {st.gates} versions seen")

    def scored(self) -> None:
        st = self.state
        self.report()
        self.check_done()
        self.ctx.health.info.update(
            scored=st.scored, failed=st.failed, skipped=st.skipped, filtered=st.filtered
        )

    def evaluated(self) -> None:
        self.progress.set()
        self.report()
        self.check_done()

    def check_done(self) -> None:
        """The run is over for rollout once the final version is in and its evaluation recorded."""
        st = self.state
        if st.final_version is not None and not st.eval_pending and st.scored >= self.feed.total:
            self.done.set()

    async def watch_gates(self) -> None:
        """Count each gate row once: it opens the feed's window, may start an evaluation, and the final
        one ends the run once its evaluation is in."""
        gates, st = self.ctx.wiring.claim("gates"), self.state
        consumer = gates.consumer_of(self.ctx.replica.name)
        while True:
            batch = await self.client.claim(
                gates.partition, consumer, list(gates.columns), 64, timeout=WATCH_S
            )
            if not batch:
                continue
            async with self.pause.work():
                for version, meta in zip(batch.tensor(VERSION).tolist(), batch.meta or [], strict=False):
                    if version <= st.last_gate:  # counted by a predecessor that died before its ack
                        continue
                    await self.gate(int(version), bool(meta and meta.get(FINAL)))
                self.ctx.health.info.update(
                    gates=st.gates, started=st.started, scored=st.scored, failed=st.failed
                )
                await self.client.ack(batch)
                self.feed.changed.set()
            self.report()
            self.progress.set()

    async def until_gated(self, version: int) -> None:
        """Until the gate of `version` is counted and the evaluation rows of it and of earlier versions
        are put. Scoring what was generated with `version` lets the trainer publish the next one: by
        then inference has claimed that version's evaluation rows, which it generates in one call with
        the weights they measure (new weights wait for the call), while the trainer trains."""
        st = self.state

        def putting() -> bool:
            return any(w["kind"] == "eval" and int(w["version"]) <= version for w in st.pending.values())

        while st.last_gate < version or putting():
            self.progress.clear()
            await self.progress.wait()

    async def gate(self, version: int, final: bool) -> None:
        st = self.state
        st.gates += 1
        st.last_gate = version
        key = None
        if self.evaluation.due(version, final):
            self.evaluation.start(version)
            key = f"{self.ctx.name}/eval/{version}"
            st.pending[key] = {"kind": "eval", "version": version}
        if final:
            st.final_version = version
        self.persist()
        if key is not None:
            await self.put_pending(key)
            self.progress.set()
        if final:
            self.check_done()

    def close(self) -> None:
        if hasattr(self, "rewards"):
            self.rewards.close()
        super().close()
