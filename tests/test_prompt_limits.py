"""Prompts the server cannot take are recorded invalid at the producer, before Redis: over
server.max_prompt_bytes (a body the server would refuse, 413), or over the server's context
(server.context_length, else the max_model_len its /v1/models reports)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import yaml
from tiny_tokenizer import make_tiny_tokenizer

from budgetq.cli.common import discover_context
from budgetq.producer.reading.reader import Invalid, Prompt, read_prompts
from budgetq.shared import keys
from budgetq.shared.config import Config, DatasetConfig, ServerConfig

ROOT = Path(__file__).resolve().parent.parent


def _ds(path: Path, **extra) -> DatasetConfig:
    return DatasetConfig(name="A", path=str(path), budget="1M", sampling={"max_tokens": 10}, **extra)


def test_a_prompt_over_max_prompt_bytes_is_invalid_naming_the_row(tmp_path):
    big = "é" * 4_000_001   # 8,000,002 bytes in UTF-8: one over the default, in half as many characters
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps({"id": 1, "prompt": "fine"}) + "\n" + json.dumps({"id": 2, "prompt": big}) + "\n")
    items = list(read_prompts(_ds(path), ServerConfig()))
    assert isinstance(items[0], Prompt) and isinstance(items[1], Invalid) and items[1].line == 2
    assert items[1].reason.startswith("prompt has 8,000,002 bytes (UTF-8), more than server.max_prompt_bytes "
                                      "8,000,000"), items[1].reason
    pq.write_table(pa.table({"id": [1, 2], "prompt": ["fine", "x" * 2000]}), tmp_path / "a.parquet")
    items = list(read_prompts(_ds(tmp_path / "a.parquet"), ServerConfig(max_prompt_bytes="1k")))
    assert isinstance(items[1], Invalid) and items[1].reason.startswith("row 2: prompt has 2,000 bytes")


def test_produce_records_it_invalid_and_never_enqueues_it(tmp_path, redis_url, conn):
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps({"id": "huge", "prompt": "word " * 1000}) + "\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"redis_url": redis_url, "output_dir": str(tmp_path / "out"),
                                   "server": {"max_prompt_bytes": "4k"},
                                   "datasets": [{"name": "A", "path": str(path), "budget": "1M"}]}))
    proc = subprocess.run([sys.executable, "-m", "budgetq.cli", "produce", "-c", str(cfg)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    (rec,) = [json.loads(ln) for ln in (tmp_path / "out" / "A.invalid.jsonl").read_text().splitlines()]
    assert rec["line"] == 1 and rec["file"] == str(path) and "more than server.max_prompt_bytes 4,000" in rec["reason"]
    assert conn.llen(keys.rq_queue_key("A")) == 0 and not conn.exists(keys.rq_job_key("A--huge"))
    assert f"{path}:1: invalid row: prompt has 5,000 bytes" in proc.stderr


def test_the_servers_context_length_is_used_when_unset(tmp_path, sim_factory):
    tok = make_tiny_tokenizer(tmp_path / "tok")
    url = sim_factory("--instant", "--context-length", "64")
    cfg = Config.model_validate({"server": {"urls": [url], "tokenizer": tok}})
    discover_context(cfg)
    assert cfg.server.context_length == 64   # /v1/models max_model_len
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps({"prompt": "hello"}) + "\n" + json.dumps({"prompt": " ".join(["hi"] * 80)}) + "\n")
    items = list(read_prompts(_ds(path), cfg.server))
    assert isinstance(items[0], Prompt) and isinstance(items[1], Invalid)
    assert "more than the 54 that server.context_length 64 leaves after sampling.max_tokens 10" in items[1].reason
    # a server not up yet: left unset (the producer starts before its servers); a setting wins
    down = Config.model_validate({"server": {"urls": ["http://127.0.0.1:9"], "tokenizer": tok}})
    discover_context(down, timeout_s=1.0)
    assert down.server.context_length is None
    fixed = Config.model_validate({"server": {"urls": [url], "tokenizer": tok, "context_length": 1000}})
    discover_context(fixed)
    assert fixed.server.context_length == 1000
