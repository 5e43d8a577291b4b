"""A tiny character-level causal language model, built from nothing on the local machine.

Tests and the CPU demo need a real Hugging Face checkpoint (one that `AutoModelForCausalLM` and
`AutoTokenizer` load like any other) but cannot download one. This module makes one: a tokenizer with
one token per character and a randomly initialised Qwen2 (or Llama, or a Qwen3-MoE mixture of experts)
of about a million parameters.

Vocabulary, in id order (the order is fixed: checkpoints and tests rely on it):

- ``<pad>`` (0), ``<eos>`` (1), ``<|user|>`` (2), ``<|assistant|>`` (3): special tokens;
- the digits ``0``-``9`` (4-13), the lowercase letters ``a``-``z`` (14-39), the space (40), then
  ``+-*/=()?.,:`` (41-51).

Every character is one token and decoding joins tokens with nothing between them, so
``decode(encode(text)) == text`` for text made of these characters. Any other character (an uppercase
letter, a newline, ...) is encoded as ``?`` (`UNK_FALLBACK`) instead of failing. Nothing is added when
encoding: there is no BOS token (the config's ``bos_token_id`` is the EOS id, only so that code which
asks for one gets a valid id).

Tokens are stored in byte-level form (the space is the token ``Ġ``, every other character is itself)
and the tokenizer maps characters to bytes before the lookup. The reason: for a ``qwen2`` checkpoint,
transformers' `AutoTokenizer` ignores the saved pipeline and rebuilds its own byte-level BPE
(`Qwen2Tokenizer`) from the saved vocabulary. With byte-level tokens that rebuilt tokenizer gives the
same ids and the same decoded text for every supported character. Two differences remain there,
neither reachable by the arithmetic task: it drops unsupported characters instead of writing ``?``,
and it adds an unused ``<|endoftext|>`` token (id 52, past the model's vocabulary). A ``llama``
checkpoint loads this tokenizer exactly as saved.

The chat template renders ``<|user|>{content}`` for user messages and ``<|assistant|>{content}<eos>``
for assistant messages; ``add_generation_prompt`` appends ``<|assistant|>``. Other roles are an error.
The tokenizer pads on the left, as batched generation needs.

``reasoning=True`` makes the tokenizer of a reasoning model: two more special tokens, ``<think>`` (52) and
``</think>`` (53), and a template that behaves as Qwen3's does: it renders tool results (role ``tool``)
as ``<|user|>`` turns that are not queries, and drops the reasoning (up to ``</think>``) of every
assistant turn before the last user query when a conversation is rendered again.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

PAD = "<pad>"
EOS = "<eos>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
SPECIAL_TOKENS = (PAD, EOS, USER, ASSISTANT)
CHARACTERS = string.digits + string.ascii_lowercase + " " + "+-*/=()?.,:"
"""The supported characters, in vocabulary order."""
UNK_FALLBACK = "?"
"""The character that stands for any character outside `CHARACTERS`."""
BYTE_LEVEL_SPACE = "\u0120"
"""How byte-level tokenizers spell the space byte (``Ġ``); all other characters here spell themselves."""
MAX_POSITIONS = 128

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}<|user|>{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}<|assistant|>{{ message['content'] }}<eos>"
    "{% elif message['role'] == 'system' %}{{ message['content'] }} "
    "{% else %}{{ raise_exception('the tiny chat template knows only system, user and assistant roles') }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


VISION_TOKENS = ("<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>")
"""The special tokens of a vision-language model's tokenizer (Idefics3's image placeholders and turn end)."""

THINK, END_THINK = "<think>", "</think>"
REASONING_TEMPLATE = (
    "{% set ns = namespace(query=-1) %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.query = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'user' or m['role'] == 'tool' %}<|user|>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}{% set c = m['content'] %}"
    "{% if '</think>' in c and loop.index0 < ns.query %}{% set c = c.split('</think>')[-1] %}{% endif %}"
    "<|assistant|>{{ c }}<eos>"
    "{% elif m['role'] == 'system' %}{{ m['content'] }} "
    "{% else %}{{ raise_exception('the tiny chat template knows only system, user, tool and assistant roles') }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""A reasoning model's template, Qwen3's behaviour in the tiny model's format (see the module docstring)."""


def vocabulary(size: int | None = None) -> dict[str, int]:
    """Token -> id: special tokens first, then `CHARACTERS` in order, each in byte-level form; with `size`,
    filler tokens ``w<id>`` up to that many (see `build_tokenizer`)."""
    chars = [c if c != " " else BYTE_LEVEL_SPACE for c in CHARACTERS]
    vocab = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *chars))}
    return vocab | {f"w{i}": i for i in range(len(vocab), size or 0)}


