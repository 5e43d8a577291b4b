"""From messages to token ids with the tokenizer's chat template, without ever re-tokenizing the
model's own tokens.

The first context (system, user, the tool schemas) is rendered whole. Each later reply of the
environment is rendered as the *difference* the template makes when the reply follows a finished
assistant turn: render(prefix + reply, generation prompt) minus render(prefix), for a fixed dummy
prefix. Those ids are appended after the model's tokens exactly as inference generated them. Templates
that close an assistant turn with more than its stop token (Qwen's "<|im_end|>\\n") add that tail
to the reply when the model's turn ended at its stop token. A template for which this difference is
not a suffix (it rewrites earlier turns) is refused at start-up with the reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from meshrl.envs.base import Message
from meshrl.envs.tools import Tool

_PREFIX: list[Message] = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]


class Renderer:
    def __init__(self, tokenizer: Any, tools: Sequence[Tool] = (), tool_role: str = "tool") -> None:
        """`tool_role`: the role tool results are rendered as ("user" for templates without a tool
        role, such as the tiny test model's)."""
        self.tokenizer = tokenizer
        template = str(getattr(tokenizer, "chat_template", "") or "")
        self.schemas = [t.schema for t in tools] if tools and "tools" in template else None
        self.tool_role = tool_role
        self._replies: dict[tuple[tuple[tuple[str, str], ...], ...], list[int]] = {}
        self.stop = tokenizer.eos_token_id
        prefix = self._ids(_PREFIX, generation=False)
        self.prefix = prefix
        stops = [i for i, t in enumerate(prefix) if t == self.stop]
        self.tail = prefix[stops[-1] + 1 :] if stops else []
        probe = self._ids([*_PREFIX, {"role": "user", "content": "c"}], generation=True)
        if probe[: len(prefix)] != prefix:
            raise ValueError(
                "the chat template renders earlier turns differently once a reply follows them; replies "
                "cannot be appended as tokens (use a template whose renderings are prefixes of each other)"
            )

    def _ids(self, messages: list[Message], *, generation: bool) -> list[int]:
        ids = self.tokenizer.apply_chat_template(
            [self._role(m) for m in messages],
            tools=self.schemas,
            add_generation_prompt=generation,
            tokenize=True,
        )
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        return [int(i) for i in ids]

    def _role(self, m: Message) -> Message:
        out = {k: v for k, v in m.items() if k in ("role", "content", "name")}
        if m["role"] == "tool" and self.tool_role != "tool":
            out = {"role": self.tool_role, "content": m["content"]}
        return out

    def first(self, messages: list[Message]) -> list[int]:
        """The trajectory's first context, ending with the generation prompt."""
        return self._ids(messages, generation=True)

    def reply(self, messages: list[Message], *, after_stop: bool) -> list[int]:
        """The ids of the environment's reply, to append after the model's turn, ending with the next
        generation prompt. `after_stop`: the model's turn ended with its stop token."""
        key = tuple(tuple(sorted((k, str(v)) for k, v in self._role(m).items())) for m in messages)
        ids = self._replies.get(key)
        if ids is None:  # the template is rendered once per distinct reply (feedback repeats a lot)
            ids = self._ids([*_PREFIX, *messages], generation=True)[len(self.prefix) :]
            if len(self._replies) < 65536:
                self._replies[key] = ids
        return [*self.tail, *ids] if after_stop else list(ids)

    def decode(self, ids: Sequence[int]) -> str:
        """The model's turn as text, without its stop token (special tokens kept: tool-call tags may be
        special tokens)."""
        ids = list(ids)
        while ids and ids[-1] == self.stop:
            ids.pop()
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))
