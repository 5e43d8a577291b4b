"""Configuration of the agents service: agent programs run against the run's endpoint, their model calls
joined into trained samples (meshrl/roles/agents/service.py; programs: meshrl/envs/programs.py)."""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from meshrl.planning.config import ServiceConfig
from meshrl.planning.wiring import Read, Write
from meshrl.schema import (
    CALLS,
    DELIVERED,
    ENV_REWARD,
    GEN_BATCH,
    GEN_S,
    LOGPROBS,
    LOSS_MASK,
    PROMPT,
    RESPONSE,
    SAMPLES,
    SEGMENTS,
    TASKS,
    TOKEN_VERSIONS,
    VERSION,
)

if TYPE_CHECKING:
    from meshrl.planning.recipe import Recipe, ServiceGroup
    from meshrl.planning.wiring import Wiring

CALL_READS = (PROMPT, RESPONSE, LOGPROBS, VERSION, GEN_S, GEN_BATCH, DELIVERED)
SAMPLE_WRITES = (
    PROMPT, RESPONSE, LOGPROBS, LOSS_MASK, TOKEN_VERSIONS, VERSION, GEN_S, GEN_BATCH, ENV_REWARD, SEGMENTS,
)  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class AgentsConfig(ServiceConfig):
    service = "meshrl.roles.agents.service:AgentsService"
    rejoins = True  # a task it was running returns to the pool and runs again, from the start

    program: str
    """`package.module:function`: the agent program (meshrl/envs/programs.py), called with an AgentRun
    and `program_args`, returning the trajectory's reward."""
    program_args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of every call of the program."""
    concurrency: int = 64
    """Programs one replica runs at once (asyncio; plain functions on threads)."""
    timeout_s: float = 600.0
    """Seconds of a program's own time, after which its trajectory fails (counted; not trained). Time
    its session's clients (`run.client`, `run.sync_client`) wait for a model call is not counted: a
    call parked for the weights it needs (the next step's programs start while the step before
    trains) or queued for generation is the run's time, bounded by endpoint.call_timeout_s."""
    settle_s: float = 2.0
    """After a program that made its calls with a client of its own (not AgentRun.client): how long to
    wait for the last of them to be recorded."""
    lease_s: float = 1800.0
    """A replica that hangs gives its tasks back after this long (one that dies: at once)."""

    def validate(self) -> Iterator[str]:
        if ":" not in self.program:
            yield f"program: {self.program!r} must look like 'package.module:function'"
        if self.concurrency < 1:
            yield "concurrency: must be >= 1"
        if self.timeout_s <= 0 or self.lease_s <= self.timeout_s:
            yield "timeout_s: must be > 0 and below lease_s"
        if self.settle_s < 0:
            yield "settle_s: must be >= 0"

    def reads(self) -> tuple[Read, ...]:
        return (
            Read("tasks", TASKS, (PROMPT,), consumer="agents", retains=True),
            Read("calls", CALLS, CALL_READS, consumer="agents", addressed=True),
        )

    def writes(self) -> tuple[Write, ...]:
        return (Write("samples", SAMPLES, SAMPLE_WRITES),)

    def needs(self) -> dict[str, str]:
        return {"model_calls": "an endpoint group serves the programs' model calls (EndpointConfig)"}

    def check(self, recipe: Recipe, group: ServiceGroup, wiring: Wiring) -> list[str]:
        from meshrl.envs.programs import load_program

        if importlib.util.find_spec("openai") is None:
            return ["agent programs' clients need openai: pip install 'meshrl[agents]'"]
        try:
            fn = load_program(self.program)
        except ValueError as e:
            return [str(e)]
        try:
            inspect.signature(fn).bind(None, **self.program_args)
        except TypeError as e:
            return [f"program_args: {self.program} cannot take {self.program_args}: {e}"]
        return []
