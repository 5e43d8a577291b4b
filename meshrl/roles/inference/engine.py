"""The generation engine a recipe's inference group names, and the sampling seed of a row: shared by the
inference service and `meshrl eval`, so that both generate alike; what a batch asks for and has got."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshrl.engines.base import InferenceEngine
from meshrl.roles.inference.config import InferenceConfig


def build_engine(
    cfg: InferenceConfig,
    *,
    device: str,
    seed: int,
    replica: int = 0,
    work_dir: str | None = None,
    model: Any = None,
    adapters: Any = None,
) -> InferenceEngine:
    """The engine `cfg` names, on `device` (`model`: a trainer's live model to generate with, in a
    hybrid ring; `adapters`: the trainer's LoRA settings when it publishes adapters alone, to vLLM)."""
    if cfg.engine == "sim":
        from meshrl.engines.sim import SimInferenceEngine

        return SimInferenceEngine(cfg.sim, seed=seed * 7919 + replica)
    if cfg.engine == "vllm":
        from meshrl.engines.vllm import VLLMEngine

        return VLLMEngine(
            cfg.model, device=device, loader_kwargs=cfg.loader_kwargs, max_batch_size=cfg.max_batch,
            max_model_len=cfg.vllm.max_model_len, kv_cache_gb=cfg.vllm.kv_cache_gb, threads=cfg.threads,
            gpu_memory_fraction=cfg.vllm.gpu_memory_fraction, work_dir=work_dir, seed=seed, adapters=adapters,
        )  # fmt: skip
    if cfg.engine == "sglang":
        from meshrl.engines.sglang import SGLangEngine

        return SGLangEngine(
            cfg.model, device=device, loader_kwargs=cfg.loader_kwargs, max_batch_size=cfg.max_batch,
            max_model_len=cfg.sglang.max_model_len, mem_fraction=cfg.sglang.mem_fraction, seed=seed,
        )  # fmt: skip
    from meshrl.engines.hf import HFEngine

    return HFEngine(
        cfg.model, device=device, loader_kwargs=cfg.loader_kwargs, max_batch_size=cfg.max_batch, model=model
    )


def row_seed(recipe_seed: int, key: tuple[int, int, int], member: int) -> int:
    """The sampling seed of one row: (0, group, turn) for training rows, (1, version, prompt) for
    evaluation rows, (2, seed, 0) or (3, row, 0) for an agent's call (`meshrl eval` samples with the same seeds as the run's evaluation at version 0)."""
    return hash((recipe_seed, *key, member)) % 2**63


@dataclass(frozen=True)
class Want:
    """How a row is to be generated."""

    temperature: float
    top_p: float
    max_tokens: int


@dataclass
class Completions:
    """What a batch has generated so far, per row: tokens, logprobs, first and last weight version."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    first: list[int]
    last: list[int]

    @classmethod
    def empty(cls, n: int) -> Completions:
        return cls([[] for _ in range(n)], [[] for _ in range(n)], [-1] * n, [-1] * n)

    def drop(self, rows: list[int]) -> None:
        for i in rows:
            self.tokens[i], self.logprobs[i], self.first[i], self.last[i] = [], [], -1, -1
