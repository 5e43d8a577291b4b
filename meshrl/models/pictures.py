"""The pictures beside a vision-language model's pixels, for an engine that runs its own image
processing (vLLM): the PICTURES column's format, and how a prompt whose image placeholders the
processor expanded goes back to one placeholder per image (meshrl/models/vision.py says why)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class Placeholders:
    """How a processor expands an image's placeholder, to undo it: an engine that expands placeholders
    itself (vLLM, from the pictures) takes a prompt holding one placeholder token per image. The
    expansion of a picture depends on its size only (the families' processors resize and tile by size),
    so it is computed once per size."""

    def __init__(self, processor: Any) -> None:
        self.processor = processor
        self.token: int = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
        self._by_size: dict[tuple[int, int], list[int]] = {}

    def expansion(self, picture: Any) -> list[int]:
        """The token ids one placeholder for `picture` becomes."""
        if picture.size not in self._by_size:
            from PIL import Image

            enc = self.processor(text=self.processor.image_token, images=[[Image.new("RGB", picture.size)]],
                                 add_special_tokens=False)  # fmt: skip
            self._by_size[picture.size] = list(enc["input_ids"][0])
        return self._by_size[picture.size]

    def collapse(self, ids: list[int], pictures: list[Any]) -> list[int]:
        """`ids` with each picture's expansion, in order, back to one placeholder token."""
        out, at = [], 0
        for n, picture in enumerate(pictures):
            span = self.expansion(picture)
            start = next(
                (i for i in range(at, len(ids) - len(span) + 1) if ids[i : i + len(span)] == span), None
            )
            if start is None:
                raise ValueError(
                    f"the prompt does not hold the tokens of its image {n} ({picture.width}x{picture.height}) as "
                    "this model's processor expands them"
                )
            out += [*ids[at:start], self.token]
            at = start + len(span)
        return out + ids[at:]


def pack(pictures: list[Any]) -> torch.Tensor:
    """RGB pictures as one row of the PICTURES column: per picture its height and width (4 bytes each,
    little-endian) then its bytes, row by row."""
    import numpy as np
    import torch

    parts = []
    for p in pictures:
        rgb = np.asarray(p.convert("RGB"), dtype=np.uint8)
        parts += [np.array(rgb.shape[:2], dtype="<u4").view(np.uint8), rgb.reshape(-1)]
    return torch.from_numpy(np.concatenate(parts)) if parts else torch.zeros(0, dtype=torch.uint8)


def unpack(row: torch.Tensor) -> list[Any]:
    """The pictures of one PICTURES row (`pack`)."""
    import numpy as np
    from PIL import Image

    data, out, at = row.numpy(), [], 0
    while at < len(data):
        h, w = (int(x) for x in data[at : at + 8].view("<u4"))
        at += 8
        out.append(Image.fromarray(np.ascontiguousarray(data[at : at + h * w * 3]).reshape(h, w, 3), "RGB"))
        at += h * w * 3
    return out
