"""kvloom's imports run one way: nothing under ``kvloom.core`` imports the layers above it (frontends, the
launch, the command line, the builder, the load tester, plugin implementations), and no modules import each
other in a cycle. Read from the source with ``ast``: every import at any depth (inside functions too), except
those under ``if TYPE_CHECKING:``, which never run."""

from __future__ import annotations

import ast
from pathlib import Path

import kvloom

# What a module under core may not import (each name and everything under it).
CORE_MAY_NOT_IMPORT = ("frontends", "launch", "cli", "builder", "bench", "plugins")
# The plugin modules core may import: the package (``hookimpl``) and the hook types, no implementation.
CORE_MAY_IMPORT_PLUGINS = ("plugins", "plugins.hookspecs", "plugins.interfaces", "plugins.info")


def module_files(root: Path, package: str) -> dict[str, Path]:
    """``{dotted module name: file}`` of every module of ``package``, a folder under ``root``."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(node: ast.AST):
    """Every import node under ``node``, at any depth, leaving out the bodies of ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:  # an else branch does run
                yield from _imports_of(other)
            continue
        yield from _imports_of(child)


def _imports_of(node: ast.AST):
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    yield from _imports(node)


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """``{module: modules of the package it imports}``; ``from a import b`` counts as importing ``a.b`` where
    that is a module, else ``a``."""
    modules = module_files(root, package)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        targets = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
                continue
            if node.level:  # relative: from the module's package, up level - 1
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                targets.add(sub if sub in modules else source)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def forbidden_imports(graph: dict[str, set[str]], package: str) -> list[str]:
    """``"importer -> imported"`` for each import from the package's core into a layer above it."""
    def under(module: str, name: str) -> bool:
        full = f"{package}.{name}"
        return module == full or module.startswith(full + ".")

    allowed = {f"{package}.{name}" for name in CORE_MAY_IMPORT_PLUGINS}
    return sorted(f"{importer} -> {imported}" for importer, targets in graph.items() if under(importer, "core")
                  for imported in targets
                  if any(under(imported, name) for name in CORE_MAY_NOT_IMPORT) and imported not in allowed)


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) for each group of modules that import each other (Tarjan's strongly
    connected components)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.add(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        groups.append(group)
    return [_cycle_in(graph, group) for group in groups]


def _cycle_in(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest path from the group's first module back to itself, inside the group."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & group):
                if nxt == start:
                    return paths[node] + [start]
                if nxt not in paths:
                    paths[nxt] = paths[node] + [nxt]
                    following.append(nxt)
        frontier = following
    return sorted(group)


ROOT = Path(kvloom.__file__).resolve().parent.parent


def test_core_imports_nothing_above_it():
    bad = forbidden_imports(import_graph(ROOT, "kvloom"), "kvloom")
    assert not bad, "modules under kvloom.core import the layers above them:\n" + "\n".join(bad)


def test_no_module_imports_itself_through_others():
    cycles = import_cycles(import_graph(ROOT, "kvloom"))
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_checks_catch_what_they_look_for(tmp_path):
    """A small package with an import from core into frontends (relative, and inside a function), one into a
    plugin implementation, a cycle, and imports that are allowed: the hook types, and back-edges under
    ``if TYPE_CHECKING:``."""
    files = {
        "__init__.py": "",
        "core/__init__.py": "",
        "core/engine.py": ("from typing import TYPE_CHECKING\n"
                           "from kvloom.plugins import hookspecs\n"
                           "if TYPE_CHECKING:\n    from kvloom.launch import starter\n"
                           "else:\n    from kvloom.core import loop\n"
                           "def serve():\n    from ..frontends import server\n"),
        "core/loop.py": "import kvloom.plugins.manager\n",
        "frontends/__init__.py": "",
        "frontends/server.py": "from kvloom.core.engine import serve\n",
        "launch/__init__.py": "",
        "launch/starter.py": "from kvloom.core import engine\n",
        "plugins/__init__.py": "",
        "plugins/hookspecs.py": "",
        "plugins/manager.py": "from kvloom import plugins\n",
        "a.py": "def f():\n    from kvloom import b\n",
        "b.py": "import kvloom.a\n",
        "p.py": "import kvloom.q\n",
        "q.py": "import typing\nif typing.TYPE_CHECKING:\n    import kvloom.p\n",
    }
    for name, text in files.items():
        path = tmp_path / "kvloom" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    graph = import_graph(tmp_path, "kvloom")
    assert graph["kvloom.core.engine"] == {"kvloom.plugins.hookspecs", "kvloom.core.loop", "kvloom.frontends.server"}
    assert forbidden_imports(graph, "kvloom") == ["kvloom.core.engine -> kvloom.frontends.server",
                                                  "kvloom.core.loop -> kvloom.plugins.manager"]
    assert sorted(import_cycles(graph)) == [["kvloom.a", "kvloom.b", "kvloom.a"],
                                            ["kvloom.core.engine", "kvloom.frontends.server", "kvloom.core.engine"]]
