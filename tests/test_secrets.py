"""Secrets never leave: the SGLang API key and Redis/monitor passwords are absent from logs (text and
JSON), status output, the monitor's page/JSON/metrics, and everything stored in Redis (job payloads)."""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import subprocess
import tempfile
import time
import uuid
import zlib

import pytest
import redis

from budgetq.shared import logs
from budgetq.simulator.local import free_port, wait_http
from tests.helpers import CLI, LIVE, ROOT, http_get, live_run, three_datasets, write_config


@pytest.fixture(scope="module")
def secure_redis():
    """A private redis-server with requirepass and an ACL user (the conftest's server has no password)."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server not installed")
    admin_pw, user_pw = f"adm-{uuid.uuid4().hex}", f"acl-{uuid.uuid4().hex}"
    port, tmp = free_port(), tempfile.mkdtemp(prefix="budgetq-secure-redis-")
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", tmp, "--save", "",
                             "--appendonly", "no", "--requirepass", admin_pw],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    admin = redis.Redis(port=port, password=admin_pw)
    for _ in range(200):
        try:
            admin.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.02)
    admin.acl_setuser("bq", enabled=True, passwords=[f"+{user_pw}"], keys=["*"], channels=["*"], commands=["+@all"])
    yield {"port": port, "admin_pw": admin_pw, "user_pw": user_pw, "admin": admin,
           "acl_url": f"redis://bq:{user_pw}@127.0.0.1:{port}/0", "pass_url": f"redis://:{admin_pw}@127.0.0.1:{port}/0"}
    proc.terminate()
    proc.wait(10)
    shutil.rmtree(tmp, ignore_errors=True)


def _redis_dump(conn: redis.Redis) -> str:
    """Every key and value in the database as text (strings, hashes, lists, sets, zsets, streams);
    RQ's job data (zlib-compressed JSON: function, args = the payload) is decompressed."""
    parts = []
    for key in conn.scan_iter(count=1000):
        kind = conn.type(key).decode()
        value = {"string": lambda k: conn.get(k), "hash": conn.hgetall, "list": lambda k: conn.lrange(k, 0, -1),
                 "set": conn.smembers, "zset": lambda k: conn.zrange(k, 0, -1, withscores=True),
                 "stream": lambda k: conn.xrange(k)}.get(kind, lambda k: b"")(key)
        if kind == "hash" and b"data" in value:
            try:
                value[b"data"] = zlib.decompress(value[b"data"])
            except zlib.error:
                pass  # stored uncompressed
        parts.append(f"{key!r} {kind} {value!r}")
    return "\n".join(parts)