def build_tokenizer(
    size: int | None = None, *, reasoning: bool = False, vision: bool = False
) -> PreTrainedTokenizerFast:
    """The character-level tokenizer (see the module docstring for its vocabulary and template).

    `size`: the vocabulary padded with filler tokens ``w<id>`` to that many, for a random-init model of a
    real model's vocabulary (benchmarks/gpu_check.py): every id it samples then decodes to some text.
    Encoding never produces a filler (text is cut into single characters first). `reasoning`: a
    reasoning model's tokenizer and template."""
    vocab = vocabulary(size)
    if reasoning:
        vocab = {**vocab, THINK: len(vocab), END_THINK: len(vocab) + 1}
    if vision:
        vocab = {**vocab, **{t: len(vocab) + i for i, t in enumerate(VISION_TOKENS)}}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_FALLBACK))
    # Special tokens are matched first; the rest is cut into single characters, each then spelled as
    # its bytes (an unsupported character thus becomes one unknown pre-token, one `?`).
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    core.decoder = decoders.ByteLevel()
    specials = [
        *SPECIAL_TOKENS,
        *((THINK, END_THINK) if reasoning else ()),
        *(VISION_TOKENS if vision else ()),
    ]
    core.add_special_tokens(specials)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        eos_token=EOS,
        additional_special_tokens=specials[2:],
        clean_up_tokenization_spaces=False,
        padding_side="left",
        model_max_length=MAX_POSITIONS,
    )
    tok.chat_template = REASONING_TEMPLATE if reasoning else CHAT_TEMPLATE
    return tok


ARCHITECTURES: dict[
    str, tuple[type[Qwen2Config] | type[LlamaConfig] | type[Qwen3MoeConfig], type[PreTrainedModel]]
] = {
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
}
"""The ``arch`` values `build_tiny_model` accepts."""
EXPERTS: dict[str, Any] = {"num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True}
"""The mixture of experts of arch "qwen3_moe": 4 experts in every layer, each token routed to 2, each
expert half the dense model's intermediate size (a token's compute is the dense model's)."""


def build_tiny_model(
    path: str | Path,
    *,
    arch: str = "qwen2",
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 384,
    seed: int = 0,
    reward_model: bool = False,
    reasoning: bool = False,
) -> Path:
    """Write a randomly initialised tiny model and its tokenizer to `path` and return `path`.

    reward_model=True writes a sequence-classification model with one label instead (what the
    reward-model service loads), with the same backbone. reasoning=True: a reasoning model's tokenizer
    and template (use arch="llama": a qwen2 checkpoint's tokenizer is rebuilt from its vocabulary).

    The weights depend only on the arguments: the same seed gives the same checkpoint. The caller's
    random number generators are left as they were.
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch: expected one of {sorted(ARCHITECTURES)}, got {arch!r}")
    config_class, model_class = ARCHITECTURES[arch]
    tok = build_tokenizer(reasoning=reasoning)
    pad, eos = tok.pad_token_id, tok.eos_token_id
    cfg = config_class(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        pad_token_id=pad,
        bos_token_id=eos,
        eos_token_id=eos,
        dtype=torch.float32,
        **({**EXPERTS, "moe_intermediate_size": intermediate_size // 2} if arch == "qwen3_moe" else {}),
    )
    if reward_model:
        from transformers import AutoModelForSequenceClassification

        cfg.num_labels = 1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_config(cfg) if reward_model else model_class(cfg)
    model.generation_config = GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=pad)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


VISION_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}<|user|>{% elif message['role'] == 'assistant' %}<|assistant|>"
    "{% elif message['role'] == 'system' %}{% else %}"
    "{{ raise_exception('the tiny chat template knows only system, user and assistant roles') }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if message['role'] == 'assistant' %}<eos>{% elif message['role'] == 'system' %} {% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""The tiny template with content parts: an image part renders as the processor's `<image>` placeholder."""


def build_tiny_vlm(
    path: str | Path,
    *,
    image_size: int = 32,
    patch_size: int = 8,
    vision_hidden: int = 64,
    vision_layers: int = 2,
    hidden_size: int = 128,
    num_layers: int = 4,
    seed: int = 0,
) -> Path:
    """Write a randomly initialised tiny vision-language model (Idefics3, the SmolVLM family: a SigLIP
    vision tower, a pixel-shuffle connector and a Llama language model over the character tokenizer)
    with its processor to `path`. Images are resized to `image_size` pixels on their longest side (no
    splitting into tiles) and become (image_size / patch_size)^2 / 4 image tokens each."""
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessor,
        Idefics3Processor,
    )

    tok = build_tokenizer(vision=True)
    tok.chat_template = VISION_TEMPLATE
    pad, eos = tok.pad_token_id, tok.eos_token_id
    text = LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=3 * hidden_size, max_position_embeddings=4 * MAX_POSITIONS,
        tie_word_embeddings=True, pad_token_id=pad, bos_token_id=eos, eos_token_id=eos,
    )  # fmt: skip
    vision = {"hidden_size": vision_hidden, "intermediate_size": 2 * vision_hidden, "num_hidden_layers": vision_layers,
              "num_attention_heads": 2, "image_size": image_size, "patch_size": patch_size}  # fmt: skip
    cfg = Idefics3Config(
        text_config=text.to_dict(), vision_config=vision, scale_factor=2, tie_word_embeddings=True,
        image_token_id=len(vocabulary()), pad_token_id=pad, dtype=torch.float32,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Idefics3ForConditionalGeneration(cfg)
    model.generation_config = GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=pad)
    images = Idefics3ImageProcessor(
        do_image_splitting=False,
        size={"longest_edge": image_size},
        max_image_size={"longest_edge": image_size},
    )
    seq_len = (image_size // patch_size) ** 2 // 4
    processor = Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=seq_len,
                                  chat_template=VISION_TEMPLATE)  # fmt: skip
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    tok.save_pretrained(out)
    return out
