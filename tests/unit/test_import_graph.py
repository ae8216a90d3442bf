"""The modules of reprokit import each other without a cycle.

A cycle is what made the code import inside functions to dodge it (the bundle reader, the replicated-state reference
and replay once imported each other that way): such an import is a cycle all the same, only found later, at call
time. So every import is read from the source with ``ast``: module level and inside functions alike.

How imports become edges of the module graph (nodes: every module of reprokit; a package is its ``__init__``):

* ``import a.b.c`` imports ``a.b.c`` and, first, the packages ``a`` and ``a.b``; ``from a.b import x`` imports
  ``a.b``, and ``a.b.x`` too when ``x`` is a submodule. Relative imports are resolved against the importing module.
* A module never counts as importing its own ancestor packages: Python runs a package's ``__init__`` before any
  module in it, so ``from reprokit.bundle import layout`` inside ``reprokit/bundle/writer.py`` is an edge to
  ``reprokit.bundle.layout`` alone. A package's ``__init__`` importing its children (to re-export their names) is
  an ordinary edge. The classic cycle is still caught: a child importing a *name* from its package
  (``from reprokit.bundle import open_bundle`` inside ``reprokit/bundle/writer.py``) is an edge to the package's
  ``__init__``, which imports the child: children import their siblings directly, never through the package.
* Imports under ``if TYPE_CHECKING:`` are not edges: they never run (annotations stay strings under
  ``from __future__ import annotations``). They are how a shrink pass names the :class:`Shrinker` that calls it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import reprokit

PACKAGE = Path(reprokit.__file__).resolve().parent


def modules() -> dict[str, Path]:
    """``{dotted name: source file}`` of every module of reprokit (a package by its ``__init__.py``)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = ["reprokit", *path.relative_to(PACKAGE).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _ancestors(name: str) -> set[str]:
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the nodes inside ``if TYPE_CHECKING:`` blocks (not their ``else``)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> dict[str, int]:
    """The reprokit modules ``name`` imports, each with the line of its first import."""
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_only(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    own = _ancestors(name)
    out: dict[str, int] = {}
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        targets: set[str] = set()  # what the statement imports (and what Python imports first: their packages)
        named: set[str] = set()  # modules a name is taken from (an ancestor package among them counts)
        if isinstance(node, ast.Import):
            for alias in node.names:
                targets |= {alias.name} | _ancestors(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            submodules = {f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in known}
            targets |= submodules | _ancestors(module) | {module}
            if len(submodules) < len(node.names):
                named.add(module)
        else:
            continue
        for target in targets:
            if target in known and target != name and (target not in own or target in named):
                out.setdefault(target, node.lineno)
    return out


def graph() -> dict[str, dict[str, int]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def find_cycle(edges: dict[str, dict[str, int]]) -> list[str] | None:
    """One cycle of the graph as ``[a, b, ..., a]``, or None (depth-first search, without recursion)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in sorted(edges):
        if state.get(root):
            continue
        path, stack = [root], [iter(sorted(edges[root]))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(edges[nxt])))
    return None


def describe(cycle: list[str], edges: dict[str, dict[str, int]]) -> str:
    known = modules()
    return "\n".join(f"  {a} ({known[a].relative_to(PACKAGE.parent)}:{edges[a][b]}) imports {b}"
                     for a, b in zip(cycle, cycle[1:]))


def test_the_modules_of_reprokit_import_each_other_without_a_cycle():
    edges = graph()
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle:\n" + describe(cycle, edges)


def test_the_graph_holds_function_level_and_package_imports(tmp_path):
    """What the graph is made of, on a package written for the test: function-level and relative imports are edges,
    an import of a submodule is one of its package too, and a child importing a name through its own package closes
    the cycle (its package's __init__ re-exports it)."""
    root = tmp_path / "pkg"
    (root / "sub").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "sub" / "__init__.py").write_text("from pkg.sub.writer import write\n")
    (root / "sub" / "layout.py").write_text("NAME = 'x'\n")
    (root / "sub" / "writer.py").write_text("from . import layout\n\ndef write():\n    from pkg.sub import NAME\n")
    (root / "user.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.other\n"
                                  "def f():\n    from .sub.layout import NAME\n")
    (root / "other.py").write_text("import pkg.user\n")
    known = {"pkg": root / "__init__.py", "pkg.sub": root / "sub" / "__init__.py",
             "pkg.sub.layout": root / "sub" / "layout.py", "pkg.sub.writer": root / "sub" / "writer.py",
             "pkg.user": root / "user.py", "pkg.other": root / "other.py"}
    edges = {name: imports(name, path, known) for name, path in known.items()}
    assert set(edges["pkg.user"]) == {"pkg.sub", "pkg.sub.layout"}  # relative, in a function; not TYPE_CHECKING
    assert set(edges["pkg.other"]) == {"pkg.user"}
    assert set(edges["pkg.sub.writer"]) == {"pkg.sub.layout", "pkg.sub"}  # `from pkg.sub import NAME`: the package
    assert find_cycle(edges) == ["pkg.sub", "pkg.sub.writer", "pkg.sub"]
    (root / "sub" / "writer.py").write_text("from . import layout\n\ndef write():\n    from pkg.sub.layout import NAME\n")
    edges["pkg.sub.writer"] = imports("pkg.sub.writer", root / "sub" / "writer.py", known)
    assert set(edges["pkg.sub.writer"]) == {"pkg.sub.layout"} and find_cycle(edges) is None
