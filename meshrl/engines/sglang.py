"""The SGLang inference engine (GPU only), behind the same interface as the HF and vLLM ones.

SGLang's offline `Engine` runs its scheduler and model in processes of its own; this process holds its
tokenizer manager and event loop. Token ids in and out (the engine starts without a tokenizer),
per-request seeds, sampled-token logprobs, stop on EOS; `interrupt` aborts the unfinished requests,
which come back with what they have. Needs the `sglang` extra: `pip install 'meshrl[sglang]'`.

Log-probabilities: SGLang returns `log_softmax(logits / temperature)` of the sampled tokens, this
package's convention (`meshrl.engines.base`), as long as no top-k / top-p truncation is applied (the
inference config refuses the combination, as for vLLM).

Weight updates: the inference service receives each bucket from the trainer's NCCL group onto its
GPU, and `load_weights` hands the tensors to SGLang's model processes with `update_weights_from_tensor`
(CUDA IPC handles, no copy through the host), one bucket at a time; `set_version` then flushes the
prefix cache (cached prefixes hold KV of the old weights).

Unverified here (no GPU on the machines that built it): everything that needs SGLang running; the
adapter's own logic is tested against a stand-in for SGLang's `Engine` (`tests/unit/test_sglang.py`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

import torch

from meshrl.engines import settings
from meshrl.engines.base import (
    FINISH_INTERRUPTED,
    FINISH_LENGTH,
    FINISH_STOP,
    Completion,
    InferenceEngine,
    SamplingParams,
    check_token_ids,
    dtype_name,
)
from meshrl.engines.served import ModelFacts, request_seeds

INSTALL = settings.INSTALL["sglang"]
POLL_S = 0.005  # how often a generation in progress looks at `interrupt`


def available() -> bool:
    return settings.installed("sglang")


class SGLangEngine(InferenceEngine):
    def __init__(
        self,
        model_path: str,
        *,
        device: str = "cuda",
        loader_kwargs: dict[str, Any] | None = None,
        max_batch_size: int = 256,
        max_model_len: int | None = None,
        mem_fraction: float = 0.8,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if not available():
            raise ImportError(f"the SGLang engine needs SGLang: {INSTALL}")
        dev = torch.device(device)
        if dev.type != "cuda":
            raise ValueError(f"the SGLang engine runs on GPU, not on {device!r}; use the hf or vllm engine")
        self.facts = ModelFacts.of(model_path)
        import sglang

        self.engine = sglang.Engine(
            model_path=model_path,
            skip_tokenizer_init=True,
            dtype=dtype_name(loader_kwargs, "auto"),
            base_gpu_id=dev.index or 0,
            max_running_requests=max_batch_size,
            context_length=max_model_len,
            mem_fraction_static=mem_fraction,
            random_seed=seed,
            log_level="error",
        )
        self._next_id = 0

    # -- weights -----------------------------------------------------------------------------------

    def parameters(self) -> list[tuple[str, tuple[int, ...], str]]:
        return list(self.facts.listing)

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        tensors = list(self.facts.checked(named))
        if tensors:
            _ok(self.engine.update_weights_from_tensor(tensors, flush_cache=False), "weight update")

    def set_version(self, version: int) -> None:
        if version >= 0 and version != self.version:
            _ok(self.engine.flush_cache(), "prefix cache flush")
        super().set_version(version)

    # -- generation --------------------------------------------------------------------------------

    def _sampling(self, params: SamplingParams, seed: int | None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "temperature": params.temperature,
            "top_k": params.top_k if params.top_k > 0 else -1,
            "top_p": params.top_p,
            "max_new_tokens": params.max_new_tokens,
            "stop_token_ids": [*self.facts.eos, *params.stop_token_ids],
            "skip_special_tokens": False,
        }
        if seed is not None:
            out["sampling_seed"] = seed
        return out

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        *,
        interrupt: Callable[[], bool] | None = None,
        seeds: list[int] | None = None,
        images: list[Any] | None = None,
    ) -> list[Completion]:
        if images is not None and any(i is not None for i in images):
            raise ValueError(
                "the SGLang engine does not take images yet: use the hf engine for a vision-language model"
            )
        check_token_ids(prompts, self.facts.vocab_size, "prompts")
        sampling = [self._sampling(params, seed) for seed in request_seeds(len(prompts), params.seed, seeds)]
        rids = [f"meshrl-{self._next_id + i}" for i in range(len(prompts))]
        self._next_id += len(prompts)
        results = self.engine.loop.run_until_complete(self._generate(prompts, sampling, rids, interrupt))
        return [_completion(r) for r in results]

    async def _generate(
        self, prompts: list[list[int]], sampling: list[dict[str, Any]], rids: list[str], interrupt: Any
    ) -> list[dict[str, Any]]:
        task = asyncio.ensure_future(
            self.engine.async_generate(
                input_ids=[list(p) for p in prompts], sampling_params=sampling, return_logprob=True, rid=rids
            )
        )
        while interrupt is not None and not task.done():
            if interrupt():  # the unfinished ones come back with what they have, finish reason "abort"
                for rid in rids:
                    self.engine.tokenizer_manager.abort_request(rid=rid)
                break
            await asyncio.wait([task], timeout=POLL_S)
        results = await task
        return results if isinstance(results, list) else [results]

    @torch.inference_mode()
    def score(
        self, sequences: list[list[int]], prompt_lens: list[int], *, temperature: float = 1.0
    ) -> list[list[float]]:
        check_token_ids(sequences, self.facts.vocab_size, "sequences")
        if temperature not in (0.0, 1.0):
            # SGLang's prompt logprobs are those of the raw logits; scaled ones would need recomputing
            raise NotImplementedError("the SGLang engine scores at temperature 1 (or 0) only")
        results = self.engine.generate(
            input_ids=[list(s) for s in sequences],
            sampling_params={"max_new_tokens": 1, "temperature": 0.0},
            return_logprob=True,
            logprob_start_len=0,
        )
        out = []
        for seq, start, r in zip(sequences, prompt_lens, results, strict=True):
            lps = r["meta_info"]["input_token_logprobs"]  # position j: (logprob of token j, id, _); None at 0
            out.append([float(lps[j][0]) for j in range(start, len(seq))])
        return out

    def eos_token_ids(self) -> list[int]:
        return list(self.facts.eos)

    def close(self) -> None:
        self.engine.shutdown()


def _ok(result: Any, what: str) -> None:
    """SGLang reports a failed weight call in its result ((success, message), or an object with
    `success`) instead of raising."""
    success, message = (result[0], result[1]) if isinstance(result, tuple) else (result, "")
    success = getattr(success, "success", success)
    if success is False:
        raise RuntimeError(f"SGLang {what} failed: {message or result}")


def _completion(result: dict[str, Any]) -> Completion:
    meta = result["meta_info"]
    tokens = [int(t) for t in result["output_ids"]]
    logprobs = [float(lp) for lp, _, *_ in meta.get("output_token_logprobs") or []][: len(tokens)]
    kind = str((meta.get("finish_reason") or {}).get("type"))
    reason = {"stop": FINISH_STOP, "length": FINISH_LENGTH}.get(kind, FINISH_INTERRUPTED)
    return Completion(tokens, logprobs, reason)
