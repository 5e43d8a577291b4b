"""Tools from typed functions: their JSON schema, and every way a call can go wrong becoming a message."""

from __future__ import annotations

import asyncio
import time
from typing import Literal

import pytest

from meshrl.envs import PlainParser, Tool, ToolCall, call_tools, tool


def search(
    query: str, limit: int = 5, mode: Literal["fast", "deep"] = "fast", tags: list[str] | None = None
) -> str:
    """Search the index for documents.

    More text that is not part of the summary.

    Args:
        query: what to look for
        limit (int): how many results
    """
    return f"{query}:{limit}:{mode}"


def test_schema_from_hints_and_docstring() -> None:
    schema = Tool.from_function(search).schema
    assert schema == {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the index for documents.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "what to look for"},
                    "limit": {"type": "integer", "description": "how many results"},
                    "mode": {"type": "string", "enum": ["fast", "deep"]},
                    "tags": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["query"],
            },
        },
    }


def test_untyped_or_unsupported_parameters_are_refused() -> None:
    def untyped(x):  # type: ignore[no-untyped-def]
        return x

    def odd(x: complex) -> str:
        return ""

    with pytest.raises(TypeError, match="needs a type hint"):
        Tool.from_function(untyped)
    with pytest.raises(TypeError, match="no JSON schema"):
        Tool.from_function(odd)


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@tool
async def slow(seconds: float) -> str:
    """Sleep, then answer."""
    await asyncio.sleep(seconds)
    return "late"


@tool
def boom() -> str:
    """Always fails."""
    raise RuntimeError("kaput")


def run(calls: list[ToolCall], timeout_s: float = 1.0) -> list[str]:
    return [m["content"] for m in asyncio.run(call_tools([add, slow, boom], calls, timeout_s=timeout_s))]


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
    ], timeout_s=0.2)  # fmt: skip
    assert out[0] == "5"
    assert out[1] == "error: add: missing argument(s) b"
    assert out[2] == "error: add: unknown argument(s) c"
    assert out[3] == "error: argument a: 'two' is not an integer"
    assert out[4].startswith("error: no tool named 'nope'")
    assert out[5] == "error: boom raised RuntimeError: kaput"
    assert out[6] == "error: tool call is not JSON"
    assert out[7] == "error: slow timed out after 0.2s"


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
