"""Tool-call parsers on valid, malformed and multiple calls."""

from __future__ import annotations

from meshrl.envs.parsers import HermesParser, PlainParser


def test_hermes_valid_and_multiple() -> None:
    text = (
        'thinking <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> and '
        '<tool_call>{"name": "now", "arguments": "{}"}</tool_call>'
    )
    calls = HermesParser().parse(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("add", {"a": 1, "b": 2}, None),
        ("now", {}, None),
    ]
    assert calls[0].raw.startswith("<tool_call>") and calls[0].raw.endswith("</tool_call>")
    assert HermesParser().parse("no calls here") == []


def test_hermes_malformed() -> None:
    bad_json, no_name, bad_args, open_tag = HermesParser().parse(
        "<tool_call>{name: add}</tool_call>"
        '<tool_call>{"arguments": {}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": [1]}</tool_call>'
        '<tool_call>{"name": "add"'
    )
    assert bad_json.error is not None and "not JSON" in bad_json.error
    assert no_name.error is not None and "name" in no_name.error
    assert bad_args.error == "tool call arguments must be an object" and bad_args.name == "add"
    assert open_tag.error is not None and "unterminated" in open_tag.error


def test_plain_valid_multiple_and_malformed() -> None:
    parser = PlainParser(["calc", "calculate"])
    calls = parser.parse("calc(12+(3*4)) then calculate(1) and recalc(2)")
    assert [(c.name, c.arguments, c.raw) for c in calls] == [
        ("calc", {"": "12+(3*4)"}, "calc(12+(3*4))"),
        ("calculate", {"": "1"}, "calculate(1)"),
    ]
    (broken,) = parser.parse("calc(1+(2")
    assert broken.name == "calc" and broken.error == "unbalanced parentheses"
    assert parser.parse("12+3=15") == []
