"""The trainer's line of metrics.jsonl for one step: its samples' summaries reduced over every rank,
the mini-batches' update statistics, and where the step's time went. Metric names and how each
reduces are in meshrl/observe/metrics.py."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from meshrl.algorithms.filters import groups_with_signal
from meshrl.dataplane import Batch
from meshrl.observe.metrics import JsonlSink, Metrics, merged
from meshrl.schema import ENV_S, PROMPT, QUEUED_S, RESPONSE, TOOL_ERROR_KINDS

log = logging.getLogger("meshrl.trainer")


def sample_metrics(parts: list[dict[str, torch.Tensor]], group: Any = None) -> dict[str, float]:
    """The step's per-sample summaries (one dict of per-row tensors per mini-batch), reduced over the
    ranks of `group` (None: this process alone)."""
    rows = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    trained = rows["valid"] & ~rows["dropped"]
    reward, advantage = rows["reward"][trained], rows["advantage"][trained]
    stale = rows["staleness"][~rows["dropped"]]
    lengths = rows["length"]
    m = Metrics()
    m.add("samples", float(len(lengths)))
    for name, values in (("reward", reward), ("advantage", advantage)):
        m.add(f"{name}_mean", values)
        m.add(f"{name}_std", values)
    m.add("advantage_absmax", advantage.double().abs())
    m.add("response_len_mean", lengths)
    m.add("response_len_max", lengths.double())
    m.add("failed", ~rows["valid"])
    m.add("staleness_mean", stale)
    m.add("staleness_max", stale.double())
    m.add("dropped_stale", rows["dropped"])
    m.add("no_signal_fraction", ~groups_with_signal(rows["reward"], rows["group"], rows["valid"]))
    m.add("continued", rows["continued"])
    if "turns" in rows:  # agents' trajectories (the environment's or a program's)
        m.add("agent/turns_mean", rows["turns"])
        m.add("agent/turns_max", rows["turns"])
        m.add("agent/sequences_mean", rows["sequences"])
        m.add("agent/truncated_turns", rows["truncated_turns"])
        m.add("agent/truncated_tokens", rows["truncated_tokens"])
        m.add("agent/generate_s_mean", rows["gen_s"])
        if "tool_calls" in rows:  # the environment service's trajectories (not an agent program's)
            m.add("agent/tool_calls_mean", rows["tool_calls"])
            for kind in TOOL_ERROR_KINDS:
                m.add(f"agent/tool_errors/{kind}", rows[f"tool_errors_{kind}"])
            m.add("agent/env_s_mean", rows[ENV_S])
            m.add("agent/queued_s_mean", rows[QUEUED_S])
    # each inference batch once (rows of one batch share its time); ranks may share batches: the max
    gen = dict(zip(rows["gen_batch"].tolist(), rows["gen_s"].tolist(), strict=True))
    m.add("time/generate_s", sum(gen.values()))
    return m.reduce(group)


def step_row(
    step: int,
    version: int,
    samples: dict[str, float],
    updates: list[dict[str, float]],
    times: dict[str, float],
) -> dict[str, Any]:
    """The metrics.jsonl line: `samples` (reduced over ranks), the mini-batches' update statistics
    (already global) merged, and the step's timings (`step_s`, `train_s`, `sync_s`, `publish_s`, `wait_s`,
    `ring_s`)."""
    update = merged(updates)
    fb, opt = update.pop("time/forward_backward_s", 0.0), update.pop("time/optimizer_s", 0.0)
    update.setdefault("nan_skipped", 0.0)
    gen_s, step_s, n = samples["time/generate_s"], times["step_s"], samples["samples"]
    return {
        "step": step,
        "version": version,
        **{k: v for k, v in samples.items() if not k.startswith("time/")},
        "samples": int(n),
        **update,
        "time/step_s": step_s,
        "time/generate_s": gen_s,
        "time/train_s": times["train_s"],
        "time/forward_backward_s": fb,
        "time/optimizer_s": opt,
        "time/sync_s": times["sync_s"],
        "time/publish_s": times["publish_s"],
        "time/wait_s": times["wait_s"],
        "time/ring_s": times["ring_s"],
        "overhead_fraction": max(0.0, 1.0 - (gen_s + fb + opt) / step_s) if step_s > 0 else 0.0,
        "samples_per_s": n / step_s if step_s > 0 else 0.0,
        "generate_tokens_per_s": samples["response_len_mean"] * n / gen_s if gen_s > 0 else 0.0,
    }


class SampleLog:
    """A few of each step's samples, decoded, in samples.jsonl (rank 0's): what the model wrote next to
    its reward, advantage and weight versions. The token ids are copied when the rows arrive, decoded
    when the step's line is written."""

    def __init__(self, path: Path, model: str, n: int, *, fresh: bool) -> None:
        # a resumed run appends: the steps it trains again get lines of their own
        self.sink, self.model, self.n = JsonlSink(path, keep=0 if fresh else None), model, n
        self.tokenizer: Any = None
        self.pending: list[dict[str, Any]] = []

    def take(self, batch: Batch, summary: dict[str, torch.Tensor], version: int) -> None:
        """Keep up to n rows of `batch` (spread over it: different groups) while the step has room."""
        room = self.n - len(self.pending)
        if room <= 0 or not len(batch):
            return
        prompts, responses = batch.ragged(PROMPT), batch.ragged(RESPONSE)
        for i in sorted({k * len(batch) // room for k in range(room)}):
            self.pending.append({
                "prompt_ids": prompts[i].tolist(), "completion_ids": responses[i].tolist(),
                "reward": float(summary["reward"][i]), "advantage": float(summary["advantage"][i]),
                "valid": bool(summary["valid"][i]), "born": int(version - summary["staleness"][i]),
                "staleness": int(summary["staleness"][i]),
            })  # fmt: skip

    def write(self, step: int, version: int) -> None:
        pending, self.pending = self.pending, []
        if not pending or not self._load_tokenizer():
            return
        for row in pending:
            prompt, completion = row.pop("prompt_ids"), row.pop("completion_ids")
            self.sink.write({
                "step": step, "version": version, "prompt": self.tokenizer.decode(prompt),
                "completion": self.tokenizer.decode(completion), **row,
            })  # fmt: skip

    def _load_tokenizer(self) -> bool:
        if self.tokenizer is None and self.model:
            try:
                from transformers import AutoTokenizer

                self.tokenizer = AutoTokenizer.from_pretrained(self.model)
            except Exception as e:
                log.warning("no sample completions in samples.jsonl: cannot load a tokenizer from %s (%s)",
                            self.model, e)  # fmt: skip
                self.model = ""
        return self.tokenizer is not None

    def close(self) -> None:
        self.sink.close()
