"""The FSDP engine's model and optimizer on disk: Hugging Face checkpoints, and sharded ones to resume.

A Hugging Face checkpoint is what evaluation, inference and the next run load (`save_pretrained`): the
full state dict is gathered to rank 0 and written through an HF model built on the meta device, so the
files are exactly those `from_pretrained` expects. It is the same kind of model the user started from
(`carry_over`): the source's generation config (several EOS ids, recommended sampling settings) with
the KV cache on, its tokenizer files and chat template as they were, and its other files (custom
code, a README) come along; the model config keeps its fields, with the cache on. The actor-critic's value head is not part of that
model; it goes beside it in VALUE_HEAD_FILE (the policy loads without it) and `value_head` reads it back.

A sharded checkpoint is the trainer's (or critic's) part of a run checkpoint (`meshrl/state/checkpoint.py`
coordinates those): model, optimizer and step count written by torch.distributed.checkpoint, every rank
its own shards, and read back on any number of ranks (`save_sharded`, `load_sharded`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

VALUE_HEAD_FILE = "value_head.safetensors"
"""The actor-critic's value head, saved next to the policy's HF checkpoint (which loads without it)."""


def value_head(model: Any, model_path: str) -> torch.nn.Linear:
    """A linear value head on `model`'s last hidden state, in the model's dtype: saved weights when
    `model_path` has them, else zero."""
    hidden = model.config.get_text_config().hidden_size
    dtype = next(model.parameters()).dtype
    head = torch.nn.Linear(hidden, 1, dtype=dtype)
    saved = os.path.join(model_path, VALUE_HEAD_FILE)
    if os.path.exists(saved):
        from safetensors.torch import load_file

        head.load_state_dict(load_file(saved))
    else:
        torch.nn.init.zeros_(head.weight)
        torch.nn.init.zeros_(head.bias)
    return head


def save_pretrained(
    model: Any, hf_config: Any, path: str, *, critic: bool, rank: int, source: str | None = None
) -> None:
    """`model` (the engine's, sharded or not) as a Hugging Face checkpoint of a causal LM, or with
    `critic` a token classifier (collective; rank 0 writes), carrying over what else `source` (the
    model it was trained from) holds."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if dist.is_initialized():
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    if rank == 0:
        write_pretrained(state, hf_config, path, critic=critic, source=source)


def write_pretrained(
    state: dict[str, Any],
    hf_config: Any,
    path: str,
    *,
    critic: bool = False,
    source: str | None = None,
) -> None:
    """A full state dict as a Hugging Face checkpoint in `path` (see `save_pretrained`)."""
    from safetensors.torch import save_file
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoModelForTokenClassification,
    )

    head: dict[str, Any] = {
        k.removeprefix("value_head."): state.pop(k) for k in list(state) if k.startswith("value_head.")
    }
    vision = getattr(hf_config, "vision_config", None) is not None
    # a vision-language critic is the model with a value head beside it (`building.load`)
    auto = (
        AutoModelForImageTextToText
        if vision
        else AutoModelForTokenClassification
        if critic
        else AutoModelForCausalLM
    )
    with torch.device("meta"):
        shell = auto.from_config(hf_config)
    shell.load_state_dict(state, assign=True, strict=False)  # tied weights may be named once
    shell.tie_weights()
    shell.config.use_cache = True  # the engine turned it off to train; its generation config follows
    if getattr(shell, "generation_config", None) is not None:
        shell.generation_config.use_cache = True
    shell.save_pretrained(path)
    if head:
        save_file({k: v.contiguous() for k, v in head.items()}, os.path.join(path, VALUE_HEAD_FILE))
    if source is not None:
        carry_over(source, path)


WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".index.json")
"""Endings of weight files (and their shard indexes), which a saved checkpoint writes anew."""


def carry_over(source: str, path: str) -> None:
    """Into the checkpoint directory `path` (weights and config written), what it keeps of the model it
    was trained from: every file of `source` that is neither weights nor the model config, as it is
    (tokenizer files, chat template, custom code, a README), and its generation config with the KV
    cache on (several EOS ids, sampling settings). A source without tokenizer files gets its
    tokenizer saved the usual way."""
    from transformers import AutoTokenizer, GenerationConfig

    src, out = Path(source), Path(path)
    if src.is_dir():
        for f in src.iterdir():
            if f.is_file() and f.name != "config.json" and not f.name.endswith(WEIGHTS):
                shutil.copyfile(f, out / f.name)
    if (src / "generation_config.json").exists():
        generation = GenerationConfig.from_pretrained(source)
        generation.use_cache = True
        generation.save_pretrained(path)
    if not (out / "tokenizer_config.json").exists():
        AutoTokenizer.from_pretrained(source).save_pretrained(path)


def save_sharded(model: Any, optimizer: torch.optim.Optimizer, steps: int, path: str) -> None:
    """Model, optimizer and step count into the directory `path`, sharded as trained (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer, options=_trained_only())
    with _single_process_ok():
        dcp.save(
            {"model": model_state, "optim": optim_state, "steps": torch.tensor(steps)}, checkpoint_id=path
        )


def load_sharded(model: Any, optimizer: torch.optim.Optimizer, path: str) -> int:
    """Restore what `save_sharded` wrote into `model` and `optimizer` (collective); returns the steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer, options=_trained_only())
    steps = torch.tensor(0)
    with _single_process_ok():
        dcp.load({"model": model_state, "optim": optim_state, "steps": steps}, checkpoint_id=path)  # in place
    set_state_dict(
        model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state, options=_trained_only()
    )
    return int(steps)


def _trained_only() -> Any:
    """Frozen parameters (a LoRA base) are not part of a run checkpoint: the model they came from has them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=True, strict=False)


@contextlib.contextmanager
def _single_process_ok() -> Iterator[None]:
    """torch.distributed.checkpoint warns when there is no process group; one rank needs none."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
