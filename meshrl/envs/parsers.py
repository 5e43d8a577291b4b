"""Tool-call formats: calls parsed from the model's decoded turn, and the text a chat template without a
tools section is given instead (meshrl/envs/render.py): the tool list, a call, a tool's result.

`HermesParser`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes, Qwen 2.5/3), results
in `<tool_response>` tags, the tool list as the Hermes system block.
`PlainParser`: `name(text)` for models without tool tokens (the tiny test model's character set has
no braces or angle brackets): the text between the parentheses is the tool's first argument; results
are plain text and the tool list is not described (the model learns its tools from its training).

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


HERMES_TOOLS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n'
    "</tool_call>"
)
"""The tool list in the system prompt, for chat templates that do not render tools themselves."""


class Parser(Protocol):
    def parse(self, text: str) -> list[ToolCall]:
        """Every tool call in `text`, in order; none is an empty list."""
        ...

    def call_text(self, name: str, arguments: dict[str, Any]) -> str:
        """A call as the model writes it (for templates that render no tool calls)."""
        ...

    def result_text(self, content: str) -> str:
        """A tool's result as the model reads it (for templates that render no tool role)."""
        ...

    def tools_text(self, schemas: list[dict[str, Any]]) -> str | None:
        """The tool list for the system prompt of a template that renders no tools (None: not described)."""
        ...

    def knowing(self, tools: Collection[str]) -> Parser:
        """This format, reading calls of the tools named `tools` (a request's)."""
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

    def call_text(self, name: str, arguments: dict[str, Any]) -> str:
        return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"

    def result_text(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"

    def tools_text(self, schemas: list[dict[str, Any]]) -> str | None:
        return HERMES_TOOLS.format(tools="\n".join(json.dumps(s) for s in schemas))

    def knowing(self, tools: Collection[str]) -> Parser:
        return self


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

    def call_text(self, name: str, arguments: dict[str, Any]) -> str:
        return f"{name}({next(iter(arguments.values()), '')})"

    def result_text(self, content: str) -> str:
        return content

    def tools_text(self, schemas: list[dict[str, Any]]) -> str | None:
        return None

    def knowing(self, tools: Collection[str]) -> Parser:
        return PlainParser(tools, self.argument)


def _closing(text: str, start: int) -> int:
    """Index of the parenthesis closing the one just before `start`, or -1."""
    depth = 1
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i
    return -1


def arguments(value: Any) -> dict[str, Any]:
    """A call's arguments as an object (OpenAI sends them as JSON text); ValueError when they are text
    that is not JSON. Anything but an object is the first argument's value."""
    if isinstance(value, str):
        value = json.loads(value) if value.strip() else {}
    return value if isinstance(value, dict) else {} if value is None else {"": value}


def build_parser(kind: str, tools: Collection[str]) -> Parser:
    """The parser for a config's `parser` setting ("hermes" or "plain")."""
    if kind == "hermes":
        return HermesParser()
    if kind == "plain":
        return PlainParser(tools)
    raise ValueError(f"parser: {kind!r} is not one of 'hermes', 'plain'")
