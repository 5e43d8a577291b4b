"""The reward-model service: `rm_score`, a sequence-classification model's output at the last token."""

from __future__ import annotations

from typing import Any

import torch

from meshrl.dataplane import Batch, Ragged
from meshrl.roles.reward_model.config import RewardModelConfig
from meshrl.roles.scorer import ScorerService, token_batches
from meshrl.schema import PROMPT, RESPONSE, RM_SCORE


class RewardModelService(ScorerService):
    def load(self) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        cfg = self.ctx.config
        assert isinstance(cfg, RewardModelConfig)
        self.model: Any = AutoModelForSequenceClassification.from_pretrained(cfg.model, **cfg.loader_kwargs)
        if self.model.config.num_labels != 1:
            raise ValueError(f"reward model {cfg.model!r} has {self.model.config.num_labels} labels, not 1")
        self.model.to(self.ctx.device).eval()
        policy = cfg.policy or self.ctx.wiring.inputs["policy"]  # the trainer's model
        self.policy_tok = AutoTokenizer.from_pretrained(policy)
        self.tok = AutoTokenizer.from_pretrained(cfg.model)
        self.same_vocab = self.tok.get_vocab() == self.policy_tok.get_vocab()
        if not self.same_vocab:
            self.log.info("reward model tokenizer differs from the policy's: rows are re-tokenized")

    def score(self, batch: Batch) -> dict[str, Any]:
        rows = self.sequences(batch.ragged(PROMPT), batch.ragged(RESPONSE))
        lengths = torch.tensor([len(r) for r in rows])
        out = torch.zeros(len(rows), dtype=torch.float32)
        for index in token_batches(lengths, self.config.max_tokens):
            out[index] = last_token_scores(self.model, [rows[i] for i in index.tolist()], self.ctx.device)
        return {RM_SCORE: out}

    def sequences(self, prompts: Ragged, responses: Ragged) -> list[torch.Tensor]:
        if self.same_vocab:
            return [torch.cat([p, r]) for p, r in zip(prompts, responses, strict=True)]
        texts = [
            self.policy_tok.decode(torch.cat([p, r]).tolist(), skip_special_tokens=True)
            for p, r in zip(prompts, responses, strict=True)
        ]
        return [torch.tensor(self.tok(t)["input_ids"], dtype=torch.long) for t in texts]


def last_token_scores(
    model: Any, rows: list[torch.Tensor], device: torch.device | str = "cpu"
) -> torch.Tensor:
    """A sequence-classification model's score [n] at each row's last token. Rows are left-padded with
    explicit positions, so the last column is every row's last token whatever the model's pad rule."""
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    for k, r in enumerate(rows):
        ids[k, width - len(r) :] = r
        attn[k, width - len(r) :] = 1
    positions = (attn.cumsum(1) - 1).clamp_min(0)
    config = model.config
    pad, config.pad_token_id = config.pad_token_id, -1  # no token matches: HF pools the last column
    try:
        logits = model(
            input_ids=ids.to(device), attention_mask=attn.to(device), position_ids=positions.to(device)
        ).logits
    finally:
        config.pad_token_id = pad
    return logits[:, 0].float().cpu()
