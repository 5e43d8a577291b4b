"""A chat model with a calculator: arithmetic beyond a small model's head (reasoning-gym's
`basic_arithmetic` with two- and three-digit numbers and products), and a `calculator` tool it calls in
the Hermes format.

A good trajectory is two turns:

    user       Calculate 41 * 265.
    assistant  <tool_call>{"name": "calculator", "arguments": {"expression": "41 * 265"}}</tool_call>
    tool       10865
    assistant  41 * 265 = 10865. Answer: 10865

The system prompt shows the call, so the environment sets `tools_in_prompt = False`: SmolLM2's chat
template has no tools section, and the Hermes tool list (the JSON schema) would triple the prompt every
step trains on. The tool's result comes in `<tool_response>` tags, as the renderer writes results for
such a template (the demonstrations are rendered alike by `meshrl sft`). The reward has two named parts:
`correct` (the final answer, after "Answer:", is the row's) and `format` (0.1 for ending with
"Answer: N"). `python -m meshrl.tasks.calculator --out FILE` writes demonstrations for `meshrl sft`
(recipes/agent_smollm.py: the warm start before RL).
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re
from typing import Any

from meshrl.envs import Environment, Message, State, Turn, tool
from meshrl.tasks import demonstrations_main

ARITHMETIC = {
    "size": 4000, "seed": 0, "min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 3,
    "operators": ["+", "-", "*"], "allow_parentheses": False, "allow_negation": False,
}  # fmt: skip
"""reasoning_gym.create_dataset's settings: two numbers of two or three digits, added, subtracted or
multiplied (a product of two three-digit numbers is beyond a 135M model's head)."""

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_ANSWER = re.compile(r"Answer:\s*(-?\d[\d,]*)\s*\.?\s*$")


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: numbers with + - * / and parentheses, like 41 * 265
    """
    try:
        value = _eval(ast.parse(expression.strip(), mode="eval").body)
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from e
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def _eval(node: ast.AST) -> int | float:
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, int | float)
        and not isinstance(node.value, bool)
    ):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    raise ValueError("only numbers, + - * / and parentheses are allowed")


SYSTEM = (
    'You have a calculator. Call it with <tool_call>{"name": "calculator", "arguments": '
    '{"expression": "41 * 265"}}</tool_call> and end with "Answer: " and the number.'
)
"""How to call the calculator, in the Hermes format (short: every token of it is trained on CPU)."""


def answer_of(text: str) -> str | None:
    """The number after a final "Answer:", without thousands separators (None: no such ending)."""
    m = _ANSWER.search(text.strip())
    return m.group(1).replace(",", "") if m else None


class CalculatorEnv(Environment):
    """The model calls `calculator` as often as it likes; a turn without a call is its answer."""

    tools = (calculator,)
    tools_in_prompt = False  # the system prompt shows the call

    def __init__(self, system: str = SYSTEM) -> None:
        self.system = system

    async def reset(self, row: dict[str, Any]) -> tuple[list[Message], State]:
        messages = [
            {"role": "system", "content": self.system},
            {"role": "user", "content": str(row["prompt"])},
        ]
        return messages, {"answer": str(row["answer"]).strip()}

    async def reward(self, state: State, final: Turn | None, transcript: list[Message]) -> dict[str, float]:
        answer = answer_of(final.content) if final is not None and not final.tool_calls else None
        return {"correct": float(answer == state["answer"]), "format": 0.1 * (answer is not None)}


def demonstrations(n: int, tool_fraction: float, seed: int = 2) -> list[dict[str, Any]]:
    """`n` conversations on problems drawn with `seed` (the run trains on seed 0, evaluates on 1): a
    share `tool_fraction` calls the calculator, the rest answer at once (right: the model learns the
    format, and RL finds that the tool is what makes answers right)."""
    import reasoning_gym

    rng, system = random.Random(seed), SYSTEM
    rows = reasoning_gym.create_dataset("basic_arithmetic", **{**ARITHMETIC, "size": n, "seed": seed})
    out = []
    for row in rows:
        question, answer = row["question"], str(row["answer"])
        expression = question.removeprefix("Calculate ").rstrip(".")
        messages: list[Message] = [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ]
        if rng.random() < tool_fraction:
            call = {"name": "calculator", "arguments": {"expression": expression}}
            messages += [
                {"role": "assistant", "content": f"<tool_call>{json.dumps(call)}</tool_call>"},
                {"role": "tool", "content": calculator.fn(expression)},
            ]
        messages.append({"role": "assistant", "content": f"{expression} = {answer}. Answer: {answer}"})
        out.append({"messages": messages})
    return out


if __name__ == "__main__":
    demonstrations_main("python -m meshrl.tasks.calculator", demonstrations, 600, 0.5)
