"""``budgetq check``: a dry run that reads the datasets, asks Redis and the servers, and writes nothing."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis
import yaml

from budgetq.producer.ops.check import CheckReport, RedisCheck, format_report, model_matches, reason_key
from budgetq.shared import keys
from budgetq.simulator.local import free_port
from tests.tiny_tokenizer import make_tiny_tokenizer

ROOT = Path(__file__).resolve().parent.parent


def _rows(tmp_path: Path) -> Path:
    lines = [json.dumps({"id": f"p{i}", "prompt": f"hello {i} what is the answer"}) for i in range(20)]
    lines += [json.dumps({"id": "p3", "prompt": "hello again"}),   # duplicate id
              json.dumps({"id": "p7", "prompt": "hello twice"}),   # duplicate id
              "{not json",
              "{also not json at all",
              json.dumps({"id": "x1"}),                            # no prompt
              json.dumps({"id": "x2", "prompt": "hi"})]            # filtered: under min_prompt_chars
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _config(tmp_path: Path, redis_url: str, server_url: str, **server) -> Path:
    data = _rows(tmp_path)
    cfg = {"redis_url": redis_url, "server": {"urls": [server_url], **server},
           "datasets": [{"name": "A1", "path": str(data), "budget": "30k", "id_field": "id", "prior_mean_tokens": 1000,
                         "min_prompt_chars": 5},
                        {"name": "B2", "path": str(data), "budget": 5000, "id_field": "id", "prior_mean_tokens": 500,
                         "mode": "strict", "min_prompt_chars": 5}]}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _check(config: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "budgetq.cli", "check", "-c", str(config), *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, env=dict(os.environ))


def _snapshot(conn: redis.Redis) -> dict[bytes, bytes]:
    return {k: conn.dump(k) for k in conn.scan_iter(count=1000)}


def test_check_counts_prompts_and_estimates_the_run_without_writing_to_redis(tmp_path, redis_url, conn, sim_factory):
    url = sim_factory("--instant")
    # A run that already started: check reads how far it got, and changes nothing.
    conn.set(keys.used_key("A1"), 12_000)
    conn.sadd(keys.done_key("A1"), *[f"A1-p{i}" for i in range(12)])
    before = _snapshot(conn)
    proc = _check(_config(tmp_path, redis_url, url), "--json", "--tok-s", "100")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _snapshot(conn) == before
    report = json.loads(proc.stdout)
    a1, b2 = report["datasets"]
    # a repeated id is an invalid row (producer/reading/tally.py), as in the producer's summary
    assert (a1["valid"], a1["duplicates"], a1["unique"], a1["invalid"], a1["filtered"]) == (20, 2, 20, 5, 1)
    assert a1["invalid_by_reason"] == {"bad JSON at column N: Expecting property name enclosed in double quotes": 2,
                                       "missing field 'prompt'": 1, "duplicate id": 2}
    assert a1["first_at"]["missing field 'prompt'"] == 25
    assert a1["prompt_chars"]["count"] == 20 and a1["prompt_tokens"] is None  # first occurrences only
    # A1: 18k left at 1,000 per response = 18 responses; 20 unique - 12 done = 8 left: runs out.
    assert (a1["used"], a1["done"], a1["responses_needed"], a1["runs_out"]) == (12_000, 12, 18, True)
    assert a1["expected_tokens"] == 8 * 1000 and a1["est_s"] == pytest.approx(80.0)
    # B2: never started; 5,000 / 500 = 10 responses of 20 prompts.
    assert (b2["used"], b2["responses_needed"], b2["runs_out"], b2["expected_tokens"]) == (None, 10, False, 5000)
    assert report["est_s"] == pytest.approx(130.0)
    assert report["redis"]["ok"] and report["servers"][0]["ok"] and report["servers"][0]["models"] == ["sim-model"]

    text = _check(_config(tmp_path, redis_url, url), "--tok-s", "100")
    assert text.returncode == 0
    assert "A1: OK" in text.stdout
    assert ("    invalid: 2 x bad JSON at column 2: Expecting property name enclosed in double quotes "
            "(first at line 23)") in text.stdout.splitlines(), text.stdout
    assert "RUNS OUT of prompts before its budget: 8 left, ~18 needed" in text.stdout
    assert "check: every dataset can run" in text.stdout.splitlines()[-1]


def test_check_and_the_producers_summary_count_invalid_rows_and_duplicate_ids_alike(tmp_path, redis_url):
    """One definition (producer/reading/tally.py): a repeated id is an invalid row, and of them a
    duplicate id, in check, the producer's summary and the ledger alike."""
    from budgetq.cli.common import load
    from budgetq.producer.ops.check import check_dataset
    from budgetq.producer.run.producer import Producer

    config = _config(tmp_path, redis_url, f"http://127.0.0.1:{free_port()}")
    cfg = load(argparse.Namespace(config=str(config), output_dir=str(tmp_path / "out")))
    cfg.datasets = cfg.datasets[:1]   # A1 (B2's strict budget is below one max_tokens: it reads nothing)
    checked = check_dataset(cfg.datasets[0], cfg)
    assert (checked.valid, checked.invalid, checked.duplicates, checked.filtered) == (20, 5, 2, 1)
    producer = Producer(cfg)
    while not all(f.ended for f in producer.feeds):
        producer.tick()
    a1 = next(r for r in producer.summary() if r["dataset"] == "A1")
    assert (a1["invalid"], a1["duplicate_ids"], a1["filtered"]) == (checked.invalid, checked.duplicates,
                                                                     checked.filtered)
    assert producer.feeds[0].enqueued == checked.valid
    text = format_report(CheckReport([checked], RedisCheck("r", True), [], None))
    assert "  prompts: 20 valid, 5 invalid (2 of them duplicate ids), 1 filtered; read in " in text, text
    assert "    invalid: 2 x duplicate id 'p3' (an earlier row has it; the first one is kept) (first at line 21)" \
        in text.splitlines(), text


