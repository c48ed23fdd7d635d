"""regenerate: all: every user turn asked in order with the model's own earlier answers as context.

One job per conversation, one row per conversation (SpecForge's regenerated multi-turn layout,
scripts/regenerate_train_data.py). Unit level against a small in-process server that records
what it is sent; then the real stack (producer, workers, simulator, Redis).
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
from collections import defaultdict
from collections.abc import Mapping

import aiohttp
import pytest
from aiohttp import web
from pydantic import ValidationError
from transformers import AutoTokenizer

from budgetq.producer.ops.check import CheckReport, RedisCheck, check_dataset, format_report
from budgetq.producer.reading.mapping import row_to_messages, split_turns
from budgetq.shared import budget, keys
from budgetq.shared.config import Config, DatasetConfig, ServerConfig
from budgetq.shared.identity import job_id
from budgetq.shared.redis_conn import aconnect
from budgetq.shared.schema import JobPayload, Message, SamplingParams
from budgetq.shared.scripts import run
from budgetq.worker import turns
from budgetq.worker.process import build_row, run_one
from budgetq.worker.sglang_client import SGLangClient
from budgetq.worker.sglang_wire import attempt_rid, job_id_of_rid
from tests.helpers import (
    Procs,
    check_invariants,
    holders,
    rows,
    run_to_completion,
    serve_routes,
    sim_get,
    wait_for,
    write_config,
)
from tests.tiny_tokenizer import make_tiny_tokenizer

FAST = {"heartbeat_ttl_s": 2, "maintenance_interval_s": 0.5, "control_interval_s": 0.2}


def _conversation(i: int, n_turns: int) -> dict:
    conv = []
    for k in range(1, n_turns + 1):
        conv += [{"from": "human", "value": f"question {i} turn {k} ?"},
                 {"from": "gpt", "value": f"OLD answer {i} {k}"}]
    return {"id": f"c{i}", "conversations": conv}


def _write(path, n: int, turns_of=lambda i: 1 + i % 4) -> dict[str, int]:
    """n ShareGPT conversations with 1-4 user turns (each with the dataset's old answer)."""
    data = [_conversation(i, turns_of(i)) for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in data))
    return {r["id"]: turns_of(i) for i, r in enumerate(data)}


def _ds(path, **extra) -> dict:
    return {"name": "D", "path": str(path), "budget": "10M", "id_field": "id", "conversations_field": "conversations",
            "regenerate": "all", "system_prompt": "you are a helpful assistant .", **extra}


def _by_request(sim: str) -> dict[str, dict]:
    """The simulator's records keyed by rid without the attempt nonce: ``<job>`` or ``<job>.t<k>``."""
    return {r["rid"].rsplit(".", 1)[0]: r for r in sim_get(sim, "/sim/requests")}


# -- producer side ---------------------------------------------------------------------------


def test_the_dataset_answers_are_dropped_and_user_turns_split():
    ds = DatasetConfig(**_ds("x.jsonl", system_prompt="sys"))
    msgs = row_to_messages(ds, _conversation(0, 3))
    first, later = split_turns(msgs)
    assert [(m.role, m.content) for m in first] == [("system", "sys"), ("user", "question 0 turn 1 ?")]
    assert [m.content for m in later] == ["question 0 turn 2 ?", "question 0 turn 3 ?"]
    assert all(m.role == "user" for m in later)


def test_payload_turns_are_validated_and_old_payloads_stay_valid():
    base = {"id": "p", "dataset": "D", "messages": [{"role": "user", "content": "q"}], "sampling": {}}
    assert JobPayload.model_validate(base).requests == 1   # a payload written before turns existed
    assert JobPayload.model_validate({**base, "turns": [{"role": "user", "content": "q2"}]}).requests == 2
    for bad, why in (([{"role": "assistant", "content": "a"}], "only user turns"),
                     ([{"role": "user", "content": " "}], "empty user turn"), ([], "at least one")):
        with pytest.raises(ValidationError, match=why):
            JobPayload.model_validate({**base, "turns": bad})
    with pytest.raises(ValidationError, match="end with the first user turn"):
        JobPayload.model_validate({**base, "messages": [{"role": "system", "content": "s"}],
                                   "turns": [{"role": "user", "content": "q2"}]})


