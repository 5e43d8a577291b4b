"""Shapes: questions about small generated pictures whose answer is in the picture alone, for
vision-language models (`recipes/grpo_vlm.py`, `meshrl demo vlm`).

Each row is one 32x32 picture drawn here with PIL, deterministically from a seed: a few filled shapes
(circle, square, triangle) in distinct colours on a white background, and one question about it.

- "colour" (the default): the colour of the largest shape (by area: at least MARGIN times any
  other's), among `COLOURS`, answered with the colour's name. The other shapes (none to two) are
  distractors.
- "count": how many shapes there are (1 to 4), answered with the digit.

The question's text is the same for every row of a kind, so without the picture the best a model can
do is guess the most common answer: `chance(rows)` is that accuracy (1 / len(COLOURS) for colour).

A row is ``{"prompt": [a user message: the question, then an image part], "images": [the picture as a
PNG data URL], "answer": "red", "kind": ..., "shapes": [[shape, colour, x, y, size], ...]}``: the
prompt's `{"type": "image"}` part stands for the `images` field's picture, as rollout (its
`images_field`) and `meshrl sft` read it. `blank(row)` is the row with a plain white picture instead.

The reward is programmatic, as arithmetic's: 1.0 when the completion begins with the answer and the
answer stops there (the model's EOS, a space or punctuation may follow), else 0.0.
"""

from __future__ import annotations

import base64
import hashlib
import io
import random
from typing import Any

SIZE = 32
"""Pictures are SIZE x SIZE pixels (the tiny vision-language model's image size)."""
COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 160, 40),
    "blue": (30, 60, 220),
    "yellow": (235, 205, 20),
    "purple": (140, 40, 170),
    "orange": (245, 130, 20),
}
SHAPES = ("circle", "square", "triangle")
QUESTIONS = {"colour": "colour of the largest shape?", "count": "how many shapes?"}
MAX_COUNT = 4
MARGIN = 1.5
"""For "colour": the largest shape covers at least this many times the pixels of any other."""
TRAIN_SIZE = 4000
EVAL_SIZE = 200


def _draw(shapes: list[list[Any]]) -> Any:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    for shape, colour, x, y, s in shapes:
        fill = COLOURS[colour]
        box = (x, y, x + s - 1, y + s - 1)
        if shape == "circle":
            draw.ellipse(box, fill=fill)
        elif shape == "square":
            draw.rectangle(box, fill=fill)
        else:
            draw.polygon([(x + (s - 1) / 2, y), (x, y + s - 1), (x + s - 1, y + s - 1)], fill=fill)
    return img


def picture(row: dict[str, Any]) -> Any:
    """The row's picture, drawn again from its `shapes` (a PIL image)."""
    return _draw(row["shapes"])


