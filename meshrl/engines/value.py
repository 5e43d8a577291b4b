"""The training engine with a value objective: the critic service's (PPO with a separate critic).

A subclass, as `SupervisedEngine` is, so that the policy's engine stays as it is and its module within
bounds: the value model is `FSDPEngine` with `head="value"`, and its step is the clipped value loss of
`objective.value_terms` over micro-batches, summed over the ranks like the policy loss.
"""

from __future__ import annotations

import math
import time

import torch

from meshrl.engines.fsdp import FSDPEngine
from meshrl.engines.objective import value_terms
from meshrl.engines.packing import TrainBatch
from meshrl.observe.metrics import merged


class ValueEngine(FSDPEngine):
    """`FSDPEngine` (same constructor; `head="value"`) that also takes value steps."""

    def update_value(
        self, batch: TrainBatch, *, clip: float | None = 0.2, epochs: int = 1
    ) -> dict[str, float]:
        """`epochs` optimizer steps of the value loss, clipped at `clip` around the values its advantages
        were computed with (None: plain squared error), on `batch`, which carries those values and the
        returns."""
        assert batch.values is not None and batch.returns is not None, "update_value needs values, returns"
        order = torch.argsort(batch.attention_mask.sum(1), descending=True)
        chunks = list(order.split(self.memory.micro_batch))
        results = []
        for _ in range(epochs):
            t0 = time.perf_counter()
            (g_tokens,) = self.all_sum([float(batch.mask.sum())])
            n_chunks = int(self._max([len(chunks)]))
            sums = {"value_loss": 0.0, "value_clip_fraction": 0.0, "values_mean": 0.0}
            for k in range(n_chunks):
                if hasattr(self.model, "set_requires_gradient_sync"):
                    self.model.set_requires_gradient_sync(k == n_chunks - 1)
                mb = batch.rows(chunks[k] if k < len(chunks) else chunks[0][:1])
                mask = mb.mask.to(self.device) & (k < len(chunks))
                loss, shares = value_terms(self.forward_values(mb), mb, mask, clip, g_tokens)
                (loss * self.world).backward()  # summed over the ranks, as the policy's (PolicyObjective)
                for key, share in shares.items():
                    sums[key] += share
            reduced = dict(zip(sums, self.all_sum(list(sums.values())), strict=True))
            t1 = time.perf_counter()
            step = self._step(loss_finite=math.isfinite(reduced["value_loss"]), empty=g_tokens == 0)
            results.append({**reduced, **step, "time/forward_backward_s": t1 - t0})
            results[-1]["time/optimizer_s"] = time.perf_counter() - t1
        return merged(results)
