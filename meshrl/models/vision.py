"""Vision-language models: how a row's images become pixel tensors once, and how every model forward
takes them.

A vision-language checkpoint is a folder whose `config.json` has a `vision_config` and whose processor
files (`processor_config.json`, the image processor's settings, the chat template) sit beside the
tokenizer's. The service that encodes a row (rollout, meshrl sft) runs the model's processor once: the
prompt's token ids, with every image placeholder expanded exactly as the processor expands it, and per
image its pixels and pixel mask. Those travel as two data-plane columns (`schema.IMAGES`,
`schema.IMAGE_MASK`, ragged over the row's images), so inference, the trainer and the reference read
the same tensors and never decode or resize an image themselves.

An engine that runs its own image processing (vLLM takes pictures, not pixels) reads a third column,
`schema.PICTURES`: the row's decoded pictures as raw RGB bytes, the very images the pixels were made
from, so its processor makes the same pixels; it expands the placeholders itself too, so it is given
the prompt with each image's expansion collapsed back to one placeholder token
(meshrl/models/pictures.py).

The families supported are those whose forward places image features at the image tokens in order
and takes ordinary 1-D position ids (Idefics3 / SmolVLM): samples can then be batched, left-padded
for generation, and packed several to a row for training, with the images of the batch concatenated
in the order their tokens appear. Qwen2-VL's 3-D rotary positions are not (yet) among them.
"""

from __future__ import annotations

import base64
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshrl.models import pictures

if TYPE_CHECKING:  # the planner reads `is_vision` in a process that never loads torch
    import torch

SUPPORTED = ("idefics3", "smolvlm")
"""`model_type`s of the vision-language families meshrl trains."""
VISION_MODULES = r".*\.vision_model\..*"
"""The modules of a vision tower, by name (LoRA adapters leave them out unless the tower trains)."""
DEFAULT_MAX_PIXELS = 1024 * 1024
"""An image with more pixels (width x height, as decoded) than this is refused, naming its row."""


def config_of(model_path: str) -> dict[str, Any]:
    """The model folder's config.json ({} when there is none: a hub id or a gguf file)."""
    path = Path(model_path) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def is_vision(model_path: str) -> bool:
    """Whether the model in folder `model_path` has a vision tower (read without torch)."""
    return "vision_config" in config_of(model_path)


def check_model(model_path: str) -> str | None:
    """Why the vision-language model in `model_path` cannot be trained here (None when it can)."""
    cfg = config_of(model_path)
    kind = cfg.get("model_type")
    if kind not in SUPPORTED:
        return (
            f"{model_path}: a vision-language model of type {kind!r}; meshrl trains {list(SUPPORTED)} "
            "(families whose image features sit at their image tokens with 1-D positions)"
        )
    if (
        not (Path(model_path) / "processor_config.json").is_file()
        and not (Path(model_path) / "preprocessor_config.json").is_file()
    ):
        return f"{model_path}: a vision-language model without processor files (processor_config.json)"
    return None


def load_model(model_path: str, **kwargs: Any) -> Any:
    """The model of `model_path` with its language-model head: a causal LM, or a vision-language one."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if is_vision(model_path) else AutoModelForCausalLM
    return auto.from_pretrained(model_path, **kwargs)


def load_processor(model_path: str) -> Any:
    """The model's processor (image processor, tokenizer and chat template)."""
    import logging

    from transformers import AutoProcessor

    # without torchvision transformers says, once per load, that it uses its PIL image processor
    quiet = logging.getLogger("transformers.models.auto.image_processing_auto")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        return AutoProcessor.from_pretrained(model_path)
    finally:
        quiet.setLevel(level)


@dataclass
class Images:
    """A row's images as the model takes them: pixels [n, 3, H, W] float32, mask [n, H, W] bool; and
    the decoded pictures they were made from (RGB PIL images, for an engine that processes its own)."""

    pixels: torch.Tensor
    mask: torch.Tensor
    pictures: list[Any] = field(default_factory=list)

    def __len__(self) -> int:
        return self.pixels.shape[0]


def decode(image: Any, where: str, max_pixels: int = DEFAULT_MAX_PIXELS) -> Any:
    """A PIL image from what a dataset row may hold: a PIL image, a file path, `datasets`' Image dict
    ({"bytes", "path"}), raw bytes, or a data URL (`data:image/png;base64,...`). `where` names the row in
    the error of an image that does not decode or has more than `max_pixels` pixels."""
    from PIL import Image, UnidentifiedImageError

    try:
        if isinstance(image, Image.Image):
            pil = image
        elif isinstance(image, dict) and (image.get("bytes") or image.get("path")):
            pil = Image.open(io.BytesIO(image["bytes"])) if image.get("bytes") else Image.open(image["path"])
        elif isinstance(image, bytes | bytearray):
            pil = Image.open(io.BytesIO(image))
        elif isinstance(image, str) and image.startswith("data:"):
            head, _, data = image.partition(",")
            if ";base64" not in head:
                raise ValueError("a data URL that is not base64")
            pil = Image.open(io.BytesIO(base64.b64decode(data, validate=True)))
        elif isinstance(image, str):
            pil = Image.open(image)
        else:
            raise ValueError(f"a {type(image).__name__} is not an image")
        pil.load()
    except (OSError, ValueError, UnidentifiedImageError, base64.binascii.Error) as e:  # type: ignore[attr-defined]
        raise ValueError(f"{where}: an image that does not decode ({e})") from None
    if pil.width * pil.height > max_pixels:
        raise ValueError(
            f"{where}: an image of {pil.width}x{pil.height} pixels is over the limit of {max_pixels} "
            "(max_pixels: rollout.max_pixels in a run, --max-pixels in meshrl sft)"
        )
    return pil.convert("RGB")