def test_check_strict_exits_1_on_invalid_rows_and_0_on_clean_data(tmp_path, redis_url, sim_factory):
    url = sim_factory("--instant")
    config = _config(tmp_path, redis_url, url)
    assert _check(config).returncode == 0   # invalid rows are reported, not fatal, without --strict
    proc = _check(config, "--strict")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[-1] == "check: FAILED (--strict: invalid rows in A1 (5), B2 (5))", proc.stdout
    report = json.loads(_check(config, "--strict", "--json").stdout)
    assert report["strict"] and not report["ok"]
    cfg = yaml.safe_load(config.read_text())
    clean = tmp_path / "clean.jsonl"
    clean.write_text("".join(json.dumps({"id": f"c{i}", "prompt": f"a clean prompt {i}"}) + "\n" for i in range(5)))
    cfg["datasets"] = [{**cfg["datasets"][0], "path": str(clean)}]
    config.write_text(yaml.safe_dump(cfg))
    proc = _check(config, "--strict")
    assert proc.returncode == 0 and proc.stdout.splitlines()[-1] == "check: every dataset can run", proc.stdout


def test_check_works_with_a_read_only_acl_user(tmp_path, redis_url, conn, sim_factory):
    url = sim_factory("--instant")
    conn.set(keys.used_key("B2"), 100)
    conn.execute_command("ACL", "SETUSER", "checker", "on", ">check-pw-123", "~*", "+@read")
    try:
        ro_url = redis_url.replace("redis://", "redis://checker:check-pw-123@")
        with pytest.raises(redis.exceptions.NoPermissionError):
            redis.Redis.from_url(ro_url).set("x", 1)  # the user really is read-only
        proc = _check(_config(tmp_path, ro_url, url), "--json")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert json.loads(proc.stdout)["datasets"][1]["used"] == 100
        assert "check-pw-123" not in proc.stdout + proc.stderr
    finally:
        conn.execute_command("ACL", "DELUSER", "checker")


def test_check_fails_on_a_model_the_server_does_not_serve(tmp_path, redis_url, sim_factory):
    url = sim_factory("--instant", "--served-model-name", "Qwen/Qwen3-8B")
    assert _check(_config(tmp_path, redis_url, url, model="Qwen3-8B")).returncode == 0
    proc = _check(_config(tmp_path, redis_url, url, model="llama"))
    assert proc.returncode == 1
    assert f"server {url}: FAILED: server.model 'llama' is not what it serves ('Qwen/Qwen3-8B')" in proc.stdout


