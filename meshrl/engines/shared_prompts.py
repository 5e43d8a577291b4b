"""A group's samples share their prompt: run it through the model once, not once per sample.

GRPO draws `group_size` completions of each prompt, so a step's rows hold every prompt that many times.
Both ends of the loop run each distinct prompt once and let every row of it attend to the one result:

- generation (`hf.py`): the prefill takes the batch's distinct prompts; their KV cache and next-token
  logits are copied to the rows that have them, and decoding goes on per row as before;
- training (`fsdp.py`, `prompt_shared_hidden`), one of two ways, whichever an estimate of the work
  finds cheaper (`_packing_pays`): a group packed into one row, its prompt and then every response,
  with a 4D attention mask that lets a response see the prompt and itself, its positions continuing
  the prompt's (one forward; short responses); or the distinct prompts first, their KV cache kept with
  its graph, then each row's response on its prompt's cache (two forwards; long responses, where a
  packed row would attend across all of them). The backward pass sums a prompt's gradient over its
  rows, so the logprobs and the gradients are those of the rows computed whole, up to float rounding
  (tests/unit/engines/test_shared_prompts.py, both ways).

What it saves is the prompt's tokens, `group_size - 1` times over (and, packed, the responses'
padding): on grpo_arith (4 prompt tokens, 1-4 response tokens, groups of 8) a step's four updates take
0.065 s packed, 0.095 s by the cache, 0.11 s with the rows whole. A micro-batch shares only where that
saves a quarter of its tokens or more (`plan`). The cache must be one that can be indexed by row
(`indexable`: transformers' dynamic layers); a model with another one computes its rows whole.
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
PACKED_MAX = 2048
"""The widest packed group (`_packed`): its attention mask is width x width booleans."""


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
    `hidden[:, :-1][mask]` of the rows computed whole gives it, with each distinct prompt run once: in
    one forward of packed groups where that costs less (`_packed`), else in two (`_cached`)."""
    lengths = mb.prompt_lengths.to(device)  # type: ignore[union-attr]
    responses = mb.attention_mask.to(device).sum(1) - lengths
    steps = int(responses.max()) - 1  # the response tokens that are inputs, at most (the last is none)
    k = torch.arange(max(steps, 0) + 1, device=device)
    if _packing_pays(model.config, prompts, responses, steps):
        hidden = _packed(model, mb, prompts, responses, k, device)
    else:
        hidden = _cached(model, mb, prompts, responses, k, device)
    # hidden[i, k] predicts response token k of row i: position prompt_lengths[i] - 1 + k of the row
    mask = mb.mask.to(device)
    take = mask.gather(1, (lengths[:, None] - 1 + k[None, :]).clamp(max=mask.shape[1] - 1))
    take &= k[None, :] < responses[:, None]
    if int(take.sum()) != int(mask.sum()):
        raise ValueError("shared prompts: the mask has positions outside the rows' responses")
    return hidden[take]


def _packing_pays(config: Any, prompts: Prompts, responses: torch.Tensor, steps: int) -> bool:
    """Whether one forward of packed groups (each group a row: its prompt, then every response) costs
    less than the prompts' forward and the responses' on the prompts' cache. Both take about the same
    tokens through the linear layers (12 h^2 multiply-adds a token); packing saves the second call
    and the responses' padding, and pays attention over the whole packed row (4 h a pair of positions:
    a group of long responses attends G times what its rows would). SDPA only (the mask is a custom
    4D one, used as given: no sliding-window layers), and a packed row of at most `PACKED_MAX`
    positions (its mask is width^2 booleans)."""
    text = config.get_text_config()  # a vision-language model's language model
    if getattr(text, "_attn_implementation", None) != "sdpa" or not hasattr(text, "hidden_size"):
        return False
    if "sliding_attention" in (getattr(text, "layer_types", None) or ()):  # a 4D mask overrides windows
        return False
    h, inputs = int(text.hidden_size), (responses - 1).clamp(min=0)
    group = torch.zeros(len(prompts), dtype=torch.long).index_add_(0, prompts.of_row.cpu(), inputs.cpu())
    width = int(prompts.mask.sum(1).max()) + int(group.max())
    if width > PACKED_MAX:
        return False
    packed = len(prompts) * width * (12 * h * h) + len(prompts) * width * width / 2 * 4 * h
    n, p = len(responses), prompts.ids.shape[1]
    cached = (prompts.ids.numel() + n * max(steps, 0)) * 12 * h * h + n * max(steps, 0) * (p + steps) * 4 * h
    return packed <= cached


