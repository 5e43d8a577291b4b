"""A group's samples share their prompt: run it through the model once, not once per sample.

GRPO draws `group_size` completions of each prompt, so a step's rows hold every prompt that many times.
Both ends of the loop run each distinct prompt once and let every row of it attend to the one result:

- generation (`hf.py`): the prefill takes the batch's distinct prompts; their KV cache and next-token
  logits are copied to the rows that have them, and decoding goes on per row as before;
- training (`fsdp.py`, `prompt_shared_hidden`): a micro-batch's distinct prompts go through the model
  first, their KV cache kept with its graph; each row's response then goes through with its prompt's
  cache as the past. The backward pass sums a prompt's gradient over its rows, so the logprobs and the
  gradients are those of the rows computed whole, up to float rounding (tests/unit/engines/
  test_shared_prompts.py).

What it saves is the prompt's tokens, `group_size - 1` times over: on grpo_arith's micro-batches (4
prompt tokens, 1-4 response tokens, groups of 8) the trainer's forward takes half the tokens. It costs a
second forward call per micro-batch, so it is used only where it saves a quarter of the tokens or more
(`plan`). The KV cache must be one that can be indexed by row (`indexable`: transformers'
dynamic layers; a model with another cache computes its rows whole).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from meshrl.engines.packing import TrainBatch

SAVING = 0.25
"""The least share of a micro-batch's tokens the shared prompts must save for the trainer to use them."""


@dataclass(frozen=True)
class Prompts:
    """The distinct prompts of a batch, left-padded to the longest (as batched generation pads)."""

    ids: torch.Tensor  # [u, P]
    mask: torch.Tensor  # [u, P] 1 on the prompt's tokens
    positions: torch.Tensor  # [u, P] 0 at each prompt's first token (and on the padding before it)
    of_row: torch.Tensor  # [n] the distinct prompt of each row

    def __len__(self) -> int:
        return self.ids.shape[0]


def distinct(
    prompts: list[list[int]], pad_id: int, device: torch.device | None = None, *, share: bool = True
) -> Prompts:
    """The distinct token lists of `prompts`, in order of first appearance, and which one each row has
    (`share` False: every row its own, e.g. rows whose images differ)."""
    index: dict[tuple[int, ...], int] = {}
    of_row = [index.setdefault(tuple(p), len(index)) for p in prompts] if share else range(len(prompts))
    unique = list(index) if share else prompts
    width = max(len(p) for p in unique)
    ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in unique], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in unique], device=device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return Prompts(ids, mask, positions, torch.tensor(list(of_row), device=device))


def indexable(config: Any) -> bool:
    """Whether every layer of the model's KV cache keeps its keys and values as tensors with one row
    per sample (transformers' dynamic layers: full or sliding-window attention), so that rows can be
    picked and copied."""
    layers = DynamicCache(config=config).layers
    return all(type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) for layer in layers)


def split(input_ids: torch.Tensor, prompt_lengths: torch.Tensor) -> Prompts:
    """The distinct prompts of right-padded rows whose first `prompt_lengths[i]` tokens are the prompt."""
    rows = input_ids.tolist()
    return distinct([r[:n] for r, n in zip(rows, prompt_lengths.tolist(), strict=True)], 0, input_ids.device)


def plan(mb: TrainBatch) -> Prompts | None:
    """The distinct prompts of a micro-batch's rows where running each once saves `SAVING` of the
    tokens (the prompts once, then each row's response but its last token, against the rows whole);
    None where it does not, or where a row is not one sample (packed, with images) or has no prompt."""
    if mb.prompt_lengths is None or mb.position_ids is not None or mb.images:
        return None
    if int(mb.prompt_lengths.min()) < 1:  # no state before the response's first token to share
        return None
    prompts = split(mb.input_ids, mb.prompt_lengths)
    n, width = mb.input_ids.shape
    responses = int((mb.attention_mask.sum(1) - mb.prompt_lengths).max())
    shared = prompts.ids.numel() + n * max(responses - 1, 0)
    return prompts if shared <= (1 - SAVING) * n * width else None


def grouped(batch: TrainBatch, order: torch.Tensor) -> torch.Tensor:
    """The rows of `order` with each prompt's rows together, at the place of its first (micro-batches
    cut from it then hold whole groups); `order` itself where the prompts are not known."""
    if batch.prompt_lengths is None:
        return order
    prompt = split(batch.input_ids, batch.prompt_lengths).of_row.tolist()
    rows: dict[int, list[int]] = {}
    for i in order.tolist():
        rows.setdefault(prompt[i], []).append(i)
    return torch.tensor([i for group in rows.values() for i in group], dtype=order.dtype)


def prompt_shared_hidden(model: Any, mb: TrainBatch, prompts: Prompts, device: torch.device) -> torch.Tensor:
    """The last hidden state at the positions of `mb.mask` (each predicting a response token), as
    `hidden[:, :-1][mask]` of the rows computed whole gives it, with each distinct prompt run once.

    The prompts' forward gives each row the state that predicts its response's first token (the
    prompt's last); the responses' forward, with the prompts' KV cache copied to their rows, the states
    that predict the next ones (a response's last token predicts nothing and is left out).
    """
    ids, mask, of_row = mb.input_ids.to(device), mb.mask.to(device), prompts.of_row.to(device)
    prompt_mask = prompts.mask.to(device)
    lengths = mb.prompt_lengths.to(device)  # type: ignore[union-attr]
    responses = mb.attention_mask.to(device).sum(1) - lengths
    cache = DynamicCache(config=model.config)
    out = model(
        input_ids=prompts.ids.to(device), attention_mask=prompt_mask,
        position_ids=prompts.positions.to(device), past_key_values=cache, use_cache=True,
        output_hidden_states=True, logits_to_keep=1,
    )  # fmt: skip
    hidden = out.hidden_states[-1][:, -1][of_row][:, None]  # [n, 1, H]
    steps = int(responses.max()) - 1
    k = torch.arange(max(steps, 0) + 1, device=device)
    if steps > 0:
        cache.batch_select_indices(of_row)
        col = lengths[:, None] + k[None, :steps]
        real = (k[None, :steps] < (responses - 1)[:, None]).to(prompt_mask.dtype)
        out = model(
            input_ids=ids.gather(1, col.clamp(max=ids.shape[1] - 1)),
            attention_mask=torch.cat([prompt_mask[of_row], real], 1), position_ids=col,
            past_key_values=cache, use_cache=True, output_hidden_states=True, logits_to_keep=1,
        )  # fmt: skip
        hidden = torch.cat([hidden, out.hidden_states[-1]], 1)
    # hidden[i, k] predicts response token k of row i: position prompt_lengths[i] - 1 + k of the row
    at = (lengths[:, None] - 1 + k[None, :]).clamp(max=mask.shape[1] - 1)
    take = mask.gather(1, at) & (k[None, :] < responses[:, None])
    if int(take.sum()) != int(mask.sum()):
        raise ValueError("shared prompts: the mask has positions outside the rows' responses")
    return hidden[take]
