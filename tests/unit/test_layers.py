"""The package's layout as a test: imports flow one way, no role imports another, the module map is whole.

Every `meshrl` import in every module counts, also one inside a function (a lazy import is still a
dependency). The layers, top to bottom, are docs/architecture.md's module map.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "meshrl"

LAYERS = (
    ("commands", ("meshrl.cli", "meshrl.__main__", "meshrl.commands")),
    ("roles", ("meshrl.roles", "meshrl.tasks", "meshrl.rewards")),
    ("runtime", ("meshrl.runtime", "meshrl.engines", "meshrl.observe")),
    ("library", ("meshrl.planning", "meshrl.models", "meshrl.envs", "meshrl.algorithms", "meshrl.state")),
    ("base", ("meshrl.dataplane", "meshrl.schema", "meshrl.lifetime")),
)
"""Top to bottom: a module imports from its own layer or lower ones only."""


def room(module: str) -> str:
    """The package a module belongs to for these rules (a role's package is a room of its own)."""
    parts = module.split(".")
    if len(parts) > 2 and parts[1] == "roles" and (PACKAGE / "roles" / parts[2]).is_dir():
        return ".".join(parts[:3])
    return ".".join(parts[:2])


def layer(module: str) -> int:
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    raise AssertionError(f"{module} is in no layer of LAYERS: add it to the test and to the module map")


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def imports() -> list[tuple[str, str]]:
    """(importing module, imported module) for every meshrl import anywhere in the package."""
    found = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("meshrl."):
                found.append((name, node.module))
            elif isinstance(node, ast.Import):
                found += [(name, a.name) for a in node.names if a.name.startswith("meshrl.")]
    return found


def test_imports_flow_down_the_layers():
    upward = [
        f"{a} imports {b}"
        for a, b in imports()
        if layer(b) < layer(a)  # a lower index is a higher layer
    ]
    assert not upward, "imports from a lower layer back up:\n" + "\n".join(upward)


def test_no_loop_between_packages():
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in imports():
        if room(a) != room(b):
            graph[room(a)].add(room(b))

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in graph[start]:
            if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
                return True
        return False

    loops = sorted(f"{a} -> {b} -> ... -> {a}" for a in list(graph) for b in graph[a] if reaches(b, a, {b}))
    assert not loops, "packages that import each other:\n" + "\n".join(loops)


def test_no_role_imports_another_role():
    """A role's package imports no other role's package; what it knows of other groups is the wiring the
    planner hands it (it is handed nothing else: tests/unit/test_service_context.py)."""
    crossing = [
        f"{a} imports {b}"
        for a, b in imports()
        if room(a).startswith("meshrl.roles.") and room(b).startswith("meshrl.roles.") and room(a) != room(b)
    ]
    assert not crossing, "\n".join(crossing)


def test_every_package_and_module_is_in_the_module_map():
    """docs/architecture.md's module map names every package (`meshrl/x/`), every module directly under
    meshrl/ (`meshrl/x.py`), and every other module and subpackage by its name."""
    text = (REPO / "docs" / "architecture.md").read_text()
    start = text.index("## Module map")
    mapped = text[start : text.index("\n## ", start + 1)]
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(REPO)
        if rel.name == "__init__.py":
            if len(rel.parts) == 3 and f"`{rel.parent}/`" not in mapped:
                missing.append(f"`{rel.parent}/`")
            elif len(rel.parts) > 3 and not re.search(rf"\b{rel.parent.name}\b", mapped):
                missing.append(str(rel.parent))
        elif len(rel.parts) == 2 and rel.name != "__main__.py" and f"`{rel}`" not in mapped:
            missing.append(f"`{rel}`")
        elif len(rel.parts) > 2 and f"`{rel.name}`" not in mapped:
            missing.append(str(rel))
    assert not missing, "not in docs/architecture.md's module map: " + ", ".join(missing)


def test_modules_stay_well_under_500_lines():
    long = {
        str(p.relative_to(REPO)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 450
    }
    assert not long, f"modules past 450 lines (split them): {long}"
