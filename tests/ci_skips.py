"""Under CI=true a test that would skip fails instead, saying what is missing (issue 38, item 5).

A skip says "this machine lacks a capability" (network namespaces, vLLM, Chromium, docker-compose,
tmpfs mounts, ...). On a developer's machine that is information; in CI it would let a machine that
lacks the capability go green without running the tests that need it. So when the environment says
CI (``CI=true``, as the CI runner sets it), every skip, at run time or at collection, becomes a
failure with the skip's own reason. ``make test`` also prints the skip summary (``-rs``), so a local
run says what it did not check. tests/conftest.py imports these hooks; tests/test_ci_skips.py runs
pytest on a test that skips, with and without CI=true.
"""

from __future__ import annotations

import os

import pytest

PREFIX = "CI=true: a missing capability fails the test instead of skipping it: "


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def _reason(longrepr: object) -> str:
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (file, line, "Skipped: why")
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if in_ci() and rep.skipped and not hasattr(rep, "wasxfail"):
        rep.outcome = "failed"
        rep.longrepr = PREFIX + _reason(rep.longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    rep = outcome.get_result()
    if in_ci() and rep.outcome == "skipped":  # a module-level importorskip / skip(allow_module_level=True)
        rep.outcome = "failed"
        rep.longrepr = PREFIX + _reason(rep.longrepr)
