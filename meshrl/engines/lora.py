"""LoRA adapters on the policy (PEFT): the trainer learns low-rank updates, inference gets them merged in
or, where its engine applies adapters itself, the adapters alone.

Only the adapters are trainable, so the optimizer state and the gradients are those of a few million
parameters, and the frozen base needs no float32 master copy: under mixed precision it is kept in the
compute dtype. What is published is the base with each adapter's update merged in
(`merged_parameters`, under the plain model's parameter names: any engine loads it), or, when every
inference group the trainer feeds runs vLLM (the planner says so: `Weights.adapters`), only the adapter
matrices (`adapter_parameters`, named as PEFT saves them), which vLLM loads as a LoRA adapter: a
publication moves megabytes instead of the whole model.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch

ADAPTER = "default"


def add_adapters(model: Any, lora: Any, frozen_dtype: torch.dtype, exclude: str | None = None) -> Any:
    """`model` with LoRA adapters (`lora`: rank, alpha, target_modules, dropout) on the target modules
    (but none whose name matches the regex `exclude`), only they trainable (float32), the rest frozen in
    `frozen_dtype`."""
    from peft import LoraConfig, get_peft_model

    targets = "all-linear" if tuple(lora.target_modules) == ("all-linear",) else list(lora.target_modules)
    config = LoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, target_modules=targets, lora_dropout=lora.dropout, bias="none",
        exclude_modules=exclude,
    )  # fmt: skip
    peft_model = get_peft_model(model, config, adapter_name=ADAPTER)
    for p in peft_model.parameters():
        p.data = p.data.float() if p.requires_grad else p.data.to(frozen_dtype)
    return peft_model


def train_dropout(model: Any) -> None:
    """The adapters' dropout on (the engine runs the model in eval mode: no other dropout in RL). With
    lora.dropout > 0 the trainer's log-probs are then noisy copies of those inference sampled with."""
    for name, module in model.named_modules():
        if ".lora_dropout." in f"{name}.":
            module.train()


def adapter_parameters(model: Any) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of each adapter matrix, named as PEFT saves an adapter
    (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`); sharded like its layer."""
    return [(n.replace(f".{ADAPTER}.", "."), p) for n, p in model.named_parameters() if ".lora_" in n]


@torch.no_grad()
def merged_parameters(model: Any) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of each parameter of the plain model, with the adapters' updates merged in.
    Sharded over the trainer's ranks (FSDP2) the tensors are sharded as the base's (the product of
    the adapter's two shards is formed by DTensor, a collective: every rank calls this)."""
    return list(_merged(model))


def _merged(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    base = model.get_base_model()
    for name, p in base.named_parameters():
        if ".lora_" in name:
            continue
        if ".base_layer." in name:
            delta = _delta(base.get_submodule(name.partition(".base_layer.")[0]), name.rpartition(".")[2])
            if delta is not None:
                p = (p.float() + delta.float()).to(p.dtype)
            name = name.replace(".base_layer", "")
        yield name, p


def _delta(layer: Any, leaf: str) -> torch.Tensor | None:
    """The adapter's update of the parameter `leaf` of the module under the LoRA layer `layer`: a linear
    layer's weight, or a parameter PEFT adapts by name (a mixture of experts' stacked experts and its
    router: one wrapper per parameter, nested, each naming its own); None for one without (a bias)."""
    while hasattr(layer, "base_layer"):
        if getattr(layer, "parameter_name", "weight") == leaf and ADAPTER in layer.lora_A:
            return layer.get_delta_weight(ADAPTER)
        layer = layer.base_layer
    return None


def save_adapter(model: Any, lora: Any, hf_config: Any, path: str, *, source: str | None, world: int) -> None:
    """The final save of a LoRA run: the adapter (PEFT's files, naming `source` as their base), and with
    `lora.save_merged` the merged model in `path`/merged. Collective over the ranks (the shards are
    gathered); rank 0 writes."""
    import torch.distributed as dist

    from meshrl.engines import checkpoints
    from meshrl.engines.gather import full_tensors

    full = None
    if world > 1:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    merged = None
    if lora.save_merged:
        named = merged_parameters(model)
        tensors = full_tensors([t for _, t in named], world, 64 << 20)
        merged = {n: t.detach().cpu() for (n, _), t in zip(named, tensors, strict=True)}
    if (dist.get_rank() if dist.is_initialized() else 0) != 0:
        return
    model.peft_config[ADAPTER].base_model_name_or_path = source
    model.save_pretrained(path, state_dict=full)
    if source is not None:
        checkpoints.carry_over(source, path)
    if merged is not None:
        checkpoints.write_pretrained(merged, hf_config, os.path.join(path, "merged"), source=source)