def _packed(
    model: Any,
    mb: TrainBatch,
    prompts: Prompts,
    responses: torch.Tensor,
    k: torch.Tensor,
    device: torch.device,
) -> torch.Tensor:
    """One forward: a row per distinct prompt holding the prompt, then each of its rows' responses but
    the last token; a 4D mask lets a response attend to the prompt and to itself (causally), its
    positions continuing the prompt's. Returns hidden [n, 1 + S, H]: [i, k] predicts row i's token k."""
    ids, of_row, lengths = mb.input_ids.tolist(), prompts.of_row.tolist(), mb.prompt_lengths.tolist()  # type: ignore[union-attr]
    rows = [p[m.bool()].tolist() for p, m in zip(prompts.ids.cpu(), prompts.mask.cpu(), strict=True)]
    seg = [[0] * len(r) for r in rows]  # 0: the prompt; i + 1: row i's response
    pos = [list(range(len(r))) for r in rows]
    at = torch.zeros((len(ids), len(k)), dtype=torch.long)  # packed position of the state for token k
    for i, (u, plen, r) in enumerate(zip(of_row, lengths, responses.tolist(), strict=True)):
        start, tokens = len(rows[u]), ids[i][plen : plen + max(r - 1, 0)]
        rows[u] += tokens
        seg[u] += [i + 1] * len(tokens)
        pos[u] += range(plen, plen + len(tokens))
        at[i, 0], at[i, 1 : 1 + len(tokens)] = plen - 1, torch.arange(start, start + len(tokens))
    width = max(len(r) for r in rows)
    pad = lambda xs, v: torch.tensor([x + [v] * (width - len(x)) for x in xs], device=device)  # noqa: E731
    segments = pad(seg, -1)
    q = torch.arange(width, device=device)
    same = (segments[:, None, :] == 0) | (segments[:, None, :] == segments[:, :, None])
    real = (segments[:, :, None] >= 0) & (segments[:, None, :] >= 0)
    attend = (q[None, :] <= q[:, None]) & same & real | torch.eye(width, dtype=torch.bool, device=device)
    out = model(
        input_ids=pad(rows, 0), attention_mask=attend[:, None], position_ids=pad(pos, 0),
        output_hidden_states=True, logits_to_keep=1,
    )  # fmt: skip
    hidden = out.hidden_states[-1]  # [u, width, H]
    return hidden[prompts.of_row.to(device)[:, None], at.to(device)]


def _cached(
    model: Any,
    mb: TrainBatch,
    prompts: Prompts,
    responses: torch.Tensor,
    k: torch.Tensor,
    device: torch.device,
) -> torch.Tensor:
    """Two forwards: the prompts' (their KV cache kept with its graph, then copied to their rows), and
    each row's response but its last token on its prompt's cache. Returns hidden [n, 1 + S, H]."""
    ids, of_row = mb.input_ids.to(device), prompts.of_row.to(device)
    prompt_mask, lengths = prompts.mask.to(device), mb.prompt_lengths.to(device)  # type: ignore[union-attr]
    cache = DynamicCache(config=model.config)
    out = model(
        input_ids=prompts.ids.to(device), attention_mask=prompt_mask,
        position_ids=prompts.positions.to(device), past_key_values=cache, use_cache=True,
        output_hidden_states=True, logits_to_keep=1,
    )  # fmt: skip
    hidden = out.hidden_states[-1][:, -1][of_row][:, None]  # [n, 1, H]
    steps = len(k) - 1
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
    return hidden