def test_turn_rids_are_fresh_and_never_a_prefix_of_another():
    rids = [attempt_rid(j, k) for j in ["C-c1", "C-c10", "C-c1-x", "A", "A-1"] for k in (1, 2, 3, 12)
            for _ in range(20)]
    assert len(set(rids)) == len(rids)
    assert not [(a, b) for a in rids for b in rids if a != b and b.startswith(a)]
    assert all(re.fullmatch(r"[A-Za-z0-9_-]+\.(t[0-9]+\.)?[0-9a-f]{12}", r) for r in rids)
    assert job_id_of_rid(attempt_rid("C-c1", 3)) == "C-c1" == job_id_of_rid(attempt_rid("C-c1"))


# -- the request loop against a server that records what it gets -----------------------------


async def _sglang_info(_request: web.Request) -> web.Response:
    """SGLang's /server_info has internal_states: the client treats this mock as SGLang."""
    return web.json_response({"internal_states": []})


async def _ok(_request: web.Request) -> web.Response:
    return web.Response()


async def _serve(handler, body, api: str = "chat", tokenizer: str | None = None) -> None:
    async def with_client(url: str) -> None:
        cfg = ServerConfig(urls=[url], api=api, tokenizer=tokenizer, max_attempts=2, backoff_base_s=0.01,
                           backoff_max_s=0.02)
        async with aiohttp.ClientSession() as session:
            client = SGLangClient(session, cfg)
            try:
                await body(client)
            finally:
                await client.close()

    await serve_routes([web.post("/v1/chat/completions", handler), web.post("/generate", handler),
                        web.get("/health", _ok), web.get("/server_info", _sglang_info)], with_client)


def _payload(n_turns: int, **extra) -> JobPayload:
    return JobPayload(id="c1", dataset="D", sampling=SamplingParams(max_tokens=50),
                      messages=[Message(role="system", content="sys"), Message(role="user", content="q1")],
                      turns=[Message(role="user", content=f"q{k}") for k in range(2, n_turns + 1)], **extra)


def test_each_turn_gets_the_models_own_answers_without_their_reasoning_and_the_row_keeps_it():
    seen: list[dict] = []

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        k = len(seen)
        return web.json_response({"choices": [{"index": 0, "finish_reason": "stop", "message": {
            "role": "assistant", "content": f"answer {k}", "reasoning_content": f"thought {k}"}}],
            "usage": {"prompt_tokens": 10 * k, "completion_tokens": k}})

    async def body(client: SGLangClient) -> None:
        payload = _payload(3)
        timed: list[int] = []
        out = await turns.send(client, payload, "D-c1", on_turn=timed.append)
        assert timed == [1, 2, 3] and isinstance(out, turns.Conversation)
        assert (out.prompt_tokens, out.completion_tokens, out.lengths) == (60, 6, [1, 2, 3])
        row = build_row(payload, out, "m").model_dump(mode="json")
        assert row["conversations"] == [
            {"role": "system", "content": "sys"}, {"role": "user", "content": "q1"},
            {"role": "assistant", "content": "answer 1", "reasoning_content": "thought 1"},
            {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "answer 2", "reasoning_content": "thought 2"},
            {"role": "user", "content": "q3"},
            {"role": "assistant", "content": "answer 3", "reasoning_content": "thought 3"}]
        assert (row["prompt_tokens"], row["completion_tokens"], row["finish_reason"]) == (60, 6, "stop")
        assert [t["completion_tokens"] for t in row["turns"]] == [1, 2, 3]

    asyncio.run(_serve(chat, body))
    # SpecForge's call_sglang: the context is the model's own answers, reasoning_content popped
    assert [m for m in seen[2]["messages"]] == [
        {"role": "system", "content": "sys"}, {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "answer 1"}, {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "answer 2"}, {"role": "user", "content": "q3"}]
    assert [len(b["messages"]) for b in seen] == [2, 4, 6]
    rid_turns = [re.sub(r"\.[0-9a-f]{12}$", "", b["rid"]) for b in seen]
    assert rid_turns == ["D-c1", "D-c1.t2", "D-c1.t3"]


