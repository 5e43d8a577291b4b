"""A model folder's vocabulary and special ids, read without torch: the planner compares tokenizers
(a teacher's with the student's) in a process that never loads torch or transformers.

A folder with a `tokenizer.json` is read with the `tokenizers` library and its `tokenizer_config.json`
(special tokens by text); one without falls back to transformers' AutoTokenizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Vocabulary:
    tokens: dict[str, int]
    eos_id: int | None
    pad_id: int | None


def vocabulary(path: str) -> Vocabulary:
    """The vocabulary (added tokens included) and eos / pad ids of the tokenizer in folder `path`."""
    folder = Path(path)
    if not (folder / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
        return Vocabulary(dict(tok.get_vocab()), tok.eos_token_id, tok.pad_token_id)
    from tokenizers import Tokenizer

    tokens = Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab(with_added_tokens=True)
    special: dict[str, Any] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the latter wins
        if (folder / name).is_file():
            special.update(json.loads((folder / name).read_text()))

    def token_id(key: str) -> int | None:
        value = special.get(key)
        text = value.get("content") if isinstance(value, dict) else value
        return tokens.get(text) if isinstance(text, str) else None

    return Vocabulary(tokens, token_id("eos_token"), token_id("pad_token"))


def mismatch(teacher: str, student: str) -> str | None:
    """Why the tokenizer of `teacher` does not map text to the same ids as that of `student` (None when
    they are one tokenizer): a teacher's top-k ids index the student's vocabulary."""
    try:
        t, s = vocabulary(teacher), vocabulary(student)
    except Exception as e:  # reported as a recipe problem
        return f"cannot load the teacher's or the student's tokenizer: {e}"
    tv, sv = t.tokens, s.tokens
    if tv != sv:
        only_t, only_s = sorted(set(tv) - set(sv))[:5], sorted(set(sv) - set(tv))[:5]
        moved = sorted(k for k in set(tv) & set(sv) if tv[k] != sv[k])[:5]
        return (
            f"the teacher's tokenizer ({len(tv)} tokens) differs from the student's ({len(sv)} tokens): only "
            f"in the teacher {only_t}, only in the student {only_s}, different ids {moved}; distillation "
            "needs one vocabulary"
        )
    if (t.eos_id, t.pad_id) != (s.eos_id, s.pad_id):
        return f"the teacher's eos/pad ids {(t.eos_id, t.pad_id)} differ from the student's {(s.eos_id, s.pad_id)}"
    return None
