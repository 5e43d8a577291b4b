"""Sampled-token log-probabilities and entropy straight from final hidden states, a chunk of positions at
a time, so that no [positions, vocabulary] logits tensor outlives its chunk.

At a 150k vocabulary the logits of 32 rows x 1,024 tokens are ~20 GB in float32; kept in the autograd
graph (with their softmax, for the entropy) they dominate a trainer's memory. `head_logprobs` is a custom
autograd function that saves only its inputs and one log-normaliser per position, and recomputes each
chunk's logits in the backward pass: the memory of the output projection is bounded by `chunk x vocab`
whatever the batch, for the cost of that projection's matmul once more. An input of one chunk or less
(a trainer's micro-batch, usually) keeps its log-probabilities for the backward instead: the same bound,
and no second matmul. The teacher's top-k
(`distill.topk_logprobs`) streams the same way, over positions and over the vocabulary, without a graph.
Both read the last hidden state (`last_hidden`) and hold only for a model whose logits are its output
projection of that state (`head_is_linear`: no logit scale or soft-cap); others compute whole logits.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def head_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    chunk: int = 1024,
) -> tuple[Tensor, Tensor]:
    """log softmax(logits / temperature)[targets] and the entropy of softmax(logits / temperature), with
    logits = hidden @ weight.T + bias, `chunk` positions at a time.

    hidden [N, D], weight [V, D], bias [V], targets [N] int64 -> (logprobs [N], entropy [N]), float32.
    The matmuls run in the inputs' dtype (cast them to the compute dtype before: bf16 under mixed
    precision), the softmax in float32. Gradients reach hidden, weight and bias through both outputs; an
    output that the loss does not use (the entropy, when its coefficient is 0) costs nothing in the
    backward pass. temperature <= 0 means 1. Equal to `losses.token_logprobs` and `losses.entropy` of
    the full logits.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} must be [N, D] with targets {tuple(targets.shape)} [N]"
        )
    scale = 1.0 / temperature if temperature > 0 else 1.0
    return _HeadLogprobs.apply(hidden, weight, bias, targets, scale, chunk)


def last_hidden(model: Any, inputs: dict[str, Any]) -> torch.Tensor:
    """Final hidden states [n, L, D] (after the last norm), computing the logits of one position only.
    No KV cache: nothing is generated, and with one transformers would not read `position_ids` that
    restart (several sequences in a row) as separate sequences."""
    return model(**inputs, output_hidden_states=True, logits_to_keep=1, use_cache=False).hidden_states[-1]


@torch.no_grad()
def head_is_linear(model: Any, device: torch.device | str = "cpu") -> bool:
    """Whether the model's logits are exactly its output projection of `last_hidden` (checked on a short
    input): then top-k can stream over the vocabulary instead of materialising all logits."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        return False
    ids = (torch.arange(1, 9, device=device) % head.weight.shape[0])[None]
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    full = model(**inputs).logits[0].float()
    mine = head(last_hidden(model, inputs)[0]).float()
    return bool(torch.allclose(full, mine, atol=1e-4, rtol=1e-4))


def _log_softmax(h: Tensor, weight: Tensor, bias: Tensor | None, scale: float) -> Tensor:
    """The scaled logits of a chunk, in float32."""
    x = (h @ weight.T).float()
    if bias is not None:
        x += bias.float()
    return x.mul_(scale) if scale != 1.0 else x


class _HeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        targets: Tensor,
        scale: float,
        chunk: int,
    ) -> tuple[Tensor, Tensor]:
        n = hidden.shape[0]
        lp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        ent, lse = torch.empty_like(lp), torch.empty_like(lp)
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, n, chunk):
                x = _log_softmax(hidden[s : s + chunk], weight, bias, scale)
                lse[s : s + chunk] = norm = torch.logsumexp(x, dim=-1)
                logp = x.sub_(norm[:, None])  # log p, in place: one [chunk, V] tensor alive
                lp[s : s + chunk] = logp.gather(-1, targets[s : s + chunk, None]).squeeze(-1)
                ent[s : s + chunk] = -(logp.exp() * logp).sum(-1)
        # one chunk in all: the backward takes its log p as it is (within the bound, one [chunk, V]
        # tensor) instead of computing the projection again
        kept = logp if 0 < n <= chunk and any(ctx.needs_input_grad) else None
        ctx.save_for_backward(hidden, weight, bias, targets, lse, ent, kept)
        ctx.scale, ctx.chunk = scale, chunk
        ctx.set_materialize_grads(False)
        return lp, ent

    @staticmethod
    def backward(ctx: Any, g_lp: Tensor | None, g_ent: Tensor | None) -> tuple[Tensor | None, ...]:
        """Per chunk, with logp = log softmax(x) and p = exp(logp): d logp[y] / dx = onehot(y) - p and
        dH / dx = -p * (logp + H); then through x = scale * (h @ W.T + b)."""
        hidden, weight, bias, targets, lse, ent, kept = ctx.saved_tensors
        g_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        g_w = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        g_b = (
            torch.zeros_like(bias, dtype=torch.float32)
            if bias is not None and ctx.needs_input_grad[2]
            else None
        )
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, hidden.shape[0], ctx.chunk):
                h = hidden[s : s + ctx.chunk]
                logp = (
                    kept
                    if kept is not None
                    else _log_softmax(h, weight, bias, ctx.scale).sub_(lse[s : s + ctx.chunk, None])
                )
                p = logp.exp()
                if g_ent is not None:  # in place: logp becomes the gradient
                    g = logp.add_(ent[s : s + ctx.chunk, None]).mul_(p).mul_(-g_ent[s : s + ctx.chunk, None])
                else:
                    g = logp.zero_()
                if g_lp is not None:
                    g_chunk = g_lp[s : s + ctx.chunk, None]
                    g.sub_(p.mul_(g_chunk)).scatter_add_(-1, targets[s : s + ctx.chunk, None], g_chunk)
                g = g.mul_(ctx.scale).to(hidden.dtype)
                if g_h is not None:
                    g_h[s : s + ctx.chunk] = g @ weight
                if g_w is not None:
                    g_w += (g.T @ h).float()
                if g_b is not None:
                    g_b += g.float().sum(0)
        return (
            g_h,
            None if g_w is None else g_w.to(weight.dtype),
            None if g_b is None else g_b.to(bias.dtype),
            None,
            None,
            None,
        )
