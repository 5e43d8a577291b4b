"""The training engine with a supervised objective: next-token negative log-likelihood on the tokens of
a batch's `mask` (`meshrl sft`, meshrl/commands/sft.py).

An RL step and a supervised step differ only in what a micro-batch's log-probabilities are turned into:
here the loss is the mean of -log p(token) over the step's masked tokens (every rank's: the same
token-mean normalisation as the policy loss), so the engine's forwards, micro-batches (rows or packed
tokens), mixed precision, gradient clipping, learning-rate schedule, skipping of a non-finite step and
FSDP over several ranks all apply unchanged. A subclass, not more methods on `FSDPEngine`, so that the
RL engine stays as it is and its module within bounds.
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch

from meshrl.engines.fsdp import FSDPEngine
from meshrl.engines.packing import TrainBatch


class SupervisedEngine(FSDPEngine):
    """`FSDPEngine` (same constructor) that also takes supervised steps. The log-probabilities are
    those of the model itself (temperature 1), whatever `temperature` the engine was built with."""

    def update_supervised(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step minimising the mean NLL of `batch`'s masked tokens (this rank's share of
        the step: collective under FSDP), gradients accumulated over micro-batches. Returns the step's
        `loss` (that mean over every rank), `tokens` (masked tokens, every rank's), `grad_norm`, `lr`,
        `nan_skipped` (1 when a non-finite loss or gradient skipped the step) and timings."""
        t0 = time.perf_counter()
        (g_tokens,) = self.all_sum([float(batch.mask.sum())])
        loss_share = 0.0
        for k, mb, n_chunks in self._collective_micro_batches(batch):
            if hasattr(self.model, "set_requires_gradient_sync"):
                self.model.set_requires_gradient_sync(k == n_chunks - 1)
            loss = self._nll_sum(mb) / max(g_tokens, 1.0)
            # FSDP averages the ranks' gradients; the step's gradient is their sum (see PolicyObjective)
            (loss * self.world).backward()
            loss_share += float(loss.detach())
        (step_loss,) = self.all_sum([loss_share])
        t1 = time.perf_counter()
        step = self._step(loss_finite=math.isfinite(step_loss), empty=g_tokens == 0)
        return {
            "loss": step_loss,
            "tokens": g_tokens,
            **step,
            "time/forward_backward_s": t1 - t0,
            "time/optimizer_s": time.perf_counter() - t1,
        }

    @torch.no_grad()
    def supervised_loss(self, batch: TrainBatch) -> tuple[float, float]:
        """(summed NLL, tokens) of `batch`'s masked tokens over every rank, without a gradient (held-out
        loss: their ratio). Collective under FSDP."""
        total = 0.0
        for _, mb, _ in self._collective_micro_batches(batch):
            total += float(self._nll_sum(mb))
        nll, tokens = self.all_sum([total, float(batch.mask.sum())])
        return nll, tokens

    def _nll_sum(self, mb: TrainBatch) -> torch.Tensor:
        """-sum of log p over the masked positions of micro-batch `mb` (differentiable)."""
        lp, _ = self.forward_logprobs(mb, 1.0)
        return -torch.where(mb.mask.to(self.device), lp, 0.0).sum()

    def _collective_micro_batches(self, batch: TrainBatch) -> list[tuple[int, TrainBatch, int]]:
        """(index, micro-batch, count) of `batch`'s micro-batches, as many on every rank (FSDP's forwards
        are collective): a rank with fewer runs masked copies of its first, which add nothing."""
        micro = self._micro_batches(batch)
        n_chunks = int(self._max([len(micro)]))
        empty = dataclasses.replace(micro[0], mask=micro[0].mask & False)
        return [(k, micro[k] if k < len(micro) else empty, n_chunks) for k in range(n_chunks)]
