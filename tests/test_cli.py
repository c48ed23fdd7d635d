"""The operator commands, run as a user would (subprocess) against a real Redis."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from budgetq.shared import budget, keys
from budgetq.shared.budget import register_dataset
from budgetq.shared.config import DatasetConfig
from budgetq.shared.scripts import run

ROOT = Path(__file__).resolve().parent.parent


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "budgetq.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def test_status_budget_pause_resume(tmp_path, redis_url, conn):
    register_dataset(conn, DatasetConfig(name="B2", path="x", budget="10M", sampling={"max_tokens": 100},
                                         prior_mean_tokens=50))
    run(conn, budget.reserve("B2", "j1", 100))
    run(conn, budget.commit("B2", "j1", 3, 77, "stop", "{}"))
    out = _cli("status", "--redis-url", redis_url, "--json")
    assert out.returncode == 0, out.stderr
    (row,) = json.loads(out.stdout)["datasets"]
    assert row["dataset"] == "B2" and row["budget"] == 10_000_000 and row["used"] == 77 and not row["paused"]

    assert _cli("budget", "set", "B2", "12.5M", "--redis-url", redis_url).returncode == 0
    assert int(conn.hget(keys.conf_key("B2"), "limit")) == 12_500_000
    assert _cli("pause", "B2", "--redis-url", redis_url).returncode == 0
    assert run(conn, budget.reserve("B2", "j2", 100)).status.value == "PAUSED"
    assert _cli("resume", "B2", "--redis-url", redis_url).returncode == 0
    assert run(conn, budget.reserve("B2", "j2", 100)).status.value == "ADMIT"

    bad = _cli("pause", "NOPE", "--redis-url", redis_url)
    assert bad.returncode == 2 and "'NOPE' is not registered" in bad.stderr
    bad = _cli("budget", "set", "B2", "lots", "--redis-url", redis_url)
    assert bad.returncode == 2 and "not a token count: 'lots'" in bad.stderr


def test_bad_config_is_a_clear_error(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"datasets": [{"name": "A", "path": "a.jsonl", "budget": "x1"}]}))
    out = _cli("produce", "-c", str(cfg))
    # one error, one line: the file, the field and the value
    _one_line_error(out, f"budgetq: error: invalid config {cfg}: datasets.0.budget: not a token count: 'x1'")
    # several: a heading, then one line each
    cfg.write_text(yaml.safe_dump({"datasets": [{"name": "A", "path": "a.jsonl", "budget": 0}],
                                   "run": {"total_budget": "lots"}}))
    out = _cli("produce", "-c", str(cfg))
    assert out.returncode == 2, out.stderr
    head, *lines = out.stderr.strip().splitlines()
    assert head == f"budgetq: error: invalid config {cfg}: 2 errors:", out.stderr
    assert [ln.split(":")[0] for ln in lines] == ["  datasets.0.budget", "  run.total_budget"], out.stderr


def _one_line_error(out: subprocess.CompletedProcess, *needles: str) -> None:
    """Exit status 2, one line on stderr naming what is wrong, no traceback."""
    assert out.returncode == 2, (out.returncode, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def _config(tmp_path, **raw) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw) if raw else "")
    return str(path)


BAD_URLS = (("redis://127.0.0.1:abc/0", "Port could not be cast"), ("redis://[::1/0", "Invalid IPv6"),
            ("http://127.0.0.1:6379/0", "scheme must be"), ("redis://127.0.0.1:99999/0", "out of range"),
            ("redis://127.0.0.1:6379/x", "database number"), ("redis://", "no host"))


def test_malformed_redis_urls_are_refused_before_any_connection():
    from budgetq.shared.errors import ConfigError
    from budgetq.shared.redis_conn import aconnect, check_url, connect

    for url, why in BAD_URLS:
        for make in (check_url, connect, aconnect):
            with pytest.raises(ConfigError, match="redis_url") as err:
                make(url)
            assert why in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ConfigError) as err:
        check_url("redis://:s3cret-pw@127.0.0.1:abc/0")
    assert "redis://:***@127.0.0.1:abc/0" in str(err.value) and "s3cret-pw" not in str(err.value)
    check_url("redis://user:pw@127.0.0.1:6379/3?socket_timeout=30")
    check_url("rediss://127.0.0.1:6380")
    check_url("unix:///run/redis.sock")


def test_malformed_redis_urls_are_one_line_errors_in_every_command(tmp_path):
    _one_line_error(_cli("status", "--redis-url", BAD_URLS[0][0]), "redis_url", BAD_URLS[0][1])
    _one_line_error(_cli("budget", "set", "A", "1M", "--redis-url", BAD_URLS[1][0]), "redis_url", BAD_URLS[1][1])
    out = _cli("status", "--redis-url", "redis://:s3cret-pw@127.0.0.1:abc/0")
    _one_line_error(out, "redis://:***@127.0.0.1:abc/0")
    assert "s3cret-pw" not in out.stderr
    (tmp_path / "a.jsonl").write_text('{"prompt": "hi"}\n')
    cfg = _config(tmp_path, redis_url="http://127.0.0.1:6379/0", redis_wait_s=0,
                  datasets=[{"name": "A", "path": str(tmp_path / "a.jsonl"), "budget": "1k"}])
    _one_line_error(_cli("produce", "-c", cfg), "redis_url", "http://127.0.0.1:6379/0")
    _one_line_error(_cli("worker", "-c", cfg), "redis_url", "http://127.0.0.1:6379/0")


def test_token_counts_are_parsed_exactly():
    from budgetq.shared.tokens import MAX_TOKENS, parse_tokens

    assert parse_tokens("12345678901234567") == 12345678901234567
    assert parse_tokens("2.5k") == 2500 and parse_tokens("10_000_000") == 10_000_000
    assert parse_tokens("9.3G") == 9_300_000_000
    assert parse_tokens(str(MAX_TOKENS)) == MAX_TOKENS == 2**63 - 1
    for bad in ("9223372036854775808", "99999999999999999999999", 10**30, 1e30):
        with pytest.raises(ValueError, match="too large"):
            parse_tokens(bad)
    with pytest.raises(ValueError, match="whole"):
        parse_tokens("1.0000001k")


def test_database_out_of_range_is_a_one_line_error(tmp_path, redis_url):
    (tmp_path / "a.jsonl").write_text('{"prompt": "hi"}\n')
    url = redis_url.rsplit("/", 1)[0] + "/99"
    cfg = _config(tmp_path, redis_url=url, datasets=[{"name": "A", "path": str(tmp_path / "a.jsonl"), "budget": "1k"}])
    _one_line_error(_cli("produce", "-c", cfg), "database 99 does not exist", "DB index is out of range")
    _one_line_error(_cli("worker", "-c", cfg), "database 99 does not exist")


def test_password_protected_redis_without_the_password_says_so(tmp_path):
    from budgetq.simulator.local import LocalRedis

    server = LocalRedis(password="pw-for-the-test")
    try:
        bare = f"redis://127.0.0.1:{server.port}/0"
        _one_line_error(_cli("status", "--redis-url", bare), f"Redis at 127.0.0.1:{server.port}/0 requires a password")
        _one_line_error(_cli("worker", "--redis-url", bare), "requires a password")
        wrong = _cli("status", "--redis-url", f"redis://:wrong-password@127.0.0.1:{server.port}/0")
        _one_line_error(wrong, "refused the user name or password")
        assert "wrong-password" not in wrong.stderr
        assert _cli("status", "--redis-url", server.url).returncode == 0
    finally:
        server.stop()


def test_worker_concurrency_must_be_positive():
    for value in ("-5", "0", "many"):
        out = _cli("worker", "--concurrency", value)
        _one_line_error(out, "--concurrency", repr(value))
    _one_line_error(_cli("worker", "--grace-s", "-1"), "--grace-s", "'-1'")


def test_budgets_are_exact_and_bounded_by_what_redis_holds(redis_url, conn):
    register_dataset(conn, DatasetConfig(name="A", path="x", budget="1M"))
    big = "9223372036854775807"  # int64 max: INCRBY's limit
    assert _cli("budget", "set", "A", big, "--redis-url", redis_url).returncode == 0
    assert conn.hget(keys.conf_key("A"), "limit").decode() == big
    assert _cli("budget", "set", "A", "12345678901234567", "--redis-url", redis_url).returncode == 0
    assert conn.hget(keys.conf_key("A"), "limit").decode() == "12345678901234567"  # not rounded via a float
    out = _cli("budget", "set", "A", "99999999999999999999999", "--redis-url", redis_url)
    _one_line_error(out, "budget for A", "too large", "99999999999999999999999")
    assert conn.hget(keys.conf_key("A"), "limit").decode() == "12345678901234567"


def test_produce_without_datasets_is_an_error(tmp_path):
    empty = _config(tmp_path)
    _one_line_error(_cli("produce", "-c", empty), f"no datasets in {empty}")
    (tmp_path / "c.yaml").write_text("datasets: []\n")
    _one_line_error(_cli("produce", "-c", empty), f"no datasets in {empty}")


def test_empty_dataset_file_is_warned_about_by_name(tmp_path, redis_url):
    (tmp_path / "empty.jsonl").write_text("")
    cfg = _config(tmp_path, redis_url=redis_url, output_dir=str(tmp_path / "out"),
                  producer={"progress": "off"},
                  datasets=[{"name": "E", "path": str(tmp_path / "empty.jsonl"), "budget": "1k"}])
    out = _cli("produce", "-c", cfg)  # nothing to send: the run ends at once
    assert out.returncode == 0, out.stderr
    assert f"dataset E: {tmp_path / 'empty.jsonl'} is empty" in out.stderr


def test_history_s_out_of_range_is_short():
    out = _cli("status", "--history-s", "99999")
    _one_line_error(out, "--history-s", "between 0 and 3600", "99999")
    assert len(out.stderr) < 300


def test_bad_log_flags_are_one_line_errors_and_good_ones_any_case():
    for flag, value in (("--log-level", "FOO"), ("--log-level", "notset"), ("--log-format", "XML")):
        _one_line_error(_cli(flag, value, "status"), f"argument {flag}: {value!r} is not one of")
    # any case, as before: the flags are taken (the error after them is the command's own, as a JSON line)
    out = _cli("--log-level", "debug", "--log-format", "JSON", "budget", "set", "B2", "0",
               "--redis-url", "redis://127.0.0.1:1/0")
    assert out.returncode == 2, out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert json.loads(line)["level"] == "ERROR" and "budget must be above 0" in json.loads(line)["msg"], line


def _skipped(conn, ds: str, ids: range) -> None:
    """Jobs the budget skipped (RQ's canceled registry), as a run that reached it leaves them."""
    from budgetq.shared.jobs import Ending

    for i in ids:
        conn.hset(f"{keys.RQ_JOB_PREFIX}{ds}--p{i}", mapping={"status": "canceled", "origin": f"bq-{ds}"})
        conn.zadd(keys.rq_registry_key(ds, Ending.CANCELED), {f"{ds}--p{i}": i})


def test_requeueing_commands_say_a_producer_collects_and_name_the_producers_hold(redis_url, conn):
    from budgetq.cli.control import COLLECT_NOTE
    from budgetq.shared.jobs import Ending

    register_dataset(conn, DatasetConfig(name="B2", path="x", budget="1k", sampling={"max_tokens": 100}))
    conn.set(keys.used_key("B2"), 1000)   # the budget reached, the run over, its last jobs skipped
    _skipped(conn, "B2", range(3))
    out = _cli("budget", "set", "B2", "2k", "--redis-url", redis_url)
    assert out.stdout.splitlines() == ["B2: budget 1.00k -> 2.00k; requeued 3 skipped jobs", COLLECT_NOTE], out
    out = _cli("budget", "set", "B2", "3k", "--redis-url", redis_url)
    assert out.stdout.splitlines() == ["B2: budget 2.00k -> 3.00k"], out   # nothing requeued: nothing to collect
    assert _cli("pause", "B2", "--redis-url", redis_url).stdout.splitlines() == ["B2: paused"]
    _skipped(conn, "B2", range(3, 5))
    out = _cli("resume", "B2", "--redis-url", redis_url)
    assert out.stdout.splitlines() == ["B2: resumed; requeued 2 skipped jobs", COLLECT_NOTE], out
    # the producer holds the dataset (output disk full): a resume cannot admit anything, and says why
    why = "output_dir /data/out: No space left on device"
    conn.hset(keys.conf_key("B2"), "hold", why)
    _skipped(conn, "B2", range(5, 6))
    for args in (("resume", "B2"), ("budget", "set", "B2", "4k")):
        out = _cli(*args, "--redis-url", redis_url)
        assert out.returncode == 0 and out.stdout.endswith(f"; admissions stay held by the producer: {why}\n"), out
        assert COLLECT_NOTE not in out.stdout, out
    assert conn.zcard(keys.rq_registry_key("B2", Ending.CANCELED)) == 1   # still skipped: nothing changed


def test_budgets_take_exponents_and_refuse_nan_and_inf_in_one_line(tmp_path, redis_url, conn):
    from budgetq.shared.config_fields import parse_budget

    assert parse_budget("1e7") == parse_budget("1E7") == parse_budget(1e7) == 10_000_000
    assert parse_budget("2.5e6") == 2_500_000 and parse_budget("1e+07") == 10_000_000
    register_dataset(conn, DatasetConfig(name="A", path="x", budget="1M"))
    assert _cli("budget", "set", "A", "1e7", "--redis-url", redis_url).returncode == 0
    assert int(conn.hget(keys.conf_key("A"), "limit")) == 10_000_000
    for bad, needle in (("nan", "not a finite token count: 'nan'"), ("inf", "not a finite token count: 'inf'"),
                        ("Infinity", "not a finite token count: 'Infinity'"), ("0", "a budget must be above 0 (got 0)"),
                        ("-1e7", "a budget must be above 0 (got -1e7)")):
        _one_line_error(_cli("budget", "set", "A", bad, "--redis-url", redis_url), needle)
    assert int(conn.hget(keys.conf_key("A"), "limit")) == 10_000_000
    # the config: YAML reads 1e7 as a string, .inf as a float
    (tmp_path / "a.jsonl").write_text('{"prompt": "hi"}\n')
    cfg = tmp_path / "c.yaml"
    cfg.write_text("datasets:\n  - {name: A, path: a.jsonl, budget: 1e7}\n")
    out = _cli("plan", "-c", str(cfg), "--tok-s", "10", "--redis-url", redis_url)
    assert out.returncode == 0 and "10.00M" in out.stdout, out.stdout + out.stderr
    cfg.write_text("datasets:\n  - {name: A, path: a.jsonl, budget: .inf}\n")
    _one_line_error(_cli("produce", "-c", str(cfg)), f"invalid config {cfg}: datasets.0.budget: not a finite "
                                                     "token count: inf")


def test_a_bad_flag_is_named_by_the_flag_not_blamed_on_the_config(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"prompt": "hi"}\n')
    cfg = tmp_path / "budgetq.yaml"
    cfg.write_text("datasets:\n  - {name: A, path: a.jsonl, budget: 1k}\n")
    out = _cli("produce", "-c", str(cfg), "--deadline", "40")
    _one_line_error(out, "budgetq: error: --deadline 40: expected a duration (12h, 90m, 1h30m, 45s) or an ISO time")
    assert "invalid config" not in out.stderr and "run.deadline" not in out.stderr
    out = _cli("produce", "-c", str(cfg), "--total-budget", "0")
    _one_line_error(out, "budgetq: error: --total-budget 0: a total budget must be above 0")
    # the file's own mistake is still the file's
    cfg.write_text("datasets:\n  - {name: A, path: a.jsonl, budget: 1k}\nrun: {deadline: 40}\n")
    _one_line_error(_cli("produce", "-c", str(cfg)), f"invalid config {cfg}: run.deadline: deadline 40")
    # an env var's is the env var's
    out = subprocess.run([sys.executable, "-m", "budgetq.cli", "status", "--redis-url", "redis://127.0.0.1:1/0"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "BUDGETQ_MONITOR_PORT": "99999"})
    _one_line_error(out, "budgetq: error: $BUDGETQ_MONITOR_PORT: Input should be less than 65536 (got '99999')")


def test_produce_help_gives_each_run_flag_its_own_text():
    out = _cli("produce", "--help")
    text = " ".join(out.stdout.split())
    deadline = text[text.index("--deadline DEADLINE run.deadline"):text.index("--total-budget TOTAL_BUDGET run.")]
    total = text[text.index("--total-budget TOTAL_BUDGET run."):]
    assert "keeps the time it was first fixed to" in deadline
    assert "12h" not in total and "keeps the time" not in total, total
    assert "tokens over all datasets, split by weight" in total and "budget total" in total, total


def test_a_produce_that_fails_at_start_leaves_no_key_in_redis(tmp_path, redis_url, conn):
    """What can refuse the run (a missing file, a dataset's ids) is checked before the first write."""
    (tmp_path / "a.jsonl").write_text('{"id": "a1", "prompt": "hi"}\n')
    cfg = _config(tmp_path, redis_url=redis_url, output_dir=str(tmp_path / "out"), producer={"progress": "off"},
                  run={"deadline": "1h", "total_budget": "10k"},
                  datasets=[{"name": "A", "path": str(tmp_path / "a.jsonl")},
                            {"name": "B", "path": str(tmp_path / "missing.jsonl")}])
    _one_line_error(_cli("--log-level", "WARNING", "produce", "-c", cfg), "dataset B: file not found")
    assert conn.keys("*") == []
    # a dataset whose state was made with other ids (the id rule is checked before anything is written)
    conn.hset(keys.conf_key("A"), "id_field", '"id"')
    before = {k: conn.dump(k) for k in conn.keys("*")}
    (tmp_path / "b.jsonl").write_text('{"prompt": "hi"}\n')
    cfg = _config(tmp_path, redis_url=redis_url, output_dir=str(tmp_path / "out"), producer={"progress": "off"},
                  datasets=[{"name": "B", "path": str(tmp_path / "b.jsonl"), "budget": "1k"},
                            {"name": "A", "path": str(tmp_path / "a.jsonl"), "budget": "1k", "id_field": None}])
    _one_line_error(_cli("--log-level", "WARNING", "produce", "-c", cfg),
                    "dataset A: its rows and Redis state were made with ids")
    assert {k: conn.dump(k) for k in conn.keys("*")} == before
