"""The import graph of the project's packages: each module imports on its own, no cycles, and the
layering rules of the common notes (shared/ below producer/ and worker/, which never import each
other; no library package imports budgetq/, the CLI).

The graph is read with ``ast`` from the source, function-level (lazy) imports included: a lazy
import hides a cycle from the interpreter, not from the design. Imports under
``if TYPE_CHECKING:`` are left out (they never run).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ("shared", "producer", "worker", "simulator")
PACKAGES = (*LIBRARY, "budgetq")


def _modules(packages: tuple[str, ...]) -> dict[str, Path]:
    out = {}
    for pkg in packages:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules(PACKAGES)


def _type_checking_only(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def _imports(name: str, path: Path) -> set[str]:
    """The project modules ``name`` imports (a ``from pkg import mod`` names the module mod)."""
    tree = ast.parse(path.read_text(), str(path))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Import | ast.ImportFrom) or _type_checking_only(node, parents):
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:  # relative: ``from . import x`` is x of this package, ``..`` one up
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        for t in targets:
            while t and t not in MODULES:
                t = t.rpartition(".")[0]
            if t and t != name and t.split(".")[0] in PACKAGES and "." in t:  # a module, not a bare package
                found.add(t)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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


def _edges(src: str, dst: str) -> list[str]:
    return sorted(f"{a} -> {b}" for a, targets in GRAPH.items() if a.split(".")[0] == src
                  for b in targets if b.split(".")[0] == dst)


def test_the_graph_sees_the_imports_it_must():
    # guards the walker itself: a graph that found nothing would pass every rule below
    assert "shared.keys" in GRAPH["shared.status"]
    assert "producer.source_rows" in GRAPH["producer.arrow_sources"]
    assert "producer.run" in GRAPH["budgetq.cli"]  # a lazy import inside a function counts


def test_no_import_cycle_among_the_project_modules():
    assert _cycles(GRAPH) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}, "a.w": {"a.x"}}) == [["a.x", "a.y", "a.z"]]


def test_layering():
    assert _edges("shared", "producer") == []
    assert _edges("shared", "worker") == []
    assert _edges("producer", "worker") == []
    assert _edges("worker", "producer") == []
    for pkg in LIBRARY:
        assert _edges(pkg, "budgetq") == [], f"{pkg} imports the CLI package"


# Each child of this one interpreter is forked before any project (or third-party) module is
# loaded, so every module imports on its own, as in a fresh interpreter, without paying for ~60
# interpreter starts on a shared machine.
_IMPORT_EACH = """
import importlib, os, sys, traceback
failed = []
for name in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        try:
            importlib.import_module(name)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if status != 0:
        failed.append(name)
print("FAILED:" + ",".join(failed))
"""


def test_every_library_module_imports_on_its_own():
    names = sorted(n for n in MODULES if n.split(".")[0] in LIBRARY)
    proc = subprocess.run([sys.executable, "-c", _IMPORT_EACH, *names], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    failed = proc.stdout.strip().rpartition("FAILED:")[2]
    assert failed == "", f"{failed} fail to import on their own:\n{proc.stderr[-3000:]}"
