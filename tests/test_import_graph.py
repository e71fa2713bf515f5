"""The Python package's imports go one way: no module of lily imports, directly or through others, a
module that imports it back. Built from the source with ast (nothing is imported): every import
counts, at the top of a module or inside a function (a lazy import still couples the two modules),
except those under ``if TYPE_CHECKING:``. Importing ``lily.a.b`` runs ``lily/a/__init__`` first, so it
is an edge to that subpackage too (``lily.server`` imports its app: a module outside the server
that imported ``lily.server.x`` would be in a cycle). The root ``lily/__init__`` is the public facade that
re-exports the API; it is not counted implicitly, but a module that names it (``from . import
__version__``, ``import lily``) depends on it like on any other.

Run as a script (``python tests/test_import_graph.py``) it prints the graph's cycles, if any.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "lily"


def module_name(path: Path) -> str:
    parts = ("lily",) + path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(node: ast.AST, parents: dict) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def imports_of(path: Path, modules: set[str]) -> dict[str, str]:
    """{imported lily module: 'top' or 'function'} for one source file."""
    name = module_name(path)
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), str(path))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found: dict[str, str] = {}

    def add(target: str, node: ast.AST) -> None:
        where = "function" if any(isinstance(p, (ast.FunctionDef, ast.AsyncFunctionDef))
                                  for p in _ancestors(node, parents)) else "top"
        parts = target.split(".")
        # The module itself and the subpackages above it (whose __init__ runs first), but not the root,
        # nor a subpackage the importing module is in (its __init__ has already started).
        above = {".".join(parts[:i]) for i in range(2, len(parts))}
        for t in {target} | {a for a in above if not name.startswith(a + ".")}:
            if t in modules and t != name and found.get(t) != "top":
                found[t] = where

    for node in ast.walk(tree):
        if _type_checking_only(node, parents):
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            submodules = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in modules]
            if len(submodules) < len(node.names) or mod != "lily":
                add(mod, node)  # `from lily import x` with x a submodule does not need lily/__init__'s names
            for sub in submodules:
                add(sub, node)
    return found


def _ancestors(node, parents):
    while node in parents:
        node = parents[node]
        yield node


def import_graph() -> dict[str, dict[str, str]]:
    files = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(f) for f in files} | {"lily._core"}  # the C++ extension: a leaf
    return {module_name(f): imports_of(f, modules) for f in files}


def cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_imports():
    graph = import_graph()
    assert graph["lily"]["lily.model"] == "top"                     # a relative import at the top
    assert graph["lily.cli"]["lily.server.cli"] == "function"       # a lazy one
    assert graph["lily.cli"]["lily.server"] == "function"           # its subpackage's __init__ runs first
    assert "lily.server" not in graph["lily.server.app"]            # ... unless the importer is inside it
    assert graph["lily.checkpoint.config"]["lily._core"] == "function"


def test_layers():
    """The pairs issue 18 named stay apart, and the checkpoint files and the core library never reach up."""
    graph = import_graph()
    assert "lily.cli" not in graph["lily.server.cli"]
    assert "lily.model" not in graph["lily.generate"]
    assert "lily.checkpoint.weights" not in graph["lily.checkpoint.convert"]
    up = ("lily.model", "lily.cli", "lily.server", "lily.bench", "lily.generate", "lily.session")
    for name, deps in graph.items():
        if name.startswith("lily.checkpoint."):
            assert not [d for d in deps if d.startswith(up) or d == "lily"], name
    for name in ("lily.generate", "lily.session", "lily.prompts", "lily.model"):
        assert not [d for d in graph[name] if d.startswith(("lily.server", "lily.cli", "lily.bench"))], name


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


if __name__ == "__main__":
    graph = import_graph()
    for comp in cycles(graph):
        print("cycle:", ", ".join(comp))
        for v in comp:
            for w, where in graph[v].items():
                if w in comp:
                    print(f"    {v} -> {w} ({where})")
    sys.exit(1 if cycles(graph) else 0)
