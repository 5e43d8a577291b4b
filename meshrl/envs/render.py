"""Messages to token ids with a model's chat template: the one renderer of every agent (an environment's
turns, a program's calls through the endpoint, `meshrl sft`'s chat rows).

- `prompt(messages, tools)` is the whole rendering, ending with the generation prompt. Tools go to the
  template's tools section; a template without one gets the tool list in its system prompt in the
  parser's format (the Hermes block; nothing for the plain format, whose model learns its tools from
  its training), and the model's calls and the tools' results as text in that format (results in the
  role `tool_role`: "user" for templates without a tool role).
- `extend(ids, history, new, tools)` is a conversation's next prompt built on its last prompt and
  answer exactly as generated (`ids`: never decoded and re-tokenized): `ids`, the end of the assistant
  turn (its stop token, if generation was cut before it, and what the template puts after it), then
  the new messages (tool results, user turns) as the template renders them after a finished assistant
  turn: the tokens after a dummy assistant turn's stop token, found once per distinct reply.

A template may render earlier turns differently once more follow: reasoning templates (Qwen3's) drop
the `<think>...</think>` of assistant turns before the last user message. A probe at start-up tells
whether the template ever does; if it does, `extend` compares, per call, the template's rendering of the
history with and without the new messages: where the history stays as it was, the tokens are extended;
where the template rewrites it, `extend` returns None and the caller renders the prompt whole, a new
segment of the trajectory (meshrl/envs/trajectory.py), so the model sees the history the template
gives it. With `keep_reasoning` the history keeps the tokens as generated, reasoning included, and
nothing splits.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from meshrl.envs.parsers import Parser, arguments
from meshrl.models import vision

Message = dict[str, Any]
_DUMMY: list[Message] = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
_PROBES: list[list[Message]] = [
    _DUMMY,
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "<think>\nr\n</think>\n\nb"}],
]
"""Conversations the start-up probe follows with a user turn and a tool result."""


class Renderer:
    def __init__(
        self,
        tokenizer: Any,
        parser: Parser,
        *,
        tool_role: str = "tool",
        keep_reasoning: bool = False,
        processor: Any = None,
    ) -> None:
        """`processor`: a vision-language model's, which renders messages with image parts (OpenAI
        `image_url` parts holding data URLs: `vision.with_urls`), their placeholders expanded."""
        self.tokenizer, self.parser, self.processor = tokenizer, parser, processor
        self.tool_role, self.keep_reasoning = tool_role, keep_reasoning
        eos = tokenizer.eos_token_id
        self.stop = int(eos) if eos is not None else -1  # no EOS: only whole renderings (`meshrl sft`)
        self.renders_tools = "tools" in str(getattr(tokenizer, "chat_template", "") or "")
        self._after: dict[tuple[str, tuple[str, ...]], list[int]] = {}
        self.rewrites = any(self._probe(p, role) for p in _PROBES for role in ("user", "tool"))
        """Whether the template renders an earlier turn differently once more follow (reasoning)."""

    def prompt(self, messages: Sequence[Message], tools: list[Message] | None = None) -> list[int]:
        """The whole rendering of `messages`, ending with the generation prompt."""
        return self.ids(messages, tools, generation=True)

    def extend(
        self, ids: list[int], history: Sequence[Message], new: Sequence[Message], tools: list[Message] | None
    ) -> list[int] | None:
        """The prompt after `history` (whose last prompt and answer are `ids`) and the `new` messages, on
        `ids` exactly as generated; None where it must be rendered whole (see the module docstring)."""
        if not new or any(m["role"] not in ("tool", "user") for m in new):
            return None
        if self.rewrites and not self.keep_reasoning and self._rewritten(history, new, tools):
            return None
        after = self._tail(new, tools)
        return [*ids, *after] if ids and ids[-1] == self.stop else [*ids, self.stop, *after]

    def decode(self, ids: Sequence[int]) -> str:
        """The model's turn as text, without its stop token (special tokens kept: tool-call tags may be
        special tokens)."""
        ids = list(ids)
        while ids and ids[-1] == self.stop:
            ids.pop()
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))

    def ids(self, messages: Sequence[Message], tools: list[Message] | None, *, generation: bool) -> list[int]:
        """Token ids of `messages` through the template (with the generation prompt or not)."""
        msgs, kw = self._for_template(messages, tools)
        if self.processor is not None:
            msgs, images = vision.split_messages(msgs, "an agent's messages", vision.DEFAULT_MAX_PIXELS)
            return vision.encode(self.processor, msgs, images, "an agent's messages", generation=generation,
                                 **kw)[0].tolist()  # fmt: skip
        ids = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=generation, tokenize=True, **kw)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        return [int(i) for i in ids]

    def _text(self, messages: Sequence[Message], tools: list[Message] | None, *, generation: bool) -> str:
        msgs, kw = self._for_template(messages, tools)
        template = self.tokenizer
        if self.processor is not None:
            msgs, _ = vision.split_messages(msgs, "an agent's messages", vision.DEFAULT_MAX_PIXELS)
            template = self.processor
        return str(template.apply_chat_template(msgs, add_generation_prompt=generation, tokenize=False, **kw))

    def _probe(self, history: list[Message], role: str) -> bool:
        try:
            return self._rewritten(history, [{"role": role, "content": "c"}], None)
        except Exception:  # a template that refuses the probe's roles or contents
            return False

    def _rewritten(
        self, history: Sequence[Message], new: Sequence[Message], tools: list[Message] | None
    ) -> bool:
        before = self._text(history, tools, generation=False)
        return not self._text([*history, *new], tools, generation=True).startswith(before)

    def _tail(self, new: Sequence[Message], tools: list[Message] | None) -> list[int]:
        """What the template puts after a finished assistant turn's stop token, `new` included, up to the
        next generation prompt (rendered once per distinct reply: feedback repeats a lot)."""
        key = json.dumps(new, sort_keys=True, default=str), tuple(t["function"]["name"] for t in tools or ())
        found = self._after.get(key)
        if found is None:
            turn_end = self.ids(_DUMMY, tools, generation=False).count(self.stop)  # the dummy's last stop
            full = self.ids([*_DUMMY, *new], tools, generation=True)
            stops = [i for i, t in enumerate(full) if t == self.stop]
            if len(stops) < turn_end:
                raise ValueError(
                    "the chat template does not end an assistant turn with the tokenizer's EOS token"
                )
            found = full[stops[turn_end - 1] + 1 :]
            if len(self._after) < 65536:
                self._after[key] = found
        return found

    def _for_template(
        self, messages: Sequence[Message], tools: list[Message] | None
    ) -> tuple[list[Message], dict[str, Any]]:
        """The messages as the template takes them: its tools section if it has one, else the format's
        text for the tool list, the calls and the results."""
        out = []
        for m in messages:
            m = {**m, "content": m.get("content") or ""}
            if not self.renders_tools and m.get("tool_calls"):
                calls = "".join("\n" + self.parser.call_text(*_call(c)) for c in m.pop("tool_calls"))
                m["content"] = (m["content"] + calls).strip("\n")
            if m["role"] == "tool":
                content = m["content"] if self.renders_tools else self._result(m["content"])
                m = (
                    {**m, "content": content}
                    if self.tool_role == "tool"
                    else {"role": self.tool_role, "content": content}
                )
            out.append(m)
        if self.renders_tools:
            return out, {"tools": tools} if tools else {}
        block = self.parser.tools_text(tools) if tools else None
        if block:
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}"}
            else:
                out.insert(0, {"role": "system", "content": block})
        return out, {}

    def _result(self, content: str | list[Message]) -> str | list[Message]:
        """A tool's result in the parser's format: text, or parts (a picture a tool returned) with their
        text in the format, after the images."""
        if isinstance(content, str):
            return self.parser.result_text(content)
        text = "".join(p.get("text", "") for p in content if p.get("type") == "text")
        return [
            *(p for p in content if p.get("type") != "text"),
            {"type": "text", "text": self.parser.result_text(text)},
        ]


def _call(call: Message) -> tuple[str, dict[str, Any]]:
    """A call's name and arguments (an OpenAI tool call: arguments as JSON text or an object)."""
    fn = call["function"]
    try:
        return str(fn["name"]), arguments(fn.get("arguments"))
    except ValueError:
        return str(fn["name"]), {"": fn.get("arguments")}
