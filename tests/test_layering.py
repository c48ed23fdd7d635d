"""The worker's modules are floors (docs/worker.md): no import cycle, none hidden behind
TYPE_CHECKING or an import inside a function, and the job flow is reached only from the runner."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("worker", "shared")


def _imports(path: Path) -> tuple[set[str], list[str]]:
    """(modules of our packages imported at module level, problems found)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    problems = []
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            problems.append(f"{path.name}:{node.lineno}: imports under TYPE_CHECKING")
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES:
            if node.module in PACKAGES:  # from worker import x
                found |= {f"{node.module}.{a.name}" for a in node.names}
            else:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] in PACKAGES}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(node):
                if isinstance(inner, (ast.Import, ast.ImportFrom)):
                    mod = inner.module if isinstance(inner, ast.ImportFrom) else inner.names[0].name
                    if mod and mod.split(".")[0] in PACKAGES:
                        problems.append(f"{path.name}:{inner.lineno}: function-local import of {mod}")
    return found, problems


def _graph() -> tuple[dict[str, set[str]], list[str]]:
    graph, problems = {}, []
    for pkg in PACKAGES:
        for path in (ROOT / pkg).glob("*.py"):
            name = f"{pkg}.{path.stem}"
            deps, probs = _imports(path)
            graph[name] = {d for d in deps if d != name}
            if pkg == "worker":  # (shared/redis_conn.py imports shared.logs inside functions; not ours)
                problems += probs
    return graph, problems


def test_no_import_cycle_and_nothing_hidden():
    graph, problems = _graph()
    assert not problems, problems
    state: dict[str, int] = {}

    def visit(n: str, path: list[str]) -> None:
        state[n] = 1
        for d in graph.get(n, ()):
            assert state.get(d) != 1, f"import cycle: {' -> '.join([*path, n, d])}"
            if d not in state:
                visit(d, [*path, n])
        state[n] = 2

    for n in graph:
        if n not in state:
            visit(n, [])


def test_shared_imports_no_worker_module_and_only_the_runner_starts_the_job_flow():
    graph, _ = _graph()
    assert not any(d.startswith("worker") for n, deps in graph.items() if n.startswith("shared") for d in deps)
    assert {n for n, deps in graph.items() if "worker.jobflow" in deps} == {"worker.runner"}
    assert not graph["worker.tracked"] & {n for n in graph if n.startswith("worker")}  # a leaf
