"""Services that add columns to sample rows with a frozen model: the reference and the reward model.

Each is the same loop over the data plane: claim up to `max_batch` rows that have the columns it needs
(its wiring's "score" claim: completed samples; replicas share the work under the group's consumer
name), compute its column on the rows in forwards of at most `max_tokens` padded tokens, write it into
the same rows, acknowledge. The
trainer, whose claim lists that column, only ever sees rows that have it; nothing else changes.
"""

from __future__ import annotations

from typing import Any

import torch

from meshrl.dataplane import Batch, Ragged
from meshrl.dataplane.missing import put_missing
from meshrl.engines.packing import segment_positions
from meshrl.roles.scorer_config import ScorerConfig
from meshrl.runtime.service import Service

__all__ = ["ScorerConfig", "ScorerService"]

LEASE_S = 300.0  # a replica that hangs gives its claimed rows back after this long (one that dies: at once)


def token_batches(lengths: torch.Tensor, max_tokens: int) -> list[torch.Tensor]:
    """Row indices in chunks whose padded size (rows x longest row) stays within `max_tokens`; rows of
    similar length go together (longest first). A row longer than the budget gets a chunk of its own."""
    order = torch.argsort(lengths, descending=True).tolist()
    chunks: list[list[int]] = []
    for i in order:
        if chunks and (len(chunks[-1]) + 1) * int(lengths[chunks[-1][0]]) <= max_tokens:
            chunks[-1].append(i)
        else:
            chunks.append([i])
    return [torch.tensor(c) for c in chunks]


def right_padded(
    prompts: Ragged, responses: Ragged, index: torch.Tensor, pad_id: int, segments: Ragged | None = None
) -> dict[str, torch.Tensor | None]:
    """input_ids and attention_mask [n, L] of prompt + response for rows `index`, right-padded. Where a
    row holds several sequences (`segments`: an agent program's sample whose history was rewritten),
    position_ids restarting at each instead of the mask: no token attends across them (as the trainer
    packs them: meshrl/engines/packing.py)."""
    rows = [torch.cat([prompts[i], responses[i]]) for i in index.tolist()]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    for k, r in enumerate(rows):
        ids[k, : len(r)] = r
        attn[k, : len(r)] = 1
    if segments is not None:
        positions = segment_positions(Ragged.from_list([segments[i] for i in index.tolist()]), width)
        if positions is not None:
            return {"input_ids": ids, "attention_mask": None, "position_ids": positions}
    return {"input_ids": ids, "attention_mask": attn}


class ScorerService(Service):
    """Subclasses implement `load()` (which sets `self.model`, the frozen module) and
    `score(batch) -> columns`."""

    model: Any

    def setup(self) -> None:
        if self.config.threads:
            torch.set_num_threads(self.config.threads)
        self.client = self.ctx.client()
        self.scored = 0
        self.load()

    @property
    def config(self) -> ScorerConfig:
        cfg = self.ctx.config
        assert isinstance(cfg, ScorerConfig)
        return cfg

    def load(self) -> None:
        raise NotImplementedError

    def score(self, batch: Batch) -> dict[str, Any]:
        raise NotImplementedError

    def run(self) -> None:
        cfg, claim = self.config, self.ctx.wiring.claim("score")
        stream = self.client.stream(
            claim.partition,
            claim.consumer,
            claim.columns,
            cfg.max_batch,
            poll=1.0,
            lease=LEASE_S,
            skip_empty=False,
        )
        try:
            for batch in stream:
                if not batch:
                    self.phase(f"waiting for rows to score ({self.scored} scored)")
                    if self.finished():
                        return
                    continue
                self.phase(f"scoring {len(batch)} rows")
                with torch.no_grad(), self.device_turn():
                    columns = self.score(batch)
                self.write(batch, columns)
                self.client.ack(batch)
                self.scored += len(batch)
                self.ctx.health.info["scored"] = self.scored
        finally:
            stream.close()

    def write(self, batch: Batch, columns: dict[str, Any]) -> None:
        kept = put_missing(self.client, batch.partition, columns, batch.ids)
        if kept:
            self.log.info(
                "%d of %d rows were scored already (by a process before this one) or are gone",
                kept,
                len(batch),
            )

    def offload(self) -> None:
        from meshrl.runtime.offload import HostStore

        self.store = HostStore(self.ctx.run_dir / "offload" / f"{self.ctx.name}.bin")
        self.store.offload(self.model.named_parameters(remove_duplicate=False))

    def restore(self) -> None:
        self.store.restore()

    def close(self) -> None:
        if hasattr(self, "client"):
            self.client.close()
        super().close()
