"""What rollout reads and how it scores: dataset rows (a built-in task or local JSONL / JSON / parquet
files) and the rule reward of completions (the recipe's `module:function`)."""

from __future__ import annotations

import importlib
import itertools
import json
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from meshrl.columns import RESPONSE
from meshrl.dataplane import Batch
from meshrl.roles.rollout.config import BUILTIN_TASKS, RolloutConfig

RewardFn = Callable[[str, str, dict[str, Any]], float]


def rule_rewards(
    tokenizer: Any, reward_fn: RewardFn, prompt_field: str, batch: Batch, rows: list[dict[str, Any]]
) -> tuple[torch.Tensor, torch.Tensor, str | None]:
    """(reward, valid, traceback of the first failure or None) of the batch's completions. Each
    completion is decoded without its stop token; `reward_fn(prompt, completion, row)` gets the row
    `rows[prompt_id]`. A call that raises or returns a non-finite number marks that sample invalid."""
    out = [0.0] * len(batch)
    valid = [True] * len(batch)
    failure = None
    responses = batch.ragged(RESPONSE)
    eos = set(tokenizer.all_special_ids) & {tokenizer.eos_token_id}
    flat, bounds = responses.values.tolist(), responses.offsets.tolist()
    answers = []
    for a, b in itertools.pairwise(bounds):
        while b > a and flat[b - 1] in eos:  # the stop token is not part of the answer
            b -= 1
        answers.append(flat[a:b])
    texts = tokenizer.batch_decode(answers, skip_special_tokens=False)
    for i, (pid, completion) in enumerate(zip(batch.meta_of("prompt_id"), texts, strict=True)):
        row = rows[int(pid)]
        try:
            value = float(reward_fn(str(row[prompt_field]), completion, row))
            if value != value or value in (float("inf"), float("-inf")):
                raise ValueError(f"reward function returned {value}")
            out[i] = value
        except Exception:
            valid[i] = False
            if failure is None:
                failure = f"on prompt {pid}:\n{traceback.format_exc()}"
    return torch.tensor(out, dtype=torch.float32), torch.tensor(valid, dtype=torch.bool), failure


def encode(tokenizer: Any, cfg: RolloutConfig, row: dict[str, Any]) -> torch.Tensor:
    """The prompt's token ids: the row's `prompt_field`, through the chat template (as one user
    message) when the config asks for it."""
    text = str(row[cfg.prompt_field])
    ids: Any
    if cfg.chat_template:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    else:
        ids = tokenizer(text)["input_ids"]
    return torch.tensor(list(ids), dtype=torch.int64)


def load_rows(
    cfg: RolloutConfig, bad: list[str] | None = None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train rows, eval rows) from a built-in task or local files.

    A row that does not parse, is not an object, or has no usable `prompt_field` is skipped, with a
    line saying where and why appended to `bad`; a file in which no row has the field is an error.
    """
    bad = [] if bad is None else bad
    if cfg.dataset in BUILTIN_TASKS:
        task = importlib.import_module(BUILTIN_TASKS[cfg.dataset])
        train, held_out = task.split()
    else:
        train, held_out = _read(cfg.dataset, bad), []
    if cfg.eval_dataset is not None and cfg.eval_dataset not in BUILTIN_TASKS:
        held_out = _read(cfg.eval_dataset, bad)
    for name, path, rows in (("dataset", cfg.dataset, train), ("eval_dataset", cfg.eval_dataset, held_out)):
        usable = [r for r in rows if isinstance(r.get(cfg.prompt_field), str) and r[cfg.prompt_field]]
        if rows and not usable:
            raise ValueError(
                f"rollout.{name}: rows have no field {cfg.prompt_field!r} (fields: {sorted(rows[0])}); "
                "set rollout.prompt_field"
            )
        for r in rows:
            if not (isinstance(r.get(cfg.prompt_field), str) and r[cfg.prompt_field]):
                bad.append(f"{path}: row {r.get('_line', '?')}: no text in field {cfg.prompt_field!r}")
        rows[:] = usable
    if not train:
        raise ValueError(f"rollout.dataset: {cfg.dataset!r} has no rows")
    return train, held_out


def _read(path: str, bad: list[str]) -> list[dict[str, Any]]:
    """Rows of a .jsonl file (line by line: a broken line is reported in `bad`, not fatal), or of a
    .json / .parquet file through `datasets`."""
    if path.endswith(".jsonl"):
        rows = []
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    bad.append(f"{path}: line {n}: not JSON ({e.msg})")
                    continue
                if not isinstance(row, dict):
                    bad.append(f"{path}: line {n}: a {type(row).__name__}, not an object")
                    continue
                rows.append({**row, "_line": n})
        return rows
    from datasets import load_dataset

    kind = "parquet" if path.endswith(".parquet") else "json"
    ds = load_dataset(kind, data_files=str(Path(path).resolve()), split="train")
    return [dict(r) for r in ds]
