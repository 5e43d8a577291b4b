"""The vLLM inference engine, behind the same interface as the HF one (`meshrl.engines.base`).

Token ids in and out (the engine starts without a tokenizer; completions are never re-tokenised),
per-request seeds, sampled-token logprobs, stop on EOS. Generation drives vLLM's engine step by step,
so `interrupt` can stop every unfinished request between steps (aborted in vLLM, returned with what
they have). Needs the `vllm` extra: `pip install 'meshrl[vllm]'`.

Log-probabilities follow the module convention of `meshrl.engines.base` (log_softmax(logits /
temperature)): vLLM is started with `logprobs_mode="processed_logprobs"`, which is that convention as
long as no top-k / top-p truncation is applied (vLLM would renormalise over the kept tokens; the
inference config refuses the combination).

Weight updates from the trainer go straight into vLLM's workers (`weight_member`,
`meshrl.engines.vllm_worker`): each worker joins the trainer's weight group (NCCL on GPU, gloo on CPU)
or maps its shared memory (one host), and feeds the buckets to vLLM's in-place reload as they arrive;
then the caches of what the old weights computed are dropped (`_forget`: prefixes' KV, and a
vision-language model's image embeddings). Tensors handed to
`load_weights` directly are buffered, then, once every part of a version is in (`set_version`),
written as one safetensors file that the workers reload (`reload_weights(weights_path=...)`).

With `adapters` (a trainer that trains LoRA adapters and publishes them alone, `meshrl.engines.lora`)
vLLM starts with LoRA enabled; each version's adapter matrices come through `load_weights` (a few
megabytes: no worker-side transport) and are written as a PEFT adapter that vLLM loads in place of the
previous one (one adapter id, `load_inplace`), and every request from then on runs with it. The base
weights never change.

On CPU, vLLM's engine core runs inside the inference service's process (VLLM_ENABLE_V1_MULTIPROCESSING=0
unless set otherwise): as its own process it busy-waits on a shared-memory queue for a second after
every message, taking a core from the trainer of a CPU-only machine each step. On GPU vLLM keeps its
own layout (the core's process overlaps scheduling with the device's work).

vLLM's engine client is not thread-safe: generation steps and the weight group's calls (made by the
inference service's receiving thread) take turns under one lock, so a weight update lands between two
steps of generation.
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
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
from meshrl.models import pictures, vision

INSTALL = settings.INSTALL["vllm"]
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts
POLICY_LORA_ID = 1
SHUTDOWN_S = 30.0  # grace for vLLM's processes to exit (and unlink their shared memory) on close


def available() -> bool:
    return settings.installed("vllm")


class VLLMEngine(InferenceEngine):
    def __init__(
        self,
        model_path: str,
        *,
        device: str = "cpu",
        loader_kwargs: dict[str, Any] | None = None,
        max_batch_size: int = 256,
        max_model_len: int | None = None,
        kv_cache_gb: float = 1.0,
        threads: int = 0,
        gpu_memory_fraction: float = 0.9,
        work_dir: str | None = None,
        seed: int = 0,
        adapters: Any = None,
    ) -> None:
        """`adapters`: the trainer's LoRA settings (rank, alpha) when it publishes adapters alone."""
        super().__init__()
        if not available():
            raise ImportError(f"the vLLM engine needs vLLM: {INSTALL}")
        self.facts = ModelFacts.of(model_path)
        # a vision-language model's prompts hold their images' expansions, which vLLM makes itself
        self.placeholders = (
            pictures.Placeholders(vision.load_processor(model_path)) if vision.is_vision(model_path) else None
        )
        self.model_path = model_path
        self.work_dir = Path(work_dir or tempfile.mkdtemp(prefix="meshrl-vllm-"))
        self.work_dir.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("VLLM_CACHE_ROOT", str(self.work_dir / "cache"))
        if device.startswith("cuda"):
            # vLLM's worker takes the first visible device: make it this replica's (the service itself
            # touches no GPU memory: the weights go straight to the worker)
            index = torch.device(device).index or 0
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            os.environ["CUDA_VISIBLE_DEVICES"] = visible.split(",")[index] if visible else str(index)
        else:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(kv_cache_gb))))
            # vLLM's engine core in this process, not its own: a separate core spins a CPU for a second
            # after every message (shared-memory queue), a core the trainer needs on a CPU-only machine
            # (measured: 1.0 CPU-s per 3 s idle after a generation vs 0.06; start-up 37 s vs 11 s)
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            if threads:
                os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
        from vllm import LLM

        if device.startswith("cuda"):
            platform: dict[str, Any] = {"gpu_memory_utilization": gpu_memory_fraction}
        else:
            # Whole prompts only: a prompt cut over two engine steps has its first sampled token thrown
            # away, and vLLM then rewinds the request's generator, which only CUDA generators can do
            # (a seeded request on CPU would fail). Prompts that do not fit a step wait for the next.
            longest = max_model_len or self.facts.max_positions
            platform = {
                "enable_chunked_prefill": False,
                "max_num_batched_tokens": max(longest, 2048, max_batch_size),
            }
        self.adapters = adapters if adapters is not None and adapters.rank > 0 else None
        lora: dict[str, Any] = {}
        if self.adapters is not None:
            if self.adapters.rank > LORA_RANKS[-1]:
                raise ValueError(f"vLLM serves LoRA ranks up to {LORA_RANKS[-1]}, not {self.adapters.rank}")
            rank = next(r for r in LORA_RANKS if r >= self.adapters.rank)
            lora = {"enable_lora": True, "max_lora_rank": rank, "max_loras": 1}
        self.lora_request: Any = None  # the newest adapter, once one has arrived
        self.vocab_size = self.facts.vocab_size
        self.tied = self.facts.tied
        self._eos = self.facts.eos
        self.llm = LLM(
            model=model_path,
            skip_tokenizer_init=self.placeholders
            is None,  # vLLM's image processing needs the processor's tokenizer
            enforce_eager=True,
            dtype=dtype_name(loader_kwargs, "float32"),
            max_model_len=max_model_len,
            max_num_seqs=max_batch_size,
            logprobs_mode="processed_logprobs",
            seed=seed,
            worker_extension_cls="meshrl.engines.vllm_worker.WeightReceiver",
            **platform,
            **lora,
        )
        self.rpc = threading.Lock()  # one caller of vLLM's engine client at a time
        self.engine = self.llm.llm_engine
        self._staged: list[tuple[str, torch.Tensor]] = []
        self._next_id = 0

    # -- weights -----------------------------------------------------------------------------------

    def parameters(self) -> list[tuple[str, tuple[int, ...], str]]:
        return list(self.facts.listing)

    def weight_member(self) -> _Member | None:
        """Adapters come through `load_weights` (small); whole models straight into the workers."""
        return None if self.adapters is not None else _Member(self)

    def _call(self, method: str, *args: Any) -> None:
        with self.rpc:
            self.llm.collective_rpc(method, args=args)

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.adapters is not None:
            named = list(named)
            for name, _ in named:
                if ".lora_A." not in name and ".lora_B." not in name:
                    raise ValueError(f"this engine takes LoRA adapter matrices, not {name!r}")
        else:
            named = self.facts.checked(named)
        for name, tensor in named:
            self._staged.append((name, tensor.detach().to("cpu", copy=True)))

    def set_version(self, version: int) -> None:
        """Apply the weights loaded since the last version, then take the new version number (-1: an
        update cut short, whose parts are dropped)."""
        if version < 0:
            self._staged = []
        if self._staged and self.adapters is not None:
            self._load_adapter()
        if self._staged:
            from safetensors.torch import save_file

            path = self._weights_dir()
            save_file(dict(self._staged), str(path / "model.safetensors"))
            self._staged = []
            with self.rpc:
                self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(path)})
                self.llm.collective_rpc("meshrl_repack_experts")
                if self.tied:
                    self.llm.collective_rpc("meshrl_retie")
                self._forget()
        super().set_version(version)

    def _forget(self) -> None:
        """Drop what the previous weights computed, under `rpc`: cached prefixes' KV, and a vision-language
        model's cached image embeddings (its vision tower may have changed; vLLM would otherwise reuse
        them for a picture it has seen, and after an in-place reload its bookkeeping of them is stale)."""
        self.llm.reset_prefix_cache()
        if self.placeholders is not None:
            self.engine.reset_encoder_cache()

    def _weights_dir(self) -> Path:
        """Where a version's weights are written for the workers to reload: a model folder of its own,
        the model's other files (config, tokenizer, processor) linked in, since vLLM takes the folder
        it reloaded from as the model's from then on (its processor, for a vision-language model, is
        loaded from there)."""
        path = self.work_dir / "weights"
        if not path.exists():
            path.mkdir()
            for f in Path(self.model_path).iterdir():
                if f.is_file() and not f.name.endswith(
                    (".safetensors", ".bin", ".safetensors.index.json", ".pt")
                ):
                    (path / f.name).symlink_to(f.resolve())
        return path

    def _load_adapter(self) -> None:
        """The staged adapter matrices as a PEFT adapter that vLLM loads in place of the previous one."""
        import json

        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        assert self.adapters is not None
        path = self.work_dir / "adapter"
        path.mkdir(exist_ok=True)
        modules = sorted({name.rsplit(".lora_", 1)[0].rsplit(".", 1)[-1] for name, _ in self._staged})
        rank = next(t.shape[0] for name, t in self._staged if ".lora_A." in name)
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": self.adapters.alpha,
                  "target_modules": modules, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
                  "use_rslora": False, "base_model_name_or_path": self.model_path}  # fmt: skip
        save_file(dict(self._staged), str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps(config))
        self._staged = []
        with self.rpc:
            self.engine.add_lora(LoRARequest("policy", POLICY_LORA_ID, str(path), load_inplace=True))
            self._forget()
        self.lora_request = LoRARequest("policy", POLICY_LORA_ID, str(path))

    # -- generation --------------------------------------------------------------------------------

    def _params(self, params: SamplingParams, seed: int | None, max_tokens: int) -> Any:
        from vllm import SamplingParams as VParams

        return VParams(
            n=1,
            temperature=params.temperature,
            top_k=params.top_k if params.top_k > 0 else -1,
            top_p=params.top_p,
            max_tokens=max_tokens,
            stop_token_ids=[*self._eos, *params.stop_token_ids, *self.facts.placeholders],
            ignore_eos=False,
            logprobs=0,
            seed=seed,
            detokenize=False,
            skip_special_tokens=False,
        )

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        *,
        interrupt: Callable[[], bool] | None = None,
        seeds: list[int] | None = None,
        images: list[Any] | None = None,
    ) -> list[Completion]:
        check_token_ids(prompts, self.vocab_size, "prompts")
        requests = self._requests(prompts, images)
        ids: dict[str, int] = {}
        per_request = request_seeds(len(prompts), params.seed, seeds)
        for i, (request, seed) in enumerate(zip(requests, per_request, strict=True)):
            rid = f"r{self._next_id}"
            self._next_id += 1
            ids[rid] = i
            with self.rpc:
                self.engine.add_request(
                    rid,
                    request,
                    self._params(params, seed, params.max_new_tokens),
                    lora_request=self.lora_request,
                )
        out: list[Completion | None] = [None] * len(prompts)
        latest: dict[str, Any] = {}
        while self.engine.has_unfinished_requests():
            if interrupt is not None and interrupt():
                left = [rid for rid in ids if out[ids[rid]] is None]
                with self.rpc:
                    self.engine.abort_request(left)
                for rid in left:
                    out[ids[rid]] = _completion(latest.get(rid), FINISH_INTERRUPTED, self.facts.placeholders)
                break
            with self.rpc:
                results = self.engine.step()
            for result in results:
                latest[result.request_id] = result
                if result.finished and result.request_id in ids:
                    out[ids[result.request_id]] = _completion(result, None, self.facts.placeholders)
        return [c if c is not None else Completion([], [], FINISH_INTERRUPTED) for c in out]

    def _requests(
        self, prompts: list[list[int]], images: list[vision.Images | None] | None
    ) -> list[dict[str, Any]]:
        """vLLM's inputs for `prompts`: the token ids, and a vision-language model's pictures as its
        multimodal data. vLLM runs the model's processor on the pictures, which makes the pixels the
        rows' IMAGES hold, and expands each image's placeholder as the prompt holds it: it is given the
        prompt with the expansions collapsed, and its prompt is then token for token ours (tested)."""
        out: list[dict[str, Any]] = []
        for i, prompt in enumerate(prompts):
            row = images[i] if images is not None else None
            if row is None or not len(row):
                out.append({"prompt_token_ids": list(prompt)})
                continue
            if self.placeholders is None:
                raise ValueError(f"{self.model_path} is a text model: it takes no images")
            if len(row.pictures) != len(row):
                raise ValueError(
                    "the vLLM engine takes a row's pictures (the PICTURES column), not only its pixels"
                )
            compact = self.placeholders.collapse(list(prompt), row.pictures)
            out.append({"prompt_token_ids": compact, "multi_modal_data": {"image": list(row.pictures)}})
        return out

    @torch.inference_mode()
    def score(
        self,
        sequences: list[list[int]],
        prompt_lens: list[int],
        *,
        temperature: float = 1.0,
        images: list[vision.Images | None] | None = None,
    ) -> list[list[float]]:
        from vllm import SamplingParams as VParams

        check_token_ids(sequences, self.vocab_size, "sequences")
        # processed prompt logprobs apply the request's temperature, as generation does
        params = VParams(max_tokens=1, temperature=temperature if temperature > 0 else 1.0,
                         prompt_logprobs=0, detokenize=False)  # fmt: skip
        with self.rpc:
            results = self.llm.generate(
                self._requests(sequences, images), params, use_tqdm=False,
                lora_request=self.lora_request,
            )  # fmt: skip
        out = []
        for seq, start, r in zip(sequences, prompt_lens, results, strict=True):
            lps = r.prompt_logprobs  # position j: logprob of token j given the ones before (None at 0)
            out.append([float(lps[j][seq[j]].logprob) for j in range(start, len(seq))])
        return out

    def eos_token_ids(self) -> list[int]:
        return list(self._eos)

    def close(self) -> None:
        """Stop vLLM's engine-core and worker processes (left to exit hooks, they leak their shared
        memory segments in /dev/shm, and a process that leaves with os._exit would orphan them). vLLM
        kills what has not exited 5 s after its SIGTERM by default, and a killed engine core leaves its
        segment behind: on a slow machine that took longer, hence the longer grace."""
        self.engine.engine_core.shutdown(timeout=SHUTDOWN_S)


