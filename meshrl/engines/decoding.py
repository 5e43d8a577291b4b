"""What the HF engine's decode loop does to stop copying its KV cache at every step, on CPU.

Two copies grew with the cache and took a tenth to a quarter of SmolLM2-135M's generation time on two
cores (8 prompts x 4 samples, 64 new tokens: 12.5 -> 9.0 s in separate runs, 12.4 -> 11.2 s interleaved
in one process on a busier hour; the same tokens and logprobs):

- transformers' dynamic cache appends a step's keys and values with `torch.cat`, copying every layer's
  whole cache at every step; `Reserved` keeps them in buffers with room for the completion, written in
  place.
- transformers' SDPA attention repeats grouped key/value heads to every query head (a copy of the whole
  cache, at every layer) whenever a mask is given, which left padding always needs: it passes grouped
  heads to SDPA as they are only where it trusts the kernel with a mask, and on CPU it does not. PyTorch's
  CPU kernel takes both; `GROUPED` is SDPA with the heads passed as they are (`use_grouped_attention`).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

GROUPED = "meshrl_sdpa"
"""The attention implementation's name (transformers' AttentionInterface) of `grouped_sdpa`."""


class Reserved(DynamicLayer):
    """A full-attention layer's keys and values [batch, heads, positions, dim] in buffers with room for
    `room` more positions, each step's written in place (writing past the room fails)."""

    def __init__(self, layer: DynamicLayer, room: int) -> None:
        super().__init__()
        keys, values = layer.keys, layer.values
        assert keys is not None and values is not None, "reserve a filled cache"
        self._n = keys.shape[-2]
        self._keys = keys.new_empty(*keys.shape[:-2], self._n + room, keys.shape[-1])
        self._values = values.new_empty(*values.shape[:-2], self._n + room, values.shape[-1])
        self._keys[..., : self._n, :] = keys
        self._values[..., : self._n, :] = values
        self._views()
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True

    def _views(self) -> None:
        self.keys, self.values = self._keys[..., : self._n, :], self._values[..., : self._n, :]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n, end = self._n, self._n + key_states.shape[-2]
        if end > self._keys.shape[-2]:
            raise ValueError(f"a reserved KV cache layer of {self._keys.shape[-2]} positions given {end}")
        self._keys[..., n:end, :] = key_states
        self._values[..., n:end, :] = value_states
        self._n = end
        keys, values = self._keys[..., :end, :], self._values[..., :end, :]
        self.keys, self.values = keys, values
        return keys, values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._keys, self._values = self._keys[indices], self._values[indices]
        self._views()


def reserve(cache: DynamicCache, room: int) -> None:
    """Give each full-attention layer of a filled `cache` room for `room` more positions (sliding-window
    and other layers stay as they are)."""
    cache.layers = [
        Reserved(layer, room) if type(layer) is DynamicLayer and layer.is_initialized else layer
        for layer in cache.layers
    ]


def grouped_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention with key/value heads passed grouped (`enable_gqa`) whatever the mask.
    Anything this does not cover (a position bias, a paged cache, attention weights asked for) goes to
    transformers' own."""
    if any(kwargs.get(k) is not None for k in ("position_bias", "cache")) or kwargs.get("output_attentions"):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs
        )
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    out = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=bool(causal and query.shape[2] > 1 and attention_mask is None),
        enable_gqa=key.shape[1] != query.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


def use_grouped_attention(model: Any) -> None:
    """Switch a CPU causal LM on transformers' SDPA to `grouped_sdpa` (registered under `GROUPED`, with
    SDPA's mask). On a GPU SDPA's fast kernels do not take grouped heads with a mask, so nothing changes
    there; nor for a model with sub-models (a vision tower) or another attention implementation."""
    from transformers import AttentionInterface  # modeling_utils: 1.5 s, for the engine's load only
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    config = model.config
    if model.device.type != "cpu" or config.get_text_config() is not config:
        return
    if config._attn_implementation != "sdpa":
        return
    AttentionInterface.register(GROUPED, grouped_sdpa)
    ALL_MASK_ATTENTION_FUNCTIONS.register(GROUPED, sdpa_mask)
    model.set_attn_implementation(GROUPED)
