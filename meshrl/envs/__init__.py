"""Multi-turn environments and tools for agent training (docs/architecture.md, "Agents"; the README's
"Writing an environment"): what a user writes against. Plain Python: an `Environment` subclass, tools
from typed, documented functions. The machinery that runs them (episodes, rendering, parsing, the
trajectory's tokens) lives in this package's modules, for the services and tests."""

from meshrl.envs.base import EnvError, Environment, Limits, Message, State, Step, Turn
from meshrl.envs.parsers import ToolCall
from meshrl.envs.tools import Tool, call_tools, tool

__all__ = [
    "EnvError",
    "Environment",
    "Limits",
    "Message",
    "State",
    "Step",
    "Tool",
    "ToolCall",
    "Turn",
    "call_tools",
    "tool",
]
