"""Messages to token ids with the model's chat template, for the endpoint (meshrl/roles/endpoint/chat.py
parses the requests).

A session's calls are rendered so that they join into one token sequence whenever the agent sends back
the history it was given: the new prompt is the previous prompt and completion exactly as generated,
followed by the new messages (tool results, the user's next turn) rendered as the difference the
template makes after a finished assistant turn (`Templates.bridge`; meshrl/envs/render.py does the
same for environments). An agent that edits, truncates or re-orders its history gets a fresh rendering,
which starts a new segment of its trajectory (meshrl/envs/sessions.py). Templates that render no tools
get the tool list in the system prompt, and calls and results as text, in the Hermes format.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

HERMES_TOOLS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n'
    "</tool_call>"
)
"""The tool list in the system prompt, for chat templates that do not render tools themselves."""

Message = dict[str, Any]
_DUMMY: list[Message] = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]


@dataclass
class Turn:
    """What a session's last call was rendered from and answered: for joining the next one to it."""

    messages: list[Message]
    tools: list[Message] | None
    ids: list[int]
    """The prompt and the completion, as one sequence."""
    reply: Message
    """The assistant message the answer carried, as the agent will send it back."""


class Templates:
    """Messages (as meshrl/roles/endpoint/chat.py checks them) to token ids with one tokenizer's template."""

    def __init__(self, tokenizer: Any, *, tool_role: str = "tool") -> None:
        self.tokenizer = tokenizer
        template = str(getattr(tokenizer, "chat_template", "") or "")
        self.renders_tools = "tools" in template and "tool_calls" in template
        self.tool_role = tool_role
        self.stop = int(tokenizer.eos_token_id)

    def prompt(self, messages: list[Message], tools: list[Message] | None) -> list[int]:
        """The whole rendering, ending with the generation prompt."""
        return self._ids(messages, tools, generation=True)

    def bridge(
        self, last: Turn | None, messages: list[Message], tools: list[Message] | None
    ) -> list[int] | None:
        """The prompt as `last`'s tokens exactly as generated plus the new messages, when `messages` is
        `last`'s messages, its answer, then tool results or user turns; else None."""
        if last is None or tools != last.tools:
            return None
        n = len(last.messages)
        if len(messages) < n + 2 or messages[:n] != last.messages or not _same_reply(messages[n], last.reply):
            return None
        tail = messages[n + 1 :]
        if any(m["role"] not in ("tool", "user") for m in tail):
            return None
        prefix = self._ids(_DUMMY, tools, generation=False)
        stops = [i for i, t in enumerate(prefix) if t == self.stop]
        full = self._ids([*_DUMMY, *tail], tools, generation=True)
        if not stops or full[: len(prefix)] != prefix:
            return None  # the template renders earlier turns differently once more follow
        closing = prefix[stops[-1] :]  # the stop token and what the template puts after it
        ended = bool(last.ids) and last.ids[-1] == self.stop
        return [*last.ids, *(closing[1:] if ended else closing), *full[len(prefix) :]]

    def _ids(self, messages: list[Message], tools: list[Message] | None, *, generation: bool) -> list[int]:
        msgs, kw = self._for_template(messages, tools)
        ids = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=generation, tokenize=True, **kw)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        return [int(i) for i in ids]

    def _for_template(
        self, messages: list[Message], tools: list[Message] | None
    ) -> tuple[list[Message], dict[str, Any]]:
        if self.renders_tools:
            return messages, {"tools": tools} if tools else {}
        out = []
        for m in messages:  # the template knows no tools: calls and results become text
            if m.get("tool_calls"):
                calls = "".join(
                    f"\n<tool_call>\n{json.dumps(c['function'])}\n</tool_call>" for c in m["tool_calls"]
                )
                m = {"role": "assistant", "content": (m["content"] + calls).strip("\n")}
            elif m["role"] == "tool":
                m = {"role": self.tool_role, "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
            out.append(m)
        if tools:
            block = HERMES_TOOLS.format(tools="\n".join(json.dumps(t) for t in tools))
            if out and out[0]["role"] == "system":
                out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{block}"}
            else:
                out.insert(0, {"role": "system", "content": block})
        return out, {}


def _same_reply(sent: Message, answered: Message) -> bool:
    """Whether the agent sent back the answer it was given (text and tool calls)."""

    def calls(m: Message) -> list[tuple[str, Any]]:
        return [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls") or []]

    if sent.get("role") != "assistant":
        return False
    return (sent.get("content") or "").strip() == (answered.get("content") or "").strip() and calls(
        sent
    ) == calls(answered)
