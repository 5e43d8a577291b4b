"""The reference service: `ref_logprobs` for every response token, from a frozen causal LM."""

from __future__ import annotations

from typing import Any

import torch

from meshrl.algorithms.losses import token_logprobs
from meshrl.dataplane import Batch, Ragged
from meshrl.models import vision
from meshrl.models.vision import Images, load_model, model_inputs
from meshrl.roles.reference.config import ReferenceConfig
from meshrl.roles.scorer import ScorerService, right_padded, token_batches
from meshrl.schema import PROMPT, REF_LOGPROBS, RESPONSE, SEGMENTS


class ReferenceService(ScorerService):
    def load(self) -> None:
        cfg = self.ctx.config
        assert isinstance(cfg, ReferenceConfig)
        self.temperature = self.ctx.run.temperature
        model: Any = load_model(cfg.model, **cfg.loader_kwargs)
        self.model = model.to(self.ctx.device).eval()
        self.pad_id = int(self.model.config.pad_token_id or 0)

    def score(self, batch: Batch) -> dict[str, Any]:
        lp = response_logprobs(
            self.model, batch.ragged(PROMPT), batch.ragged(RESPONSE), temperature=self.temperature,
            max_tokens=self.config.max_tokens, pad_id=self.pad_id, device=self.ctx.device,
            segments=batch.ragged(SEGMENTS) if SEGMENTS in batch else None, images=vision.from_batch(batch),
        )  # fmt: skip
        return {REF_LOGPROBS: lp}


def response_logprobs(
    model: Any,
    prompts: Ragged,
    responses: Ragged,
    *,
    temperature: float = 1.0,
    max_tokens: int = 8192,
    pad_id: int = 0,
    device: torch.device | str = "cpu",
    segments: Ragged | None = None,
    images: list[Images | None] | None = None,
) -> Ragged:
    """Log-probability of every response token given its prompt (and its images) and the response
    before it (within its own segment, where a row holds several)."""
    out: list[torch.Tensor] = [torch.empty(0)] * len(prompts)
    for index in token_batches(prompts.lengths + responses.lengths, max_tokens):
        padded = right_padded(prompts, responses, index, pad_id, segments)
        inputs = {k: v if v is None else v.to(device) for k, v in padded.items()}
        if images is not None:
            inputs |= model_inputs([images[i] for i in index.tolist()], device)
        logits = model(**inputs, use_cache=False).logits[:, :-1]  # no cache: it would also hide segments
        ids = padded["input_ids"]
        assert ids is not None
        lp = token_logprobs(logits, ids[:, 1:].to(device), temperature=temperature).float().cpu()
        for k, i in enumerate(index.tolist()):
            start = len(prompts[i]) - 1  # the position predicting the first response token
            out[i] = lp[k, start : start + len(responses[i])].clone()
    return Ragged.from_list(out, dtype=torch.float32)
