"""Tool calls parsed from the model's decoded turn, one parser per format.

`HermesParser`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes, Qwen 2.5/3).
`PlainParser`: `name(text)` for models without tool tokens (the tiny test model's character set has
no braces or angle brackets): the text between the parentheses is the tool's first argument.

A parser never raises on the model's output: a malformed call comes back as a `ToolCall` with `error`
set, which the tool runner turns into a tool message saying what was wrong, so the model can learn
the format from the reply instead of the run failing.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    raw: str = ""
    """The exact text of the call in the model's turn."""
    error: str | None = None
    """Why the call could not be parsed (then `name`/`arguments` are best effort)."""


class Parser(Protocol):
    def parse(self, text: str) -> list[ToolCall]:
        """Every tool call in `text`, in order; none is an empty list."""
        ...


class HermesParser:
    """`<tool_call>{json}</tool_call>`, any number per turn; an unclosed tag is a malformed call."""

    PATTERN = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> list[ToolCall]:
        return [
            self._one(m.group(1), m.group(0), closed=bool(m.group(2))) for m in self.PATTERN.finditer(text)
        ]

    @staticmethod
    def _one(body: str, raw: str, *, closed: bool) -> ToolCall:
        if not closed:
            return ToolCall("", raw=raw, error="unterminated <tool_call> (no </tool_call>)")
        try:
            call = json.loads(body)
        except json.JSONDecodeError as e:
            return ToolCall("", raw=raw, error=f"tool call is not JSON: {e.msg} at column {e.colno}")
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return ToolCall("", raw=raw, error='tool call must be {"name": str, "arguments": {...}}')
        args = call.get("arguments", {})
        if isinstance(args, str):  # some models write the arguments as a JSON string
            with contextlib.suppress(json.JSONDecodeError):
                args = json.loads(args)
        if not isinstance(args, dict):
            return ToolCall(call["name"], raw=raw, error="tool call arguments must be an object")
        return ToolCall(call["name"], args, raw=raw)


class PlainParser:
    """`name(text)` for the names in `tools`; the text becomes argument `argument` (or the tool's first
    parameter, resolved by the runner when `argument` is None). Unbalanced parentheses are malformed."""

    def __init__(self, tools: Collection[str], argument: str | None = None) -> None:
        self.tools = set(tools)
        self.argument = argument
        names = "|".join(sorted(map(re.escape, self.tools), key=len, reverse=True)) or r"(?!)"
        self.pattern = re.compile(rf"\b({names})\(")

    def parse(self, text: str) -> list[ToolCall]:
        calls = []
        pos = 0
        while (m := self.pattern.search(text, pos)) is not None:
            end = _closing(text, m.end())
            if end < 0:
                calls.append(ToolCall(m.group(1), raw=text[m.start() :], error="unbalanced parentheses"))
                break
            arg = text[m.end() : end]
            calls.append(ToolCall(m.group(1), {self.argument or "": arg}, raw=text[m.start() : end + 1]))
            pos = end + 1
        return calls


def _closing(text: str, start: int) -> int:
    """Index of the parenthesis closing the one just before `start`, or -1."""
    depth = 1
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i
    return -1


def build_parser(kind: str, tools: Collection[str]) -> Parser:
    """The parser for a config's `parser` setting ("hermes" or "plain")."""
    if kind == "hermes":
        return HermesParser()
    if kind == "plain":
        return PlainParser(tools)
    raise ValueError(f"parser: {kind!r} is not one of 'hermes', 'plain'")
