"""Prefix-aware routing (server.routing: prefix, worker/endpoints.py) and cached_tokens per endpoint."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from pydantic import ValidationError

from budgetq.producer.ops.metrics import render
from budgetq.shared.config import ServerConfig
from budgetq.shared.config_load import load_config
from budgetq.shared.schema import JobPayload, Message, SamplingParams
from budgetq.shared.status import snapshot
from budgetq.worker.endpoints import EndpointPool, routing_key
from tests.helpers import Procs, rows, sim_get, wait_for, write_config

URLS = [f"http://10.0.0.{i}:30000" for i in range(1, 5)]


def _pool(**server) -> EndpointPool:
    # pick() never touches the session: only the health probe does.
    return EndpointPool(ServerConfig(urls=URLS, routing="prefix", **server), None, {})  # type: ignore[arg-type]


def _payload(system: str, question: str) -> JobPayload:
    return JobPayload(id="x", dataset="D", sampling=SamplingParams(max_tokens=8),
                      messages=[Message(role="system", content=system), Message(role="user", content=question)])


def test_routing_key_is_the_start_of_the_rendered_messages_or_input_ids():
    long_system = "s" * 2000
    a, b = _payload(long_system, "one"), _payload(long_system, "two")
    assert routing_key(a, 1024) == routing_key(b, 1024)           # the shared system prompt decides
    assert routing_key(_payload("short", "one"), 1024) != routing_key(_payload("short", "two"), 1024)
    ids = JobPayload(id="x", dataset="D", sampling=SamplingParams(max_tokens=8), messages=[],
                     input_ids=list(range(500)))
    other = ids.model_copy(update={"input_ids": [*range(256), 9, 9]})
    assert routing_key(ids, 1024) == routing_key(other, 1024)      # the first 256 ids
    assert routing_key(ids, 1028) != routing_key(other, 1028)


def test_same_key_same_endpoint_different_keys_spread():
    pool = _pool()
    key = b"chat:system prompt A"
    first = pool.pick(key)
    assert all(pool.pick(key) is first for _ in range(20))
    chosen = Counter(pool.pick(f"chat:group {i}".encode()).url for i in range(400))
    assert set(chosen) == set(URLS) and min(chosen.values()) > 60   # rendezvous spreads keys evenly


def test_load_bound_spills_a_hot_key_to_its_second_choice_then_least_loaded():
    pool = _pool(prefix_balance=1.25)
    key = b"chat:hot prefix"
    picks = []
    for _ in range(40):                    # requests of one hot prefix, none finishing
        ep = pool.pick(key)
        ep.in_flight += 1
        picks.append(ep.url)
    loads = [e.in_flight for e in pool.endpoints]
    assert max(loads) <= 1.25 * min(loads) + 2                     # the bound against the least loaded
    ranked = [u for u, _ in Counter(picks).most_common()]
    assert picks[0] == ranked[0]                                   # its first choice took the most
    pool.endpoints[0].healthy = False                              # an ejected endpoint is skipped
    assert all(pool.pick(key) is not pool.endpoints[0] for _ in range(10))


def test_least_loaded_ignores_keys_and_config_rejects_unknown_routing(tmp_path):
    pool = EndpointPool(ServerConfig(urls=URLS), None, {})  # type: ignore[arg-type]
    pool.endpoints[0].in_flight = 0
    for e in pool.endpoints[1:]:
        e.in_flight = 5
    assert pool.pick(None) is pool.endpoints[0]
    with pytest.raises(ValidationError, match="routing"):
        ServerConfig(urls=URLS, routing="random")
    cfg = write_config(tmp_path, "redis://127.0.0.1:1/0", URLS, [{"name": "D", "path": "x.jsonl", "budget": 10}],
                       server={"routing": "prefix", "prefix_chars": 512})
    loaded = load_config(cfg).server
    assert (loaded.routing, loaded.prefix_chars, loaded.prefix_balance) == ("prefix", 512, 1.25)


def test_prefix_routing_end_to_end_groups_land_on_one_server_and_status_shows_cached(tmp_path, redis_url, conn,
                                                                                    sim_factory):
    sims = [sim_factory("--instant", "--length-mean", "10", "--radix-cache", "--enable-cache-report")
            for _ in range(3)]
    systems = {g: f"System prompt of group {g}: " + "be brief and exact. " * 60 for g in range(4)}
    with open(tmp_path / "D.jsonl", "w") as fh:
        for i in range(48):
            g = i % 4
            fh.write(json.dumps({"id": f"g{g}-{i}", "messages": [{"role": "system", "content": systems[g]},
                                                                 {"role": "user", "content": f"question {i}"}]})
                     + "\n")
    cfg = write_config(tmp_path, redis_url, sims, [{"name": "D", "path": str(tmp_path / "D.jsonl"), "budget": 10**9,
                                                    "id_field": "id", "messages_field": "messages",
                                                    "sampling": {"max_tokens": 32}}],
                       server={"routing": "prefix"}, producer={"progress": "off"})
    procs = Procs(cfg, tmp_path)
    try:
        procs.worker("--concurrency", "1")     # one at a time: in flight never binds, the key alone decides
        assert procs.producer().wait(120) == 0
        sim_cached = sum(sim_get(u, "/sim/stats")["cached_tokens"] for u in sims)
        # the worker publishes its counts about once a second: wait for the last requests' to arrive
        snap = wait_for(lambda: (s := snapshot(conn, redis_url, sims)) and
                        sum(e["cached_tokens"] for e in s["endpoints"]) == sim_cached and s, 30,
                        "every cached token in status")
    finally:
        procs.stop_all()
    assert len(rows(tmp_path / "out" / "D.jsonl")) == 48
    where = {}
    for url in sims:
        for rec in sim_get(url, "/sim/requests"):
            where.setdefault(rec["rid"].split("--", 1)[1].split("-", 1)[0], set()).add(url)
    assert sorted(where) == ["g0", "g1", "g2", "g3"]
    assert all(len(urls) == 1 for urls in where.values()), where    # each group on one server
    status_cached = sum(e["cached_tokens"] for e in snap["endpoints"])
    assert status_cached == sim_cached > 0
    # Every request but each group's first found its system prompt cached.
    assert sum(sim_get(u, "/sim/stats")["requests"] for u in sims) == 48
    assert {e["url"] for e in snap["endpoints"]} == set(sims)
    text = render(snap).decode()
    assert f'budgetq_endpoint_cached_tokens{{endpoint="{sims[0]}"}}' in text
