"""`InferenceEngine` on Hugging Face transformers: works for any causal LM, on any device, with no extra
dependency, so runs and tests need no vLLM/SGLang (and CPU-only machines can do RL rollouts).

The sampling loop is our own rather than `model.generate`, for full control over the RNG and over the
log-probabilities (see `meshrl.engines.base` for the convention): one forward per generated position
for the whole batch (left-padded prompts, explicit position ids, a KV cache), vectorised sampling, and
rows that have stopped are dropped from the batch as they accumulate.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from meshrl.engines.base import (
    FINISH_INTERRUPTED,
    FINISH_LENGTH,
    FINISH_STOP,
    Completion,
    InferenceEngine,
    SamplingParams,
    check_token_ids,
)
from meshrl.engines.decoding import reserve, use_grouped_attention
from meshrl.engines.shared_prompts import distinct, indexable
from meshrl.models.vision import Images, load_model, model_inputs

# Finished rows are removed from the batch (and its KV cache) once they are at least this fraction of it:
# the copy of the cache costs about one decoding step, so doing it on every finished row would not pay.
_COMPACT_FRACTION = 0.25


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """float32 logits divided by the temperature (left as they are for 0 = greedy, and for 1)."""
    logits = logits.float()
    if temperature in (0.0, 1.0):
        return logits
    return logits / temperature


def _token_logprobs(scaled: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log_softmax(scaled)[tokens] along the last dim, without materialising the whole log_softmax."""
    return scaled.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - scaled.logsumexp(-1)


