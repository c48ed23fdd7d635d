"""samples: N and samples: auto in answers, everywhere: the monitor (/api/status, /metrics), `budgetq status`
(text and --json) and the ledger against the rows on disk; a live budget raise on a samples: 3 dataset; what
``unread`` means for a samples: auto dataset its budget stopped (docs/datasets.md "Samples per prompt",
docs/budget.md "Samples per prompt")."""

from __future__ import annotations

import json
import os
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import redis
from rq.registry import CanceledJobRegistry
from rq.serializers import JSONSerializer

from budgetq.shared import keys
from budgetq.shared.identity import answer_id, job_id
from budgetq.shared.ledger import STATES, read_ledger
from budgetq.simulator.local import free_port, wait_http
from tests.helpers import (
    CLI,
    PY,
    ROOT,
    Procs,
    check_invariants,
    cli_out,
    http_get,
    prometheus_samples,
    rows,
    run_to_completion,
    wait_for,
    write_config,
    write_dataset,
)

FAST = {"heartbeat_ttl_s": 2, "maintenance_interval_s": 0.5, "control_interval_s": 0.2}
# Two bad rows ahead of the prompts: a line that is not JSON, and an id shaped like an answer id
# (refused with samples other than 1): ``invalid`` counts rows, the rest of the ledger answers.
BAD = {1: "{not json", 2: json.dumps({"id": "z#3", "prompt": "q"})}


def _answer_ids(prompt_ids: list[str], samples: int) -> list[str]:
    return [str(answer_id(p, k)) for p in prompt_ids for k in range(1, samples + 1)]


def _spec(tmp_path: Path, name: str, n: int, budget: str, samples: int | str, max_tokens: int, **extra) -> tuple[
        list[str], dict]:
    ids = write_dataset(tmp_path / f"{name}.jsonl", n, bad_lines=BAD)
    return ids, {"name": name, "path": str(tmp_path / f"{name}.jsonl"), "budget": budget, "id_field": "id",
                 "samples": samples, "sampling": {"max_tokens": max_tokens, "temperature": 0.9},
                 "prior_mean_tokens": 100, **extra}


def _skipped_answers(conn: redis.Redis, ds: str, want: list[str]) -> set[str]:
    """The answer ids in RQ's canceled registry (skipped: the budget came first)."""
    by_job = {job_id(ds, a): a for a in want}
    reg = CanceledJobRegistry(keys.queue_name(ds), connection=conn, serializer=JSONSerializer)
    return {by_job[j] for j in reg.get_job_ids(cleanup=False)}


def _text_row(text: str, ds: str) -> dict[str, str]:
    """``ds``'s row of the datasets table of `budgetq status` (text), by column header."""
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if "┃" in line and "unread" in line and "ledger" in line)
    names = [c.strip() for c in lines[head].strip().strip("┃").split("┃")]
    for line in lines[head + 1:]:
        cells = [c.strip() for c in line.strip().strip("│").split("│")]
        if len(cells) == len(names) and cells[0] == ds:
            return dict(zip(names, cells, strict=True))
    raise AssertionError(f"no row for {ds} in:\n{text}")


