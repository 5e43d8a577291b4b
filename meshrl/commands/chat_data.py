"""Data for supervised fine-tuning (`meshrl sft`), read strictly, with a loss mask on what the model
should learn to write. A row is one of:

- a conversation: OpenAI-style `messages` (and optional `tools`), rendered as an agent's messages are
  (meshrl/envs/render.py: the chat template; tools, calls and results in the Hermes format where the
  template has no tools section); the mask covers the assistant messages' tokens;
- a prompt and a completion, both text: the prompt's tokens as rollout encodes a text prompt without
  the chat template (the tokenizer's own special tokens included), then the completion's and EOS; the
  mask covers the completion and EOS (a base model's warm start, `meshrl.tasks.arith`);
- a prompt and a completion, both lists of messages: the conversation `prompt + completion`.

A conversation may hold images, for a vision-language model: OpenAI `image_url` parts (data URLs), image
parts holding the image (`{"type": "image", "image": ...}`, or its `url` / `path`), or bare
`{"type": "image"}` placeholders that stand, in order, for the row's `images` field (PIL images, file
paths, `datasets` Image values, bytes or data URLs, as rollout reads them). Such a row is rendered by the
model's processor (meshrl/models/vision.py): every placeholder expanded into the image's tokens, and the
pixels carried beside the ids into the engine's batch. An image that does not decode, is over the pixel
limit (--max-pixels) or has no placeholder, and images for a text model, are errors naming the row.

The loss mask is RL's notion (meshrl/envs/trajectory.py): one 0/1 per token, 1 on the tokens the model
itself should produce. Few chat templates mark the assistant's text (`{% generation %}`), so it is found
by rendering: for each assistant message, the conversation before it (with and without the generation
prompt) and up to its end. The tokens the message adds, after the generation prompt (the role header
the model is given at inference), are its tokens: its content, tool calls and end-of-turn token. That
needs a template whose renderings of a conversation's prefixes are prefixes of the whole rendering in
tokens; one that rewrites earlier turns once more follow (some drop the reasoning of past turns) is
refused with the row's number rather than trained on a wrong mask.

A row that does not parse, has no messages, a malformed message or no assistant message is an error
naming the row: supervised data is small and curated, and a silently dropped row is a bug found late.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from meshrl.dataplane.batch import Ragged
from meshrl.engines.packing import TrainBatch, pack
from meshrl.envs.parsers import HermesParser
from meshrl.envs.render import Renderer
from meshrl.models import vision
from meshrl.models.vision import Images

Message = dict[str, Any]


class DataError(ValueError):
    """The data cannot be trained on as it is; the message names the file and row."""


@dataclass(frozen=True)
class Conversation:
    where: str
    """Its file and row, for error messages ("chats.jsonl: line 7")."""
    messages: list[Message]
    tools: list[dict[str, Any]] | None
    images: tuple[Any, ...] = ()
    """The row's `images` field: what its bare `{"type": "image"}` parts stand for, in order."""

    @property
    def has_images(self) -> bool:
        """Whether the conversation holds images (in its messages, or in its `images` field)."""
        return bool(self.images) or any(_image_parts(m) for m in self.messages)


@dataclass(frozen=True)
class Completion:
    where: str
    prompt: str
    completion: str


@dataclass(frozen=True)
class Example:
    ids: list[int]
    mask: list[int]
    """1 on the tokens of assistant messages, 0 elsewhere (one per id)."""
    truncated: bool
    images: Images | None = None
    """A vision-language model's pixels of the images whose tokens `ids` hold (None: no image)."""


