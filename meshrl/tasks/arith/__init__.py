"""Single-digit addition: the smallest task on which a tiny model can learn, and RL can be measured.

There are exactly 100 problems (``a+b=`` for a, b in 0..9), so a run can score the whole task and its
held-out part exactly. The reward is programmatic: the completion must begin with the sum's digits,
and the digits must stop there.
"""

from __future__ import annotations

import random


def all_problems() -> list[dict]:
    """The 100 rows ``{"prompt": "a+b=", "answer": str(a+b), "a": a, "b": b}``, a then b ascending."""
    return [
        {"prompt": f"{a}+{b}=", "answer": str(a + b), "a": a, "b": b} for a in range(10) for b in range(10)
    ]


def split(seed: int = 0, eval_size: int = 20) -> tuple[list[dict], list[dict]]:
    """A (train, eval) split of the 100 problems: eval is `eval_size` rows drawn with `seed`.

    The same seed always gives the same split; the two parts are disjoint and together hold every
    problem, each part in the order of `all_problems`.
    """
    rows = all_problems()
    if not 0 <= eval_size <= len(rows):
        raise ValueError(f"eval_size: expected 0..{len(rows)}, got {eval_size}")
    held_out = set(random.Random(seed).sample(range(len(rows)), eval_size))
    train = [r for i, r in enumerate(rows) if i not in held_out]
    evaluation = [r for i, r in enumerate(rows) if i in held_out]
    return train, evaluation


def correct(completion: str, row: dict) -> bool:
    """Whether `completion` starts with exactly the answer's digits (then ends, or goes on with a non-digit).

    ``"7"``, ``"7<eos>"`` and ``"7 "`` answer 3+4; ``"71"``, ``" 7"`` and ``""`` do not.
    """
    answer = row["answer"]
    if not completion.startswith(answer):
        return False
    rest = completion[len(answer) :]
    return not rest or not rest[0].isdigit()


def reward(prompt: str, completion: str, row: dict) -> float:
    """1.0 for a `correct` completion, else 0.0 (`prompt` is accepted for a uniform reward signature)."""
    return 1.0 if correct(completion, row) else 0.0


def demonstrations(rows: list[dict]) -> list[dict]:
    """Rows for `meshrl sft`: each problem's prompt, and its answer as the completion (EOS follows)."""
    return [{"prompt": row["prompt"], "completion": row["answer"]} for row in rows]
