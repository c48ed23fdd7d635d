"""The vLLM tests' time limit counts their own work, not the shared server's start.

A test that uses the run's vLLM server (the ``vllm`` / ``vllm_alone`` fixtures, test_vllm_features.py's
``hs_server``) or one of its own (``vllm_fp32``) first waits, in its setup, for that server to start: 40 s
unloaded, minutes on a loaded 2-core machine (tests/vllm_server.py bounds it by START_TIMEOUT_S).
pytest-timeout's default counts setup too, so the suite's 300 s (pyproject) once failed a test for the start
alone; each such module sets ``pytest.mark.timeout(..., func_only=True)``. Checked here without vLLM: every
module that uses one of those fixtures sets it, and pytest-timeout then leaves a slow session fixture's setup
out of the limit.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
SERVER_FIXTURES = {"vllm", "vllm_alone", "vllm_fp32", "hs_server"}


def _uses_server(tree: ast.Module) -> bool:
    return any(isinstance(node, ast.FunctionDef) and {a.arg for a in node.args.args} & SERVER_FIXTURES
               for node in ast.walk(tree))


def _timeout_mark(tree: ast.Module) -> ast.Call | None:
    """The module's ``pytestmark = pytest.mark.timeout(...)`` (alone or in a list), if any."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            values = node.value.elts if isinstance(node.value, ast.List | ast.Tuple) else [node.value]
            for v in values:
                if isinstance(v, ast.Call) and ast.unparse(v.func) == "pytest.mark.timeout":
                    return v
    return None


def test_every_module_using_the_vllm_server_times_its_tests_alone():
    modules = sorted(TESTS.glob("test_*.py"))
    users = [m for m in modules if _uses_server(ast.parse(m.read_text()))]
    assert {m.name for m in users} >= {"test_vllm_generation.py", "test_vllm_fleet.py", "test_vllm_features.py"}
    missing = []
    for m in users:
        mark = _timeout_mark(ast.parse(m.read_text()))
        func_only = mark is not None and any(k.arg == "func_only" and isinstance(k.value, ast.Constant)
                                             and k.value.value is True for k in mark.keywords)
        if not func_only:
            missing.append(m.name)
    assert not missing, f"{missing}: set pytestmark = pytest.mark.timeout(<s>, func_only=True)"


@pytest.mark.parametrize("func_only", [True, False])
def test_func_only_leaves_a_slow_session_fixture_out_of_the_limit(tmp_path, func_only):
    """A session fixture that takes 3 s (the server's start) under a 2 s limit: func_only passes, the default fails
    (the negative control: the setup does count without it)."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "conftest.py").write_text(
        "import time, pytest\n\n@pytest.fixture(scope='session')\ndef server():\n    time.sleep(3)\n    return 'up'\n")
    (tmp_path / "test_it.py").write_text(
        "import pytest\n\n"
        f"pytestmark = pytest.mark.timeout(2, func_only={func_only})\n\n"
        "def test_one(server):\n    assert server == 'up'\n\n"
        "def test_two(server):\n    assert server == 'up'\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    if func_only:
        assert done.returncode == 0 and "2 passed" in done.stdout, done.stdout + done.stderr
    else:
        assert done.returncode == 1 and "Timeout" in done.stdout + done.stderr, done.stdout + done.stderr