def test_a_cut_turn_ends_the_conversation():
    seen: list[dict] = []

    async def chat(request: web.Request) -> web.Response:
        seen.append(await request.json())
        fr = "length" if len(seen) == 2 else "stop"
        return web.json_response({"choices": [{"index": 0, "finish_reason": fr, "message": {
            "role": "assistant", "content": f"answer {len(seen)}"}}], "usage": {"prompt_tokens": 5,
                                                                               "completion_tokens": 50}})

    async def body(client: SGLangClient) -> None:
        out = await turns.send(client, _payload(4), "D-c1")
        assert isinstance(out, turns.Conversation) and out.finish_reason == "length" and len(out.outs) == 2
        row = build_row(_payload(4), out, "m")
        assert [m.role for m in row.conversations] == ["system", "user", "assistant", "user", "assistant"]
        assert row.conversations[-1].content == "answer 2"

    asyncio.run(_serve(chat, body))
    assert len(seen) == 2   # turns 3 and 4 were never asked


def test_generate_mode_templates_each_turn_with_the_models_answers(tmp_path):
    tok_path = make_tiny_tokenizer(tmp_path / "tok", words=["q1", "q2", "q3", "sys"])
    tok = AutoTokenizer.from_pretrained(tok_path)
    sent: list[list[int]] = []

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        sent.append(body["input_ids"])
        return web.json_response({"text": f"answer {len(sent)} .", "meta_info": {
            "finish_reason": {"type": "stop"}, "prompt_tokens": len(body["input_ids"]), "completion_tokens": 3}})

    def encode(msgs: list[dict]) -> list[int]:
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, enable_thinking=False)
        return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)

    first = encode([{"role": "system", "content": "sys"}, {"role": "user", "content": "q1"}])

    async def body(client: SGLangClient) -> None:
        payload = _payload(3, input_ids=first, chat_template_kwargs={"enable_thinking": False})
        out = await turns.send(client, payload, "D-c1")
        row = build_row(payload, out, "m")
        for k in (2, 3):   # request k's ids: the row's conversation up to user turn k, templated
            upto = [m.model_dump() for m in row.conversations[:2 * k]]
            assert sent[k - 1] == encode(upto)
        assert row.prompt_tokens == sum(len(s) for s in sent)

    asyncio.run(_serve(generate, body, api="generate", tokenizer=tok_path))
    assert sent[0] == first and len(sent) == 3


# -- budget scripts ----------------------------------------------------------------------------


def _register(conn, **kw) -> None:
    kw.setdefault("prior_mean_tokens", 20)
    ds = DatasetConfig(name="D", path="x", budget=kw.pop("budget", 1000), sampling={"max_tokens": 100}, **kw)
    budget.register_dataset(conn, ds)


def test_reservations_cover_every_turn(conn):
    _register(conn, mode="strict")
    assert run(conn, budget.reserve("D", "a", 100, 0, requests=3)).tokens == 300
    _register(conn, mode="strict", count="total")
    # 3 requests, 40 prompt tokens without answers, and 1 + 2 earlier answers sent back as context
    assert run(conn, budget.reserve("D", "b", 100, 40, requests=3)).tokens == 300 + 40 + 3 * (100 + 8)
    conn.delete(keys.resv_key("D"), keys.reserved_key("D"))
    _register(conn, mode="soft")
    assert run(conn, budget.reserve("D", "c", 100, 0, requests=4)).tokens == 4 * 20   # the prior, per request
    _register(conn, mode="soft", count="total")
    assert run(conn, budget.reserve("D", "d", 100, 40, requests=3)).tokens == 3 * 20 + 40 + 3 * 20