def _sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator, u: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of `logits` [batch, vocab] and its log-probability (the base-module convention)."""
    scaled = _scaled(logits, params.temperature)
    if params.greedy:
        tokens = scaled.argmax(-1)
        return tokens, _token_logprobs(scaled, tokens)
    vocab = scaled.shape[-1]
    top_k = params.top_k if 0 < params.top_k < vocab else 0
    index: torch.Tensor | None = None
    if top_k:
        values, index = scaled.topk(top_k, dim=-1)  # sorted, largest first
    elif params.top_p < 1.0:
        values, index = scaled.sort(dim=-1, descending=True)
    else:
        values = scaled
    probs = values.softmax(-1)
    if params.top_p < 1.0:
        # Drop a token when the ones before it already reach top_p: the most likely one always stays.
        probs = probs.masked_fill(probs.cumsum(-1) - probs > params.top_p, 0.0)
    choice = _draw(probs, generator, u)
    tokens = (choice if index is None else index.gather(-1, choice)).squeeze(-1)
    return tokens, _token_logprobs(scaled, tokens)


def _draw(weights: torch.Tensor, generator: torch.Generator, u: torch.Tensor | None = None) -> torch.Tensor:
    """One index per row, with probability proportional to `weights` (>= 0, not normalised) [batch, n].

    Inverse-CDF sampling, one uniform per row (from `generator`, or given as `u` [batch]): several times
    faster on CPU than torch.multinomial.
    """
    cdf = weights.double().cumsum(-1)
    total = cdf[:, -1:].contiguous()
    if u is None:
        u = torch.rand(total.shape, generator=generator, dtype=cdf.dtype, device=cdf.device)
    u = u.to(cdf).view(total.shape) * total
    # The first index whose cdf exceeds u has a positive weight; the second bound covers u rounding up to
    # the total (it is the last index with a positive weight).
    return torch.minimum(torch.searchsorted(cdf, u, right=True), torch.searchsorted(cdf, total))


_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash on int64 tensors holding values < 2**32 (no product reaches 2**63)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & _M32
    return x ^ (x >> 16)


def _uniform(seeds: torch.Tensor, step: int) -> torch.Tensor:
    """Counter-based uniforms in [0, 1) [n], float64 with 53 random bits: a pure function of each row's
    seed and the step, so a row samples the same tokens whatever batch it is generated in."""
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    h = _mix32(lo ^ _mix32(hi ^ _mix32(torch.full_like(seeds, step & _M32))))
    h2 = _mix32(h ^ 0x9E3779B9)
    return (h.double() * 2.0**21 + (h2 >> 11).double()) / 2.0**53


class HFEngine(InferenceEngine):
    """A transformers causal LM in eval mode, driven by our own batched sampling loop.

    `max_batch_size` bounds the rows of one forward pass (generate and score); larger requests are split
    into chunks (sorted by length, so that rows of similar lengths share a chunk). With a fixed seed the
    samples depend on the chunking, so compare runs with the same `max_batch_size`.
    """

    def __init__(
        self,
        model_path: str,
        *,
        device: str = "cpu",
        loader_kwargs: dict[str, Any] | None = None,
        max_batch_size: int = 256,
        model: Any = None,
    ) -> None:
        """`model`: generate with this already loaded model instead of loading `model_path` (the
        trainer's own, in a hybrid colocation ring: used as it is, in eval mode, gradients untouched)."""
        super().__init__()
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.device = torch.device(device)
        self.model = model.eval() if model is not None else self._load(model_path, loader_kwargs)
        self.max_batch_size = max_batch_size
        self.vocab_size: int = self.model.get_input_embeddings().weight.shape[0]
        pad = getattr(self.model.config, "pad_token_id", None)
        self._pad_id = pad if isinstance(pad, int) and 0 <= pad < self.vocab_size else 0
        self._eos = self._find_eos()
        # rows of a KV cache that is not indexable by row can be neither shared nor dropped mid-batch
        self._indexable = indexable(self.model.config)
        # a vision-language model's image placeholder is not text: a completion that samples it ends
        # before it (every forward of the sequence then finds exactly its prompt's images' tokens)
        image = getattr(self.model.config, "image_token_id", None)
        self._placeholders = [image] if isinstance(image, int) else []
        # Every name, tied aliases included (loading "lm_head.weight" of a tied model writes the shared
        # tensor); the listing names each tensor once, like named_parameters().
        self._by_name = dict(self.model.named_parameters(remove_duplicate=False))
        self._listing = [
            (name, tuple(p.shape), _dtype_name(p.dtype)) for name, p in self.model.named_parameters()
        ]

    def _load(self, model_path: str, loader_kwargs: dict[str, Any] | None) -> Any:
        path = Path(model_path)
        if not path.exists():
            raise FileNotFoundError(f"model path {model_path!r} does not exist")
        if not path.is_dir():
            raise ValueError(f"model path {model_path!r} is not a directory (expected a save_pretrained one)")
        try:
            model = load_model(model_path, **(loader_kwargs or {}))
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"cannot load a language model from {model_path!r}: {e}") from e
        model.to(self.device)
        use_grouped_attention(model)
        return model.eval().requires_grad_(False)

    def _find_eos(self) -> list[int]:
        found: list[int] = []
        for source in (getattr(self.model, "generation_config", None), self.model.config):
            value = getattr(source, "eos_token_id", None)
            if value is None:
                continue
            for token in value if isinstance(value, list | tuple) else [value]:
                if int(token) not in found:
                    found.append(int(token))
        return found

    def eos_token_ids(self) -> list[int]:
        return list(self._eos)

    def parameters(self) -> list[tuple[str, tuple[int, ...], str]]:
        return list(self._listing)

    @torch.no_grad()
    def offload(self, path: str) -> int:
        from meshrl.runtime.offload import HostStore

        self.store = HostStore(path)
        return self.store.offload(self.model.named_parameters(remove_duplicate=False))

    def restore(self) -> int:
        return self.store.restore()

    @property
    def offloaded(self) -> bool:
        return getattr(self, "store", None) is not None and self.store.offloaded

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        offloaded = self.offloaded
        for name, tensor in named:
            param = self._by_name.get(name)
            if param is None:
                raise ValueError(f"unknown parameter {name!r}")
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(
                    f"shape mismatch for parameter {name!r}: got {tuple(tensor.shape)}, "
                    f"expected {tuple(param.shape)}"
                )
            if offloaded:
                self.store.write(name, tensor.to(param.dtype))
            elif tensor.dtype == param.dtype and tensor.device == param.device:
                param.data = tensor  # kept, not copied: a shared-memory version is the replicas' one copy
            else:
                param.copy_(tensor)

    # -- generation --------------------------------------------------------------------------------

    def _chunks(self, order: list[int]) -> Iterable[list[int]]:
        for start in range(0, len(order), self.max_batch_size):
            yield order[start : start + self.max_batch_size]

    @torch.inference_mode()
    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        *,
        interrupt: Callable[[], bool] | None = None,
        seeds: list[int] | None = None,
        images: list[Images | None] | None = None,
    ) -> list[Completion]:
        if not prompts:
            return []
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        if images is not None and len(images) != len(prompts):
            raise ValueError(f"{len(images)} image entries for {len(prompts)} prompts")
        check_token_ids(prompts, self.vocab_size, "prompts")
        generator = torch.Generator(device=self.device)
        if params.seed is None:
            generator.seed()
        else:
            generator.manual_seed(params.seed)
        stop = torch.tensor(
            sorted({*self._eos, *params.stop_token_ids, *self._placeholders}),
            dtype=torch.long,
            device=self.device,
        )
        order = list(range(len(prompts)))
        if len(prompts) > self.max_batch_size:
            order.sort(key=lambda i: len(prompts[i]))
        results: list[Completion | None] = [None] * len(prompts)
        for chunk in self._chunks(order):
            row_seeds = None if seeds is None else [seeds[i] for i in chunk]
            pixels = model_inputs([images[i] for i in chunk], self.device) if images is not None else {}
            done = self._generate_batch(
                [prompts[i] for i in chunk], params, generator, stop, interrupt, row_seeds, pixels
            )
            for i, completion in zip(chunk, done, strict=True):
                results[i] = completion
        return [c for c in results if c is not None]

    def _generate_batch(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        generator: torch.Generator,
        stop: torch.Tensor,
        interrupt: Callable[[], bool] | None = None,
        seeds: list[int] | None = None,
        pixels: dict[str, torch.Tensor] | None = None,
    ) -> list[Completion]:
        """`pixels`: a vision-language model's image inputs of these rows (`vision.model_inputs`), taken
        by the prompts' forward only (the KV cache holds them from then on)."""
        dev, steps = self.device, params.max_new_tokens
        row_seeds = (
            None if seeds is None else torch.tensor([s & (2**63 - 1) for s in seeds], dtype=torch.int64)
        )
        # Left padding: real tokens sit at the right; their positions start at 0 regardless. A prompt
        # that several rows have (a group's) is run once and its cache copied to them (shared_prompts.py).
        unique = distinct(prompts, self._pad_id, dev, share=self._indexable and not pixels)
        cache = DynamicCache(config=self.model.config)
        out = self.model(
            input_ids=unique.ids,
            attention_mask=unique.mask,
            position_ids=unique.positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
            **(pixels or {}),
        )
        logits = out.logits[:, -1][unique.of_row]
        mask, positions = unique.mask[unique.of_row], unique.positions[unique.of_row]
        if len(unique) < len(prompts):
            cache.batch_select_indices(unique.of_row)
        if self._indexable:
            reserve(cache, steps)  # decoding.py: each step's keys and values written in place
        batch = len(prompts)
        tokens_out = torch.full((batch, steps), -1, dtype=torch.long, device=dev)
        logprobs_out = torch.zeros((batch, steps), dtype=torch.float32, device=dev)
        rows = torch.arange(batch, device=dev)  # row of the batch -> row of the output
        next_pos = positions[:, -1] + 1
        finished = torch.zeros(batch, dtype=torch.bool, device=dev)
        produced = steps  # tokens generated per row at most (fewer when interrupted)
        for step in range(steps):
            u = None if row_seeds is None else _uniform(row_seeds[rows.cpu()], step)
            tokens, logprobs = _sample(logits, params, generator, u)
            tokens_out[rows, step] = tokens
            logprobs_out[rows, step] = logprobs
            if step == steps - 1:
                break
            if interrupt is not None and interrupt():
                produced = step + 1
                break
            finished |= torch.isin(tokens, stop)
            n_finished = int(finished.sum())
            if n_finished == len(rows):
                break
            if self._indexable and n_finished >= _COMPACT_FRACTION * len(rows):
                keep = (~finished).nonzero().squeeze(-1)
                cache.batch_select_indices(keep)
                rows, tokens, mask, next_pos = rows[keep], tokens[keep], mask[keep], next_pos[keep]
                finished = finished[keep]
            mask = torch.cat([mask, mask.new_ones(len(rows), 1)], dim=-1)
            out = self.model(
                input_ids=tokens.unsqueeze(-1),
                attention_mask=mask,
                position_ids=next_pos.unsqueeze(-1),
                past_key_values=cache,
                use_cache=True,
            )
            logits = out.logits[:, -1]
            next_pos = next_pos + 1
        # Each row ends at its first stop token; what a finished row sampled after it is discarded.
        tokens_out, logprobs_out = tokens_out[:, :produced], logprobs_out[:, :produced]
        is_stop = torch.isin(tokens_out, stop)
        stopped = is_stop.any(-1)
        lengths = torch.where(stopped, is_stop.int().argmax(-1) + 1, produced)
        if self._placeholders:
            last = tokens_out.gather(1, (lengths - 1).clamp_min(0)[:, None]).squeeze(1)
            lengths -= (stopped & torch.isin(last, torch.tensor(self._placeholders, device=dev))).long()
        unfinished = FINISH_LENGTH if produced == steps else FINISH_INTERRUPTED
        toks, lps = tokens_out.tolist(), logprobs_out.tolist()
        return [
            Completion(
                tokens=toks[i][:n],
                logprobs=lps[i][:n],
                finish_reason=FINISH_STOP if s else unfinished,
            )
            for i, (n, s) in enumerate(zip(lengths.tolist(), stopped.tolist(), strict=True))
        ]

    # -- scoring -----------------------------------------------------------------------------------

    @torch.inference_mode()
    def score(
        self,
        sequences: list[list[int]],
        prompt_lens: list[int],
        *,
        temperature: float = 1.0,
        images: list[Images | None] | None = None,
    ) -> list[list[float]]:
        if len(sequences) != len(prompt_lens):
            raise ValueError(f"{len(sequences)} sequences but {len(prompt_lens)} prompt_lens")
        if not (math.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
        for i, (seq, n) in enumerate(zip(sequences, prompt_lens, strict=True)):
            if not 1 <= n <= len(seq):
                raise ValueError(f"prompt_lens[{i}] = {n} is not in [1, len(sequences[{i}]) = {len(seq)}]")
        check_token_ids(sequences, self.vocab_size, "sequences")
        results: list[list[float]] = [[] for _ in sequences]
        todo = [i for i, seq in enumerate(sequences) if len(seq) > prompt_lens[i]]
        todo.sort(key=lambda i: len(sequences[i]), reverse=True)
        for chunk in self._chunks(todo):
            seqs = [sequences[i] for i in chunk]
            width = len(seqs[0])
            # Logits are needed from the last prompt token of the shortest prompt onwards.
            first = min(prompt_lens[i] for i in chunk) - 1
            input_ids = torch.tensor(
                [s + [self._pad_id] * (width - len(s)) for s in seqs], device=self.device
            )
            mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs], device=self.device)
            pixels = model_inputs([images[i] for i in chunk], self.device) if images is not None else {}
            out = self.model(input_ids=input_ids, attention_mask=mask, logits_to_keep=width - first, **pixels)
            scaled = _scaled(out.logits[:, :-1, :], temperature)  # positions first .. width - 2
            logprobs = _token_logprobs(scaled, input_ids[:, first + 1 :]).tolist()
            for row, i in enumerate(chunk):
                results[i] = logprobs[row][prompt_lens[i] - 1 - first : len(sequences[i]) - 1 - first]
        return results
