"""CLI conventions, run as a user would (subprocess): --version, a closed pipe, output off a
terminal (full tables, --watch frames flushed), help texts, budgets, `budgetq init`, config lookup."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import ROOT, wait_for

from budgetq.shared.budget import register_dataset
from budgetq.shared.config import DatasetConfig

PY = [sys.executable, "-m", "budgetq.cli"]


def _cli(*args: str, cwd: Path = ROOT, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*PY, *args], cwd=cwd, capture_output=True, text=True, timeout=60,
                          env=env if env is not None else _env())


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BUDGETQ_")}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


def _register(conn, n: int = 3, name: str = "a_dataset_whose_name_is_long_enough_to_be_cut") -> list[str]:
    names = [f"{name}_{i}" for i in range(n)]
    for ds in names:
        register_dataset(conn, DatasetConfig(name=ds, path="x", budget="10M", sampling={"max_tokens": 100}))
    return names


def test_version():
    out = _cli("--version")
    assert out.returncode == 0 and out.stdout.startswith("budgetq ") and out.stdout.split()[1][0].isdigit(), out


def _closed_pipe(args: list[str], tmp_path: Path, lines: int = 0, timeout_s: float = 60) -> str:
    """Run ``budgetq ARGS | head -LINES`` with a real pipe: read ``lines`` lines of stdout (0: none,
    the reader is gone before the command writes anything), close it, and check the command
    stops quietly with 141; returns its stderr."""
    with open(tmp_path / "stderr.txt", "w+") as err:   # a file: a chatty command never blocks on it
        p = subprocess.Popen([*PY, *args], cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=err, text=True)
        assert p.stdout is not None
        try:
            got = [p.stdout.readline() for _ in range(lines)]
            assert all(got), (got, (tmp_path / "stderr.txt").read_text())   # it did write before the close
            p.stdout.close()
            rc = p.wait(timeout_s)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        err.seek(0)
        text = err.read()
    assert rc == 141, (rc, text)
    assert "Traceback" not in text and "BrokenPipe" not in text and "Exception ignored" not in text, text
    return text


@pytest.mark.parametrize("args", [["status", "--json"], ["status"]], ids=["json", "table"])
def test_a_closed_stdout_ends_quietly(tmp_path, redis_url, conn, args):
    _register(conn, 40)
    # `budgetq status --json | true`: the reader is gone before the command writes anything.
    _closed_pipe([*args, "--redis-url", redis_url], tmp_path)


@pytest.mark.parametrize("args", [["--json"], []], ids=["json", "table"])
def test_status_watch_ends_quietly_when_its_reader_goes(tmp_path, redis_url, conn, args):
    _register(conn, 2)
    # `budgetq status --watch | head -2`: the frames after the reader went have nowhere to go.
    _closed_pipe(["status", "--watch", *args, "--interval", "0.1", "--redis-url", redis_url], tmp_path, lines=2)


def test_produce_and_demo_summaries_end_quietly_on_a_closed_stdout(tmp_path, redis_url):
    (tmp_path / "empty.jsonl").write_text("")   # nothing to send: the run ends at once, then its summary
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"redis_url": redis_url, "output_dir": str(tmp_path / "out"),
                                   "producer": {"progress": "off"},
                                   "datasets": [{"name": "E", "path": str(tmp_path / "empty.jsonl"),
                                                 "budget": "1k"}]}))
    _closed_pipe(["produce", "-c", str(cfg)], tmp_path)
    # the demo's summary is its produce child's, on the same stdout: `budgetq demo | head -1`
    _closed_pipe(["demo", "--redis-url", redis_url, "--concurrency", "16"], tmp_path, lines=1, timeout_s=180)


def test_tables_are_never_cut_off_a_terminal(redis_url, conn):
    names = _register(conn, 2)
    out = _cli("status", "--redis-url", redis_url)   # stdout is a pipe here, as in CI or `| tee`
    assert out.returncode == 0, out.stderr
    assert all(n in out.stdout for n in names) and "…" not in out.stdout, out.stdout
    summary = subprocess.run(
        [sys.executable, "-c", "from budgetq.cli.main import print_summary; print_summary([dict(dataset='"
         + names[0] + "', budget=10, used=5, rows=1, skipped=0, aborted=0, failed=0, invalid=0, filtered=0, "
         "queued=0, running=0, truncated=0, duplicate_ids=0, unaccounted=0, "
         "wasted_tokens=0, stop='rows exhausted')])"], cwd=ROOT, env=_env(), capture_output=True, text=True,
        timeout=60)
    assert summary.returncode == 0, summary.stderr
    assert names[0] in summary.stdout and "dataset" in summary.stdout and "…" not in summary.stdout, summary.stdout


def test_status_watch_into_a_file_flushes_every_frame(tmp_path, redis_url, conn):
    _register(conn, 1)
    target = tmp_path / "watch.txt"
    with open(target, "w") as fh:
        p = subprocess.Popen([*PY, "status", "--watch", "--interval", "0.2", "--redis-url", redis_url], cwd=ROOT,
                             env=_env(), stdout=fh, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: target.read_text().count("budgetq status") >= 2, 30, "two frames in the file")
    finally:
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=30)
    assert p.returncode == 0 and "Traceback" not in err, err
    assert target.read_text().count("budgetq status") >= 2


def test_help_texts_say_what_the_commands_do():
    export = _cli("export", "--help").stdout
    assert "Parquet" in export and "SpecForge" in export and "--server-url" not in export
    for cmd in (("pause",), ("resume",), ("budget", "set"), ("retry-failed",), ("reconcile",)):
        out = _cli(*cmd, "--help")
        assert out.returncode == 0 and "--server-url" not in out.stdout, (cmd, out.stdout)
    assert "--server-url" in _cli("worker", "--help").stdout
    bad = _cli("pause", "B2", "--server-url", "http://x")
    assert bad.returncode == 2 and "unrecognized arguments: --server-url" in bad.stderr


BUDGET_RULE = "to stop a dataset, pause it: budgetq pause NAME"


def test_budgets_are_above_zero_with_one_clear_message(tmp_path):
    # the command line: 0 and below are one mistake, one message, the value as written ("-5k" is a value, not a flag)
    for tokens in ("0", "0k", "-5", "-5k", "-2.5M"):
        out = _cli("budget", "set", "B2", tokens, "--redis-url", "redis://127.0.0.1:1/0")
        assert out.returncode == 2, out
        (line,) = out.stderr.strip().splitlines()
        assert line == f"budgetq: error: budget for B2: a budget must be above 0 (got {tokens}); {BUDGET_RULE}", line
    # the config: the same message, whether YAML reads the value as a number or a string
    (tmp_path / "a.jsonl").write_text('{"prompt": "hi"}\n')
    for budget, shown in ((0, "0"), (-5, "-5"), ("-5", "-5"), ("-5k", "-5k")):
        cfg = tmp_path / "c.yaml"
        cfg.write_text(yaml.safe_dump({"datasets": [{"name": "A", "path": "a.jsonl", "budget": budget}]}))
        out = _cli("check", "-c", str(cfg))
        assert out.returncode == 2 and "datasets.0.budget" in out.stderr, out.stderr
        (line,) = [ln for ln in out.stderr.splitlines() if "datasets.0.budget" in ln]
        assert line.endswith(f"datasets.0.budget: a budget must be above 0 (got {shown}); {BUDGET_RULE}"), line
        assert line.count("got ") == 1 and "Value error" not in line, line   # the value said once
    # a total is above 0 too (0 would end every dataset at once); other token counts are not
    # budgets: their own message; the value said once
    for total, shown in ((0, "0"), (-5, "-5")):
        cfg.write_text(yaml.safe_dump({"run": {"total_budget": total}, "features": {"max_bytes": "-1G"}}))
        err = _cli("check", "-c", str(cfg)).stderr
        assert (f"run.total_budget: a total budget must be above 0 (got {shown}); for no total, leave "
                "run.total_budget out (budgetq budget total none)\n") in err, err
        assert "features.max_bytes: a token count must be >= 0 (got -1G)\n" in err, err
    for total in ("0", "-5k"):
        out = _cli("budget", "total", total, "--redis-url", "redis://127.0.0.1:1/0")
        assert out.returncode == 2 and out.stderr.startswith("budgetq: error: a total budget must be above 0 "
                                                             f"(got {total}); "), out.stderr


def test_init_writes_a_commented_config_that_commands_find_without_c(tmp_path, redis_url):
    dest = tmp_path / "run"
    out = _cli("init", str(dest))
    assert out.returncode == 0, out.stderr
    cfg = dest / "budgetq.yaml"
    text = cfg.read_text()
    assert text.count("#") > 50 and "id_field" in text   # the commented example, every field
    raw = yaml.safe_load(text)
    assert all((dest / ds["path"]).is_file() for ds in raw["datasets"])   # its sample data came along
    again = _cli("init", str(dest))
    assert again.returncode == 2 and "exists" in again.stderr and len(again.stderr.strip().splitlines()) == 1
    check = _cli("check", "--redis-url", redis_url, "--timeout-s", "0.5", cwd=dest)
    assert "B2: OK" in check.stdout, (check.stdout, check.stderr)
    assert "config budgetq.yaml; redis " in check.stderr, check.stderr   # which config, said once
    assert check.stderr.count("config budgetq.yaml") == 1


def test_without_c_a_command_says_which_config_and_redis(tmp_path, redis_url):
    cfg = tmp_path / "elsewhere.yaml"
    cfg.write_text(yaml.safe_dump({"redis_url": redis_url}))
    port = redis_url.rsplit(":", 1)[1].split("/")[0]
    out = _cli("status", "--json", cwd=tmp_path, env=_env(BUDGETQ_CONFIG=str(cfg)))
    assert out.returncode == 0, out.stderr
    json.loads(out.stdout)   # stdout stays pure JSON: the line is on stderr
    (line,) = [ln for ln in out.stderr.splitlines() if "redis" in ln]
    assert f"config {cfg}" in line and f"redis 127.0.0.1:{port}/0" in line, line
    # nothing given at all: the defaults' Redis is named (here it does not answer: one error line follows)
    bare = _cli("status", "--json", cwd=tmp_path, env=_env(BUDGETQ_REDIS_URL=""))
    assert "no config file" in bare.stderr and "redis 127.0.0.1:6379/0" in bare.stderr, bare.stderr
    # named explicitly (flag), with no config file: nothing to say
    named = _cli("status", "--json", "--redis-url", redis_url, cwd=tmp_path)
    assert named.returncode == 0 and "no config file" not in named.stderr, named.stderr
