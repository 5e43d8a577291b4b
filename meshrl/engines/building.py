"""How the trainer's model is built: loaded in float32 (the master weights), each decoder layer found
(an FSDP unit, and optionally checkpointed), and FSDP2's mixed-precision arguments."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of an HF causal LM (each becomes one FSDP unit)."""
    for attr in ("model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers"):
        obj: Any = model
        for part in attr.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, torch.nn.ModuleList):
            return list(obj)
    return []


def load(model_path: str, head: str, loader_kwargs: dict[str, Any] | None) -> Any:
    """The HF model of `head`, in float32 whatever its checkpoint's dtype (the master weights: updates
    in bf16 round small steps away; a critic's loader_kwargs may still choose), without a KV cache."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    kwargs = {"dtype": torch.float32, **(loader_kwargs or {})}
    if head == "value":
        model = AutoModelForTokenClassification.from_pretrained(model_path, num_labels=1, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, **kwargs)
    model.config.use_cache = False
    return model


def checkpoint_layer(layer: torch.nn.Module) -> None:
    """Activation checkpointing of one decoder layer: its forward runs under torch.utils.checkpoint
    (non-reentrant, so it composes with FSDP2's hooks around the layer, which stay outside). The
    parameter names do not change, unlike with a checkpoint wrapper module. No RNG state is kept:
    the engine trains in eval mode (no dropout), so the recomputation is deterministic anyway."""
    forward = layer.forward
    layer.forward = functools.partial(checkpoint, forward, use_reentrant=False, preserve_rng_state=False)


def mixed_precision(dtype: torch.dtype) -> dict[str, Any]:
    """FSDP2's arguments for computing in `dtype` from float32 shards (gradients reduced in float32)."""
    if dtype == torch.float32:
        return {}
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return {"mp_policy": MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)}
