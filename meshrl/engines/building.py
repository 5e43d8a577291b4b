"""How the trainer's model is built: loaded in float32 (the master weights), a value head added, each
decoder layer found (an FSDP unit, and optionally checkpointed), LoRA adapters added, sharded with
FSDP2 and its mixed-precision arguments over several ranks."""

from __future__ import annotations

import functools
import inspect
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from meshrl.algorithms.chunked import head_is_linear
from meshrl.engines import checkpoints
from meshrl.engines.lora import add_adapters
from meshrl.engines.settings import LoraConfig, MemoryConfig
from meshrl.models.vision import VISION_MODULES, is_vision, load_model, vision_tower


@dataclass
class Built:
    model: Any
    model_config: Any
    logits_to_keep: bool
    """The model's forward can compute the logits of its last positions only."""
    linear_head: bool
    """Its logits are a plain projection of the last hidden state (chunked log-probs apply)."""


def build(
    model_path: str,
    head: str,
    loader_kwargs: dict[str, Any] | None,
    memory: MemoryConfig,
    lora: LoraConfig | None,
    compute_dtype: torch.dtype,
    device: torch.device,
    world: int,
    train_vision: bool = False,
) -> Built:
    """The model of `head` ("lm", "value", "lm+value": see FSDPEngine) ready to train on `device`: value
    head, activation checkpointing, LoRA adapters, FSDP over `world` ranks (one rank: not wrapped, FSDP's
    hooks would be pure overhead). A vision-language model's vision tower is frozen (and gets no
    adapters) unless `train_vision`; its connector trains with the language model."""
    if not os.path.exists(model_path):
        raise FileNotFoundError(f"trainer model path {model_path!r} does not exist")
    model = load(model_path, head, loader_kwargs)
    config = model.config
    tower = vision_tower(model)
    if tower is not None and not train_vision:
        tower.requires_grad_(False)
    logits_to_keep = "logits_to_keep" in inspect.signature(type(model).forward).parameters
    if head == "lm+value" or (head == "value" and tower is not None):
        model.value_head = checkpoints.value_head(model, model_path)
    model.to(device)
    linear = head != "value" and logits_to_keep and head_is_linear(model, device)
    if memory.activation_checkpointing:
        for layer in decoder_layers(model):
            checkpoint_layer(layer)
    if lora is not None:
        if head != "lm":
            raise ValueError("LoRA trains a policy (head 'lm')")
        model = add_adapters(
            model,
            lora,
            frozen_dtype=compute_dtype,
            exclude=None if tower is None or train_vision else VISION_MODULES,
        )
    if world > 1:  # FSDP brings DTensor and sympy: imported only where it shards (0.6 s)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (world,))
        shard = functools.partial(fully_shard, mesh=mesh, **mixed_precision(compute_dtype))
        for layer in decoder_layers(model):
            shard(layer)
        if hasattr(model, "value_head"):  # called outside the model's forward: its own unit
            shard(model.value_head)
        shard(model)
    return Built(model, config, logits_to_keep, linear)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of an HF causal LM (each becomes one FSDP unit)."""
    for attr in (
        "model.layers",
        "transformer.h",
        "gpt_neox.layers",
        "model.decoder.layers",
        "model.text_model.layers",
    ):
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
    in bf16 round small steps away; a critic's loader_kwargs may still choose), without a KV cache.
    A vision-language critic is the model itself (transformers has no token classifier of those
    families): `build` adds a linear value head on its last hidden state, as the actor-critic's."""
    from transformers import AutoModelForTokenClassification

    kwargs = {"dtype": torch.float32, **(loader_kwargs or {})}
    if head == "value" and not is_vision(model_path):
        model = AutoModelForTokenClassification.from_pretrained(model_path, num_labels=1, **kwargs)
    else:
        model = load_model(model_path, **kwargs)
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
