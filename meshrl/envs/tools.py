"""Tools: typed Python functions the model may call.

`Tool.from_function(f)` reads the JSON schema from `f`'s type hints and its docstring (the first
paragraph describes the tool; `name: text` lines under "Args:" describe the parameters), which is what
`tokenizer.apply_chat_template(..., tools=[t.schema for t in tools])` renders into the prompt.

`call_tools` runs one turn's calls concurrently. Nothing a tool or the model does crashes a
trajectory: an unknown tool, bad arguments, a tool that raises, or one that outlives its timeout each
become a tool message saying so, which the model reads on its next turn.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from meshrl.envs.parsers import ToolCall

_JSON_TYPES: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}


@dataclass(frozen=True)
class Tool:
    name: str
    fn: Callable[..., Any]
    """Sync or async; its result is sent to the model as text (`str()`, or JSON for dicts and lists)."""
    schema: dict[str, Any]
    """OpenAI-style function schema: {"type": "function", "function": {name, description, parameters}}."""

    @classmethod
    def from_function(cls, fn: Callable[..., Any]) -> Tool:
        doc = inspect.getdoc(fn) or ""
        described = _arg_docs(doc)
        hints = typing.get_type_hints(fn)
        props: dict[str, Any] = {}
        required = []
        for p in inspect.signature(fn).parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise TypeError(f"tool {fn.__name__}: *args/**kwargs cannot be described to a model")
            if p.name not in hints:
                raise TypeError(f"tool {fn.__name__}: parameter {p.name!r} needs a type hint")
            props[p.name] = {**_json_type(hints[p.name], f"{fn.__name__}.{p.name}")}
            if p.name in described:
                props[p.name]["description"] = described[p.name]
            if p.default is p.empty:
                required.append(p.name)
        summary = doc.split("\n\n")[0].replace("\n", " ").strip()
        schema = {
            "type": "function",
            "function": {
                "name": fn.__name__,
                "description": summary,
                "parameters": {"type": "object", "properties": props, "required": required},
            },
        }
        return cls(fn.__name__, fn, schema)

    @property
    def parameters(self) -> list[str]:
        return list(self.schema["function"]["parameters"]["properties"])

    def bind(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """Arguments checked against the schema; a positional "" argument (plain-text calls) names the
        first parameter. Raises ValueError saying what is wrong."""
        if "" in arguments:
            if not self.parameters:
                raise ValueError(f"{self.name} takes no arguments")
            arguments = {self.parameters[0]: arguments[""], **{k: v for k, v in arguments.items() if k}}
        params = self.schema["function"]["parameters"]
        unknown = sorted(set(arguments) - set(params["properties"]))
        missing = sorted(set(params["required"]) - set(arguments))
        if unknown or missing:
            raise ValueError(f"{self.name}: " + "; ".join(
                [*(["unknown argument(s) " + ", ".join(unknown)] if unknown else []),
                 *(["missing argument(s) " + ", ".join(missing)] if missing else [])]))  # fmt: skip
        return {k: _coerce(v, params["properties"][k], f"{self.name}.{k}") for k, v in arguments.items()}


def tool(fn: Callable[..., Any]) -> Tool:
    """Decorator: `@tool` over a typed, documented function makes it a `Tool`."""
    return Tool.from_function(fn)


async def call_tools(
    tools: Sequence[Tool], calls: Sequence[ToolCall], *, timeout_s: float
) -> list[dict[str, Any]]:
    """One tool message per call, in the calls' order, the calls run concurrently."""
    by_name = {t.name: t for t in tools}
    results = await asyncio.gather(*(_call(by_name, c, timeout_s) for c in calls))
    return [{"role": "tool", "name": c.name, "content": r} for c, r in zip(calls, results, strict=True)]


async def _call(tools: dict[str, Tool], call: ToolCall, timeout_s: float) -> str:
    if call.error is not None:
        return f"error: {call.error}"
    tool = tools.get(call.name)
    if tool is None:
        return f"error: no tool named {call.name!r} (tools: {', '.join(sorted(tools)) or 'none'})"
    try:
        args = tool.bind(call.arguments)
    except ValueError as e:
        return f"error: {e}"
    try:
        async with asyncio.timeout(timeout_s):
            if inspect.iscoroutinefunction(tool.fn):
                result = await tool.fn(**args)
            else:  # a blocking tool runs on a thread, so other trajectories go on meanwhile
                result = await asyncio.to_thread(tool.fn, **args)
    except TimeoutError:
        return f"error: {call.name} timed out after {timeout_s:g}s"
    except Exception as e:
        return f"error: {call.name} raised {type(e).__name__}: {e}"
    return json.dumps(result) if isinstance(result, dict | list) else str(result)


def _json_type(hint: Any, where: str) -> dict[str, Any]:
    origin = typing.get_origin(hint)
    if hint in _JSON_TYPES:
        return {"type": _JSON_TYPES[hint]}
    if origin is list:
        (item,) = typing.get_args(hint) or (str,)
        return {"type": "array", "items": _json_type(item, where)}
    if origin is typing.Literal:
        return {"type": _JSON_TYPES[type(typing.get_args(hint)[0])], "enum": list(typing.get_args(hint))}
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return _json_type(args[0], where)
    if hint is dict or origin is dict:
        return {"type": "object"}
    raise TypeError(
        f"tool parameter {where}: type {hint!r} has no JSON schema here (use str, int, float, bool, list, dict, Literal)"
    )


def _coerce(value: Any, schema: dict[str, Any], where: str) -> Any:
    """`value` as the schema's type (plain-text calls give strings: "12" for an integer is fine)."""
    kind = schema.get("type")
    try:
        if kind == "integer" and not isinstance(value, bool):
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if kind == "number" and not isinstance(value, bool):
            return float(value)
        if kind == "string":
            return value if isinstance(value, str) else json.dumps(value)
        if kind == "boolean" and isinstance(value, bool):
            return value
        if kind == "array" and isinstance(value, list):
            return value
        if kind == "object" and isinstance(value, dict):
            return value
    except (TypeError, ValueError):
        pass
    raise ValueError(
        f"argument {where.split('.')[-1]}: {value!r} is not a{'n' if kind in ('integer', 'array', 'object') else ''} {kind}"
    )


def _arg_docs(doc: str) -> dict[str, str]:
    """`name: text` (or `name (type): text`) lines of a docstring's Args section."""
    section = re.search(r"^\s*(Args|Arguments|Parameters):\s*\n(.*?)(\n\s*\n|\Z)", doc, re.M | re.S)
    if section is None:
        return {}
    found = re.findall(r"^\s*(\w+)(?:\s*\([^)]*\))?:\s*(.+)$", section.group(2), re.M)
    return {name: text.strip() for name, text in found}
