"""The layout's rules (docs/architecture.md), read from the source with ``ast``.

- One namespace: every import of ours names ``budgetq.<room>``, never a bare ``shared`` or ``producer``.
- No import cycle among the modules. Function-level (lazy) imports count: a lazy import hides a
  cycle from the interpreter, not from the design. Imports under ``if TYPE_CHECKING:`` are left
  out (they never run).
- Rooms: shared/ imports no other room; producer/ and worker/ never import each other; producer/ never
  imports hidden_states/ (capture: features is a hook the CLI registers); inside
  producer/, reading/ < run/ < ops/; the hidden-states pass keeps its producer side (collect/)
  and worker side (capture/) apart, its store and schema import only shared/; the simulator
  imports no pipeline room; no library room imports the CLI.
- The worker's floors (docs/worker.md): nothing hidden behind TYPE_CHECKING or a function-local
  import, the job flow reached only from the runner, tracked.py a leaf.
- No module over 400 lines; every module imports on its own.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROOMS = ("shared", "producer", "worker", "simulator", "hidden_states")  # top-level folders, budgetq.<room>
OLD_TOP = {*ROOMS, "cli"}
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    """Every module of the package by its installed name (the rooms through their real folders)."""
    out = {}
    paths = [p for p in (ROOT / "budgetq").rglob("*.py")]  # rglob does not follow the room links
    for room in ROOMS:
        paths += (ROOT / room).rglob("*.py")
    for path in sorted(paths):
        rel = path.relative_to(ROOT).with_suffix("").parts
        parts = rel if rel[0] == "budgetq" else ("budgetq", *rel)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _under_type_checking(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def _imports(name: str, path: Path) -> tuple[set[str], list[str]]:
    """(the project modules ``name`` imports, problems: bare room names, hidden or local imports)."""
    tree = ast.parse(path.read_text(), str(path))
    parents = _parents(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    problems: list[str] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Import | ast.ImportFrom):
            continue
        where = f"{name}:{node.lineno}"
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:  # relative: ``from . import x`` is x of this package, ``..`` one up
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        for t in targets:
            if t.split(".")[0] in OLD_TOP:
                problems.append(f"{where}: imports {t} (outside the budgetq namespace)")
        if _under_type_checking(node, parents):
            if name.startswith("budgetq.worker."):
                problems.append(f"{where}: imports under TYPE_CHECKING")
            continue
        local = not isinstance(parents.get(node), ast.Module)
        for t in targets:
            while t and t not in MODULES:
                t = t.rpartition(".")[0]
            if t and t != name and "." in t:  # a module of ours, not the bare package
                found.add(t)
                if local and name.startswith("budgetq.worker.") and isinstance(
                        _enclosing(node, parents), ast.FunctionDef | ast.AsyncFunctionDef):
                    problems.append(f"{where}: function-local import of {t}")
    return found, problems


def _enclosing(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> ast.AST | None:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            return node
    return None


_READ = {name: _imports(name, path) for name, path in MODULES.items()}
GRAPH = {name: deps for name, (deps, _) in _READ.items()}
PROBLEMS = [p for _, probs in _READ.values() for p in probs]


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


def _in(name: str, room: str) -> bool:
    return name == room or name.startswith(room + ".")


def _edges(src: str, dst: str, *, allow: tuple[str, ...] = ()) -> list[str]:
    """Imports from modules of room ``src`` into room ``dst`` (``allow``: targets let through)."""
    return sorted(f"{a} -> {b}" for a, targets in GRAPH.items() if _in(a, src)
                  for b in targets if _in(b, dst) and not _in(b, src) and b not in allow)


def test_the_graph_sees_the_imports_it_must():
    # guards the walker itself: a graph that found nothing would pass every rule below
    assert "budgetq.shared.keys" in GRAPH["budgetq.shared.status"]
    assert "budgetq.producer.reading.source_rows" in GRAPH["budgetq.producer.reading.arrow_sources"]
    assert "budgetq.producer.run.producer" in GRAPH["budgetq.cli.main"]  # a lazy import inside a function counts
    assert "budgetq.worker.sglang_client" in GRAPH["budgetq.hidden_states.capture.backends"]
    assert len(MODULES) > 100


def test_every_import_names_the_budgetq_namespace_and_the_worker_hides_none():
    assert PROBLEMS == []


def test_no_import_cycle_among_the_project_modules():
    assert _cycles(GRAPH) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}, "a.w": {"a.x"}}) == [["a.x", "a.y", "a.z"]]


def test_rooms_import_only_downward():
    b = "budgetq."
    for room in ("producer", "worker", "simulator", "hidden_states", "cli"):
        assert _edges(b + "shared", b + room) == [], f"shared imports {room}"
    assert _edges(b + "producer", b + "worker") == []
    assert _edges(b + "worker", b + "producer") == []
    assert _edges(b + "worker", b + "hidden_states") == []
    # inside producer/: reading < run < ops; produce's `capture: features` reaches the run through a hook
    # the CLI registers (producer/run/hooks.py): hidden_states imports the producer, never the reverse
    assert _edges(b + "producer.reading", b + "producer.run") == []
    assert _edges(b + "producer.reading", b + "producer.ops") == []
    assert _edges(b + "producer.reading", b + "hidden_states") == []
    assert _edges(b + "producer.run", b + "producer.ops") == []
    assert _edges(b + "producer", b + "hidden_states") == []
    # the hidden-states pass: two sides that never meet, a store and a schema below both
    hs = b + "hidden_states."
    assert _edges(hs + "collect", hs + "capture") == [] and _edges(hs + "capture", hs + "collect") == []
    assert _edges(hs + "collect", b + "worker") == []
    assert _edges(hs + "capture", b + "producer") == []
    for low in ("schema", "store"):
        for room in ("producer", "worker", "simulator", "cli", "hidden_states.collect", "hidden_states.capture"):
            assert _edges(hs + low, b + room) == [], f"hidden_states.{low} imports {room}"
    for room in ("producer", "worker", "hidden_states"):
        assert _edges(b + "simulator", b + room) == [], f"the simulator imports {room}"
    for room in ROOMS:
        assert _edges(b + room, b + "cli") == [], f"{room} imports the CLI"


def test_the_worker_floors():
    worker = {n: d for n, d in GRAPH.items() if _in(n, "budgetq.worker")}
    assert {n for n, deps in worker.items() if "budgetq.worker.jobflow" in deps} == {"budgetq.worker.runner"}
    assert not GRAPH["budgetq.worker.tracked"] & set(worker)  # a leaf


def test_no_module_is_over_400_lines():
    long = {n: len(p.read_text().splitlines()) for n, p in MODULES.items()}
    assert {n: k for n, k in long.items() if k > MAX_LINES} == {}


def test_the_rooms_are_linked_into_the_package():
    # the rooms are reached through budgetq/<room> links to the top-level folders (pyproject.toml)
    for room in ROOMS:
        link = ROOT / "budgetq" / room
        assert link.is_symlink() and link.resolve() == (ROOT / room).resolve(), link


# Each child of this one interpreter is forked before any project (or third-party) module is
# loaded, so every module imports on its own, as in a fresh interpreter, without paying for ~100
# interpreter starts on a shared machine.
_IMPORT_EACH = """
import importlib, os, sys, traceback
# Third-party packages are imported once, before the forks: what is checked is that each of *our* modules
# imports on its own (a name it uses is imported in it, whatever our other modules did), and a package in
# sys.modules puts no name into a module that does not import it. Saves each fork re-importing torch (~3 s).
for pkg in ("numpy", "pydantic", "redis", "rq", "aiohttp", "yaml", "torch", "transformers"):
    try:
        importlib.import_module(pkg)
    except ImportError:
        pass
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


def test_every_module_imports_on_its_own():
    names = sorted(n for n in MODULES if not n.endswith("__main__"))
    proc = subprocess.run([sys.executable, "-c", _IMPORT_EACH, *names], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    failed = proc.stdout.strip().rpartition("FAILED:")[2]
    assert failed == "", f"{failed} fail to import on their own:\n{proc.stderr[-3000:]}"