def read_rows(path: str) -> list[Conversation | Completion]:
    """Every row of `path` (`row`): a .jsonl file (read line by line, numbered by line), or anything
    `datasets` opens (a .json / .parquet / .csv file, a directory `save_to_disk` wrote or of data files;
    numbered by row from 1)."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"{path}: no such file or directory")
    if p.is_file() and p.suffix == ".jsonl":
        return [row_of(r, where) for r, where in _jsonl(p)]
    from datasets import load_dataset, load_from_disk

    ds: Any
    if p.is_file():
        kind = {".parquet": "parquet", ".csv": "csv"}.get(p.suffix, "json")
        ds = load_dataset(kind, data_files=str(p.resolve()), split="train")
    elif (p / "dataset_info.json").is_file() or (p / "dataset_dict.json").is_file():
        ds = load_from_disk(str(p))
        ds = ds["train"] if hasattr(ds, "keys") else ds
    else:
        ds = load_dataset(str(p), split="train")
    return [row_of(dict(r), f"{path}: row {n}") for n, r in enumerate(ds, 1)]


def _jsonl(path: Path) -> list[tuple[Any, str]]:
    rows = []
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append((json.loads(line), f"{path}: line {n}"))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: line {n}: not JSON ({e.msg} at column {e.colno})") from None
    return rows


def row_of(row: Any, where: str) -> Conversation | Completion:
    """`row` checked: a conversation (`conversation`), or a "prompt" and a "completion" (text, or lists
    of messages: then the conversation of both)."""
    if not isinstance(row, dict) or "messages" in row or not {"prompt", "completion"} <= row.keys():
        return conversation(row, where)
    prompt, completion = row["prompt"], row["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        if not completion:
            raise DataError(f"{where}: an empty 'completion': nothing to learn from")
        return Completion(where, prompt, completion)
    if isinstance(prompt, list) and isinstance(completion, list):
        return conversation({**row, "messages": [*prompt, *completion]}, where)
    raise DataError(
        f"{where}: 'prompt' and 'completion' must both be text or both lists of messages, not a "
        f"{type(prompt).__name__} and a {type(completion).__name__}"
    )


def conversation(row: Any, where: str) -> Conversation:
    """`row` checked: {"messages": [{"role", "content", optional "tool_calls", ...}, ...], optional
    "tools": [function schemas]}, with at least one assistant message. Keys that are None (columns
    `datasets` fills in for every row) are dropped, and a None content becomes empty text."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: a {type(row).__name__}, not an object with 'messages'")
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: no 'messages' list (fields: {sorted(row)})")
    clean = []
    for k, m in enumerate(messages, 1):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise DataError(f"{where}: message {k} is not an object with a 'role'")
        m = {key: v for key, v in m.items() if v is not None}
        m["content"] = m.get("content", "")
        if not isinstance(m["content"], str | list):
            raise DataError(f"{where}: message {k}: 'content' is a {type(m['content']).__name__}")
        clean.append(m)
    if not any(m["role"] == "assistant" for m in clean):
        raise DataError(f"{where}: no assistant message: nothing to learn from")
    tools = row.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise DataError(f"{where}: 'tools' must be a list of function schemas")
    images = row.get("images")
    images = [] if images is None else images if isinstance(images, list | tuple) else [images]
    return Conversation(where, clean, tools or None, tuple(images))


def _image_parts(message: Message) -> list[dict[str, Any]]:
    content = message.get("content")
    if not isinstance(content, list):
        return []
    return [p for p in content if isinstance(p, dict) and p.get("type") in ("image", "image_url")]


@functools.cache
def renderer(tokenizer: Any) -> Renderer:
    """The renderer agents use (meshrl/envs/render.py), so a conversation trains on the tokens an agent
    sees: tools in the template's tools section, or, for a template without one, in the Hermes format
    (the tool list in the system prompt, calls and results as text)."""
    return Renderer(tokenizer, HermesParser())


def render(
    tokenizer: Any, messages: Sequence[Message], tools: list[dict[str, Any]] | None, *, generation: bool
) -> list[int]:
    """Token ids of `messages` through the chat template (with the generation prompt or not)."""
    return renderer(tokenizer).ids(messages, tools, generation=generation)


def chat_tokens(tokenizer: Any, chat: Conversation) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of a conversation: its whole rendering, 1 on the assistant messages' tokens (see
    the module docstring). Raises DataError when the template renders a prefix of the conversation
    differently from the start of the whole."""
    return _masked(chat, lambda n, generation: _render(tokenizer, chat, n, generation=generation))


def _masked(chat: Conversation, render: Any) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of `chat` given `render(n, generation)`, the token ids of its first n messages."""
    full = render(len(chat.messages), False)
    mask = [0] * len(full)
    for i, m in enumerate(chat.messages):
        if m["role"] != "assistant":
            continue
        before = render(i, False)
        prompt = render(i, True)
        through = render(i + 1, False)
        if through[: len(before)] != before or full[: len(through)] != through:
            raise DataError(
                f"{chat.where}: the chat template renders the conversation up to message {i + 1} "
                "differently from the start of the whole (it rewrites earlier turns once more follow), "
                "so the assistant's tokens cannot be told apart; split such conversations into one row "
                "per assistant turn"
            )
        # from the end of the generation prompt (the header the model is given), never before the turn
        start = max(len(before), _common_prefix(prompt, through))
        mask[start : len(through)] = [1] * (len(through) - start)
    return full, mask


def _render(tokenizer: Any, chat: Conversation, n: int, *, generation: bool) -> list[int]:
    """The first `n` messages rendered; no messages at all render as nothing (templates may refuse)."""
    if n == 0:
        try:
            return render(tokenizer, [], chat.tools, generation=generation)
        except Exception:  # a template that needs a message: the empty prefix is empty
            return []
    try:
        return render(tokenizer, chat.messages[:n], chat.tools, generation=generation)
    except Exception as e:  # the template's own error (an unknown role, ...), with the row
        raise DataError(f"{chat.where}: the chat template cannot render it: {e}") from e


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def image_chat_tokens(
    processor: Any, chat: Conversation, max_pixels: int
) -> tuple[list[int], list[int], Images | None]:
    """(ids, loss mask, pixels) of a conversation with images, rendered by a vision-language model's
    processor: as `chat_tokens`, every image placeholder expanded into the image's tokens."""
    if chat.tools:
        raise DataError(f"{chat.where}: tools and images in one row: a vision-language row takes no 'tools'")
    messages, images, per_message = _with_images(chat, max_pixels)
    done: dict[tuple[int, bool], tuple[list[int], Images | None]] = {}  # the processor is slow-ish: once each

    def encoded(n: int, generation: bool) -> tuple[list[int], Images | None]:
        if n == 0:
            return [], None
        if (n, generation) not in done:
            try:
                ids, pixels = vision.encode(
                    processor, messages[:n], images[: sum(per_message[:n])], chat.where, generation=generation
                )
            except ValueError as e:  # placeholders and images that do not match (the error names the row)
                raise DataError(str(e)) from None
            except Exception as e:  # the template's own error (an unknown role, ...), with the row
                raise DataError(f"{chat.where}: the chat template cannot render it: {e}") from e
            done[n, generation] = [int(i) for i in ids], pixels
        return done[n, generation]

    ids, mask = _masked(chat, lambda n, generation: encoded(n, generation)[0])
    return ids, mask, encoded(len(messages), False)[1]


