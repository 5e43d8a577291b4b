"""The arithmetic task as an agent program (meshrl/envs/programs.py): the model is asked through the
OpenAI API, as any agent would ask it, and the program scores its answers (recipes/agent_program.py).

With `turns=2` the program asks the same problem twice in one conversation (sending back the history it
was given), so a trajectory holds two model calls joined into one token sequence; `rewrite=True` edits
that history first (a full stop after the first answer), which splits the trajectory into segments.
"""

from __future__ import annotations

from typing import Any

from meshrl.envs.programs import AgentRun
from meshrl.tasks.arith import reward


async def solve(run: AgentRun, turns: int = 1, rewrite: bool = False, max_tokens: int = 4) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": run.task["prompt"]}]
    scores = []
    for _ in range(turns):
        answer = await run.client.chat.completions.create(
            model=run.model, messages=messages, max_tokens=max_tokens
        )
        text = answer.choices[0].message.content or ""
        scores.append(reward(run.task["prompt"], text, run.task))
        reply = f"{text}." if rewrite else text
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": run.task["prompt"]}]
    return {"correct": sum(scores) / len(scores)}
