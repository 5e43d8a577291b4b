"""What rollout reads: dataset rows (a built-in task, local files, a dataset directory or a hub dataset
through `datasets.load_dataset`) and how a row's prompt becomes tokens (text, or chat messages through
the chat template, with an optional system prompt)."""

from __future__ import annotations

import importlib
import itertools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from meshrl.roles.rollout.config import BUILTIN_TASKS, RolloutConfig


def encode(tokenizer: Any, cfg: RolloutConfig, row: dict[str, Any]) -> torch.Tensor:
    """The prompt's token ids. A list of chat messages, or any prompt when a system prompt or the chat
    template is asked for, goes through the tokenizer's chat template (a string as one user message,
    the system prompt put first unless the messages bring their own)."""
    prompt = row[cfg.prompt_field]
    ids: Any
    if isinstance(prompt, list) or cfg.chat_template or cfg.system_prompt is not None:
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
        if cfg.system_prompt is not None and not (messages and messages[0].get("role") == "system"):
            messages = [{"role": "system", "content": cfg.system_prompt}, *messages]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    else:
        ids = tokenizer(str(prompt))["input_ids"]
    return torch.tensor(list(ids), dtype=torch.int64)


def check_lengths(
    rows: list[dict[str, Any]], encode: Callable[[dict[str, Any]], torch.Tensor], max_len: int
) -> None:
    """Stop at start-up when most of the first rows do not fit `max_len` tokens: a run that skips
    most of its data is a setting to raise, not a run to start (a chat template and system prompt
    easily add 30+ tokens to every prompt)."""
    sample = rows[:64]
    lengths = sorted(len(encode(r)) for r in sample)
    too_long = sum(n > max_len for n in lengths)
    if sample and too_long > len(sample) // 2:
        raise ValueError(
            f"rollout.max_prompt_len={max_len}: {too_long} of the first {len(sample)} prompts are longer "
            f"(chat template and system prompt included; median {lengths[len(lengths) // 2]} tokens, "
            f"longest {lengths[-1]}); raise rollout.max_prompt_len"
        )


def usable(prompt: Any) -> bool:
    """A prompt is non-empty text, or a non-empty list of {"role", "content"} messages."""
    if isinstance(prompt, str):
        return bool(prompt)
    return (
        isinstance(prompt, list)
        and bool(prompt)
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt)
    )


def load_rows(
    cfg: RolloutConfig, bad: list[str] | None = None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train rows, eval rows) from a built-in task, local files or `datasets.load_dataset`.

    A row that does not parse, is not an object, or has no usable `prompt_field` is skipped, with a
    line saying where and why appended to `bad`; a file in which no row has the field is an error.
    """
    bad = [] if bad is None else bad
    if cfg.dataset in BUILTIN_TASKS:
        task = importlib.import_module(BUILTIN_TASKS[cfg.dataset])
        train, held_out = task.split()
    else:
        train, held_out = _read(cfg, cfg.dataset, cfg.dataset_split, bad)[: cfg.max_rows], []
    if cfg.eval_dataset is not None and cfg.eval_dataset not in BUILTIN_TASKS:
        held_out = _read(cfg, cfg.eval_dataset, cfg.eval_split, bad)
    held_out = held_out[: cfg.eval_size]
    for name, path, rows in (("dataset", cfg.dataset, train), ("eval_dataset", cfg.eval_dataset, held_out)):
        good = [r for r in rows if usable(r.get(cfg.prompt_field))]
        if rows and not good:
            raise ValueError(
                f"rollout.{name}: rows have no field {cfg.prompt_field!r} (fields: {sorted(rows[0])}); "
                "set rollout.prompt_field"
            )
        for r in rows:
            if not usable(r.get(cfg.prompt_field)):
                bad.append(
                    f"{path}: row {r.get('_line', '?')}: no text or chat messages in field {cfg.prompt_field!r}"
                )
        rows[:] = good
    if not train:
        raise ValueError(f"rollout.dataset: {cfg.dataset!r} has no rows")
    return train, held_out


def _read(cfg: RolloutConfig, name: str, split: str, bad: list[str]) -> list[dict[str, Any]]:
    """Rows of a .jsonl file (line by line: a broken line is reported in `bad`, not fatal), or of
    anything else through `datasets.load_dataset`: a .json / .parquet / .csv file, a dataset directory
    (one `save_to_disk` wrote, or data files), or a hub name (from the local cache when offline)."""
    if name.endswith(".jsonl") and Path(name).is_file():
        return _read_jsonl(name, bad)
    if name.startswith("reasoning_gym:"):
        return _generate(name.partition(":")[2], cfg.dataset_kwargs, held_out=split != cfg.dataset_split)
    from datasets import load_dataset, load_from_disk

    path = Path(name)
    ds: Any
    if path.is_file():
        kind = {".parquet": "parquet", ".csv": "csv"}.get(path.suffix, "json")
        ds = load_dataset(kind, data_files=str(path.resolve()), split="train")
    elif (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
        ds = load_from_disk(str(path))
        ds = ds[split] if hasattr(ds, "keys") else ds
    else:
        ds = load_dataset(name, cfg.dataset_config, split=split, streaming=cfg.streaming)
    limit = cfg.max_rows if split == cfg.dataset_split else cfg.eval_size
    return [dict(r) for r in (ds if limit is None else itertools.islice(ds, limit))]


def _generate(task: str, kwargs: dict[str, Any], *, held_out: bool) -> list[dict[str, Any]]:
    """Rows {"prompt", "answer", "metadata"} of reasoning-gym task `task` (held-out: seed + 1)."""
    import reasoning_gym

    kwargs = {"seed": 0, **kwargs}
    if held_out:
        kwargs["seed"] += 1
    ds = reasoning_gym.create_dataset(task, **kwargs)
    return [{"prompt": x["question"], "answer": str(x["answer"]), "metadata": x["metadata"]} for x in ds]


def _read_jsonl(path: str, bad: list[str]) -> list[dict[str, Any]]:
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