def data_url(image: Any) -> str:
    """A PIL image as a PNG data URL."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _place(rng: random.Random, sizes: list[int]) -> list[tuple[int, int]] | None:
    """Top-left corners for squares of `sizes` inside the picture, none overlapping (None: no room)."""
    boxes: list[tuple[int, int, int]] = []
    for s in sizes:
        for _ in range(50):
            x, y = rng.randint(0, SIZE - s), rng.randint(0, SIZE - s)
            if all(x + s < bx or bx + bs < x or y + s < by or by + bs < y for bx, by, bs in boxes):
                boxes.append((x, y, s))
                break
        else:
            return None
    return [(x, y) for x, y, _ in boxes]


def areas(shapes: list[list[Any]]) -> dict[str, int]:
    """Pixels of each colour in the picture of `shapes` (the shapes do not overlap: each one's area)."""
    counts = {rgb: n for n, rgb in _draw(shapes).getcolors(SIZE * SIZE)}
    return {colour: counts.get(COLOURS[colour], 0) for _, colour, *_ in shapes}


def _shapes(rng: random.Random, kind: str) -> list[list[Any]]:
    """The shapes of one picture: [shape, colour, x, y, size] each; for "colour" the largest first (by
    area, at least MARGIN times any other's)."""
    n = rng.randint(1, 3) if kind == "colour" else rng.randint(1, MAX_COUNT)
    while True:  # until the shapes fit without overlapping (the count stays as drawn)
        if kind == "colour":
            big = rng.randint(12, 18)
            sizes = [big] + [rng.randint(5, big - 3) for _ in range(n - 1)]
        else:
            sizes = [rng.randint(6, 10) for _ in range(n)]
        corners = _place(rng, sizes)
        if corners is None:
            continue
        colours = rng.sample(sorted(COLOURS), n)
        drawn: list[list[Any]] = [
            [rng.choice(SHAPES), c, x, y, s] for c, (x, y), s in zip(colours, corners, sizes, strict=True)
        ]
        if kind == "colour":
            area = areas(drawn)
            drawn.sort(key=lambda shape: -area[shape[1]])
            if n > 1 and area[drawn[0][1]] < MARGIN * area[drawn[1][1]]:
                continue
        return drawn


def make_row(rng: random.Random, kind: str = "colour") -> dict[str, Any]:
    """One row of `kind` drawn with `rng` (see the module docstring)."""
    if kind not in QUESTIONS:
        raise ValueError(f"kind: one of {sorted(QUESTIONS)}, not {kind!r}")
    shapes = _shapes(rng, kind)
    answer = shapes[0][1] if kind == "colour" else str(len(shapes))
    return {
        "prompt": [
            {"role": "user", "content": [{"type": "text", "text": QUESTIONS[kind]}, {"type": "image"}]}
        ],
        "images": [data_url(_draw(shapes))],
        "answer": answer,
        "kind": kind,
        "shapes": shapes,
    }


def generate(n: int, seed: int, kind: str = "colour") -> list[dict[str, Any]]:
    """`n` rows of `kind`, the same for the same seed."""
    rng = random.Random(f"shapes/{kind}/{seed}")
    return [make_row(rng, kind) for _ in range(n)]


def _key(row: dict[str, Any]) -> str:
    return hashlib.sha1(row["images"][0].encode()).hexdigest()


def split(
    seed: int = 0, eval_size: int = EVAL_SIZE, train_size: int = TRAIN_SIZE, kind: str = "colour"
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, held out): `train_size` rows from `seed` and `eval_size` from another stream; a held-out
    picture never appears in the train rows (identical pictures are drawn again)."""
    train = generate(train_size, seed, kind)
    seen = {_key(r) for r in train}
    rng = random.Random(f"shapes/{kind}/{seed}/held-out")
    held: list[dict[str, Any]] = []
    while len(held) < eval_size:
        row = make_row(rng, kind)
        if _key(row) not in seen:
            seen.add(_key(row))
            held.append(row)
    return train, held


def chance(rows: list[dict[str, Any]]) -> float:
    """Accuracy of always giving the most common answer of `rows`: the best without the picture."""
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["answer"]] = counts.get(r["answer"], 0) + 1
    return max(counts.values()) / len(rows) if rows else 0.0


def blank(row: dict[str, Any]) -> dict[str, Any]:
    """`row` with a plain white picture of the same size: the question without its answer."""
    from PIL import Image

    white = data_url(Image.new("RGB", (SIZE, SIZE), (255, 255, 255)))
    return {**row, "images": [white for _ in row["images"]]}


def correct(completion: str, row: dict[str, Any]) -> bool:
    """Whether `completion` starts with exactly the answer (then ends, or goes on with a character that
    is not a letter or digit): "red", "red<eos>" and "red." answer red; "reddish", " red" do not."""
    answer = row["answer"]
    if not completion.startswith(answer):
        return False
    rest = completion[len(answer) :]
    return not rest or not rest[0].isalnum()


def reward(prompt: Any, completion: Any, row: dict[str, Any]) -> float:
    """1.0 for a `correct` completion (text, or a chat completion: the assistant's message), else 0.0."""
    from meshrl.rewards import text_of

    return 1.0 if correct(text_of(completion), row) else 0.0


def demonstrations(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat rows for `meshrl sft`: each row's question, the picture in its `images` field, and the
    answer as the assistant's message."""
    return [
        {
            "messages": [*row["prompt"], {"role": "assistant", "content": row["answer"]}],
            "images": row["images"],
        }
        for row in rows
    ]
