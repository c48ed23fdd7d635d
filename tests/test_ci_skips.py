"""tests/ci_skips.py: under CI=true a skip fails with its reason; elsewhere it skips and `-rs` names it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SKIPPING = '''
import pytest

def test_runtime_skip():
    pytest.skip("no frobnicator here")

def test_passes():
    assert True

@pytest.mark.xfail(reason="known")
def test_xfail():
    assert False
'''
MODULE_SKIP = '''
import pytest
pytest.importorskip("no_such_module_budgetq_test")

def test_never():
    assert True
'''


def _pytest(tmp_path: Path, ci: str | None, module_skip: bool = False) -> subprocess.CompletedProcess:
    if module_skip:
        (tmp_path / "test_module.py").write_text(MODULE_SKIP)
    else:
        (tmp_path / "test_runtime.py").write_text(SKIPPING)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    env["PYTHONPATH"] = str(ROOT)
    args = ["-q", "-rs", "-p", "tests.ci_skips", "-p", "no:cacheprovider", "-p", "no:xdist", "-p", "no:randomly",
            "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path)]
    return subprocess.run([sys.executable, "-m", "pytest", *args], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=120)


def test_under_ci_a_skip_fails_with_its_reason(tmp_path):
    res = _pytest(tmp_path, "true")
    out = res.stdout + res.stderr
    assert res.returncode == 1, out
    assert "a missing capability fails the test instead of skipping it: no frobnicator here" in out, out
    assert "1 failed, 1 passed, 1 xfailed" in out, out  # an expected failure is not a missing capability
    assert " skipped" not in out.split("short test summary")[-1], out


def test_under_ci_a_module_level_skip_is_a_collection_error(tmp_path):
    res = _pytest(tmp_path, "true", module_skip=True)
    out = res.stdout + res.stderr
    assert res.returncode != 0, out
    assert "a missing capability fails the test instead of skipping it" in out, out
    assert "no_such_module_budgetq_test" in out, out


def test_outside_ci_a_skip_skips_and_the_summary_names_it(tmp_path):
    res = _pytest(tmp_path, None)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "SKIPPED" in out and "no frobnicator here" in out, out
    assert "1 passed, 1 skipped, 1 xfailed" in out, out
    res = _pytest(tmp_path, None, module_skip=True)
    assert res.returncode == 0 and "no_such_module_budgetq_test" in res.stdout, res.stdout + res.stderr
