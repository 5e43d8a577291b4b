"""Built-in reward functions, TRL's batched signature (they run under TRL unchanged too).

    rewards={"meshrl.rewards:math_answer": 1.0, "meshrl.rewards:answer_format": 0.2}

- `math_answer`: 1.0 when the completion's final answer equals the row's `answer` column, numerically
  or symbolically (the `math-verify` package: "1/2", "0.5" and "\\frac{1}{2}" agree), else 0.0; None
  for a row without an answer (left out of the mean). The final answer is the last
  `<answer>...</answer>`, else the text after the last "Answer:", else the last `\\boxed{}` or number.
- `answer_format`: 1.0 when the completion states its answer in one of those explicit forms, else
  0.0: a small weight on it keeps the answer tag from being trained away.

`in_process` marks a function to run in a worker process instead of a thread (see
meshrl/roles/rollout/reward_functions.py).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def in_process(fn: F) -> F:
    """Mark a reward function to run in a worker process rather than on a thread (CPU-bound Python that
    would hold the GIL, or code that needs a main thread: signal-based time limits). It must be a
    module-level function (the worker imports it by name) taking and returning plain values."""
    fn.meshrl_in_process = True  # type: ignore[attr-defined]
    return fn


_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_LINE = re.compile(r"answer\s*:\s*(.+)", re.IGNORECASE)
_BOXED = re.compile(r"\\boxed\{")


def text_of(completion: Any) -> str:
    """A completion's text: a string, or TRL's conversational list of messages (the last one's)."""
    if isinstance(completion, list):
        return str(completion[-1]["content"]) if completion else ""
    return str(completion)


def final_answer(text: str) -> str:
    """The part of `text` holding its final answer (see the module docstring)."""
    tags = _TAG.findall(text)
    if tags:
        return str(tags[-1]).strip()
    lines = _LINE.findall(text)
    if lines:
        return str(lines[-1]).strip()
    return text


@in_process
def math_answer(prompts: list[Any], completions: list[Any], **columns: Any) -> list[float | None]:
    """Whether each completion's final answer equals its row's `answer` (math-verify's equality). It runs
    in a worker process, whose main thread gives math-verify its time limits."""
    from math_verify import parse, verify

    # math-verify's time limits use SIGALRM, which only the main thread may set: off it, none
    limit = 5 if threading.current_thread() is threading.main_thread() else None
    answers = columns.get("answer") or [None] * len(completions)
    out: list[float | None] = []
    for completion, answer in zip(completions, answers, strict=True):
        if answer is None or str(answer).strip() == "":
            out.append(None)
            continue
        gold = parse(str(answer), parsing_timeout=limit)
        if not gold:  # an answer math-verify cannot read: compare the text itself
            out.append(float(final_answer(text_of(completion)) == str(answer).strip()))
            continue
        guess = parse(final_answer(text_of(completion)), parsing_timeout=limit)
        out.append(float(verify(gold, guess, timeout_seconds=limit)))
    return out


def answer_format(prompts: list[Any], completions: list[Any], **columns: Any) -> list[float | None]:
    """1.0 for a completion that states its answer as `<answer>...</answer>`, "Answer: ..." or
    `\\boxed{...}`, else 0.0."""
    out: list[float | None] = []
    for completion in completions:
        text = text_of(completion)
        out.append(float(bool(_TAG.search(text) or _LINE.search(text) or _BOXED.search(text))))
    return out
