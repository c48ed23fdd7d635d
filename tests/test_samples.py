"""samples: N (several answers per prompt): ids, seeds, rows, the budget, the ledger, kill -9, routing."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest
from rq.registry import FailedJobRegistry

from budgetq.shared import jobs, keys
from budgetq.shared.config_load import load_config
from budgetq.shared.errors import ConfigError
from budgetq.shared.identity import answer_id, answer_seed, job_id
from budgetq.shared.ledger import read_ledger
from tests.helpers import (
    CLI,
    ROOT,
    Procs,
    check_invariants,
    rows,
    run_to_completion,
    sim_get,
    wait_for,
    write_config,
    write_dataset,
)

FAST = {"heartbeat_ttl_s": 2, "maintenance_interval_s": 0.5, "control_interval_s": 0.2}


def _answer_ids(prompt_ids: list[str], samples: int) -> list[str]:
    return [str(answer_id(p, k)) for p in prompt_ids for k in range(1, samples + 1)]


def _spec(tmp_path: Path, name: str, n: int, samples: int, budget: str, **extra) -> tuple[list[str], dict]:
    ids = write_dataset(tmp_path / f"{name}.jsonl", n)
    return ids, {"name": name, "path": str(tmp_path / f"{name}.jsonl"), "budget": budget, "id_field": "id",
                 "samples": samples, "sampling": {"max_tokens": 600, "temperature": 0.8, "seed": 11},
                 "prior_mean_tokens": 100, **extra}




def test_every_prompt_gives_n_answers_with_their_own_ids_seeds_and_rows(tmp_path, redis_url, conn, sim_factory):
    sim = sim_factory("--speedup", "200", "--seed", "3", "--length-mean", "100")
    ids, spec = _spec(tmp_path, "S", 40, 3, "10M")
    cfg = write_config(tmp_path, redis_url, sim, [spec], worker={"concurrency": 16})
    run_to_completion(cfg, tmp_path)
    kept = rows(tmp_path / "out" / "S.jsonl")
    want = _answer_ids(ids, 3)
    assert sorted(r["id"] for r in kept) == sorted(want)        # 3 rows a prompt, ids p7, p7#2, p7#3
    for r in kept:
        prompt, _, k = r["id"].partition("#")
        assert r["sample"] == (int(k) if k else 1)
        assert r["conversations"][0]["content"] == f"question {prompt}"   # each answer of its own prompt
    states = check_invariants(conn, tmp_path / "out", "S", want)       # I1-I3 per answer
    assert states["committed"] == 120
    # every answer was sent with its own seed, derived from (seed, dataset, prompt id, sample): a rerun sends the same
    requests = sim_get(sim, "/sim/requests")
    by_job = {job_id("S", a): a for a in want}
    seeds = {}
    for rec in requests:
        jid = rec["rid"].rsplit(".", 1)[0]
        seeds[by_job[jid]] = rec["sampling"]["seed"] if "seed" in rec["sampling"] else rec["sampling"].get(
            "sampling_seed")
    assert len(seeds) == 120 and len(set(seeds.values())) == 120
    for a, seed in seeds.items():
        prompt, _, k = a.partition("#")
        assert seed == answer_seed(11, "S", prompt, int(k) if k else 1)
    # the ledger counts answers: the file's 40 rows are 120 of them, all rows now
    ledger = read_ledger(conn, "S")
    assert (ledger["samples"], ledger["source_rows"], ledger["entered"], ledger["rows"], ledger["unread"]) == \
        (3, 40, 120, 120, 0)
    assert ledger["balanced"]
    # the SpecForge export: one row per answer, each with its own (string) id
    exp = subprocess.run([*CLI, "export", "-c", str(cfg), "--dataset", "S", "--format", "specforge", "--out",
                          str(tmp_path / "sf")], cwd=ROOT, capture_output=True, text=True)
    assert exp.returncode == 0, exp.stderr
    exported = rows(next((tmp_path / "sf").glob("S*.jsonl")))
    assert sorted(r["id"] for r in exported) == sorted(want) and all(r["status"] == "success" for r in exported)


@pytest.mark.parametrize("mode", ["soft", "strict"])
def test_the_budget_counts_every_answer_exactly(tmp_path, redis_url, conn, sim_factory, mode):
    sim = sim_factory("--speedup", "200", "--seed", "4", "--length-mean", "150")
    ids, spec = _spec(tmp_path, "B", 200, 4, "12k", mode=mode)
    cfg = write_config(tmp_path, redis_url, sim, [spec], worker={"concurrency": 32})
    run_to_completion(cfg, tmp_path)
    states = check_invariants(conn, tmp_path / "out", "B", _answer_ids(ids, 4))
    used = states["used"]
    if mode == "soft":
        assert 12_000 <= used < 12_000 + 600
    else:
        assert 12_000 - 600 <= used <= 12_000
    kept = rows(tmp_path / "out" / "B.jsonl")
    assert any("#" in r["id"] for r in kept) and len({r["id"] for r in kept}) == len(kept)
    # the summary, status and the ledger agree, in answers
    ledger = read_ledger(conn, "B")
    assert ledger["rows"] == len(kept) == states["committed"] and ledger["balanced"]
    status = json.loads(subprocess.run([*CLI, "status", "-c", str(cfg), "--json"], cwd=ROOT, capture_output=True,
                                       text=True, check=True).stdout)
    ds = next(d for d in status["datasets"] if d["dataset"] == "B")
    led = ds["ledger"]
    assert led["rows"] == len(kept) and led["samples"] == 4
    assert led["rows"] + led["truncated"] + led["skipped"] + led["unread"] == 800   # 200 prompts x 4 answers


def test_killed_worker_and_producer_give_each_answer_exactly_once(tmp_path, redis_url, conn, sim_factory):
    sim = sim_factory("--speedup", "4", "--length-mean", "200", "--seed", "6")   # ~0.4 s requests
    ids, spec = _spec(tmp_path, "K", 60, 3, "10M")
    cfg = write_config(tmp_path, redis_url, sim, [spec], worker={"concurrency": 16, **FAST})
    procs = Procs(cfg, tmp_path)
    victim = procs.worker()
    procs.worker()
    first = procs.producer()
    out = tmp_path / "out" / "K.jsonl"
    try:
        wait_for(lambda: out.exists() and len(rows(out)) > 30, 60, "rows on disk")
        wait_for(lambda: conn.zcard(keys.rq_wip_key("K")) > 0, 30, "jobs in flight")
        victim.send_signal(signal.SIGKILL)
        first.send_signal(signal.SIGKILL)
        first.wait()
        second = procs.producer()
        assert second.wait(180) == 0, procs.log(second)
    finally:
        procs.stop_all()
    want = _answer_ids(ids, 3)
    states = check_invariants(conn, tmp_path / "out", "K", want)
    assert states["committed"] == 180 and states["failed"] == 0
    assert sorted(r["id"] for r in rows(out)) == sorted(want)     # each (prompt, sample) once
    committed = int(conn.hget(keys.stats_key("K"), "committed"))
    assert committed == 180   # counted once each, whatever ran twice after the kill


def test_greedy_sampling_with_several_answers_is_refused_in_one_line(tmp_path):
    write_dataset(tmp_path / "G.jsonl", 3)
    for sampling, what in (({"temperature": 0}, "temperature 0"), ({"top_k": 1}, "top_k 1")):
        cfg = write_config(tmp_path, "redis://127.0.0.1:1/0", "http://127.0.0.1:1",
                           [{"name": "G", "path": str(tmp_path / "G.jsonl"), "budget": "1k", "samples": 2,
                             "sampling": {"max_tokens": 10, **sampling}}])
        with pytest.raises(ConfigError) as err:
            load_config(cfg)
        line = str(err.value)
        assert "dataset G" in line and what in line and "samples: 2" in line
        proc = subprocess.run([*CLI, "check", "-c", str(cfg)], cwd=ROOT, capture_output=True, text=True)
        assert proc.returncode != 0 and "Traceback" not in proc.stderr and "dataset G" in proc.stderr
    # the model's generation_config.json may bring the greedy value: refused at the producer's start too
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "generation_config.json").write_text(json.dumps({"temperature": 0.0}))
    from budgetq.shared.sampling import resolve_datasets

    ds = load_config(write_config(tmp_path, "redis://127.0.0.1:1/0", "http://127.0.0.1:1",
                                  [{"name": "M", "path": str(tmp_path / "G.jsonl"), "budget": "1k",
                                    "samples": 3}])).datasets
    with pytest.raises(ConfigError, match="dataset M: samples: 3 with temperature 0.0 from"):
        resolve_datasets(ds, str(tok))
    # samples: 1 with temperature 0 is as before
    load_config(write_config(tmp_path, "redis://127.0.0.1:1/0", "http://127.0.0.1:1",
                             [{"name": "G", "path": str(tmp_path / "G.jsonl"), "budget": "1k",
                               "sampling": {"max_tokens": 10, "temperature": 0}}]))


def test_an_id_shaped_like_an_answer_id_is_an_invalid_row_and_check_agrees(tmp_path, redis_url, conn, sim_factory):
    sim = sim_factory("--speedup", "200", "--seed", "3", "--length-mean", "50")
    path = tmp_path / "H.jsonl"
    path.write_text("".join(json.dumps({"id": i, "prompt": f"q {i}"}) + "\n" for i in ("a", "a#2", "b#x", "c#10")))
    spec = {"name": "H", "path": str(path), "budget": "1M", "samples": 2, "id_field": "id",
            "sampling": {"max_tokens": 100, "temperature": 1.0}, "prior_mean_tokens": 50}
    cfg = write_config(tmp_path, redis_url, sim, [spec])
    check = subprocess.run([*CLI, "check", "-c", str(cfg), "--json"], cwd=ROOT, capture_output=True, text=True)
    report = json.loads(check.stdout)
    h = next(d for d in report["datasets"] if d["name"] == "H")
    assert (h["valid"], h["invalid"], h["samples"]) == (2, 2, 2)
    run_to_completion(cfg, tmp_path)
    assert sorted(r["id"] for r in rows(tmp_path / "out" / "H.jsonl")) == ["a", "a#2", "b#x", "b#x#2"]
    invalid = rows(tmp_path / "out" / "H.invalid.jsonl")
    assert sorted(r["line"] for r in invalid) == [2, 4] and all("#<digits>" in r["reason"] for r in invalid)
    ledger = read_ledger(conn, "H")
    assert (ledger["rows"], ledger["invalid"], ledger["unread"]) == (4, 2, 0)


def _cached(tmp_path: Path, redis_url: str, sim_factory, routing: str) -> tuple[int, int, dict[str, set[str]]]:
    sims = [sim_factory("--speedup", "50", "--seed", str(s), "--length-mean", "50", "--radix-cache",
                        "--enable-cache-report") for s in (1, 2)]
    path = tmp_path / routing / "R.jsonl"
    path.parent.mkdir()
    # long prompts, each its own: only the answers of one prompt share a prefix
    path.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"{i} " + f"question {i} " * 300}) + "\n"
                            for i in range(30)))
    spec = {"name": "R", "path": str(path), "budget": "10M", "samples": 4, "id_field": "id",
            "sampling": {"max_tokens": 100, "temperature": 1.0}, "prior_mean_tokens": 50}
    cfg = write_config(tmp_path / routing, redis_url, sims, [spec], worker={"concurrency": 8},
                       server={"routing": routing})
    procs = Procs(cfg, tmp_path / routing)
    procs.worker()
    try:
        producer = procs.producer()
        assert producer.wait(120) == 0, procs.log(producer)
    finally:
        procs.stop_all()
    records = [r for s in sims for r in sim_get(s, "/sim/requests")]
    where: dict[str, set[str]] = {}
    for r in rows(path.parent / "out" / "R.jsonl"):
        where.setdefault(r["id"].partition("#")[0], set()).add(r["endpoint"])
    return sum(r["cached_tokens"] for r in records), sum(r["prompt_tokens"] for r in records), where


def test_prefix_routing_sends_the_answers_of_a_prompt_to_one_server_and_saves_their_prefill(
        tmp_path, redis_url, conn, sim_factory):
    cached_prefix, prompt_prefix, where_prefix = _cached(tmp_path, redis_url, sim_factory, "prefix")
    conn.flushdb()  # a second run on the same private Redis
    cached_spread, prompt_spread, where_spread = _cached(tmp_path, redis_url, sim_factory, "least_loaded")
    print(f"samples: 4, 30 prompts of ~{prompt_prefix // 120} tokens, 2 simulators: cached_tokens "
          f"{cached_prefix:,} of {prompt_prefix:,} prompt tokens with routing: prefix, {cached_spread:,} of "
          f"{prompt_spread:,} with least_loaded")
    together = sum(len(eps) == 1 for eps in where_prefix.values())
    together_spread = sum(len(eps) == 1 for eps in where_spread.values())
    print(f"prompts whose 4 answers all went to one server: {together} of 30 (prefix), "
          f"{together_spread} of 30 (least_loaded)")
    # prefix routing sends a prompt's answers to its server: answer k follows where the prompt's key went
    # and may pass the load bound by k - 1 (worker/endpoints.py RoutingKey); without that a burst of 4
    # answers spilled past the bound (4-11 of 30 together)
    assert together >= 25 and together > together_spread
    assert cached_prefix > cached_spread


def test_a_failed_answer_is_its_own_job_and_retry_failed_requeues_each(tmp_path, redis_url, conn, sim_factory):
    sim = sim_factory("--speedup", "100", "--length-mean", "20", "--context-length", "64")
    path = tmp_path / "F.jsonl"
    ids = write_dataset(path, 5)
    path.write_text(path.read_text() + json.dumps({"id": "long", "prompt": "word " * 400}) + "\n")
    cfg = write_config(tmp_path, redis_url, [sim], [{"name": "F", "path": str(path), "budget": "10M", "samples": 2,
                                                     "id_field": "id", "sampling": {"max_tokens": 16,
                                                                                    "temperature": 1.0}}],
                       worker={"concurrency": 8, **FAST},
                       server={"backoff_base_s": 0.02, "backoff_max_s": 0.2, "eject_after_failures": 50})
    run_to_completion(cfg, tmp_path, timeout_s=60)
    failed = jobs.registry(FailedJobRegistry, "F", conn)
    assert sorted(failed.get_job_ids(cleanup=False)) == sorted([job_id("F", "long"), job_id("F", "long#2")])
    check_invariants(conn, tmp_path / "out", "F", _answer_ids([*ids, "long"], 2))
    out = subprocess.run([*CLI, "retry-failed", "F", "-c", str(cfg)], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and "F: requeued 2 failed jobs" in out.stdout, out.stdout + out.stderr
    assert conn.llen(keys.rq_queue_key("F")) == 2


@pytest.mark.parametrize("bad", [-1, 0, 1001, 2.5, True, "many", None])
def test_a_bad_samples_value_is_one_line_naming_the_field(tmp_path, bad):
    write_dataset(tmp_path / "G.jsonl", 3)
    cfg = write_config(tmp_path, "redis://127.0.0.1:1/0", "http://127.0.0.1:1",
                       [{"name": "G", "path": str(tmp_path / "G.jsonl"), "budget": "1k", "samples": bad,
                         "sampling": {"max_tokens": 10}}])
    with pytest.raises(ConfigError) as err:
        load_config(cfg)
    line = str(err.value)
    assert "\n" not in line and "datasets.0.samples" in line and f"(got {bad!r})" in line, line
    assert "constrained-int" not in line and "literal" not in line  # not pydantic's union internals
