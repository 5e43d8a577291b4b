"""The trainer's loader: each rank's next mini-batch, claimed and packed while the current one trains."""

from __future__ import annotations

import json
import queue
import random
import threading
from dataclasses import dataclass

import torch

from meshrl.dataplane import Batch, Client, Ragged
from meshrl.engines.packing import TrainBatch, pack
from meshrl.models import vision
from meshrl.planning.wiring import Claim
from meshrl.roles.trainer.config import TrainerConfig
from meshrl.schema import (
    ADVANTAGE,
    ENV_S,
    GEN_BATCH,
    GEN_S,
    GROUP,
    LOGPROBS,
    LOSS_MASK,
    MEMBER,
    MODEL_TURNS,
    PROMPT,
    QUEUED_S,
    REF_LOGPROBS,
    RESPONSE,
    REWARD,
    SEGMENTS,
    SEQUENCES,
    TOKEN_REWARDS,
    TOOL_CALLS,
    TOOL_ERROR_KINDS,
    TOOL_ERRORS,
    TRUNCATED,
    VALID,
    VERSION,
    teacher_columns,
)

CLAIM_POLL_S = 1.0


@dataclass
class MiniBatch:
    """A claimed mini-batch, ready to train: nothing here is a view into the data plane's rows."""

    batch: Batch  # the claim (or a part of it), to acknowledge once trained
    packed: TrainBatch
    summary: dict[str, torch.Tensor]  # per-row values for the step's metrics
    born: torch.Tensor  # [n] weight version of each row's first token
    part: bool = False  # `batch` is a part of its claim: acknowledge its rows by id


def prepare(batch: Batch, cfg: TrainerConfig) -> MiniBatch:
    """Pack a claimed mini-batch for training and copy what the metrics need (loader thread)."""
    packed = pack(
        batch.ragged(PROMPT),
        batch.ragged(RESPONSE),
        batch.ragged(LOGPROBS),
        batch[TOKEN_REWARDS if cfg.value.head else ADVANTAGE],
        batch.tensor(VALID),
        ref_logprobs=batch.ragged(REF_LOGPROBS) if REF_LOGPROBS in batch else None,
        teachers={
            name: tuple(batch.ragged(c) for c in teacher_columns(name))  # type: ignore[misc]
            for name in (cfg.distill.teachers if cfg.distill.active else ())
        },
        loss_mask=batch.ragged(LOSS_MASK) if LOSS_MASK in batch else None,
        segments=batch.ragged(SEGMENTS) if SEGMENTS in batch else None,
        images=vision.from_batch(batch),
    )
    versions = batch.tensor(VERSION)
    summary = {
        "reward": batch.tensor(REWARD).clone(),
        "advantage": _row_means(batch[ADVANTAGE]) if ADVANTAGE in batch else torch.zeros(len(batch)),
        "valid": batch.tensor(VALID).bool().clone(),
        "length": batch.ragged(RESPONSE).lengths.clone(),
        "gen_s": batch.tensor(GEN_S).clone(),
        "gen_batch": batch.tensor(GEN_BATCH).clone(),
        "continued": versions[:, 1] != versions[:, 0],
        "group": torch.tensor(batch.meta_of(GROUP, -1), dtype=torch.int64),
    }
    turns = batch.meta_of(MODEL_TURNS)
    if any(t is not None for t in turns):  # agents' trajectories
        summary["turns"] = torch.tensor([t or 0 for t in turns], dtype=torch.float64)
        summary["sequences"] = torch.tensor([s or 1 for s in batch.meta_of(SEQUENCES)], dtype=torch.float64)
        summary.update(environment_summary(batch))
    return MiniBatch(batch, packed, summary, versions[:, 0].clone())


def environment_summary(batch: Batch) -> dict[str, torch.Tensor]:
    """What the environment service records of each trajectory (an agent program's sample has none of
    it): truncations by limit, tool calls and errors by kind, seconds in the environment and queued."""
    truncated = batch.meta_of(TRUNCATED)
    out = {
        f"truncated_{limit}": torch.tensor([t == limit for t in truncated]) for limit in ("turns", "tokens")
    }
    if all(c is None for c in batch.meta_of(TOOL_CALLS)):
        return out
    errors = [json.loads(e or "{}") for e in batch.meta_of(TOOL_ERRORS)]
    out["tool_calls"] = torch.tensor([c or 0 for c in batch.meta_of(TOOL_CALLS)], dtype=torch.float64)
    for kind in TOOL_ERROR_KINDS:
        out[f"tool_errors_{kind}"] = torch.tensor([e.get(kind, 0) for e in errors], dtype=torch.float64)
    for key in (ENV_S, QUEUED_S):
        out[key] = torch.tensor([s or 0.0 for s in batch.meta_of(key)], dtype=torch.float64)
    return out