def _image_of(part: Any) -> tuple[str | None, Any]:
    """A content part's image kind ("image_url" or "image"; None: not an image part) and the image it
    carries (an `image_url` part's URL; an `image` part's `image`, `url` or `path`; None: a bare
    `{"type": "image"}` placeholder)."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "image_url":
        url = part.get("image_url")
        return kind, url.get("url") if isinstance(url, dict) else url
    if kind == "image":
        return kind, next((part[k] for k in ("image", "url", "path") if part.get(k) is not None), None)
    return None, None


def _each_part(messages: list[dict[str, Any]], change: Any) -> list[dict[str, Any]]:
    """`messages` with every content part replaced by `change(part)` (text contents as they are)."""
    return [
        {**m, "content": [change(p) for p in m["content"]]} if isinstance(m.get("content"), list) else m
        for m in messages
    ]


def fill_placeholders(messages: list[dict[str, Any]], images: list[Any], where: str) -> list[dict[str, Any]]:
    """`messages` with their bare `{"type": "image"}` parts holding `images`, in the order they appear
    (a row's `images` field); more placeholders than images, or the reverse, is an error naming the row
    (`where`)."""
    left = list(images)

    def fill(part: Any) -> Any:
        if _image_of(part) != ("image", None):
            return part
        if not left:
            raise ValueError(
                f"{where}: more image placeholders than the {len(images)} image(s) of its 'images' field"
            )
        return {**part, "image": left.pop(0)}

    out = _each_part(messages, fill)
    if left:
        raise ValueError(
            f"{where}: {len(left)} of the {len(images)} image(s) of its 'images' field have no placeholder "
            '(a {"type": "image"} part) in its messages'
        )
    return out


def split_messages(
    messages: list[dict[str, Any]], where: str, max_pixels: int
) -> tuple[list[dict[str, Any]], list[Any]]:
    """Chat messages as a processor's chat template takes them ({"type": "image"} parts) and the images
    their parts carry, in order: an OpenAI `image_url` part (a data URL), or an `image` part holding the
    image itself (`image`, `url` or `path`)."""
    images: list[Any] = []

    def split(part: Any) -> Any:
        kind, source = _image_of(part)
        if kind == "image_url" or (kind == "image" and source is not None):
            images.append(decode(source, where, max_pixels))
            return {"type": "image"}
        return part

    return _each_part(messages, split), images


def encode(
    processor: Any,
    messages: list[dict[str, Any]],
    images: list[Any],
    where: str,
    *,
    generation: bool = True,
    **template: Any,
) -> tuple[torch.Tensor, Images | None]:
    """Token ids of `messages` through the processor's chat template (`template`: its other arguments,
    such as `tools`), every image placeholder expanded as the processor expands it, and the pixels of
    `images` (decoded PIL images, one per image part)."""
    import torch

    text = processor.apply_chat_template(
        messages, add_generation_prompt=generation, tokenize=False, **template
    )
    if not images:
        ids = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
        return torch.tensor(ids, dtype=torch.int64), None
    try:
        enc = processor(text=text, images=[images], return_tensors="pt", add_special_tokens=False)
    except ValueError as e:  # the placeholders and the images do not match
        raise ValueError(f"{where}: {e}") from None
    return enc["input_ids"][0].to(torch.int64), _images(enc, images)


def pixels(processor: Any, images: list[Any]) -> Images:
    """The pixels of `images` (PIL images, or anything `decode` takes), as `encode` makes them."""
    decoded = [decode(i, "an agent's image") for i in images]
    return _images(processor.image_processor([decoded], return_tensors="pt"), decoded)


def _images(enc: Any, pictures: list[Any]) -> Images:
    import torch

    pixels = enc["pixel_values"][0].float()
    mask = enc.get("pixel_attention_mask")
    mask = (
        torch.ones(pixels.shape[0], *pixels.shape[2:], dtype=torch.bool) if mask is None else mask[0].bool()
    )
    return Images(pixels.contiguous(), mask.contiguous(), [p.convert("RGB") for p in pictures])


def as_url(image: Any, where: str, max_pixels: int = DEFAULT_MAX_PIXELS) -> str:
    """`image` (anything `decode` takes) as a PNG data URL: how an agent's messages keep their images
    (they travel as JSON, in call rows)."""
    if isinstance(image, str) and image.startswith("data:"):
        decode(image, where, max_pixels)  # an image that does not decode fails here, naming where
        return image
    buf = io.BytesIO()
    decode(image, where, max_pixels).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_urls(messages: list[dict[str, Any]]) -> list[str]:
    """The data URLs of the image parts of `messages` (made by `with_urls`), in order."""
    return [
        p["image_url"]["url"]
        for m in messages
        if isinstance(m.get("content"), list)
        for p in m["content"]
        if isinstance(p, dict) and p.get("type") == "image_url"
    ]


def with_urls(
    messages: list[dict[str, Any]], where: str, max_pixels: int = DEFAULT_MAX_PIXELS
) -> list[dict[str, Any]]:
    """`messages` with every image part as an OpenAI `image_url` part holding a data URL."""

    def as_url_part(part: Any) -> Any:
        kind, source = _image_of(part)
        if kind is None:
            return part
        return {"type": "image_url", "image_url": {"url": as_url(source, where, max_pixels)}}

    return _each_part(messages, as_url_part)


def model_inputs(images: list[Images | None], device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """The vision inputs of one forward over rows whose images are `images` (None: a row without), in
    row order: the images of all rows as one [1, N, 3, H, W] batch (the model places image i at the
    i-th run of image tokens of the flattened batch), padded to the largest size; {} when there are none."""
    import torch

    present = [i for i in images if i is not None and len(i)]
    if not present:
        return {}
    h = max(i.pixels.shape[-2] for i in present)
    w = max(i.pixels.shape[-1] for i in present)
    n = sum(len(i) for i in present)
    pixels = present[0].pixels.new_zeros(1, n, 3, h, w)
    mask = torch.zeros(1, n, h, w, dtype=torch.bool)
    at = 0
    for i in present:
        k, ih, iw = len(i), i.pixels.shape[-2], i.pixels.shape[-1]
        pixels[0, at : at + k, :, :ih, :iw] = i.pixels
        mask[0, at : at + k, :ih, :iw] = i.mask
        at += k
    return {"pixel_values": pixels.to(device), "pixel_attention_mask": mask.to(device)}


def vision_tower(model: Any) -> Any:
    """The vision encoder of a vision-language model (None for a text model)."""
    inner = getattr(model, "model", None)
    return getattr(inner, "vision_model", None)


def blank(processor: Any) -> Images:
    """No images, shaped as the processor's images are (a text-only row of a vision-language run: every
    row of a column shares the trailing shape)."""
    from PIL import Image

    _, one = encode(
        processor, [{"role": "user", "content": [{"type": "image"}]}], [Image.new("RGB", (8, 8))], ""
    )
    assert one is not None
    return Images(one.pixels[:0].clone(), one.mask[:0].clone())


def columns(images: list[Images | None], empty: Images) -> dict[str, list[torch.Tensor]]:
    """The IMAGES, IMAGE_MASK and PICTURES columns of rows whose images are `images` (None: `empty`)."""
    from meshrl.schema import IMAGE_MASK, IMAGES, PICTURES

    rows = [empty if i is None else i for i in images]
    return {
        IMAGES: [i.pixels for i in rows],
        IMAGE_MASK: [i.mask for i in rows],
        PICTURES: [pictures.pack(i.pictures) for i in rows],
    }


def from_batch(batch: Any, rows: list[int] | None = None) -> list[Images | None] | None:
    """Each row's images from a claimed batch's IMAGES and IMAGE_MASK columns, with their pictures where
    the claim read PICTURES (None: the batch has no images)."""
    from meshrl.schema import IMAGE_MASK, IMAGES, PICTURES

    if IMAGES not in batch:
        return None
    pixels, masks = batch.ragged(IMAGES), batch.ragged(IMAGE_MASK)
    raw = batch.ragged(PICTURES) if PICTURES in batch else None
    pick = range(len(pixels)) if rows is None else rows
    return [
        Images(pixels[i].clone(), masks[i].bool().clone(), [] if raw is None else pictures.unpack(raw[i]))
        if len(pixels[i])
        else None
        for i in pick
    ]


def disagreement(model_path: str, columns: tuple[str, ...] | list[str]) -> str | None:
    """Why a service whose model is `model_path` and whose claim reads `columns` would not see the images
    the prompts were made with: a text model given a vision-language model's images, or a
    vision-language model whose prompts were encoded by a text tokenizer (no images written)."""
    from meshrl.schema import IMAGES

    if not Path(model_path).exists():
        return None  # reported as a missing path
    if IMAGES in columns and not is_vision(model_path):
        return (
            f"model: {model_path} is a text model, but rollout's model is a vision-language one (it writes "
            "images): every service of the run takes the same model family"
        )
    if IMAGES not in columns and is_vision(model_path):
        return (
            f"model: {model_path} is a vision-language model, but rollout's model is a text one (it writes no "
            "images): give rollout the same model, whose processor encodes the prompts' images"
        )
    return None
