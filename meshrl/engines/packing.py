"""Rows packed for training: prompt + response token ids right-padded into one batch, with every
per-response-token column (behaviour logprobs, advantages, reference logprobs, values, returns, the
teachers' top-k) aligned to the positions that predict those tokens (`pack`); and micro-batches filled
by tokens, several samples to a row (`token_micro_batches`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from meshrl.dataplane.batch import Ragged
from meshrl.models.vision import Images


@dataclass
class TrainBatch:
    """Rows packed for training. Position t of `mask`/`old_logprobs` scores token t+1 of `input_ids`."""

    input_ids: torch.Tensor  # [n, L] right-padded prompt + response
    attention_mask: torch.Tensor  # [n, L]
    mask: torch.Tensor  # [n, L-1] bool: positions that predict a response token of a valid row
    old_logprobs: torch.Tensor  # [n, L-1] behaviour logprobs at those positions
    advantages: torch.Tensor  # [n] (outcome) or [n, L-1] (per token)
    ref_logprobs: torch.Tensor | None = None  # [n, L-1]
    stale: torch.Tensor | None = None  # [n] bool: generated with weights older than the step's start
    values: torch.Tensor | None = None  # [n, L-1] critic values the advantages were computed with
    returns: torch.Tensor | None = None  # [n, L-1] the critic's regression targets
    # per teacher (column prefix): top-k ids [n, L-1, k], top-k logprobs [n, L-1, k], sampled-token
    # logprobs [n, L-1]
    teachers: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    position_ids: torch.Tensor | None = None  # [n, L] when several samples share a row (restarting at 0)
    # a vision-language model's images, per sample in the order the rows hold them (None: one without);
    # a forward takes those of its rows concatenated, in the order their image tokens appear
    images: list[Images | None] | None = None
    # [n] each row's prompt tokens (rows of one sample; None once packed): lets a group's rows share
    # their prompt's forward (shared_prompts.py)
    prompt_lengths: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def rows(self, index: torch.Tensor) -> TrainBatch:
        """A subset of rows, trimmed to its own longest row."""
        width = int(self.attention_mask[index].sum(1).max())
        pick = lambda t: None if t is None else t[index][:, : width - 1] if t.dim() >= 2 else t[index]  # noqa: E731
        return TrainBatch(
            input_ids=self.input_ids[index][:, :width],
            attention_mask=self.attention_mask[index][:, :width],
            mask=pick(self.mask),  # type: ignore[arg-type]
            old_logprobs=pick(self.old_logprobs),  # type: ignore[arg-type]
            advantages=pick(self.advantages),  # type: ignore[arg-type]
            ref_logprobs=pick(self.ref_logprobs),
            stale=None if self.stale is None else self.stale[index],
            values=pick(self.values),
            returns=pick(self.returns),
            teachers={k: tuple(pick(t) for t in v) for k, v in self.teachers.items()},  # type: ignore[misc]
            position_ids=None if self.position_ids is None else self.position_ids[index][:, :width],
            images=None if self.images is None else [self.images[i] for i in index.tolist()],
            prompt_lengths=None if self.prompt_lengths is None else self.prompt_lengths[index],
        )


def pack(
    prompts: Ragged | list[torch.Tensor],
    responses: Ragged | list[torch.Tensor],
    logprobs: Ragged | list[torch.Tensor] | None,
    advantages: torch.Tensor | Ragged,
    valid: torch.Tensor,
    ref_logprobs: Ragged | list[torch.Tensor] | None = None,
    pad_id: int = 0,
    stale: torch.Tensor | None = None,
    values: Ragged | None = None,
    returns: Ragged | None = None,
    teachers: dict[str, tuple[Ragged, Ragged, Ragged]] | None = None,
    loss_mask: Ragged | None = None,
    segments: Ragged | None = None,
    images: list[Images | None] | None = None,
) -> TrainBatch:
    """Right-pad prompt+response rows; align per-response-token values to the positions predicting them.

    `advantages` is one value per row (outcome estimators) or a ragged column with one per response
    token (GAE). `segments`: per row, the lengths of the independent sequences its prompt + response
    hold (an agent's trajectory whose history was rewritten between calls, meshrl/envs/trajectory.py):
    their positions restart at 0, so no token attends across them. Vectorised over rows: a few index
    computations whatever the batch size.
    """
    p, r = (x if isinstance(x, Ragged) else Ragged.from_list(x) for x in (prompts, responses))
    n = len(p)
    pl, rl = p.lengths, r.lengths
    width = int((pl + rl).max())
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    row_p, col_p = _positions(pl, torch.zeros_like(pl))
    ids[row_p, col_p] = p.values.long()
    row_r, col_r = _positions(rl, pl)
    ids[row_r, col_r] = r.values.long()
    attn = (torch.arange(width)[None, :] < (pl + rl)[:, None]).long()
    mask = torch.zeros((n, width - 1), dtype=torch.bool)
    mask[row_r, col_r - 1] = valid.bool()[row_r]
    if loss_mask is not None:
        mask[row_r, col_r - 1] &= loss_mask.values.bool()

    def tokens(column: Ragged | list[torch.Tensor] | None, dtype: torch.dtype = torch.float32) -> Any:
        if column is None:
            return None
        column = column if isinstance(column, Ragged) else Ragged.from_list(column)
        out = torch.zeros((n, width - 1, *column.values.shape[1:]), dtype=dtype)
        out[row_r, col_r - 1] = column.values.to(dtype)
        return out

    old = tokens(logprobs)
    old = torch.zeros(mask.shape) if old is None else old
    if isinstance(advantages, Ragged):
        adv = torch.where(mask, tokens(advantages), 0.0)
    else:
        adv = torch.where(valid.bool(), advantages.float(), 0.0)
    distill = {
        name: (tokens(top_ids, torch.long), tokens(top_lp), tokens(sampled))
        for name, (top_ids, top_lp, sampled) in (teachers or {}).items()
    }
    return TrainBatch(
        ids, attn, mask, old, adv, tokens(ref_logprobs), stale, tokens(values), tokens(returns), distill,
        position_ids=segment_positions(segments, width), images=images, prompt_lengths=pl,
    )  # fmt: skip


def segment_positions(segments: Ragged | None, width: int) -> torch.Tensor | None:
    """[n, width] positions restarting at every segment (and at the padding after the last); None when
    no row has more than one segment."""
    if segments is None or not bool((segments.lengths > 1).any()):
        return None
    pos = torch.arange(width).repeat(len(segments), 1)
    for r in torch.nonzero(segments.lengths > 1).flatten().tolist():
        start = 0
        for n in segments[r].tolist():
            pos[r, start : start + n] = torch.arange(n)
            start += n
        pos[r, start:] = torch.arange(width - start)
    return pos


def _positions(lengths: torch.Tensor, start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) of every item of ragged rows laid out from column `start[row]`."""
    rows = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    first = torch.cumsum(lengths, 0) - lengths
    cols = torch.arange(int(lengths.sum())) - torch.repeat_interleave(first - start, lengths)
    return rows, cols


def token_micro_batches(batch: TrainBatch, max_tokens: int) -> list[TrainBatch]:
    """`batch` as micro-batches of at most `max_tokens` tokens (at least one row), samples packed into rows.

    Rows are as wide as the longest sample, so attention costs what it costs unpacked; samples go into
    them longest first, each into the first row with room (first-fit decreasing), and a micro-batch
    takes as many rows as `max_tokens` holds. Every sample's position ids restart at 0 and the model
    gets no attention mask: transformers derives a block-diagonal causal mask from the positions (sdpa,
    eager) or cuts the rows into variable-length sequences (flash attention), so no token attends
    across samples. Per-token columns follow their tokens; per-row ones (outcome advantages, staleness)
    are spread over them; the position where one sample's last token would predict the next sample's
    first is masked. The loss sees the same tokens with the same values: its normalisation is unchanged.
    """
    lengths = batch.attention_mask.sum(1).tolist()
    width = max(lengths)
    rows = _first_fit(lengths, width)
    per = max(1, max_tokens // width)
    return [_packed_rows(batch, rows[i : i + per], lengths) for i in range(0, len(rows), per)]


def _first_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of `lengths` in rows of at most `capacity`, longest first, each in the first that fits."""
    rows: list[list[int]] = []
    fill: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        r = next((r for r, f in enumerate(fill) if f + lengths[i] <= capacity), len(rows))
        if r == len(rows):
            rows.append([])
            fill.append(0)
        rows[r].append(i)
        fill[r] += lengths[i]
    return rows


def _packed_rows(batch: TrainBatch, rows: list[list[int]], lengths: list[int]) -> TrainBatch:
    """The samples `rows` of `batch` laid end to end, one list per row, right-padded."""
    width = max(sum(lengths[i] for i in r) for r in rows)
    src = torch.full((len(rows), width), -1)  # sample of each token (-1: padding)
    pos = torch.zeros((len(rows), width), dtype=torch.long)  # its position id (0 where a sequence starts)
    at = torch.zeros((len(rows), width), dtype=torch.long)  # its column in the sample's row of `batch`
    for r, samples in enumerate(rows):
        start = 0
        for i in samples:
            src[r, start : start + lengths[i]] = i
            own = (
                torch.arange(lengths[i])
                if batch.position_ids is None
                else batch.position_ids[i, : lengths[i]]
            )
            pos[r, start : start + lengths[i]] = own
            at[r, start : start + lengths[i]] = torch.arange(lengths[i])
            start += lengths[i]
        pos[r, start:] = torch.arange(width - start)  # padding: a sequence of its own
    real = src >= 0
    sample, col = src.clamp_min(0), at.clamp(max=batch.input_ids.shape[1] - 2)
    # position t predicts a token of its own sample (and of its own segment: one starts at position 0)
    predicts = real[:, :-1] & (src[:, :-1] == src[:, 1:]) & (pos[:, 1:] != 0)

    def tokens(x: torch.Tensor | None) -> Any:
        if x is None:
            return None
        picked = x[sample[:, :-1]] if x.dim() == 1 else x[sample[:, :-1], col[:, :-1]]
        keep = predicts.view(*predicts.shape, *([1] * (picked.dim() - 2)))
        return torch.where(keep, picked, torch.zeros((), dtype=picked.dtype))

    return TrainBatch(
        input_ids=torch.where(real, batch.input_ids[sample, at.clamp(max=batch.input_ids.shape[1] - 1)], 0),
        attention_mask=real.long(),
        mask=tokens(batch.mask),
        old_logprobs=tokens(batch.old_logprobs),
        advantages=tokens(batch.advantages),
        ref_logprobs=tokens(batch.ref_logprobs),
        stale=tokens(batch.stale),
        values=tokens(batch.values),
        returns=tokens(batch.returns),
        teachers={k: tuple(tokens(t) for t in v) for k, v in batch.teachers.items()},
        position_ids=pos,
        images=None if batch.images is None else [batch.images[i] for r in rows for i in r],
    )
