"""The teacher service: the top-k next-token distribution of a frozen model at every response token."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from meshrl.algorithms.chunked import head_is_linear, last_hidden
from meshrl.algorithms.distill import topk_logprobs
from meshrl.dataplane import Batch, Ragged
from meshrl.models import vision
from meshrl.roles.scorer import ScorerService, right_padded, token_batches
from meshrl.roles.teacher.config import TeacherConfig
from meshrl.schema import PROMPT, RESPONSE, SEGMENTS, teacher_columns


class TeacherService(ScorerService):
    def load(self) -> None:
        cfg = self.ctx.config
        assert isinstance(cfg, TeacherConfig)
        model: Any = vision.load_model(cfg.model, **cfg.loader_kwargs)
        model = model.to(self.ctx.device).eval()
        vocab = model.get_output_embeddings().weight.shape[0]
        if cfg.top_k > vocab:
            raise ValueError(f"top_k {cfg.top_k} exceeds the teacher's vocabulary of {vocab}")
        streamed = head_is_linear(model, self.ctx.device)
        if not streamed:
            self.log.warning(
                "the teacher's logits are not its output projection of the last hidden state (a logit "
                "scale or soft-cap?): computing full-vocabulary logits per batch instead of streaming"
            )
        self.model = model
        self.topk = TopK(
            model, k=cfg.top_k, temperature=self.ctx.run.temperature, max_tokens=cfg.max_tokens,
            token_chunk=cfg.token_chunk, vocab_chunk=cfg.vocab_chunk, device=self.ctx.device,
            streamed=streamed,
        )  # fmt: skip
        self.columns = teacher_columns(cfg.prefix)

    def score(self, batch: Batch) -> dict[str, Any]:
        segments = batch.ragged(SEGMENTS) if SEGMENTS in batch else None
        out = self.topk(batch.ragged(PROMPT), batch.ragged(RESPONSE), segments, vision.from_batch(batch))
        return dict(zip(self.columns, out, strict=True))


@dataclass
class TopK:
    """A frozen causal LM's view of response tokens: per row, its top-k ids [response_len, k] (int32)
    and their logprobs [response_len, k], and the sampled tokens' logprobs [response_len], at the
    positions that predict each response token. Rows are packed into forwards of at most `max_tokens`
    padded tokens."""

    model: Any
    k: int
    temperature: float = 1.0
    max_tokens: int = 8192
    token_chunk: int = 1024
    vocab_chunk: int = 16384
    device: torch.device | str = "cpu"
    streamed: bool = True
    """Top-k from the last hidden state streamed over the vocabulary (needs `head_is_linear`), or from
    full-vocabulary logits."""

    @torch.no_grad()
    def __call__(
        self,
        prompts: Ragged,
        responses: Ragged,
        segments: Ragged | None = None,
        images: list[vision.Images | None] | None = None,
    ) -> tuple[Ragged, Ragged, Ragged]:
        """(top-k ids, their logprobs, the sampled tokens' logprobs) of every row (a vision-language
        model's with the rows' `images`)."""
        n = len(prompts)
        pad_id = int(self.model.config.pad_token_id or 0)
        ids: list[torch.Tensor] = [torch.empty(0)] * n
        lps: list[torch.Tensor] = [torch.empty(0)] * n
        sampled: list[torch.Tensor] = [torch.empty(0)] * n
        for index in token_batches(prompts.lengths + responses.lengths, self.max_tokens):
            padded = right_padded(prompts, responses, index, pad_id, segments)
            inputs = {k: v if v is None else v.to(self.device) for k, v in padded.items()}
            if images is not None:
                inputs |= vision.model_inputs([images[i] for i in index.tolist()], self.device)
            rows, cols, targets = _response_positions(prompts, responses, index)
            targets = targets.to(self.device)
            top_ids, top_lp, target_lp = (self._streamed if self.streamed else self._full)(
                inputs, rows, cols, targets
            )
            start = 0
            for i in index.tolist():
                end = start + len(responses[i])
                ids[i] = top_ids[start:end].to(torch.int32).cpu()
                lps[i] = top_lp[start:end].float().cpu()
                sampled[i] = target_lp[start:end].float().cpu()
                start = end
        return (
            Ragged.from_list(ids, dtype=torch.int32),
            Ragged.from_list(lps, dtype=torch.float32),
            Ragged.from_list(sampled, dtype=torch.float32),
        )

    def _streamed(self, inputs: dict, rows: torch.Tensor, cols: torch.Tensor, targets: torch.Tensor) -> Any:
        hidden = last_hidden(self.model, inputs)[rows, cols].float()
        head = self.model.get_output_embeddings()
        top_ids, top_lp, lse = topk_logprobs(
            hidden, head.weight, self.k, bias=head.bias, temperature=self.temperature,
            token_chunk=self.token_chunk, vocab_chunk=self.vocab_chunk,
        )  # fmt: skip
        picked = (hidden * head.weight[targets].float()).sum(-1)
        if head.bias is not None:
            picked = picked + head.bias[targets].float()
        return top_ids, top_lp, picked / self.temperature - lse

    def _full(self, inputs: dict, rows: torch.Tensor, cols: torch.Tensor, targets: torch.Tensor) -> Any:
        logits = self.model(**inputs, use_cache=False).logits[rows, cols].float() / self.temperature
        logp = torch.log_softmax(logits, dim=-1)
        top = logp.topk(self.k, dim=-1)
        return top.indices, top.values, logp.gather(-1, targets[:, None]).squeeze(-1)


def _response_positions(
    prompts: Ragged, responses: Ragged, index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row in the padded batch, column, response token) of every position that predicts a response
    token of rows `index`, row by row in `index` order."""
    rows, cols, targets = [], [], []
    for k, i in enumerate(index.tolist()):
        start, length = len(prompts[i]) - 1, len(responses[i])
        rows.append(torch.full((length,), k, dtype=torch.long))
        cols.append(torch.arange(start, start + length))
        targets.append(responses[i].long())
    return torch.cat(rows), torch.cat(cols), torch.cat(targets)