def test_check_fails_fast_when_redis_and_the_server_do_not_answer(tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    proc = _check(_config(tmp_path, f"redis://127.0.0.1:{free_port()}/0", dead), "--timeout-s", "2")
    assert proc.returncode == 1
    lines = proc.stdout.splitlines()
    assert any(ln.startswith("redis 127.0.0.1:") and "FAILED: ConnectionError" in ln for ln in lines)
    assert any(ln.startswith(f"server {dead}: FAILED") for ln in lines)
    assert "A1: OK" in proc.stdout  # the datasets are still checked


def test_a_dataset_that_cannot_be_read_fails_the_check_and_the_others_are_still_checked(tmp_path, redis_url,
                                                                                       sim_factory):
    url = sim_factory("--instant")
    config = _config(tmp_path, redis_url, url)
    cfg = yaml.safe_load(config.read_text())
    cfg["datasets"][0]["path"] = str(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("{broken\n")
    cfg["datasets"].append({"name": "C1", "path": str(tmp_path / "empty.jsonl"), "budget": 1000})
    config.write_text(yaml.safe_dump(cfg))
    proc = _check(config, "--json")
    assert proc.returncode == 1
    a1, b2, c1 = json.loads(proc.stdout)["datasets"]
    assert not a1["ok"] and "missing.jsonl" in a1["error"]
    assert b2["ok"] and b2["valid"] == 20
    assert not c1["ok"] and c1["invalid"] == 1 and c1["valid"] == 0


def test_check_counts_prompt_tokens_with_the_tokenizer(tmp_path, redis_url, sim_factory):
    url = sim_factory("--instant")
    tok = make_tiny_tokenizer(tmp_path / "tok")
    config = _config(tmp_path, redis_url, url, tokenizer=tok)
    proc = _check(config, "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    a1 = json.loads(proc.stdout)["datasets"][0]
    tokens = a1["prompt_tokens"]
    assert tokens["count"] == a1["unique"] == a1["valid"] == 20 and 0 < tokens["min"] <= tokens["max"]
    # Prompts over max_prompt_tokens are invalid, with the numbers, counted under one reason.
    cfg = yaml.safe_load(config.read_text())
    cfg["datasets"][0]["max_prompt_tokens"] = tokens["max"] - 1
    config.write_text(yaml.safe_dump(cfg))
    a1 = json.loads(_check(config, "--json").stdout)["datasets"][0]
    too_long = {r: n for r, n in a1["invalid_by_reason"].items() if "max_prompt_tokens" in r}
    # (the rows too long include the first p3 and p7: the later rows with those ids are then no duplicates)
    assert len(too_long) == 1 and a1["invalid"] == 3 + sum(too_long.values()) and a1["valid"] == 22 - sum(
        too_long.values()) and a1["duplicates"] == 0
    assert a1["prompt_tokens"]["max"] <= tokens["max"] - 1



def test_check_takes_produces_output_dir(tmp_path, redis_url):
    """--output-dir means what it means to produce: the directory checked for room is that one."""
    elsewhere = tmp_path / "elsewhere"
    dead = f"http://127.0.0.1:{free_port()}"   # the server's answer does not matter here
    proc = _check(_config(tmp_path, redis_url, dead), "--json", "--timeout-s", "0.5", "--output-dir", str(elsewhere))
    output = json.loads(proc.stdout)["output"]
    assert output["path"] == str(elsewhere) and output["ok"], (output, proc.stderr)
    for cmd in ("check", "produce"):
        text = subprocess.run([sys.executable, "-m", "budgetq.cli", cmd, "--help"], cwd=ROOT, capture_output=True,
                              text=True, timeout=60).stdout
        assert "--output-dir OUTPUT_DIR" in text and "overrides output_dir" in " ".join(text.split()), (cmd, text)


def test_reason_key_drops_row_and_column_numbers():
    assert reason_key("row 12: field 'prompt' is empty") == "field 'prompt' is empty"
    assert reason_key("bad JSON at column 7: Expecting value") == "bad JSON at column N: Expecting value"
    # whole numbers only: the 8 of UTF-8 is part of a word, 3,000,000 is one number
    assert reason_key("prompt has 3,000,000 bytes (UTF-8), more than server.max_prompt_bytes 1,000,000") == \
        "prompt has N bytes (UTF-8), more than server.max_prompt_bytes N"


def test_invalid_reasons_are_counted_together_and_shown_as_the_first_one_reads(tmp_path, redis_url):
    rows = [{"prompt": "fine"}, {"prompt": "fine too"}, {"prompt": "x" * 3_000_000}, {"prompt": "y" * 2_000_000}]
    data = tmp_path / "big.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"redis_url": redis_url, "output_dir": str(tmp_path / "out"),
                                   "server": {"urls": [f"http://127.0.0.1:{free_port()}"], "max_prompt_bytes": "1M"},
                                   "datasets": [{"name": "A", "path": str(data), "budget": "1k"},
                                                {"name": "B", "path": str(tmp_path / "big.parquet"), "budget": "1k"}]}))
    pq.write_table(pa.table({"prompt": ["fine", "z" * 1_500_000]}), tmp_path / "big.parquet")
    proc = _check(cfg, "--timeout-s", "0.5")
    line, other = [ln for ln in proc.stdout.splitlines() if "invalid: " in ln]
    # Parquet counts rows, not lines; the row number is said once, not inside the reason too
    assert other.startswith("    invalid: 1 x prompt has 1,500,000 bytes"), other
    assert other.endswith(" (first at row 2)"), other
    assert line.startswith("    invalid: 2 x prompt has 3,000,000 bytes (UTF-8), more than server.max_prompt_bytes "
                           "1,000,000: "), line
    assert line.endswith(" (first at line 3)") and ",N" not in line and "UTF-N" not in line, line
    a = json.loads(_check(cfg, "--timeout-s", "0.5", "--json").stdout)["datasets"][0]
    (key,) = a["invalid_by_reason"]
    assert key.startswith("prompt has N bytes (UTF-8), more than server.max_prompt_bytes N: ") and \
        a["invalid_by_reason"][key] == 2, a
    assert a["first_at"][key] == 3 and a["first_reason"][key].startswith("prompt has 3,000,000 bytes"), a


def test_model_matches_ids_paths_and_default():
    assert model_matches("default", ["anything"], None)
    assert model_matches("Qwen/Qwen3-8B", ["Qwen/Qwen3-8B"], None)
    assert model_matches("Qwen3-8B", [], "/models/Qwen3-8B/")
    assert not model_matches("llama", ["Qwen/Qwen3-8B"], "/models/Qwen3-8B")