def test_commit_keeps_the_length_statistics_per_request(conn):
    _register(conn, mode="soft", prior_mean_tokens=None, budget=10**6)   # prior 25
    for i in range(60):   # 60 conversations of 3 requests: 10, 20 and 30 tokens
        assert run(conn, budget.reserve("D", f"j{i}", 100, 0, requests=3)).status is budget.Admission.ADMIT
        assert run(conn, budget.commit("D", f"j{i}", 5, 60, "stop", "{}", lengths=[10, 20, 30])).kept
    stats = conn.hgetall(keys.stats_key("D"))
    assert int(stats[b"committed"]) == 60 and int(stats[b"extra_requests"]) == 120
    assert int(stats[b"sum_completion"]) == 3600 == int(conn.get(keys.used_key("D")))
    hist = {int(k): int(v) for k, v in conn.hgetall(keys.hist_key("D")).items()}
    width = 100 // keys.HIST_BINS
    assert hist == {10 // width: 60, 20 // width: 60, 30 // width: 60}
    # the mean per request (20), not per conversation (60): a 2-turn job reserves 40
    assert run(conn, budget.reserve("D", "next", 100, 0, requests=2)).tokens == 40


# -- the whole stack ---------------------------------------------------------------------------


def test_every_turn_is_regenerated_in_order_and_counted_once(tmp_path, redis_url, conn, sim_factory):
    sim = sim_factory("--speedup", "200", "--length-mean", "40", "--seed", "5", "--reasoning-tokens-frac", "0.3",
                      "--reasoning-parser", "qwen3")
    n_turns = _write(tmp_path / "D.jsonl", 24)
    cfg = write_config(tmp_path, redis_url, [sim], [_ds(tmp_path / "D.jsonl", count="total",
                                                        sampling={"max_tokens": 400})])
    run_to_completion(cfg, tmp_path)
    states = check_invariants(conn, tmp_path / "out", "D", list(n_turns), count="total")
    assert states["committed"] == 24
    records = _by_request(sim)
    assert len(records) == sum(n_turns.values())   # one request per user turn, none sent twice
    for row in rows(tmp_path / "out" / "D.jsonl"):
        conv, k = row["conversations"], n_turns[row["id"]]
        assert [m["role"] for m in conv] == ["system"] + ["user", "assistant"] * k
        users = [m["content"] for m in conv if m["role"] == "user"]
        assert users == [f"question {row['id'][1:]} turn {t} ?" for t in range(1, k + 1)]
        answers = [m for m in conv if m["role"] == "assistant"]
        assert all("OLD" not in m["content"] and m["reasoning_content"] for m in answers)
        job = job_id("D", row["id"])
        sent = [records[job if t == 1 else f"{job}.t{t}"] for t in range(1, k + 1)]
        assert ("turns" in row) == (k > 1)   # the per-request breakdown, when there were several
        per_turn = row.get("turns") or [row]
        assert [r["completion_tokens"] for r in sent] == [t["completion_tokens"] for t in per_turn]
        assert row["completion_tokens"] == sum(r["completion_tokens"] for r in sent)
        assert row["prompt_tokens"] == sum(r["prompt_tokens"] for r in sent)
        # each turn's prompt holds the one before, its answer and the next question
        assert all(b["prompt_tokens"] > a["prompt_tokens"] for a, b in zip(sent, sent[1:], strict=False))
    lengths = [t["completion_tokens"] for r in rows(tmp_path / "out" / "D.jsonl") for t in r.get("turns", [])]
    assert len(set(lengths)) > len(lengths) // 2   # turns draw their own lengths
    stats = conn.hgetall(keys.stats_key("D"))
    assert int(stats[b"extra_requests"]) == sum(n_turns.values()) - 24
    assert sum(int(v) for v in conn.hgetall(keys.hist_key("D")).values()) == sum(n_turns.values())


def test_strict_multi_turn_reservations_never_pass_the_budget(tmp_path, redis_url, conn, sim_factory):
    sim = sim_factory("--speedup", "100", "--length-mean", "150", "--length-sigma", "0.8", "--seed", "2")
    n_turns = _write(tmp_path / "D.jsonl", 80)
    cfg = write_config(tmp_path, redis_url, [sim], [_ds(tmp_path / "D.jsonl", mode="strict", budget=6000,
                                                        sampling={"max_tokens": 300})],
                       worker={"concurrency": 16})
    run_to_completion(cfg, tmp_path)
    states = check_invariants(conn, tmp_path / "out", "D", list(n_turns))
    assert states["used"] <= 6000 and states["committed"] > 0 and states["skipped"] > 0
    # the last admitted conversations fit their turns x max_tokens into what was left
    assert 6000 - states["used"] < 4 * 300


def test_a_cut_turn_ends_the_conversation_and_keep_complete_sets_it_aside(tmp_path, redis_url, conn, sim_factory):
    sim = sim_factory("--speedup", "200", "--length-mean", "60", "--length-sigma", "1.0", "--seed", "9")
    n_turns = _write(tmp_path / "D.jsonl", 30, turns_of=lambda i: 4)
    cfg = write_config(tmp_path, redis_url, [sim], [_ds(tmp_path / "D.jsonl", keep="complete",
                                                        sampling={"max_tokens": 80})])
    run_to_completion(cfg, tmp_path)
    check_invariants(conn, tmp_path / "out", "D", list(n_turns))
    kept, cut = rows(tmp_path / "out" / "D.jsonl"), rows(tmp_path / "out" / "D.truncated.jsonl")
    assert kept and cut and len(kept) + len(cut) == 30
    for row in kept:
        assert len(row["turns"]) == 4 and all(t["finish_reason"] == "stop" for t in row["turns"])
    asked = _by_request(sim)
    for row in cut:
        reasons = [t["finish_reason"] for t in row["turns"]]
        assert reasons[-1] == "length" and "length" not in reasons[:-1]
        assert row["finish_reason"] == "length" and row["conversations"][-1]["role"] == "assistant"
        k = len(reasons)
        assert len(row["conversations"]) == 1 + 2 * k
        assert f"{job_id('D', row['id'])}.t{k + 1}" not in asked   # nothing asked after the cut


def test_generate_mode_sends_each_turn_templated_with_the_rows_own_answers(tmp_path, redis_url, conn, sim_factory):
    tok_path = make_tiny_tokenizer(tmp_path / "tok", words=["turn", "OLD", "1", "2", "3", "4"])
    tok = AutoTokenizer.from_pretrained(tok_path)
    sim = sim_factory("--speedup", "200", "--length-mean", "30", "--seed", "4")
    n_turns = _write(tmp_path / "D.jsonl", 12)
    cfg = write_config(tmp_path, redis_url, [sim], [_ds(tmp_path / "D.jsonl", sampling={"max_tokens": 200},
                                                        chat_template_kwargs={"enable_thinking": False})],
                       server={"api": "generate", "tokenizer": tok_path})
    run_to_completion(cfg, tmp_path)
    check_invariants(conn, tmp_path / "out", "D", list(n_turns))
    records = _by_request(sim)
    for row in rows(tmp_path / "out" / "D.jsonl"):
        conv = row["conversations"]
        for k in range(1, n_turns[row["id"]] + 1):
            want = tok.apply_chat_template(conv[:1 + 2 * k - 1], add_generation_prompt=True, tokenize=True,
                                           enable_thinking=False)
            want = list(want["input_ids"] if isinstance(want, Mapping) else want)
            rec = records[job_id("D", row["id"]) + (f".t{k}" if k > 1 else "")]
            assert rec["endpoint"] == "generate"
            assert (rec["prompt_tokens"], rec["input_ids_head"]) == (len(want), want[:8]), (row["id"], k)


def test_a_worker_killed_mid_conversation_loses_nothing_and_counts_nothing_twice(tmp_path, redis_url, conn,
                                                                                 sim_factory):
    # ~0.5 s per request, 4 turns each: a kill lands between turns of conversations in flight
    sim = sim_factory("--speedup", "2", "--length-mean", "200", "--length-sigma", "0.3", "--seed", "8")
    n_turns = _write(tmp_path / "D.jsonl", 40, turns_of=lambda i: 4)
    cfg = write_config(tmp_path, redis_url, [sim], [_ds(tmp_path / "D.jsonl", sampling={"max_tokens": 2000})],
                       worker={"concurrency": 8, **FAST})
    procs = Procs(cfg, tmp_path)
    victim = procs.worker()
    producer = procs.producer()
    try:
        # some conversation of the victim's is past its first turn and not committed yet
        def mid_conversation() -> bool:
            held = holders(conn, "D", victim.pid)
            later = {r["rid"].split(".")[0] for r in sim_get(sim, "/sim/requests") if ".t" in r["rid"]}
            return bool(held & later)
        wait_for(mid_conversation, 60, "a conversation past its first turn")
        victim.send_signal(signal.SIGKILL)
        procs.worker()
        assert producer.wait(120) == 0, procs.log(producer)
    finally:
        procs.stop_all()
    states = check_invariants(conn, tmp_path / "out", "D", list(n_turns))
    assert states["committed"] == 40 and states["failed"] == 0
    assert int(conn.hget(keys.stats_key("D"), "recovered") or 0) > 0
    per_job: dict[str, set[int]] = defaultdict(set)
    for r in sim_get(sim, "/sim/requests"):
        key = r["rid"].rsplit(".", 1)[0]
        per_job[key.split(".")[0]].add(int(key.split(".t")[1]) if ".t" in key else 1)
    for row in rows(tmp_path / "out" / "D.jsonl"):
        assert len(row["turns"]) == 4 and per_job[job_id("D", row["id"])] == {1, 2, 3, 4}


def test_check_reports_requests_per_conversation(tmp_path):
    n_turns = _write(tmp_path / "D.jsonl", 8)   # 1, 2, 3, 4, 1, 2, 3, 4 user turns
    tok_path = make_tiny_tokenizer(tmp_path / "tok")
    cfg = Config(server={"urls": ["http://127.0.0.1:1"], "tokenizer": tok_path},
                 datasets=[_ds(tmp_path / "D.jsonl", prior_mean_tokens=100, count="total", budget=100_000)])
    d = check_dataset(cfg.datasets[0], cfg)
    d.finish(None)
    assert d.requests is not None and (d.requests.total, d.requests.min, d.requests.max) == (20, 1, 4)
    # prompt tokens are summed over each conversation's requests: more than the first request alone
    assert d.prompt_tokens is not None and d.prompt_tokens.max > d.prompt_tokens.min * 4
    per_conversation = 2.5 * 100 + round(d.prompt_tokens.mean)
    assert d.responses_needed == -(-100_000 // per_conversation)
    text = format_report(CheckReport([d], RedisCheck("redis://x", True), [], None))
    assert "requests per conversation: mean 2.50, min 1, max 4 (20 in all" in text
    assert sum(n_turns.values()) == 20


def test_the_one_at_a_time_path_runs_a_conversation_too(redis_url, conn):
    _register(conn, mode="strict", budget=10_000)
    seen: list[dict] = []

    async def chat(request: web.Request) -> web.Response:
        seen.append(await request.json())
        return web.json_response({"choices": [{"index": 0, "finish_reason": "stop", "message": {
            "role": "assistant", "content": f"answer {len(seen)}"}}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 10 * len(seen)}})

    async def body(client: SGLangClient) -> None:
        aconn = aconnect(redis_url, max_connections=4)
        try:
            assert (await run_one(_payload(3), "D-c1", aconn, client))["status"] == "committed"
        finally:
            await aconn.aclose()

    asyncio.run(_serve(chat, body))
    assert len(seen) == 3 and int(conn.get(keys.used_key("D"))) == 60
    [(_id, fields)] = conn.xrange(keys.results_key("D"))
    row = json.loads(fields[b"row"])
    assert [m["content"] for m in row["conversations"] if m["role"] == "assistant"] == ["answer 1", "answer 2",
                                                                                         "answer 3"]
    assert int(conn.hget(keys.stats_key("D"), "extra_requests")) == 2
