"""What an engine serving a model in processes of its own (vLLM, SGLang) needs to know about it without
loading it here: vocabulary size, tied embeddings, EOS tokens and the parameter listing, read from the
model directory (the listing from a model built on the meta device: no memory)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

Listing = list[tuple[str, tuple[int, ...], str]]


@dataclass(frozen=True)
class ModelFacts:
    vocab_size: int
    tied: bool
    """The output head is the input embedding (one weight, listed once)."""
    eos: list[int]
    listing: Listing
    """(name, shape, dtype) of every parameter, as the trainer names them (`InferenceEngine.parameters`)."""
    max_positions: int = 0
    """The longest sequence the model takes (its config's max_position_embeddings; 0: not given)."""
    placeholders: tuple[int, ...] = ()
    """A vision-language model's image placeholder token: not text, so a completion that samples it
    ends before it (as the hf engine's do: a forward then finds exactly its prompt's images' tokens)."""

    @classmethod
    def of(cls, model_path: str) -> ModelFacts:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

        if not Path(model_path).is_dir():
            raise FileNotFoundError(f"model path {model_path!r} is not a directory")
        config = AutoConfig.from_pretrained(model_path)
        vision = getattr(config, "vision_config", None) is not None  # as meshrl.models.vision.is_vision
        with torch.device("meta"):
            model = (AutoModelForImageTextToText if vision else AutoModelForCausalLM).from_config(config)
        text = config.get_text_config()
        listing = [
            (n, tuple(p.shape), str(p.dtype).replace("torch.", "")) for n, p in model.named_parameters()
        ]
        return cls(
            vocab_size=int(text.vocab_size),
            tied=bool(getattr(config, "tie_word_embeddings", False)),
            eos=_eos_ids(model_path, config),
            listing=listing,
            max_positions=int(getattr(text, "max_position_embeddings", 0) or 0),
            placeholders=(image,)
            if isinstance(image := getattr(config, "image_token_id", None), int)
            else (),
        )

    def checked(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """`named`, each checked against the listing: ValueError naming an unknown parameter or a shape
        mismatch (`InferenceEngine.load_weights`)."""
        known = {name: shape for name, shape, _ in self.listing}
        for name, tensor in named:
            if name not in known:
                raise ValueError(f"unknown parameter {name!r}")
            if tuple(tensor.shape) != known[name]:
                raise ValueError(f"shape mismatch for parameter {name!r}: got {tuple(tensor.shape)}")
            yield name, tensor


def request_seeds(n: int, seed: int | None, seeds: list[int] | None) -> list[int | None]:
    """A sampler seed per request for engines that seed requests one by one (vLLM, SGLang), inside their
    int64 range: the caller's per-prompt `seeds`, else the batch seed plus the row index, else None."""
    if seeds is not None:
        if len(seeds) != n:
            raise ValueError(f"{len(seeds)} seeds for {n} prompts")
        return [s % 2**63 for s in seeds]
    return [None if seed is None else (seed + i) % 2**63 for i in range(n)]


def _eos_ids(model_path: str, config: Any) -> list[int]:
    """Every EOS id the model declares (config, generation config, tokenizer), in that order."""
    from transformers import AutoTokenizer, GenerationConfig

    found: list[int] = []
    sources: list[Any] = [getattr(config, "eos_token_id", None)]
    with contextlib.suppress(OSError):
        sources.append(GenerationConfig.from_pretrained(model_path).eos_token_id)
    with contextlib.suppress(OSError, ValueError):
        sources.append(AutoTokenizer.from_pretrained(model_path).eos_token_id)
    for s in sources:
        for t in s if isinstance(s, list) else [s]:
            if isinstance(t, int) and t not in found:
                found.append(t)
    return found
