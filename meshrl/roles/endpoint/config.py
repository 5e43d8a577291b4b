"""Configuration of the endpoint service: an OpenAI-compatible HTTP server over the data plane's call
rows, for agents that are programs of their own (meshrl/roles/endpoint/service.py)."""

from __future__ import annotations

import importlib.util
import ipaddress
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from meshrl.models.hub import missing
from meshrl.planning.config import ServiceConfig
from meshrl.planning.wiring import Read, Write
from meshrl.schema import CALLS, DELIVERED, GENERATED, PROMPT

if TYPE_CHECKING:
    from meshrl.planning.recipe import Recipe, ServiceGroup
    from meshrl.planning.wiring import Wiring


@dataclass(frozen=True, kw_only=True)
class EndpointConfig(ServiceConfig):
    service = "meshrl.roles.endpoint.service:EndpointService"
    rejoins = True  # a restarted replica answers what arrives next; calls in flight fail over to the caller

    model: str
    """Local path of the policy: its tokenizer and chat template render the agents' messages."""
    name: str | None = None
    """The model name agents ask for (`model` in a request); None: `model` as written, or its last part."""
    host: str = "127.0.0.1"
    """Where it listens. On loopback it is open; on any other address a request needs the run's secret
    as a bearer token (`Authorization: Bearer <secret>`, the OpenAI SDK's api_key)."""
    parser: Literal["hermes", "plain"] = "hermes"
    """How tool calls are read from the model's text (meshrl/envs/parsers.py)."""
    tool_role: str = "tool"
    """The role tool results take when the chat template renders no tools ("user" for templates without
    a tool role); such templates get the tool list in the system prompt, Hermes style."""
    max_prompt_tokens: int = 4096
    """A longer prompt is refused (HTTP 400)."""
    context: int | None = None
    """The model's context length in tokens; None: its config.json's max_position_embeddings. A prompt
    must leave room in it for a full answer (inference.max_new_tokens)."""
    call_timeout_s: float = 600.0
    """A call not answered within this long gets HTTP 504 (inference stalled, or the run is ending)."""

    def validate(self) -> Iterator[str]:
        if self.max_prompt_tokens < 1:
            yield "max_prompt_tokens: must be >= 1"
        if self.call_timeout_s <= 0:
            yield "call_timeout_s: must be > 0"
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            yield f"host: {self.host!r} is not an IP address (127.0.0.1 for this host only, 0.0.0.0 for all)"

    @property
    def loopback(self) -> bool:
        return ipaddress.ip_address(self.host).is_loopback

    @property
    def names(self) -> tuple[str, ...]:
        """The model names a request may give."""
        return (self.name,) if self.name else (self.model, Path(self.model).name)

    def reads(self) -> tuple[Read, ...]:
        # each replica takes the answers to its own calls (the rows addressed to it)
        return (Read("answers", CALLS, GENERATED, consumer="endpoint", addressed=True),)

    def writes(self) -> tuple[Write, ...]:
        return (Write("calls", CALLS, (PROMPT,)), Write("delivered", CALLS, (DELIVERED,)))

    def needs(self) -> dict[str, str]:
        return {"turn_tokens": "an inference group generates the calls (its max_new_tokens bounds one)"}

    def offers(self) -> dict[str, Any]:
        return {"model_calls": self.names[0]}

    def check(self, recipe: Recipe, group: ServiceGroup, wiring: Wiring) -> list[str]:
        if not Path(self.model).exists():
            return [missing(self.model)]
        absent = [m for m in ("starlette", "uvicorn") if importlib.util.find_spec(m) is None]
        if absent:
            return [f"the endpoint needs {' and '.join(absent)}: pip install 'meshrl[agents]'"]
        turn = int(wiring.inputs.get("turn_tokens") or 0)
        if self.prompt_limit(turn) < 1:
            return [f"max_prompt_tokens: the model's context ({self.context_len()} positions) leaves no room for a "
                    f"prompt beside a full answer of {turn} tokens (inference.max_new_tokens)"]  # fmt: skip
        return []

    def context_len(self) -> int | None:
        """The model's context length: `context`, or its config.json's (read without transformers)."""
        if self.context is not None:
            return self.context
        path = Path(self.model) / "config.json"
        if not path.exists():
            return None
        value = json.loads(path.read_text()).get("max_position_embeddings")
        return int(value) if isinstance(value, int) else None

    def prompt_limit(self, max_new: int) -> int:
        """The longest prompt served: max_prompt_tokens, within the model's context less a full answer."""
        context = self.context_len()
        return min(self.max_prompt_tokens, context - max_new) if context else self.max_prompt_tokens