def _views(cfg: Path, ds: str) -> dict[str, Any]:
    """What `budgetq status --json`, `budgetq status` and a `budgetq monitor` (/api/status, /metrics) say of ``ds``."""
    status = next(d for d in json.loads(cli_out(cfg, "status", "--json"))["datasets"] if d["dataset"] == ds)
    text = subprocess.run([*PY, "status", "-c", str(cfg)], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, COLUMNS="400"))
    assert text.returncode == 0, text.stderr
    port = free_port()
    mon = subprocess.Popen([*PY, "monitor", "-c", str(cfg), "--port", str(port)], cwd=ROOT,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_http(base + "/healthz", 60, mon)
        code, _, body = http_get(base + "/api/status")
        assert code == 200, body
        api = next(d for d in json.loads(body)["datasets"] if d["dataset"] == ds)
        code, _, metrics = http_get(base + "/metrics")
        assert code == 200, metrics
    finally:
        mon.terminate()
        mon.wait(30)
    return {"status": status, "text": _text_row(text.stdout, ds), "api": api, "metrics": prometheus_samples(metrics)}


def _assert_all_agree(cfg: Path, conn: redis.Redis, out: Path, ds: str, want_unread: int, samples: int,
                      stop: str) -> dict[str, Any]:
    """Status (json, text), the monitor (/api/status, /metrics) and read_ledger say the same numbers of ``ds``,
    and they are those of the rows on disk: rows, unread, samples, tokens. Returns the ledger."""
    led = read_ledger(conn, ds)
    kept, cut = rows(out / f"{ds}.jsonl"), rows(out / f"{ds}.truncated.jsonl")
    tokens = sum(r["completion_tokens"] for r in kept)
    used = int(conn.get(keys.used_key(ds)))
    # the ledger against the disk and the definition of unread given by the caller
    assert (led["rows"], led["truncated"], led["samples"], led["unread"]) == (len(kept), len(cut), samples,
                                                                              want_unread), led
    assert used == tokens and led["balanced"] and led["queued"] == led["running"] == 0, led
    assert led["source_rows"] * samples == led["entered"] + (led["invalid"] + led["filtered"]) * samples + \
        led["unread"], led
    views = _views(cfg, ds)
    for where in ("status", "api"):
        d = views[where]
        assert d["ledger"] == led, (where, d["ledger"], led)
        assert (d["used"], d["tokens"]["kept"], d["counts"]["committed"]) == (used, tokens, len(kept)), where
        assert d["prompts_left"] == led["unread"] and d["stop"] == stop, (where, d["prompts_left"], d["stop"])
    m, lab = views["metrics"], (("dataset", ds),)
    for state in STATES:
        assert m[("budgetq_ledger_prompts", (("dataset", ds), ("state", state)))] == led[state], state
    assert m[("budgetq_ledger_entered_prompts", lab)] == led["entered"]
    assert m[("budgetq_ledger_unaccounted_prompts", lab)] == 0
    assert m[("budgetq_ledger_unread_prompts", lab)] == want_unread
    assert m[("budgetq_used_tokens", lab)] == used
    assert m[("budgetq_tokens_total", (("dataset", ds), ("kind", "kept")))] == tokens
    assert m[("budgetq_jobs_total", (("dataset", ds), ("state", "committed")))] == len(kept)
    assert m[("budgetq_stop", (("dataset", ds), ("reason", stop)))] == 1
    row = views["text"]
    assert (row["rows"], row["skipped"], row["unread"], row["invalid"], row["used"], row["ledger"]) == (
        f"{len(kept) + len(cut):,}", f"{led['skipped']:,}", f"{want_unread:,}", f"{led['invalid']:,}",
        f"{used:,}", f"ok {led['entered']:,}"), row
    return led


def test_status_and_the_monitor_count_answers_as_the_ledger_and_the_disk(tmp_path, redis_url, conn, sim_factory):
    sim = sim_factory("--speedup", "200", "--seed", "5", "--length-mean", "100", "--length-sigma", "0.3")
    ids, spec = _spec(tmp_path, "S", 100, "6k", 3, 600)
    cfg = write_config(tmp_path, redis_url, sim, [spec], worker={"concurrency": 8})
    run_to_completion(cfg, tmp_path)
    out = tmp_path / "out"
    want = _answer_ids(ids, 3)
    states = check_invariants(conn, out, "S", want)
    assert 6000 <= states["used"] < 6600 and states["skipped"] > 0
    # independently of the ledger: every answer the file's 100 valid rows give that is not on disk nor
    # skipped was never read (soft budget reached: reading stopped)
    on_disk = {r["id"] for r in rows(out / "S.jsonl") + rows(out / "S.truncated.jsonl")}
    skipped = _skipped_answers(conn, "S", want)
    unread = 300 - len(on_disk) - len(skipped)
    assert unread > 0 and unread % 3 == 0   # whole prompts: a row read is its 3 answers
    led = _assert_all_agree(cfg, conn, out, "S", unread, 3, "budget reached")
    assert (led["source_rows"], led["invalid"], led["skipped"]) == (102, 2, len(skipped))


def test_a_live_raise_on_a_samples_3_dataset_continues_to_the_new_budget_each_answer_once(
        tmp_path, redis_url, conn, sim_factory):
    sim = sim_factory("--speedup", "10", "--seed", "9", "--length-mean", "100", "--length-sigma", "0.3")
    ids, spec = _spec(tmp_path, "A", 150, "3k", 3, 400)
    write_dataset(tmp_path / "B.jsonl", 3000)   # keeps the producer running while A waits for its raise
    keeper = {"name": "B", "path": str(tmp_path / "B.jsonl"), "budget": "10M", "id_field": "id",
              "sampling": {"max_tokens": 400}, "prior_mean_tokens": 100}
    cfg = write_config(tmp_path, redis_url, [sim], [spec, keeper], worker={"concurrency": 8, **FAST})
    out = tmp_path / "out"
    want = _answer_ids(ids, 3)
    procs = Procs(cfg, tmp_path)
    producer = procs.producer()
    procs.worker()

    def settled() -> bool:
        return (conn.llen(keys.rq_queue_key("A")) == 0 and conn.zcard(keys.rq_wip_key("A")) == 0
                and int(conn.get(keys.reserved_key("A")) or 0) == 0)

    def used() -> int:
        return int(conn.get(keys.used_key("A")) or 0)

    try:
        # 1. the first budget: A stops (soft: by less than one answer past it); what was queued is skipped
        wait_for(lambda: used() >= 3000 and settled(), 90, "A to stop at its first budget")
        wait_for(lambda: len(rows(out / "A.jsonl")) == read_ledger(conn, "A")["rows"], 30, "A's rows on disk")
        assert producer.poll() is None, procs.log(producer)
        first_used = used()
        assert 3000 <= first_used < 3000 + 400
        first_rows = {r["id"] for r in rows(out / "A.jsonl")}
        skipped = _skipped_answers(conn, "A", want)
        assert skipped and sum(r["completion_tokens"] for r in rows(out / "A.jsonl")) == first_used
        led = read_ledger(conn, "A")
        assert led["balanced"] and led["rows"] + led["skipped"] == led["entered"], led
        assert led["unread"] == 450 - led["entered"] > 0 and led["samples"] == 3, led   # reading stopped
        # 2. raised live: the skipped answers are requeued, reading resumes, A goes on to 9k
        out_set = subprocess.run([*PY, "budget", "set", "A", "9k", "-c", str(cfg)], cwd=ROOT, capture_output=True,
                                 text=True, timeout=60)
        assert out_set.returncode == 0, out_set.stderr
        wait_for(lambda: used() >= 9000 and settled(), 90, "A to reach its raised budget")
        # 3. B ends too (lowered under what it used): the run is complete
        assert subprocess.run([*CLI, "budget", "set", "B", "1", "-c", str(cfg)], cwd=ROOT, capture_output=True,
                              timeout=60).returncode == 0
        assert producer.wait(90) == 0, procs.log(producer)
    finally:
        procs.stop_all()
    states = check_invariants(conn, out, "A", want)   # I1-I3 per answer: each (prompt, sample) once
    assert 9000 <= states["used"] < 9000 + 400, states
    kept = rows(out / "A.jsonl")
    got = Counter(r["id"] for r in kept)
    assert set(got) <= set(want) and max(got.values()) == 1
    assert first_rows <= set(got)                    # nothing written before the raise was lost or rewritten
    assert skipped <= set(got)                       # every answer skipped at the first budget was answered after
    for r in kept:
        prompt, _, k = r["id"].partition("#")
        assert r["sample"] == (int(k) if k else 1) and r["conversations"][0]["content"] == f"question {prompt}"
    led = read_ledger(conn, "A")
    assert led["rows"] == len(kept) == states["committed"] and led["balanced"] and led["unaccounted"] == 0, led
    assert led["entered"] == led["rows"] + led["truncated"] + led["skipped"] + led["failed"] + led["discarded"]
    assert led["unread"] == 450 - led["entered"] > 0 and led["samples"] == 3
    assert led["source_rows"] * 3 == led["entered"] + led["invalid"] * 3 + led["unread"]


def test_auto_stopped_by_its_budget_says_unread_is_the_answers_left_to_max_samples(tmp_path, redis_url, conn,
                                                                                     sim_factory):
    # 20 prompts of ~100 tokens a round: a 4.6k budget ends it in round 3 of at most 4; a short queue
    # (high_water 2) keeps reading close to the answers, so round 4 is never read
    sim = sim_factory("--speedup", "50", "--seed", "2", "--length-mean", "100", "--length-sigma", "0.2")
    ids, spec = _spec(tmp_path, "U", 20, "4600", "auto", 400, max_samples=4)
    cfg = write_config(tmp_path, redis_url, sim, [spec], worker={"concurrency": 4},
                       producer={"high_water": 2})
    run_to_completion(cfg, tmp_path)
    out = tmp_path / "out"
    want = _answer_ids(ids, 4)
    states = check_invariants(conn, out, "U", want)
    assert 4600 <= states["used"] < 4600 + 400
    kept = rows(out / "U.jsonl")
    per = Counter(r["sample"] for r in kept)
    assert per[1] == 20 and per[2] == 20 and 0 < per[3] < 20 and per[4] == 0, per   # stopped after round 2
    # documented (docs/budget.md "Samples per prompt"): unread counts the answers up to max_samples that were
    # never drawn; entered = the answers written, cut or skipped. Counted here from the disk and RQ alone.
    drawn = {r["id"] for r in kept + rows(out / "U.truncated.jsonl")} | _skipped_answers(conn, "U", want)
    unread = 20 * 4 - len(drawn)
    assert unread >= 20   # at least every prompt's 4th answer
    led = _assert_all_agree(cfg, conn, out, "U", unread, 4, "budget reached")
    assert (led["source_rows"], led["invalid"], led["entered"]) == (22, 2, len(drawn)) and not led["unread_estimated"]
