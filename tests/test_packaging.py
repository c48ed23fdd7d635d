"""The wheel carries everything ``budgetq demo`` needs, and the Docker image installs that wheel.

A fresh venv outside the checkout gets only the wheel (``--no-deps``, offline); its
dependencies come from the running venv's site-packages through a .pth line, which adds
that directory without processing its .pth files, so the checkout's editable install (if
any) stays out and the wheel is what is imported.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_SKIP = shutil.ignore_patterns(".git", ".venv", "build", "out", "*.egg-info", "__pycache__", ".pytest_cache",
                               ".ruff_cache", "bench")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    # Built from a copy: a build writes build/ and *.egg-info, which must not race other test runs.
    src = tmp_path_factory.mktemp("src") / "budgetq"
    shutil.copytree(ROOT, src, symlinks=True, ignore=_SKIP)
    dist = tmp_path_factory.mktemp("dist")
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", str(src), "-w", str(dist)]
    if importlib.util.find_spec("setuptools") and importlib.util.find_spec("wheel"):
        cmd.insert(5, "--no-build-isolation")  # offline: this venv's setuptools (and wheel) build it
    subprocess.run(cmd, check=True, timeout=300)
    (whl,) = dist.glob("budgetq-*.whl")
    return whl


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    venv = tmp_path_factory.mktemp("venv") / "v"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    Path(purelib, "budgetq_test_deps.pth").write_text("\n".join(sorted(deps)) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index", "-q",
                    str(wheel)], check=True, timeout=300)
    return venv


def test_the_wheel_ships_the_demo_config_datasets_lua_and_static_files(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in ("budgetq/examples/demo.yaml", "budgetq/examples/budgetq.yaml", "budgetq/examples/data/a1.jsonl",
                 "budgetq/examples/data/b2.jsonl", "budgetq/examples/data/c1.jsonl", "budgetq/shared/lua/reserve.lua",
                 "budgetq/producer/ops/static/monitor.html"):
        assert path in names, path
    assert not any(n.startswith(("examples/", "tests/")) for n in names)


def test_the_wheel_installs_one_name_budgetq_and_the_console_script(wheel, installed, tmp_path):
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"budgetq", wheel.name.split("-py3")[0] + ".dist-info"}
    for room in ("shared", "producer", "producer/reading", "producer/run", "producer/ops", "worker", "simulator",
                 "hidden_states", "hidden_states/collect", "hidden_states/capture", "hidden_states/store", "cli"):
        assert f"budgetq/{room}/__init__.py" in names, room
    purelib = Path(subprocess.run([str(installed / "bin" / "python"), "-c",
                                   "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  check=True, capture_output=True, text=True).stdout.strip())
    ours = {p.name for p in purelib.iterdir()} - {"budgetq_test_deps.pth"}
    assert {n for n in ours if not n.endswith(".dist-info")} == {"budgetq"}, ours
    assert sorted(p.name for p in (installed / "bin").iterdir() if p.name.startswith("budgetq")) == ["budgetq"]
    # the generic names are not importable from the wheel (a checkout on sys.path would hide that)
    probe = ("import importlib.util as u; import budgetq.shared.keys, budgetq.worker.job, "
             "budgetq.producer.run.producer; "
             "print([n for n in ('shared', 'producer', 'worker', 'simulator', 'hidden_states') if u.find_spec(n)])")
    out = subprocess.run([str(installed / "bin" / "python"), "-c", probe], cwd=tmp_path, capture_output=True,
                         text=True, env=_clean_env(), check=True).stdout.strip()
    assert out == "[]", out


def _clean_env() -> dict[str, str]:
    # Nothing from the checkout: no PYTHONPATH, no BUDGETQ_* of a developer's shell.
    return {k: v for k, v in os.environ.items() if not k.startswith(("BUDGETQ_", "PYTHON"))}


def test_the_installed_wheel_runs_the_demo_outside_the_checkout_quietly(installed, tmp_path):
    where = subprocess.run([str(installed / "bin" / "python"), "-c", "import budgetq; print(budgetq.__file__)"],
                           cwd=tmp_path, capture_output=True, text=True, env=_clean_env(), check=True).stdout
    assert where.startswith(str(installed)), where  # the wheel, not the checkout
    proc = subprocess.run([str(installed / "bin" / "budgetq"), "--log-level", "WARNING", "--log-format", "json",
                           "demo"], cwd=tmp_path, capture_output=True, text=True, env=_clean_env(), timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows: dict[str, str] = {}  # the summary's row of each (the end-of-run table that follows has one too)
    for ln in proc.stdout.splitlines():
        if re.match(r"^│ (A1|B2|C1) ", ln):
            rows.setdefault(ln.split("│")[1].strip(), ln)
    assert set(rows) == {"A1", "B2", "C1"}, proc.stdout
    assert all("budget" in ln for ln in rows.values())  # the stop column: budget reached
    # --log-level and --log-format reached every child: no INFO line, every log line is JSON.
    logs = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    for ln in logs:
        if ln.startswith("[transformers]"):  # transformers' own import-time notice, not a log record
            continue
        record = json.loads(ln)
        assert record["level"] in ("WARNING", "ERROR", "CRITICAL"), ln
    assert " INFO " not in proc.stdout + proc.stderr


def _dockerfile_lines() -> list[str]:
    text = (ROOT / "Dockerfile").read_text()
    # Join continuation lines: one RUN per entry.
    text = re.sub(r"\\\n\s*", " ", text)
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]


def test_the_image_installs_the_same_wheel_and_carries_redis_for_the_demo():
    lines = _dockerfile_lines()
    runs = [ln for ln in lines if ln.startswith("RUN ")]
    build = next(ln for ln in runs if "pip wheel" in ln)
    assert "--no-deps" in build and re.search(r"pip install --no-deps \S*budgetq-\*\.whl", build)
    assert "rm -rf /app" in build  # no source tree left to import instead of the wheel
    assert any("apt-get install" in ln and "redis-server" in ln for ln in runs)
    assert lines[-2] == 'ENTRYPOINT ["budgetq"]'
    workdir = [ln for ln in lines if ln.startswith("WORKDIR ")][-1]
    assert workdir != "WORKDIR /app"
    ignored = {p.strip("/") for p in (ROOT / ".dockerignore").read_text().split()}
    assert not {"budgetq", "budgetq/examples", "examples"} & ignored