def test_no_secret_in_logs_status_monitor_or_redis(tmp_path, secure_redis, sim_factory):
    api_key = f"sk-budgetq-{uuid.uuid4().hex}"
    mon_pw = f"mon-{uuid.uuid4().hex}"
    secrets = [api_key, secure_redis["admin_pw"], secure_redis["user_pw"], mon_pw]
    admin = secure_redis["admin"]
    admin.flushall()  # our own server
    sim = sim_factory("--speedup", "200", "--length-mean", "120")
    cfg = write_config(tmp_path, "redis://placeholder:6379/0", sim, three_datasets(tmp_path), **LIVE)
    env = {"BUDGETQ_REDIS_URL": secure_redis["acl_url"], "BUDGETQ_API_KEY": api_key,
           "BUDGETQ_MONITOR_USERNAME": "ops", "BUDGETQ_MONITOR_PASSWORD": mon_pw}
    debug = ["--log-level", "DEBUG"]
    live = live_run(cfg, tmp_path, workers=[debug, [*debug, "--log-format", "json"]],
               producer_args=[*debug, "--log-format", "json"], env=env)
    assert live.producer.returncode == 0, live.producer.stderr
    texts = {"worker text log": live.worker_logs[0], "worker json log": live.worker_logs[1],
             "producer json log": live.producer.stderr, "producer stdout": live.producer.stdout}
    assert "budgetq summary" in live.producer.stdout and "DEBUG" in live.worker_logs[0]

    def cli(*args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([*CLI, *args], cwd=ROOT, capture_output=True, text=True, timeout=60,
                              env={**os.environ, **env, **(env_extra or {})})

    again = cli(*debug, "produce", "-c", str(cfg))  # a restarted producer, text logs
    assert again.returncode == 0, again.stderr
    texts["producer text log"] = again.stderr
    for fmt in ("text", "json"):
        for extra in ([], ["--json"]):
            out = cli(*debug, "--log-format", fmt, "status", "-c", str(cfg), *extra,
                      env_extra={"BUDGETQ_REDIS_URL": secure_redis["pass_url"]})
            assert out.returncode == 0, out.stderr
            texts[f"status {fmt} {extra}"] = out.stdout + out.stderr
    assert "A1" in texts["status text []"]
    wrong = cli("--log-format", "json", "status", "--redis-url",
                f"redis://bq:{secure_redis['user_pw']}@127.0.0.1:{free_port()}/0")
    # the error names host:port/db only (shared.redis_conn.explain); the texts are grepped for the password below
    assert wrong.returncode == 2 and "cannot reach Redis at 127.0.0.1:" in wrong.stderr
    texts["status error"] = wrong.stdout + wrong.stderr

    port = free_port()
    mon = subprocess.Popen([*CLI, *debug, "--log-format", "json", "monitor", "-c", str(cfg), "--port", str(port)],
                           cwd=ROOT, env={**os.environ, **env}, stderr=subprocess.PIPE, text=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz")
        for path in ("/", "/api/status", "/metrics"):
            status, _ctype, body = http_get(f"http://127.0.0.1:{port}{path}", ("ops", mon_pw))
            assert status == 200
            texts[f"monitor {path}"] = body
    finally:
        mon.terminate()
        texts["monitor json log"] = mon.communicate(timeout=10)[1]
    assert '"dataset": "A1"' in texts["monitor /api/status"] and "budgetq_used_tokens" in texts["monitor /metrics"]

    dump = _redis_dump(admin)
    assert "rq:job:A1--p1'" in dump and '"content": "question p1"' in dump  # job payloads, decompressed
    texts["redis"] = dump

    for name, text in texts.items():
        for s in secrets:
            assert s not in text, f"a secret leaked into {name}"
    for name in ("worker json log", "producer json log", "monitor json log"):  # structured: one object a line
        lines = [ln for ln in texts[name].splitlines() if ln.strip()]
        assert lines and all(isinstance(json.loads(ln), dict) for ln in lines), name


def _capture(fmt: str) -> tuple[logging.Logger, io.StringIO]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.JsonFormatter() if fmt == "json" else logs.TextFormatter())
    handler.addFilter(logs.RedactFilter())
    logger = logging.getLogger(f"budgetq.test.redact.{fmt}.{uuid.uuid4().hex[:6]}")
    logger.propagate = False
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    return logger, stream


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_redaction_covers_messages_args_tracebacks_and_extras(fmt, monkeypatch):
    key = f"sk-{uuid.uuid4().hex}"
    monkeypatch.setenv("BUDGETQ_API_KEY", key)
    logs.register_env_secrets()
    logger, stream = _capture(fmt)
    logger.info("connecting to %s", "rediss://bq:hunter2-pw@redis.internal:6380/0")
    logger.info("headers %s", {"Authorization": "Bearer some-other-token-123"})
    logger.warning("key is " + key, extra={"detail": f"x{key}y"})
    try:
        raise RuntimeError(f"server said: bad key {key}")
    except RuntimeError:
        logger.exception("request failed")
    out = stream.getvalue()
    for leaked in (key, "hunter2-pw", "some-other-token-123"):
        assert leaked not in out
    assert "rediss://bq:***@redis.internal:6380/0" in out and "Bearer ***" in out
    assert "RuntimeError: server said: bad key ***" in out
    if fmt == "json":
        records = [json.loads(line) for line in out.splitlines()]
        assert len(records) == 4 and records[3]["exc"].startswith("Traceback") and records[2]["detail"] == "x***y"
        assert {r["level"] for r in records} == {"INFO", "WARNING", "ERROR"}


def test_redact_helpers():
    assert logs.redact_url("redis://:p4ss@h:1/0") == "redis://:***@h:1/0"
    assert logs.redact_url("redis://h:1/0") == "redis://h:1/0"
    assert logs.url_password("rediss://u:p%40ss@h:6380/0") == "p@ss"
    logs.register_secret("abc")  # too short to mask safely: ignored
    assert logs.redact("abc def") == "abc def"


def test_status_and_monitor_need_only_read_access(secure_redis):
    """Both only read: a Redis ACL user limited to read commands on bq:* and rq:* keys is enough."""
    from budgetq.producer.ops.monitor import MonitorThread
    from budgetq.shared import budget
    from budgetq.shared.budget import register_dataset
    from budgetq.shared.config import Config, DatasetConfig
    from budgetq.shared.scripts import run

    admin = secure_redis["admin"]
    admin.flushall()
    register_dataset(admin, DatasetConfig(name="R1", path="x", budget="1k", sampling={"max_tokens": 10}))
    run(admin, budget.reserve("R1", "R1-a", 10))
    admin.sadd("bq:workers", "w-gone")
    admin.xadd("bq:control", {"ts": 1.0, "who": "a@b", "action": "pause", "dataset": "R1", "old": "0", "new": "1"})
    viewer_pw = f"view-{uuid.uuid4().hex}"
    admin.acl_setuser("viewer", enabled=True, reset=True, passwords=[f"+{viewer_pw}"], keys=["bq:*", "rq:*"],
                      commands=["-@all", "+@read", "+time", "+ping"])
    admin.acl_log_reset()
    url = f"redis://viewer:{viewer_pw}@127.0.0.1:{secure_redis['port']}/0"
    out = subprocess.run([*CLI, "status", "--json", "--redis-url", url], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["datasets"][0]["in_flight"] == 1
    mon = MonitorThread(Config(redis_url=url), port=0)
    port = mon.start()
    try:
        for path in ("/api/status", "/metrics"):
            assert http_get(f"http://127.0.0.1:{port}{path}")[0] == 200
    finally:
        mon.stop()
    assert admin.acl_log() == []  # no command was refused
