"""Tools: typed Python functions the model may call.

`Tool.from_function(f)` (or `@tool`) takes the JSON schema transformers makes of `f` (`get_json_schema`:
the type hints, the docstring's text before "Args:" as the description, and its "Args:" section, which
must describe every parameter), the schema `tokenizer.apply_chat_template(..., tools=...)` renders
into the prompt and an OpenAI client sends. It leaves out transformers' "return" entry, which OpenAI's
function schema does not have. The schema is made on first use (the environment service's start-up),
not at import: planning a recipe imports its environment, and stays free of transformers.

`call_tools` runs one turn's calls concurrently. Nothing a tool or the model does crashes a
trajectory: a malformed call, an unknown tool, bad arguments, a tool that raises, or one that outlives
its timeout each become a tool message saying so, which the model reads on its next turn, and count
as a tool error of that kind (`schema.TOOL_ERROR_KINDS`) in the run's metrics.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import json
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from meshrl.envs.parsers import ToolCall


@dataclass(frozen=True)
class Tool:
    name: str
    fn: Callable[..., Any]
    """Sync or async; its result is sent to the model as text (`str()`, or JSON for dicts and lists), or
    as a picture when it is a PIL image (a vision-language model's)."""

    @classmethod
    def from_function(cls, fn: Callable[..., Any]) -> Tool:
        return cls(fn.__name__, fn)

    @functools.cached_property
    def schema(self) -> dict[str, Any]:
        """OpenAI-style function schema: {"type": "function", "function": {name, description, parameters}}.
        Raises TypeError naming the tool when transformers cannot describe it."""
        from transformers.utils.chat_template_utils import get_json_schema

        try:
            schema = get_json_schema(self.fn)
        except Exception as e:  # no type hint, an undescribed argument, *args: say which tool
            raise TypeError(f"tool {self.name!r}: {e}") from e
        schema["function"].pop("return", None)
        schema["function"]["parameters"].setdefault("required", [])
        return schema

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


tally: contextvars.ContextVar[Counter[str] | None] = contextvars.ContextVar("tool_tally", default=None)
"""Where `call_tools` counts the calls it ran ("calls") and their errors by kind: the episode sets its
trajectory's Counter around each step."""


async def call_tools(
    tools: Sequence[Tool], calls: Sequence[ToolCall], *, timeout_s: float
) -> list[dict[str, Any]]:
    """One tool message per call, in the calls' order, the calls run concurrently."""
    by_name = {t.name: t for t in tools}
    results = await asyncio.gather(*(_call(by_name, c, timeout_s) for c in calls))
    counter = tally.get()
    if counter is not None:
        counter["calls"] += len(calls)
        counter.update(kind for _, kind in results if kind is not None)
    return [
        {"role": "tool", "name": c.name, "content": text} for c, (text, _) in zip(calls, results, strict=True)
    ]


async def _call(
    tools: dict[str, Tool], call: ToolCall, timeout_s: float
) -> tuple[str | list[dict[str, Any]], str | None]:
    """The tool message's content (text, or an image part), and the kind of error it reports (None: the
    call worked)."""
    if call.error is not None:
        return f"error: {call.error}", "malformed"
    tool = tools.get(call.name)
    if tool is None:
        return (
            f"error: no tool named {call.name!r} (tools: {', '.join(sorted(tools)) or 'none'})",
            "unknown_tool",
        )
    try:
        args = tool.bind(call.arguments)
    except ValueError as e:
        return f"error: {e}", "arguments"
    try:
        async with asyncio.timeout(timeout_s):
            if inspect.iscoroutinefunction(tool.fn):
                result = await tool.fn(**args)
            else:  # a blocking tool runs on a thread, so other trajectories go on meanwhile
                result = await asyncio.to_thread(tool.fn, **args)
    except TimeoutError:
        return f"error: {call.name} timed out after {timeout_s:g}s", "timeout"
    except Exception as e:
        return f"error: {call.name} raised {type(e).__name__}: {e}", "raised"
    if type(result).__module__.startswith("PIL."):  # a picture: an image part (a data URL once checked)
        return [{"type": "image", "image": result}], None
    return (json.dumps(result) if isinstance(result, dict | list) else str(result)), None


def _coerce(value: Any, schema: dict[str, Any], where: str) -> Any:
    """`value` as the schema's type (plain-text calls give strings: "12" for an integer is fine)."""
    name, kind = where.split(".")[-1], schema.get("type")
    if value is None and schema.get("nullable"):
        return None
    out = _as_type(value, kind)
    if out is _WRONG:
        raise ValueError(
            f"argument {name}: {value!r} is not a{'n' if kind in ('integer', 'array', 'object') else ''} {kind}"
        )
    if "enum" in schema and out not in schema["enum"]:
        raise ValueError(f"argument {name}: {value!r} is not one of {schema['enum']}")
    return out


_WRONG = object()


def _as_type(value: Any, kind: Any) -> Any:
    try:
        if kind == "integer" and not isinstance(value, bool):
            if isinstance(value, float) and not value.is_integer():
                return _WRONG
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
        if kind is None or isinstance(kind, list):  # a union transformers did not narrow: as given
            return value
    except (TypeError, ValueError):
        pass
    return _WRONG
