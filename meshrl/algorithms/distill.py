"""On-policy distillation: a teacher's top-k next-token distribution, and the losses that pull a student
towards it on the student's own samples.

The teacher side (`topk_logprobs`) turns final hidden states into the k most likely next tokens and their
log-probabilities under the full-vocabulary softmax, streaming over the vocabulary so that memory stays
bounded by `token_chunk x vocab_chunk` logits whatever the vocabulary size. The student side is a loss
term (`topk_forward_kl`) and a dense per-token advantage (`reverse_kl_advantages`). All [B, T] inputs are
padded batches with a bool `mask`, as in `meshrl.algorithms.losses`.

On-policy distillation: Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from
Self-Generated Mistakes" (GKD); Gu et al. 2024, "MiniLLM" (reverse KL on the student's samples).
"""

from __future__ import annotations

import torch
from torch import Tensor

from meshrl.algorithms.losses import aggregate


@torch.no_grad()
def topk_logprobs(
    hidden: Tensor,
    weight: Tensor,
    k: int,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    token_chunk: int = 1024,
    vocab_chunk: int = 16384,
) -> tuple[Tensor, Tensor, Tensor]:
    """The k most likely next tokens at each position, their log-probabilities, and the log-normaliser.

    hidden [N, D] final hidden states, weight [V, D] (and bias [V]) of the output projection: logits =
    (hidden @ weight.T + bias) / temperature. Returns (ids [N, k] int64, logprobs [N, k] float32 sorted
    by decreasing probability, lse [N] float32 = logsumexp of the logits): the logprobs are normalised
    over the whole vocabulary (a running logsumexp over vocabulary chunks), and any other token's
    logprob is its logit - lse. Equal to
    `log_softmax(logits).topk(k)` computed at once, with at most [token_chunk, vocab_chunk] logits alive.
    """
    vocab = weight.shape[0]
    if not 1 <= k <= vocab:
        raise ValueError(f"top-k must be in [1, vocabulary size {vocab}], got {k}")
    if token_chunk < 1 or vocab_chunk < 1:
        raise ValueError("token_chunk and vocab_chunk must be >= 1")
    n = hidden.shape[0]
    out_ids = torch.empty((n, k), dtype=torch.int64, device=hidden.device)
    out_lp = torch.empty((n, k), dtype=torch.float32, device=hidden.device)
    out_lse = torch.empty((n,), dtype=torch.float32, device=hidden.device)
    scale = 1.0 / temperature if temperature > 0 else 1.0
    for s in range(0, n, token_chunk):
        h = hidden[s : s + token_chunk].float()
        lse = torch.full((h.shape[0],), -torch.inf, device=h.device)
        best = torch.full((h.shape[0], 0), -torch.inf, device=h.device)
        best_ids = torch.empty((h.shape[0], 0), dtype=torch.int64, device=h.device)
        for v in range(0, vocab, vocab_chunk):
            logits = h @ weight[v : v + vocab_chunk].float().T
            if bias is not None:
                logits = logits + bias[v : v + vocab_chunk].float()
            logits = logits * scale
            lse = torch.logaddexp(lse, torch.logsumexp(logits, dim=-1))
            top = logits.topk(min(k, logits.shape[1]), dim=-1)
            merged = torch.cat([best, top.values], dim=1)
            merged_ids = torch.cat([best_ids, top.indices + v], dim=1)
            keep = merged.topk(min(k, merged.shape[1]), dim=-1)
            best, best_ids = keep.values, merged_ids.gather(1, keep.indices)
        out_ids[s : s + token_chunk] = best_ids
        out_lp[s : s + token_chunk] = best - lse[:, None]
        out_lse[s : s + token_chunk] = lse
    return out_ids, out_lp, out_lse


def topk_forward_kl(
    logits: Tensor,
    teacher_ids: Tensor,
    teacher_logprobs: Tensor,
    mask: Tensor,
    *,
    temperature: float = 1.0,
    floor: float = -20.0,
    aggregation: str = "token-mean",
    normalizer: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Forward KL from the teacher's top-k distribution to the student, per token, aggregated.

    logits [B, T, V] of the student; teacher_ids / teacher_logprobs [B, T, k]; mask [B, T]. The
    teacher's k log-probabilities are renormalised over the top-k set (q = softmax(teacher_logprobs)),
    the student's are its full-vocabulary log-softmax at those ids, clamped below at `floor` so that a
    token the student all but rules out gives a bounded loss and gradient. Per token:
    sum_j q_j * (log q_j - max(log p_j, floor)), which is >= 0 because the student's mass on the set is
    at most 1, and 0 only when the student puts exactly q on it. Masked positions contribute nothing.

    Returns (loss, per-token tensors without gradient: "kl" [B, T] and "agree" [B, T] (1.0 where the
    student's most likely token is the teacher's top-1)).
    """
    if teacher_ids.shape[:2] != mask.shape or teacher_ids.shape != teacher_logprobs.shape:
        raise ValueError(
            f"teacher ids {tuple(teacher_ids.shape)} / logprobs {tuple(teacher_logprobs.shape)} must be "
            f"[B, T, k] for mask {tuple(mask.shape)}"
        )
    m = mask.bool()
    x = logits.float()
    if temperature > 0 and temperature != 1.0:
        x = x / temperature
    ids = torch.where(m[..., None], teacher_ids.long(), 0)
    student = x.gather(-1, ids) - torch.logsumexp(x, dim=-1, keepdim=True)
    # whatever sits at masked positions (padding) must not reach the loss or its gradient
    q_log = torch.log_softmax(torch.where(m[..., None], teacher_logprobs.float(), 0.0), dim=-1)
    per_token = (q_log.exp() * (q_log - student.clamp_min(floor))).sum(-1)
    per_token = torch.where(m, per_token, 0.0)
    loss = aggregate(per_token, m, aggregation, normalizer)
    with torch.no_grad():
        agree = (x.argmax(-1) == ids[..., 0]).float()
    return loss, {"kl": per_token.detach(), "agree": torch.where(m, agree, 0.0)}


def reverse_kl_advantages(teacher_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor) -> Tensor:
    """Per-token advantages log p_teacher(y_t) - log p_student(y_t) of the sampled tokens: the negative
    of a one-sample estimate of the reverse KL(student || teacher) at each token, used as a dense reward
    without discounting. All [B, T]; 0 at masked positions."""
    return torch.where(mask.bool(), teacher_logprobs.float() - behaviour_logprobs.float(), 0.0)
