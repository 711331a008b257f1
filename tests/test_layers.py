"""The core's modules form layers: no import cycle (lazy imports inside functions count),
and nothing imports the command line (``lmserve_core.cli``) but ``python -m lmserve_core``."""

from __future__ import annotations

import ast
from pathlib import Path

import lmserve_core

ROOT = Path(lmserve_core.__file__).parent


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = ["lmserve_core", *path.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _type_checking_only(tree: ast.AST) -> set[int]:
    """Line numbers of imports under ``if TYPE_CHECKING:`` (not run)."""
    lines = set()
    for node in ast.walk(tree):
        test = getattr(node, "test", None)
        if isinstance(node, ast.If) and getattr(test, "id", getattr(test, "attr", "")) == (
            "TYPE_CHECKING"
        ):
            lines |= {n.lineno for n in ast.walk(node) if isinstance(n, ast.ImportFrom)}
    return lines


def import_graph() -> dict[str, set[str]]:
    """Module -> the core modules it imports at run time, anywhere in its body."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = _type_checking_only(tree)
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        deps: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.lineno not in skip:
                base = package[: len(package) - node.level + 1] if node.level else []
                source = ".".join(base + ([node.module] if node.module else []))
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    deps.add(sub if sub in modules else source)
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_core_has_no_import_cycle() -> None:
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_one() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_nothing_imports_the_command_line() -> None:
    graph = import_graph()
    assert graph["lmserve_core.cli"]  # the graph sees its imports
    importers = sorted(m for m, deps in graph.items() if "lmserve_core.cli" in deps)
    assert importers == ["lmserve_core.__main__"]


def test_serving_imports_no_optional_extra() -> None:
    """The server's modules import neither Ray (``[ray]``) nor torch or transformers
    (``[train]``): serving works without the extras installed."""
    import subprocess
    import sys

    code = (
        "import sys, lmserve_core.cli, lmserve_core.launch, lmserve_core.app, "
        "lmserve_core.gguf_chat, lmserve_core.engine, lmserve_core.commands, "
        "lmserve_core.cluster.command, lmserve_core.cartridge.cli, lmserve_core.plugins; "
        "lmserve_core.plugins.backends(); "
        "found = sorted({m.split('.')[0] for m in sys.modules} & "
        "{'ray', 'torch', 'transformers'}); print(found); sys.exit(bool(found))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
