"""worker.concurrency: auto (worker/capacity.py): sized from /server_info and /v1/loads, split
among the workers sharing a server through Redis."""

from __future__ import annotations

import json

import pytest

from budgetq.cli.main import concurrency_arg
from budgetq.shared import keys
from budgetq.shared.config import WorkerConfig
from budgetq.shared.status import snapshot
from budgetq.worker.capacity import ServerLoad, my_share, next_target, parse_loads, parse_server_info, queue_target
from tests.helpers import Procs, sim_get, wait_for, write_config


def test_the_simulator_reports_capacity_and_load_like_sglang(sim_factory):
    sim = sim_factory("--max-running-requests", "48")
    assert parse_server_info(sim_get(sim, "/server_info")) == 48
    assert parse_loads(sim_get(sim, "/v1/loads")) == (0, 0)


def test_dp_ranks_are_summed_and_the_configured_value_is_the_fallback():
    info = {"internal_states": [{"effective_max_running_requests_per_dp": 30},
                                {"effective_max_running_requests_per_dp": 34}], "max_running_requests": 99}
    assert parse_server_info(info) == 64
    assert parse_server_info({"max_running_requests": 99}) == 99
    with pytest.raises(ValueError, match="server_info"):
        parse_server_info({})
    assert parse_loads({"loads": [{"num_running_reqs": 3, "num_waiting_reqs": 1},
                                  {"num_running_reqs": 4, "num_waiting_reqs": 0}]}) == (7, 1)


def test_target_keeps_a_short_non_empty_queue_and_shares_add_up():
    assert queue_target(8) == 2 and queue_target(256) == 13
    assert next_target(ServerLoad(256, 0, 0), ours=0) == 269                 # empty server: slots + queue
    assert next_target(ServerLoad(256, 256, 13), ours=269) == 269            # as wanted: unchanged
    assert next_target(ServerLoad(256, 256, 53), ours=269) == 229            # others hold 40 there: back off
    assert next_target(ServerLoad(256, 180, 40), ours=220) == 193            # KV-bound: 180 run, so 180 + 13
    assert next_target(ServerLoad(8, 8, 500), ours=0) == 2                   # someone else floods it: a queue only
    names = [f"w{i}" for i in range(8)]
    assert sum(my_share(269, names, n) for n in names) == 269
    assert {my_share(269, names, n) for n in names} == {33, 34}


def test_fixed_numbers_still_parse_and_auto_is_accepted():
    assert WorkerConfig(concurrency="auto").concurrency == "auto"
    assert WorkerConfig(concurrency=12).concurrency == 12
    assert concurrency_arg("auto") == "auto" and concurrency_arg("7") == 7
    with pytest.raises(ValueError):
        WorkerConfig(concurrency="lots")


def test_two_auto_workers_fill_two_servers_of_different_sizes_and_split_them(tmp_path, redis_url, conn, sim_factory):
    small = sim_factory("--max-running-requests", "8", "--speedup", "20", "--length-mean", "2000")
    big = sim_factory("--max-running-requests", "24", "--speedup", "20", "--length-mean", "2000")
    with open(tmp_path / "D.jsonl", "w") as fh:
        for i in range(2000):
            fh.write(json.dumps({"id": f"p{i}", "prompt": f"question {i}"}) + "\n")
    cfg = write_config(tmp_path, redis_url, [small, big],
                       [{"name": "D", "path": str(tmp_path / "D.jsonl"), "budget": 10**9, "id_field": "id",
                         "sampling": {"max_tokens": 4096}}],
                       worker={"concurrency": "auto", "capacity_interval_s": 0.3}, producer={"progress": "off"})
    procs = Procs(cfg, tmp_path)
    try:
        procs.worker()
        procs.worker()
        procs.producer()

        def settled():
            s, b = sim_get(small, "/sim/stats"), sim_get(big, "/sim/stats")
            workers = snapshot(conn, redis_url)["workers"]
            return (s["running"] == 8 and b["running"] == 24 and len(workers) == 2
                    and sum(w["concurrency"] for w in workers) == (8 + 2) + (24 + 2) and (s, b, workers))

        s, b, workers = wait_for(settled, 60, "both servers full and the workers' limits settled")
        assert s["queued"] <= 2 + 2 and b["queued"] <= 2 + 2          # a short queue, not the whole limit
        lo, hi = sorted(w["concurrency"] for w in workers)              # (10 + 26) split in two
        assert lo + hi == 36 and hi - lo <= 2
        assert len(conn.hgetall(keys.capacity_key(small))) == 2
    finally:
        procs.stop_all()
