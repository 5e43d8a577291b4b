"""Multi-turn environments and tools for agent training (docs/architecture.md, "Agents"; the README's
"Writing an environment"). Plain Python: an `Environment` subclass, tools from typed functions."""

from meshrl.envs.base import EnvError, Environment, Message, State, Step, Turn
from meshrl.envs.episode import Limits, Outcome, advance, start
from meshrl.envs.parsers import HermesParser, Parser, PlainParser, ToolCall, build_parser
from meshrl.envs.render import Renderer
from meshrl.envs.tools import Tool, call_tools, tool
from meshrl.envs.trajectory import Trajectory

__all__ = [
    "EnvError",
    "Environment",
    "HermesParser",
    "Limits",
    "Message",
    "Outcome",
    "Parser",
    "PlainParser",
    "Renderer",
    "State",
    "Step",
    "Tool",
    "ToolCall",
    "Trajectory",
    "Turn",
    "advance",
    "build_parser",
    "call_tools",
    "start",
    "tool",
]
