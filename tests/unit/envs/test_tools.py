"""Tools from typed functions: their JSON schema, and every way a call can go wrong becoming a message."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any, Literal

import pytest

from meshrl.envs import Tool, ToolCall, call_tools, tool, tools
from meshrl.envs.parsers import PlainParser
from meshrl.schema import TOOL_ERROR_KINDS


def search(
    query: str, limit: int = 5, mode: Literal["fast", "deep"] = "fast", tags: list[str] | None = None
) -> str:
    """Search the index for documents.

    It looks at titles and bodies.

    Args:
        query: what to look for
        limit: how many results
        mode: how hard to look
        tags: only documents with these tags
    """
    return f"{query}:{limit}:{mode}"


def test_schema_is_the_one_transformers_renders_less_its_return_entry() -> None:
    from transformers.utils import get_json_schema

    schema = Tool.from_function(search).schema
    assert schema == {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the index for documents.\n\nIt looks at titles and bodies.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "what to look for"},
                    "limit": {"type": "integer", "description": "how many results"},
                    "mode": {"type": "string", "enum": ["fast", "deep"], "description": "how hard to look"},
                    "tags": {
                        "type": "array", "items": {"type": "string"}, "nullable": True,
                        "description": "only documents with these tags",
                    },
                },
                "required": ["query"],
            },
        },
    }  # fmt: skip
    theirs = get_json_schema(search)
    del theirs["function"]["return"]
    assert schema == theirs


def test_undescribed_or_untyped_parameters_are_refused_naming_the_tool() -> None:
    def untyped(x):  # type: ignore[no-untyped-def]
        """Echo.

        Args:
            x: anything
        """
        return x

    def undescribed(x: int) -> str:
        """Echo."""
        return ""

    with pytest.raises(TypeError, match="tool 'untyped'.*type hint"):
        Tool.from_function(untyped).schema  # noqa: B018
    with pytest.raises(TypeError, match="tool 'undescribed'.*no description for the argument 'x'"):
        Tool.from_function(undescribed).schema  # noqa: B018


def test_enum_and_nullable_arguments_are_checked() -> None:
    t = Tool.from_function(search)
    assert t.bind({"query": "q", "mode": "deep", "tags": None}) == {
        "query": "q",
        "mode": "deep",
        "tags": None,
    }
    with pytest.raises(ValueError, match="argument mode: 'slow' is not one of"):
        t.bind({"query": "q", "mode": "slow"})


@tool
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: one
        b: the other
    """
    return a + b


@tool
async def slow(seconds: float) -> str:
    """Sleep, then answer.

    Args:
        seconds: how long
    """
    await asyncio.sleep(seconds)
    return "late"


@tool
def boom() -> str:
    """Always fails."""
    raise RuntimeError("kaput")


def run(calls: list[ToolCall], timeout_s: float = 1.0, counted: Counter[str] | None = None) -> list[str]:
    async def go() -> list[dict[str, Any]]:
        tools.tally.set(counted)
        return await call_tools([add, slow, boom], calls, timeout_s=timeout_s)

    return [m["content"] for m in asyncio.run(go())]


def test_calls_and_their_errors_become_tool_messages() -> None:
    out = run([
        ToolCall("add", {"a": 2, "b": "3"}),  # a string that is an integer is fine
        ToolCall("add", {"a": 2}),
        ToolCall("add", {"a": 1, "b": 2, "c": 3}),
        ToolCall("add", {"a": "two", "b": 1}),
        ToolCall("nope", {}),
        ToolCall("boom", {}),
        ToolCall("", raw="<tool_call>{", error="tool call is not JSON"),
        ToolCall("slow", {"seconds": 5.0}),
    ], timeout_s=0.2, counted=(counted := Counter()))  # fmt: skip
    assert out[0] == "5"
    assert out[1] == "error: add: missing argument(s) b"
    assert out[2] == "error: add: unknown argument(s) c"
    assert out[3] == "error: argument a: 'two' is not an integer"
    assert out[4].startswith("error: no tool named 'nope'")
    assert out[5] == "error: boom raised RuntimeError: kaput"
    assert out[6] == "error: tool call is not JSON"
    assert out[7] == "error: slow timed out after 0.2s"
    assert counted == {
        "calls": 8,
        "arguments": 3,
        "unknown_tool": 1,
        "raised": 1,
        "malformed": 1,
        "timeout": 1,
    }
    assert set(counted) - {"calls"} <= set(TOOL_ERROR_KINDS)


def test_calls_of_one_turn_run_concurrently() -> None:
    t0 = time.monotonic()
    out = run([ToolCall("slow", {"seconds": 0.3}) for _ in range(5)])
    assert out == ["late"] * 5
    assert time.monotonic() - t0 < 0.9  # not 1.5 s


def test_plain_call_names_the_first_parameter() -> None:
    (call,) = PlainParser(["add"]).parse("add(4)")
    assert run([call])[0] == "error: add: missing argument(s) b"
    (call,) = PlainParser(["slow"]).parse("slow(0)")
    assert run([call]) == ["late"]