class Loader:
    """A thread that claims this rank's next mini-batch and prepares it while the current one trains, so
    the claim's round trip, the mapping of its segments and the packing stay off the training step.

    It runs one mini-batch ahead (one claim in flight or prepared, one waiting to be taken): together
    with the one training, no more rows are held than a rank needs. Its own data-plane connection:
    a claim waiting for rows must not hold up the trainer's acknowledgements."""

    def __init__(
        self,
        client: Client,
        claim: Claim,
        cfg: TrainerConfig,
        n: int,
        group_size: int,
        split: int = 1,
        seed: int = 0,
    ) -> None:
        """Claims of `n` rows (whole groups of `group_size`) as the trainer's `claim` says (the columns it
        trains on, and the loss mask where an environment writes multi-turn samples), each one mini-batch,
        or with `split` > 1 that many, of rows drawn at random (`mixed`)."""
        self.client = client
        self.cfg = cfg
        self.split, self.seed = split, seed
        self.released: set[int] = set()  # claims given back (a claim in parts is given back once)
        self.stream = client.stream(
            claim.partition, claim.consumer, claim.columns, n, min_n=n, group_size=group_size, prefetch=1,
            poll=CLAIM_POLL_S, lease=3600, skip_empty=False,
        )  # fmt: skip
        self.ready: queue.Queue[MiniBatch] = queue.Queue(maxsize=1)
        self.error: BaseException | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="loader", daemon=True)
        self.thread.start()

    def get(self, timeout: float) -> MiniBatch | None:
        """The next mini-batch, or None if none is ready within `timeout` (raises the loader's failure)."""
        try:
            return self.ready.get(timeout=timeout)
        except queue.Empty:
            if self.error is not None:
                raise RuntimeError("the trainer's loader failed") from self.error
            return None

    def _run(self) -> None:
        try:
            for batch in self.stream:
                if self.stop.is_set():
                    self.client.release(batch)
                    return
                if not batch:
                    continue
                parts = (
                    [batch]
                    if self.split == 1
                    else [batch.select(i) for i in mixed(batch, self.split, self.seed)]
                )
                for part in parts:
                    mini = prepare(part, self.cfg)
                    mini.part = part is not batch
                    if not self._put(mini):  # stopping: the claim's rows not yet trained go back
                        self.released.add(batch.claim)
                        self.client.release(batch)
                        return
        except BaseException as e:
            if not self.stop.is_set():
                self.error = e
        finally:
            self.stream.close()  # hands back the claim in flight, if any

    def _put(self, mini: MiniBatch) -> bool:
        """Hand `mini` to the trainer (waiting while one is there); False if the loader stops first."""
        while not self.stop.is_set():
            try:
                self.ready.put(mini, timeout=0.2)
                return True
            except queue.Full:
                pass
        return False

    def close(self) -> None:
        """Stop claiming; what was claimed ahead and not taken goes back to the pool (a claim whose
        first parts were trained gives back the rest)."""
        self.stop.set()
        self.thread.join()
        while not self.ready.empty():
            batch = self.ready.get_nowait().batch
            if batch.claim not in self.released:
                self.released.add(batch.claim)
                self.client.release(batch)
        self.client.close()


def mixed(batch: Batch, k: int, seed: int) -> list[list[int]]:
    """`k` near-equal parts of `batch`'s rows drawn at random, the same in every run of the same seed:
    the rows are put in (group, member) order first (a claim's order depends on timing), then shuffled
    with a generator seeded by the seed and the first group."""
    groups, members, ids = batch.meta_of(GROUP, -1), batch.meta_of(MEMBER, 0), batch.ids.tolist()
    order = sorted(range(len(batch)), key=lambda i: (groups[i], members[i] or 0, ids[i]))
    random.Random(seed * 1_000_003 + min(groups, default=0)).shuffle(order)
    return [order[j::k] for j in range(k) if order[j::k]]


def _row_means(value: torch.Tensor | Ragged) -> torch.Tensor:
    """One number per row: the value itself, or the mean over the row's tokens for a ragged column."""
    if not isinstance(value, Ragged):
        return value.clone()
    sums = torch.zeros(len(value), dtype=torch.float64).index_add_(
        0, torch.repeat_interleave(torch.arange(len(value)), value.lengths), value.values.double()
    )
    return (sums / value.lengths.clamp_min(1)).float()