def _with_images(chat: Conversation, max_pixels: int) -> tuple[list[Message], list[Any], list[int]]:
    """The messages as the processor's template takes them, the images they stand for (decoded, in the
    order of their parts: the `images` field's in the place of the bare placeholders) and how many each
    message holds."""
    try:
        filled = vision.fill_placeholders(chat.messages, list(chat.images), chat.where)
    except ValueError as e:
        raise DataError(str(e)) from None
    messages, images, per_message = [], [], []
    for m in filled:
        try:
            (out,), found = vision.split_messages([m], chat.where, max_pixels)
        except ValueError as e:  # an image that does not decode or is too large (the error names the row)
            raise DataError(str(e)) from None
        messages.append(out)
        images += found
        per_message.append(len(found))
    return messages, images, per_message


def completion_tokens(tokenizer: Any, row: Completion) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of a prompt and completion: the prompt as rollout encodes text, the completion
    and EOS after it, 1 on those."""
    prompt = [int(i) for i in tokenizer(row.prompt)["input_ids"]]
    answer = [int(i) for i in tokenizer(row.completion, add_special_tokens=False)["input_ids"]]
    if tokenizer.eos_token_id is None:
        raise DataError(f"{row.where}: the tokenizer has no EOS token to end the completion with")
    answer.append(int(tokenizer.eos_token_id))
    return prompt + answer, [0] * len(prompt) + [1] * len(answer)


def encode(
    tokenizer: Any,
    row: Conversation | Completion,
    max_len: int,
    *,
    processor: Any = None,
    max_pixels: int = vision.DEFAULT_MAX_PIXELS,
) -> Example:
    """The row's ids and mask, cut to `max_len` tokens. A conversation with images needs the
    vision-language model's `processor` (None: a text model, and such a row is an error); a cut that
    would split an image's tokens falls before that image, which is left out."""
    if isinstance(row, Completion):
        ids, mask = completion_tokens(tokenizer, row)
    elif row.has_images:
        if processor is None:
            raise DataError(
                f"{row.where}: a row with images, for a text model (no vision tower): give --model a "
                "vision-language model, or rows without images"
            )
        ids, mask, pixels = image_chat_tokens(processor, row, max_pixels)
        cut = len(ids) > max_len
        if cut and pixels is not None:
            ids, mask, pixels = _cut_images(processor, ids, mask, pixels, max_len)
        return Example(ids[:max_len], mask[:max_len], cut, pixels)
    else:
        ids, mask = chat_tokens(tokenizer, row)
    return Example(ids[:max_len], mask[:max_len], len(ids) > max_len)


def _cut_images(
    processor: Any, ids: list[int], mask: list[int], pixels: Images, max_len: int
) -> tuple[list[int], list[int], Images | None]:
    """`ids` to be cut at `max_len`: when the cut falls inside an image's tokens it moves before the
    first of them, and only the images left whole keep their pixels (the model takes as many images
    as its image tokens make: each of the processor's images, a tile or the whole, has as many)."""
    image_id = processor.tokenizer.convert_tokens_to_ids(getattr(processor, "image_token", "<image>"))
    at = [i for i, t in enumerate(ids) if t == image_id]
    per = len(at) // len(pixels)
    whole = sum(1 for i in at if i < max_len) // per if per else 0
    if whole < len(pixels):
        ids, mask = ids[: at[whole * per]], mask[: at[whole * per]]
    kept = None if whole == 0 else Images(pixels.pixels[:whole], pixels.mask[:whole])
    return ids, mask, kept


def to_batch(examples: Sequence[Example], pad_id: int) -> TrainBatch:
    """The engine's batch: each example a row, its masked tokens the positions the loss covers (as a
    response with a loss mask, `packing.pack`; the first token is the "prompt": nothing predicts it)."""
    n = len(examples)
    images = [e.images for e in examples] if any(e.images is not None for e in examples) else None
    return pack(
        [torch.tensor(e.ids[:1]) for e in examples],
        [torch.tensor(e.ids[1:]) for e in examples],
        None,
        torch.zeros(n),
        torch.ones(n, dtype=torch.bool),
        pad_id=pad_id,
        loss_mask=Ragged.from_list([torch.tensor(e.mask[1:], dtype=torch.int8) for e in examples]),
        images=images,
    )
