"""The inference engine interface, shared by every engine (HF transformers now, vLLM / SGLang later).

The inference service samples completions and their log-probabilities through it, and the trainer
pushes new weights into it, without knowing which engine runs underneath. Only plain Python and torch
types appear here, never an engine's own types.

Log-probability convention (the same for `InferenceEngine.generate` and `InferenceEngine.score`): the
log-probability of token `t` at a position is `log_softmax(logits / temperature)[t]` of the model's raw
logits there (`log_softmax(logits)[t]` when `temperature == 0`, i.e. greedy). It is *not* renormalised
over the tokens that survive top-k / top-p truncation, so a trainer that computes
`log_softmax(logits / temperature)` on the same sequence with the same weights gets the same numbers
(up to floating-point noise), whatever truncation the sampler used.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from meshrl.models.vision import Images
    from meshrl.runtime.weights import Member


def dtype_name(loader_kwargs: dict | None, default: str) -> str:
    """The dtype `loader_kwargs` asks for, under either key from_pretrained accepts (`dtype`, or the
    older `torch_dtype`), spelled as vLLM and SGLang take it ("bfloat16"); `default` when neither is set.
    Engines that do not load through from_pretrained read it here, so `dtype=bfloat16` means the same
    for every engine."""
    kwargs = loader_kwargs or {}
    return str(kwargs.get("dtype", kwargs.get("torch_dtype", default))).removeprefix("torch.")


FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_INTERRUPTED = "interrupted"


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to sample one batch of completions; engines must honour every field."""

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax, no randomness)."""
    top_k: int = 0
    """Sample only among the `top_k` most likely tokens; 0 turns it off."""
    top_p: float = 1.0
    """Nucleus sampling: sample only among the most likely tokens whose probabilities (after temperature
    and top-k) add up to at least `top_p`; 1.0 turns it off."""
    max_new_tokens: int = 16
    """Most tokens generated per prompt, the stop token included."""
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end a completion, besides the model's own EOS tokens; the stop token is kept."""
    seed: int | None = None
    """Seed of the sampler: the same seed, prompts and weights give the same completions on the same engine
    and batch size; None draws a fresh seed every call."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k!r}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens!r}")
        stop = tuple(self.stop_token_ids)
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in stop):
            raise ValueError(f"stop_token_ids must be token ids (ints >= 0), got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", stop)  # a list given by a caller becomes a tuple
        if self.seed is not None and not (0 <= self.seed < 2**64):
            raise ValueError(f"seed must be None or in [0, 2**64), got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Completion:
    """One generated continuation of one prompt."""

    tokens: list[int]
    """Generated tokens, including the stop token when generation stopped on one."""
    logprobs: list[float]
    """One per generated token, under the module's log-probability convention."""
    finish_reason: str
    """"stop" (ended on an EOS or stop token, the last of `tokens`) or "length" (hit max_new_tokens)."""


def check_token_ids(seqs: list[list[int]], vocab_size: int, what: str) -> None:
    """ValueError unless every sequence is non-empty and its ids are in [0, vocab_size)."""
    for i, seq in enumerate(seqs):
        if not seq:
            raise ValueError(f"{what}[{i}] is empty")
        if min(seq) < 0 or max(seq) >= vocab_size:
            raise ValueError(f"{what}[{i}] has a token id outside [0, {vocab_size})")


class InferenceEngine(abc.ABC):
    """Samples and scores token sequences with one model whose weights the trainer replaces over time.

    Token ids in, token ids out: tokenisation happens elsewhere. Calls are not thread-safe; one service
    drives one engine.
    """

    version: int
    """Version of the weights now loaded; 0 for the weights the engine was built with."""

    def __init__(self) -> None:
        self.version = 0

    @abc.abstractmethod
    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        *,
        interrupt: Callable[[], bool] | None = None,
        seeds: list[int] | None = None,
        images: list[Images | None] | None = None,
    ) -> list[Completion]:
        """One completion per prompt, in the order of `prompts`.

        `images` (a vision-language model's; one entry per prompt, None for a prompt without): the pixels
        of the images whose placeholders the prompt's tokens hold, as the model's processor made them
        (meshrl/models/vision.py). An engine that cannot take them raises ValueError saying so.

        `seeds` (one per prompt, like vLLM's per-request seed) make each completion a function of its own
        prompt, seed and the weights, whatever else is in the batch; without them `params.seed` seeds the
        batch as a whole.

        Each completion ends at the first EOS or `params.stop_token_ids` token (kept, finish_reason
        "stop") or after `params.max_new_tokens` tokens (finish_reason "length"). `logprobs[j]` is the
        log-probability of `tokens[j]` under the module's convention with `params.temperature`. Prompts
        must be non-empty. When `interrupt()` turns true (checked after every generated token), the
        unfinished completions are returned as they are, with finish_reason "interrupted", so the caller
        can apply new weights and continue them.
        """

    @abc.abstractmethod
    def score(
        self, sequences: list[list[int]], prompt_lens: list[int], *, temperature: float = 1.0
    ) -> list[list[float]]:
        """Teacher-forced log-probabilities of `sequences[i][prompt_lens[i]:]` under the current weights.

        Result `i` has `len(sequences[i]) - prompt_lens[i]` entries, under the module's convention with
        `temperature` (0 = plain `log_softmax(logits)`). `1 <= prompt_lens[i] <= len(sequences[i])`.
        """

    @abc.abstractmethod
    def parameters(self) -> list[tuple[str, tuple[int, ...], str]]:
        """(name, shape, dtype name such as "float32") of every parameter, in a stable order.

        Names are those of the Hugging Face model's `named_parameters()` (tied weights listed once), so a
        trainer holding the same HF model can send its tensors by name.
        """

    def weight_member(self) -> Member | None:
        """Engines whose model lives in worker processes of their own (vLLM) return the member that lets
        those workers receive each weight version straight from the trainer (`meshrl.runtime.weights.Member`);
        the others return None and get the tensors through `load_weights`."""
        return None

    def close(self) -> None:  # noqa: B027 (optional hook: most engines hold nothing outside)
        """Release what the engine holds outside this process (vLLM's worker processes, ...)."""

    def offload(self, path: str) -> int:
        """Release the weights (and any cache) from device and resident memory, keeping them in the file
        `path`; `load_weights` still works meanwhile (it updates the file). Returns bytes released.
        Engines without anything to release return 0."""
        return 0

    def restore(self) -> int:
        """Bring the weights back (the newest loaded ones). Returns bytes restored."""
        return 0

    @abc.abstractmethod
    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load each tensor into the parameter of that name (converting dtype and device). An engine may
        keep a tensor of the parameter's dtype and device as the parameter (the HF engine does): the
        caller hands it over and does not write it again (the weight group's tensors are such).

        May be called several times with parts of the model; it does not change `version` (call
        `set_version` once every part has arrived). An unknown name or a shape mismatch raises ValueError
        naming it; tensors before the bad one are already copied.
        """

    def set_version(self, version: int) -> None:
        """Record which weight version is now loaded; -1: none (a re-joined replica before its first
        update, or an update cut short), so no row is served until a version arrives."""
        if version < -1:
            raise ValueError(f"version must be >= -1, got {version}")
        self.version = version

    @abc.abstractmethod
    def eos_token_ids(self) -> list[int]:
        """The model's own end-of-sequence tokens (always stop generation)."""
