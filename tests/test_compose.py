"""docker-compose.yml (and the GPU overlay) pass a real compose parser and hold what users rely on.

There is no Docker engine in CI: Debian's docker-compose ``config`` parses, validates against
the compose schema, interpolates variables and merges the overlay, which is what we check.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from budgetq.shared.config import WorkerConfig
from budgetq.shared.config_load import load_config

ROOT = Path(__file__).resolve().parent.parent
BASE, GPU = ROOT / "docker-compose.yml", ROOT / "docker-compose.gpu.yml"


def _config(*args: str, env: dict[str, str] | None = None) -> dict:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose not installed (.ci/run installs Debian's docker-compose)")
    # A clean environment: a developer's BUDGETQ_* or REDIS_PASSWORD must not change the defaults checked.
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("BUDGETQ_", "REDIS_", "SGLANG_", "COMPOSE_"))}
    out = subprocess.run([binary, "--project-directory", str(ROOT), *args, "config"], capture_output=True,
                         text=True, env={**clean, **(env or {})}, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


def _seconds(duration: str) -> float:
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    return sum(float(n) * units[u] for n, u in re.findall(r"([\d.]+)(ms|h|m|s)", duration))


def _published(port) -> tuple[str, int]:
    """(host ip, host port) of a ports entry, short or long syntax."""
    if isinstance(port, dict):
        return port.get("host_ip", ""), int(port["published"])
    parts = str(port).split("/")[0].split(":")
    return (parts[0], int(parts[1])) if len(parts) == 3 else ("", int(parts[0]))


def _target(volume) -> str:
    """Container path of a volumes entry ("src:/target[:mode]" or long syntax)."""
    return volume["target"] if isinstance(volume, dict) else str(volume).split(":")[1]


def _command(svc: dict) -> str:
    cmd = svc.get("command", "")
    return " ".join(cmd) if isinstance(cmd, list) else cmd


def test_default_stack_has_every_service_wired_for_health_and_scale():
    services = _config("-f", str(BASE))["services"]
    assert {"redis", "sim", "producer", "worker", "monitor", "rq-dashboard"} <= set(services)
    default = {n for n, s in services.items() if not s.get("profiles")}
    assert {"redis", "sim", "producer", "worker", "monitor", "rq-dashboard"} <= default and "sglang" not in default

    redis = services["redis"]
    assert "--appendonly yes" in _command(redis) and "--appendfsync everysec" in _command(redis)
    assert "/data" in {_target(v) for v in redis["volumes"]}
    assert redis["healthcheck"]["test"] and "ports" not in redis  # never published on the host

    for name in ("sim", "monitor"):
        assert services[name]["healthcheck"]["test"], name
    for name in ("producer", "worker", "monitor", "rq-dashboard"):
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy", name
    assert services["worker"]["depends_on"]["sim"]["condition"] == "service_healthy"

    for name in ("sim", "producer", "worker", "monitor"):
        assert services[name]["init"] is True, f"{name}: without an init, PID 1 python ignores SIGTERM"
    worker = services["worker"]
    assert "container_name" not in worker and "ports" not in worker  # `--scale worker=8` works
    assert worker["deploy"]["replicas"] == 2
    assert worker.get("stop_signal", "SIGTERM") == "SIGTERM"
    grace = max(WorkerConfig().grace_s, load_config(ROOT / "examples" / "demo.yaml", env={}).worker.grace_s)
    assert _seconds(worker["stop_grace_period"]) > grace

    producer = services["producer"]
    assert {"/config", "/data", "/out"} <= {_target(v) for v in producer["volumes"]}
    assert producer["environment"]["BUDGETQ_OUTPUT_DIR"] == "/out"
    for name in ("producer", "worker", "monitor"):
        env = services[name]["environment"]
        assert env["BUDGETQ_REDIS_URL"] == "redis://redis:6379/0" and env["BUDGETQ_SERVER_URLS"] == "http://sim:30000"
        assert "/config/demo.yaml" in _command(services[name])

    dash = services["rq-dashboard"]
    assert "--json" in _command(dash)
    assert [_published(p) for p in dash["ports"]] == [("127.0.0.1", 9181)]
    assert [_published(p) for p in services["monitor"]["ports"]] == [("127.0.0.1", 9200)]
    for name, svc in services.items():
        for p in svc.get("ports", []):
            assert _published(p)[0] == "127.0.0.1", f"{name} publishes {p} beyond localhost"


def test_gpu_profile_runs_sglang_and_the_overlay_points_workers_at_it():
    services = _config("-f", str(BASE), "--profile", "gpu")["services"]
    sg = services["sglang"]
    assert sg["profiles"] == ["gpu"] and sg["image"].startswith("lmsysorg/sglang")
    (dev,) = sg["deploy"]["resources"]["reservations"]["devices"]
    assert dev["driver"] == "nvidia" and "gpu" in dev["capabilities"]
    assert sg["ipc"] == "host" and sg["shm_size"] and sg["ulimits"]["memlock"] == -1
    assert "/health" in " ".join(sg["healthcheck"]["test"]) and sg["healthcheck"]["start_period"]
    cmd = _command(sg)
    assert "sglang.launch_server" in cmd and "$SGLANG_MODEL_PATH" in cmd.replace("$$", "$")

    env = {"SGLANG_MODEL_PATH": "/models/qwen3-8b", "SGLANG_ARGS": "--tp 2"}
    merged = _config("-f", str(BASE), "-f", str(GPU), "--profile", "gpu", env=env)["services"]
    assert merged["sglang"]["environment"]["SGLANG_MODEL_PATH"] == "/models/qwen3-8b"
    assert merged["sglang"]["environment"]["SGLANG_ARGS"] == "--tp 2"
    worker = merged["worker"]
    assert worker["environment"]["BUDGETQ_SERVER_URLS"] == "http://sglang:30000"
    assert worker["depends_on"]["sglang"]["condition"] == "service_healthy"
    assert worker["depends_on"]["redis"]["condition"] == "service_healthy"


def test_secrets_and_passwords_come_from_env_only():
    env = {"REDIS_PASSWORD": "pw-from-env", "BUDGETQ_REDIS_URL": "redis://:pw-from-env@redis:6379/0",
           "BUDGETQ_API_KEY": "sk-from-env", "BUDGETQ_MONITOR_USERNAME": "ops", "BUDGETQ_MONITOR_PASSWORD": "mon-pw"}
    services = _config("-f", str(BASE), env=env)["services"]
    assert services["redis"]["environment"]["REDIS_PASSWORD"] == "pw-from-env"
    assert "--requirepass" in _command(services["redis"])
    assert services["rq-dashboard"]["environment"]["RQ_DASHBOARD_REDIS_URL"] == "redis://:pw-from-env@redis:6379/0"
    assert services["worker"]["environment"]["BUDGETQ_API_KEY"] == "sk-from-env"
    assert services["monitor"]["environment"]["BUDGETQ_MONITOR_PASSWORD"] == "mon-pw"
    assert "sk-from-env" not in BASE.read_text() and "pw-from-env" not in BASE.read_text()


def test_dockerfile_runs_as_non_root_with_cached_dependency_layer():
    text = (ROOT / "Dockerfile").read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    assert lines[0].startswith("FROM python:3.11-slim")
    user = [ln for ln in lines if ln.startswith("USER ")]
    assert user and user[-1] not in ("USER root", "USER 0")
    copies = [i for i, ln in enumerate(lines) if ln.startswith("COPY ")]
    first_install = next(i for i, ln in enumerate(lines) if "pip install" in ln)
    # pyproject alone is copied and installed before the source: code edits keep the dependency layer
    assert "pyproject.toml" in lines[copies[0]] and copies[0] < first_install < copies[1]
    ignore = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "out", ".env"} <= {p.strip("/") for p in ignore}
