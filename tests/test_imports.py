"""No module of the package imports a module that imports it back, not even through an import inside a
function (which hides a circle from the interpreter until that function runs). Imports under
`if TYPE_CHECKING:` are for annotations only and do not count."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "kdtree"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that `path` imports anywhere (a package import counts as its __init__)."""
    tree = ast.parse(path.read_text())
    skip = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    here = module_name(path)
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = here if path.name == "__init__.py" else here.rsplit(".", 1)[0]
                pkg = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1])
                base = f"{pkg}.{base}" if base else pkg
            subs = [f"{base}.{a.name}" for a in node.names]
            # `from pkg import submodule` imports the submodule; `from pkg import name` imports pkg itself
            names = subs + ([base] if any(sub not in modules for sub in subs) else [])
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != here:
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    files = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(f) for f in files}
    return {module_name(f): imports_of(f, modules) for f in files}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], {}

    def visit(m, stack):
        state[m] = "open"
        for n in sorted(graph.get(m, ())):
            if state.get(n) == "open":
                found.append(stack[stack.index(n) :] + [n])
            elif n not in state:
                visit(n, stack + [n])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return found


def test_the_graph_is_read():
    g = import_graph()
    assert "kdtree.capture" in g["kdtree.impls"] and "kdtree.validate" in g["kdtree.capture"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_no_import_circles():
    assert cycles(import_graph()) == []
