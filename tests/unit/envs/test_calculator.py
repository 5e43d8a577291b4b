"""The calculator task of recipes/agent_smollm.py: its tool, its reward, and demonstrations whose tool
calls parse and whose tool results are the answers."""

from __future__ import annotations

import asyncio

import pytest

from meshrl.envs import Turn, call_tools
from meshrl.envs.parsers import HermesParser
from meshrl.tasks.calculator import CalculatorEnv, answer_of, calculator, demonstrations


def test_the_calculator_is_exact_and_refuses_anything_else() -> None:
    assert calculator.fn("41 * 265") == "10865"
    assert calculator.fn("105 - 738") == "-633"
    assert calculator.fn("(2 + 3) * -4") == "-20"
    assert calculator.fn("7 / 2") == "3.5"
    for bad in ("__import__('os')", "2 ** 8", "1 +"):
        with pytest.raises(ValueError):
            calculator.fn(bad)
    (message,) = asyncio.run(call_tools([calculator], HermesParser().parse(
        '<tool_call>{"name": "calculator", "arguments": {"expression": "2 ** 8"}}</tool_call>'), timeout_s=1))  # fmt: skip
    assert message["content"].startswith("error: calculator raised ValueError: only numbers")


def test_the_reward_reads_the_final_answer() -> None:
    env = CalculatorEnv()

    def reward(final: Turn | None) -> dict[str, float]:
        return asyncio.run(env.reward({"answer": "10865"}, final, []))

    assert reward(Turn("41 * 265 = 10865. Answer: 10865")) == {"correct": 1.0, "format": 0.1}
    assert reward(Turn("Answer: 10,865")) == {"correct": 1.0, "format": 0.1}
    assert reward(Turn("Answer: 10864")) == {"correct": 0.0, "format": 0.1}
    assert reward(Turn("it is 10865")) == {"correct": 0.0, "format": 0.0}
    assert reward(None) == {"correct": 0.0, "format": 0.0}
    assert answer_of("Answer: -633.") == "-633"


def test_demonstrations_call_the_tool_on_their_share_and_are_right() -> None:
    rows = demonstrations(200, tool_fraction=0.5)
    with_tool = [r["messages"] for r in rows if len(r["messages"]) == 5]
    assert 70 <= len(with_tool) <= 130
    for m in with_tool:
        (call,) = HermesParser().parse(m[2]["content"])
        assert call.error is None and call.name == "calculator"
        assert m[3] == {"role": "tool", "content": calculator.fn(call.arguments["expression"])}
        assert answer_of(m[4]["content"]) == m[3]["content"]
    assert all(
        r["messages"][0]["role"] == "system" and "<tool_call>" in r["messages"][0]["content"] for r in rows
    )
