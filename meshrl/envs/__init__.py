"""Multi-turn agents (docs/architecture.md, "Agents"; the README's "Agents"): what a user writes against.
Plain Python: an `Environment` subclass, tools from typed, documented functions (agent programs get an
`AgentRun`: meshrl.envs.programs). The machinery every kind of agent shares (rendering, tool-call
formats, the trajectory's tokens, an environment's moves) lives in this package's modules."""

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
