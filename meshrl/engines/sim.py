"""Simulated engines: the real services and data plane, with the model math replaced by sleeps.

They let a benchmark run 16-64 inference replicas on 2 cores and measure what the framework does to a
pipeline: pacing, queues, weight publication, stragglers. Only time is simulated.

- `SimInferenceEngine`: each prompt gets a response length drawn from a lognormal distribution
  (capped at max_new_tokens); a batch is decoded in lock-step, so it takes
  max(length) * `token_s` seconds, the long tail of a real batched engine. Interruptible.
- `SimTrainEngine`: an optimizer step takes `token_s` seconds per trained token.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from meshrl.engines.base import FINISH_INTERRUPTED, FINISH_LENGTH, Completion, InferenceEngine, SamplingParams
from meshrl.engines.settings import SimGeneration, SimTraining

WEIGHTS = (("w", (256,), "float32"),)  # a token model for the weight-publication path


class SimInferenceEngine(InferenceEngine):
    def __init__(self, sim: SimGeneration, *, seed: int = 0, token: int = 5) -> None:
        self.sim = sim
        self.rng = random.Random(seed)
        self.token = token
        self.version = 0

    def lengths(self, n: int, cap: int) -> list[int]:
        mu = math.log(self.sim.median_tokens)
        return [max(1, min(cap, round(self.rng.lognormvariate(mu, self.sim.sigma)))) for _ in range(n)]

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        *,
        interrupt: Callable[[], bool] | None = None,
        seeds: list[int] | None = None,
        images: list[Any] | None = None,
    ) -> list[Completion]:
        lengths = self.lengths(len(prompts), params.max_new_tokens)
        steps = max(lengths, default=0)
        done = steps
        if interrupt is None:
            time.sleep(steps * self.sim.token_s)
        else:
            for step in range(steps):
                time.sleep(self.sim.token_s)
                if interrupt():
                    done = step + 1
                    break
        return [
            Completion(
                tokens=[self.token] * min(n, done),
                logprobs=[-1.0] * min(n, done),
                finish_reason=FINISH_LENGTH if n <= done else FINISH_INTERRUPTED,
            )
            for n in lengths
        ]

    def score(
        self, sequences: list[list[int]], prompt_lens: list[int], *, temperature: float = 1.0
    ) -> list[list[float]]:
        return [[-1.0] * (len(s) - n) for s, n in zip(sequences, prompt_lens, strict=True)]

    def parameters(self) -> list[tuple[str, tuple[int, ...], str]]:
        return list(WEIGHTS)

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        for _ in named:
            pass

    def eos_token_ids(self) -> list[int]:
        return [1]


class SimTrainEngine:
    """Stands in for FSDPEngine in the trainer service."""

    def __init__(self, sim: SimTraining, lr: float = 0.0) -> None:
        self.sim, self.lr = sim, lr
        self.steps = 0
        self.weights = torch.zeros(WEIGHTS[0][1])

    def update_policy(
        self, batch: Any, loss: Any = None, *, epochs: int = 1, **sections: Any
    ) -> dict[str, float]:
        t0 = time.perf_counter()
        time.sleep(float(batch.mask.sum()) * self.sim.token_s * epochs)
        self.steps += epochs
        self.weights += 1
        spent = time.perf_counter() - t0
        zero = dict.fromkeys(
            ("pg_loss", "entropy", "kl_ref", "kl_behaviour", "clip_fraction", "approx_kl"), 0.0
        )
        return {
            **zero,
            "loss": 0.0,
            "ratio_max": 1.0,
            "grad_norm": 0.0,
            "lr": self.lr,
            "nan_skipped": 0.0,
            "time/forward_backward_s": spent,
            "time/optimizer_s": 0.0,
        }

    def offload(self, path: str) -> int:
        return 0

    def restore(self) -> int:
        return 0

    def snapshot(self) -> None:
        pass

    def manifest(self) -> list[tuple[str, tuple[int, ...], str]]:
        return list(WEIGHTS)

    def get_weights(self, bucket_bytes: int = 0) -> Iterator[torch.Tensor]:
        yield self.weights

    def save_pretrained(self, path: str, source: str | None = None) -> None:
        pass