class _Member:
    """The engine's workers as the receiving member of the weight group (`meshrl.runtime.weights.Member`)."""

    def __init__(self, engine: VLLMEngine) -> None:
        self.engine = engine

    def join(self, host: str, port: int, epoch: int, rank: int, world_size: int, timeout_s: float) -> None:
        self.engine._call("meshrl_join", host, port, epoch, rank, world_size, timeout_s)

    def receive(self, header: dict[str, Any]) -> None:
        self.engine._call("meshrl_receive", header, self.engine.tied)
        with self.engine.rpc:
            self.engine._forget()

    def barrier(self) -> None:
        self.engine._call("meshrl_barrier")

    def leave(self) -> None:
        self.engine._call("meshrl_leave")


def _completion(result: Any, reason: str | None, placeholders: tuple[int, ...] = ()) -> Completion:
    """`placeholders`: stop tokens left out of the completion (`ModelFacts.placeholders`)."""
    if result is None:
        return Completion([], [], reason or FINISH_INTERRUPTED)
    o = result.outputs[0]
    tokens = list(o.token_ids)
    logprobs = [float(step[t].logprob) for step, t in zip(o.logprobs or [], tokens, strict=False)]
    if reason is None:
        reason = FINISH_STOP if o.finish_reason == "stop" else FINISH_LENGTH
    if reason == FINISH_STOP and tokens and tokens[-1] in placeholders:
        tokens = tokens[:-1]
    return Completion(tokens, logprobs[: len(tokens)], reason)
