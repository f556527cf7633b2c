"""The import graph of src/gptlab has no circle: not between modules, and not between rooms.

A room is a top-level subpackage of gptlab (all its modules together) or a top-level module. Rooms stand in
floors, each above all that it imports; a circle between rooms is an import that runs back up a floor, and it
is what lets a module circle grow unnoticed (the two rooms already know each other). The graph is read from
the source alone (pure AST, nothing of gptlab is imported): every import statement, at module level and inside
functions, and those under ``if TYPE_CHECKING:`` too, since a name a module needs for its types is a name it
depends on. Imports made by ``importlib.import_module`` are not read: the registries load their plug-ins that
way, by name, on purpose.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "gptlab"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted((SRC / PACKAGE).rglob("*.py"))}


def imported(tree: ast.AST, name: str, is_package: bool, known: set[str]) -> set[str]:
    """The gptlab modules that the module ``name`` imports, anywhere in its body."""
    found: set[str] = set()
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                # `from pkg import sub` imports the module pkg.sub; `from mod import name` imports mod
                found.add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source)
    return {m for m in found if m in known and m != name}


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {
        name: imported(ast.parse(path.read_text(), str(path)), name, path.name == "__init__.py", known)
        for name, path in mods.items()
    }


def room_of(module: str) -> str:
    """gptlab.runs.layout -> runs; gptlab.config -> config; gptlab itself -> __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def room_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    rooms: dict[str, set[str]] = {room_of(m): set() for m in graph}
    for source, targets in graph.items():
        rooms[room_of(source)].update(room_of(t) for t in targets if room_of(t) != room_of(source))
    return rooms


def components(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm): each is a circle, or
    several circles that share nodes."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def cycle_through(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest closed path inside a strongly connected component, from its first member back to it."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:  # breadth first
        next_frontier = []
        for node in frontier:
            for nxt in sorted(graph[node] & component):
                if nxt == start:
                    return paths[node] + [start]
                if nxt not in paths:
                    paths[nxt] = paths[node] + [nxt]
                    next_frontier.append(nxt)
        frontier = next_frontier
    raise AssertionError(f"{sorted(component)} is no strongly connected component")


def describe(
    graph: dict[str, set[str]], found: list[set[str]], modules: dict[str, set[str]] | None = None
) -> str:
    """Each circle: one loop through it, then every arrow inside it (for rooms, with the module imports that
    make the arrow), so that each import that closes it can be found and moved."""
    lines = []
    for component in found:
        lines.append(" -> ".join(cycle_through(graph, component)))
        for a in sorted(component):
            for b in sorted(graph[a] & component):
                lines.append(f"  {a} -> {b}")
                if modules is not None:
                    lines += [
                        f"      {source} imports {target}"
                        for source, targets in sorted(modules.items())
                        for target in sorted(targets)
                        if room_of(source) == a and room_of(target) == b
                    ]
    return "\n".join(lines)


def test_the_graph_reads_the_package():
    """The reader finds what the package is made of, so that an empty graph cannot pass the checks below."""
    graph = import_graph()
    assert len(graph) > 50
    assert f"{PACKAGE}.errors" in graph[f"{PACKAGE}.config"]  # an absolute `from gptlab.errors import ...`
    assert {"model", "data", "runs", "config"} <= set(room_graph(graph))
    # a relative import, one inside a function and one for type checking only are read as well
    tree = ast.parse(
        "from . import errors\nif TYPE_CHECKING:\n    from gptlab.model.gpt import GPT\n\n"
        "def f():\n    from .runs import naming\n"
    )
    assert imported(tree, f"{PACKAGE}.config", False, set(graph)) == {
        f"{PACKAGE}.errors",
        f"{PACKAGE}.model.gpt",
        f"{PACKAGE}.runs.naming",
    }
    # and a circle is found wherever it closes, with a loop through it
    toy = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert components(toy) == [{"a", "b", "c"}]
    assert cycle_through(toy, {"a", "b", "c"}) == ["a", "b", "c", "a"]


def test_no_circle_between_modules():
    graph = import_graph()
    found = components(graph)
    assert not found, f"modules that import each other in a circle:\n{describe(graph, found)}"


def test_no_import_runs_back_up_between_rooms():
    graph = import_graph()
    rooms = room_graph(graph)
    found = components(rooms)
    assert not found, (
        "rooms (gptlab's top-level packages and modules) that import each other in a circle; move the "
        "definition that an arrow fetches to the room that owns it:\n" + describe(rooms, found, graph)
    )
