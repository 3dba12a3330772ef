"""The rooms' import rules (docs/architecture.md), checked on the source itself.

- no import cycle between modules of the project (at module level or inside functions);
- ``worker/`` never imports ``service/``; ``service/`` imports neither ``worker/`` nor
  ``recipes/``; ``ddpq/`` imports ``service/`` and ``worker/`` only inside the commands
  that run them; ``ddpq.train``, ``ddpq.wire`` and ``ddpq.errors`` (which every rank
  imports) import no project module but ``ddpq.errors``, ``ddpq.http``, ``ddpq.rules``,
  ``ddpq.tensorboard`` and ``ddpq.wire``;
- the worker's rooms (``WORKER_ROOMS``): each sub-package of ``worker/`` and each entry
  module at its top imports only what its row allows, and the rows run one way (no room
  imports one that imports it back);
- no Python module over ``MAX_MODULE_LINES`` lines, no function over
  ``MAX_FUNCTION_LINES``.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("service", "worker", "ddpq", "recipes")
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80

# The worker's rooms, top down, and what of the worker each may import (docs/architecture.md,
# "Which way imports run"). A room is a sub-package of worker/; the entry modules at its top
# stand alone, each a row of its own: they stay where the command lines that start them
# (`python -m worker.entry`, torchrun's `worker.tee`, a container's `worker.health`, ...)
# name them, so a worker in the middle of an upgrade still finds them there.
WORKER_ROOMS: dict[str, set[str]] = {
    "worker.slurmnode": {"worker.executors", "worker.starting", "worker.edges"},
    "worker.executors": {
        "worker.starting",
        "worker.files",
        "worker.walled",
        "worker.edges",
        "worker.health",
    },
    "worker.launch": {"worker.edges", "worker.zygote"},
    "worker.starting": {
        "worker.files",
        "worker.walled",
        "worker.edges",
        "worker.entry",
        "worker.tee",
        "worker.zygote",
    },
    "worker.files": {"worker.walled", "worker.edges"},
    "worker.zygote": {"worker.entry", "worker.tee"},
    "worker.walled": {"worker.edges"},
    "worker.tee": {"worker.entry"},
    "worker.edges": set(),
    "worker.entry": set(),
    "worker.health": set(),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {
        _module_name(p): p
        for package in PACKAGES
        for p in (REPO / package).rglob("*.py")
        if "__pycache__" not in p.parts
    }


def _imports(path: Path, known: set[str], top_level_only: bool) -> set[str]:
    """The project's modules that ``path`` imports (a name imported from a package is
    that package's module if it is one, else the package)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] in PACKAGES)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] not in PACKAGES:
                continue
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in known else node.module)
    return {m for m in found if m in known}


def _graph(top_level_only: bool) -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(path, known, top_level_only) - {name} for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            # A package's __init__ importing its own submodules is how packages work.
            if node == nxt.rsplit(".", 1)[0] or nxt == node.rsplit(".", 1)[0]:
                continue
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_two_modules_import_each_other() -> None:
    assert _cycle(_graph(top_level_only=False)) is None


def test_the_rooms_import_only_what_they_may() -> None:
    anywhere = _graph(top_level_only=False)
    top = _graph(top_level_only=True)
    for name, deps in anywhere.items():
        rooms = {d.split(".")[0] for d in deps}
        if name.startswith("worker"):
            assert "service" not in rooms, (name, deps)
        if name.startswith("service"):
            assert not rooms & {"worker", "recipes"}, (name, deps)
    for name, deps in top.items():
        if name.startswith("ddpq"):
            assert not {d.split(".")[0] for d in deps} & {"service", "worker"}, (name, deps)
    rank = {"ddpq.errors", "ddpq.http", "ddpq.plain", "ddpq.rules", "ddpq.tensorboard", "ddpq.wire"}
    for name in ("ddpq.train", "ddpq.http", "ddpq.plain", "ddpq.wire", "ddpq.errors"):
        assert anywhere[name] <= rank, anywhere[name]


def _worker_room(module: str) -> str:
    """The room a worker module stands in: its sub-package, or itself at the top."""
    parts = module.split(".")
    return ".".join(parts[:2])


def test_the_worker_rooms_import_only_the_rooms_below_them() -> None:
    """Each worker module imports, of the worker, only its own room and the rooms its
    room's row of WORKER_ROOMS allows (at module level or inside functions), and the
    rows run one way: no room reaches back up to one that imports it."""
    assert _cycle(WORKER_ROOMS) is None, "the worker's rooms must run one way"
    found: dict[str, set[str]] = {}
    for name, deps in _graph(top_level_only=False).items():
        if name != "worker" and name.startswith("worker."):
            room = _worker_room(name)
            assert room in WORKER_ROOMS, f"{name} stands in no room of WORKER_ROOMS"
            rooms = {_worker_room(d) for d in deps if d.startswith("worker.")} - {room}
            found.setdefault(room, set()).update(rooms)
            assert rooms <= WORKER_ROOMS[room], (name, rooms - WORKER_ROOMS[room])
    assert set(found) == set(WORKER_ROOMS), set(WORKER_ROOMS) - set(found)


def test_no_module_is_over_the_line_limit() -> None:
    """Every Python module of the packages stays within MAX_MODULE_LINES: past that a
    module holds more than one concern, and is split along its seam (as ddpq/cli/jobs.py
    and service/app.py were). The rule is about the Python modules these import rules
    cover; the dashboard's script (service/static/app.js) is
    no module of theirs, served to the browser as written, and is left to its own."""
    over = {
        str(path.relative_to(REPO)): lines
        for path in _modules().values()
        if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert over == {}, f"over {MAX_MODULE_LINES} lines, split each along a seam: " + ", ".join(
        f"{path} ({lines} lines)" for path, lines in sorted(over.items())
    )


def test_no_function_is_over_the_line_limit() -> None:
    """Every function of the packages (its signature, docstring and body) stays within
    MAX_FUNCTION_LINES: a longer one does several things a reader must hold at once (the
    worker's command was 182 lines before its settings had an owner, worker.executors.settings)."""
    over = []
    for path in _modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    over.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines})")
    assert over == [], f"over {MAX_FUNCTION_LINES} lines, split each: " + ", ".join(over)
