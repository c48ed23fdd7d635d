"""worker.concurrency: auto (worker/capacity.py): sized from /server_info and /v1/loads (SGLang) or
/metrics (vLLM, worker/vllm_load.py), split among the workers sharing a server through Redis."""

from __future__ import annotations

import json

import pytest

from budgetq.cli.main import concurrency_arg
from budgetq.shared import keys
from budgetq.shared.config import WorkerConfig
from budgetq.shared.status import snapshot
from budgetq.worker.capacity import (
    KV_HIGH,
    MAX_PER_ENGINE,
    ServerLoad,
    my_share,
    next_slots,
    next_target,
    parse_loads,
    parse_server_info,
    queue_target,
)
from budgetq.worker.vllm_load import VllmLoad, parse_metrics
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
        for i in range(20_000):  # far more than the test runs: on a loaded machine the fleet fills slowly
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

        s, b, workers = wait_for(settled, 120, "both servers full and the workers' limits settled")
        assert s["queued"] <= 2 + 2 and b["queued"] <= 2 + 2          # a short queue, not the whole limit
        lo, hi = sorted(w["concurrency"] for w in workers)              # (10 + 26) split in two
        assert lo + hi == 36 and hi - lo <= 2
        assert len(conn.hgetall(keys.capacity_key(small))) == 2
    finally:
        procs.stop_all()


# --- vLLM: its /metrics, and the running slots estimated from them ----------------------------------
# An excerpt of vLLM 0.32.0's /metrics (CPU build, SmolLM2-135M), as two data-parallel engines would
# write it: HELP/TYPE lines, a histogram and an info metric between the gauges read.
VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="smollm2"} 40.0
vllm:num_requests_running{engine="1",model_name="smollm2"} 38.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="smollm2"} 5.0
vllm:num_requests_waiting{engine="1",model_name="smollm2"} 2.0
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="smollm2",reason="capacity"} 4.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="smollm2",reason="deferred"} 1.0
vllm:num_requests_waiting_by_reason{engine="1",model_name="smollm2",reason="capacity"} 2.0
vllm:num_requests_waiting_by_reason{engine="1",model_name="smollm2",reason="deferred"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="smollm2"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="smollm2"} 0.625
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="smollm2"} 3.0
vllm:num_preemptions_total{engine="1",model_name="smollm2"} 1.0
vllm:num_preemptions_created{engine="0",model_name="smollm2"} 1.7965617778946946e+09
vllm:request_num_preemptions_bucket{engine="0",le="1.0",model_name="smollm2"} 79.0
vllm:cache_config_info{block_size="128",engine="0",kv_cache_max_concurrency="22.75",num_gpu_blocks="364"} 1.0
"""


def test_vllm_metrics_are_summed_over_engines_and_the_fullest_kv_cache_counts():
    load = parse_metrics(VLLM_METRICS)
    assert load == VllmLoad(running=78, waiting=7, waiting_capacity=6, kv_cache_use=0.625, preemptions=4, engines=2)
    # an older vLLM without waiting_by_reason: all of waiting counts as waiting for room
    older = "\n".join(line for line in VLLM_METRICS.splitlines() if "by_reason" not in line)
    assert parse_metrics(older).waiting_capacity == 7


@pytest.mark.parametrize("text, why", [
    ("", "no vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc"),
    ("# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs 3\n", "not a vLLM server"),
    (VLLM_METRICS.replace("} 0.625", "} NaN"), "NaN"),
    (VLLM_METRICS.replace("} 40.0", "} -1"), "negative"),
    (VLLM_METRICS.replace('vllm:num_requests_running{engine="1"', 'vllm:num_requests_running{engine=1'),
     "unreadable vLLM metrics"),
])
def test_bad_or_missing_vllm_metrics_are_an_error_the_caller_keeps_the_share_for(text, why):
    with pytest.raises(ValueError, match=why):
        parse_metrics(text)


def _vllm(running: int, waiting: int, kv: float = 0.2, engines: int = 1) -> VllmLoad:
    return VllmLoad(running, waiting, waiting, kv, 0, engines)


def test_vllm_slots_grow_while_everything_runs_and_fall_to_what_runs_when_more_than_the_queue_waits():
    assert next_slots(8, _vllm(running=10, waiting=0)) == 16          # 8 + its queue of 2 all run: double
    assert next_slots(8, _vllm(running=8, waiting=0)) == 8            # the queue is not there (few jobs): hold
    assert next_slots(64, _vllm(running=20, waiting=0)) == 64         # a worker short of jobs never grows it
    assert next_slots(256, _vllm(running=256, waiting=13)) == 256     # max_num_seqs 256 and its queue: hold
    assert next_slots(256, _vllm(running=256, waiting=0)) == 256      # ... also the instant the queue is empty
    assert next_slots(512, _vllm(running=256, waiting=269)) == 256    # grown past max_num_seqs: back to it
    assert next_slots(256, _vllm(running=180, waiting=2, kv=KV_HIGH)) == 180     # KV memory is the bound
    assert next_slots(256, _vllm(running=200, waiting=0), preempted=True) == 200  # KV ran out: work was lost
    assert next_slots(MAX_PER_ENGINE, _vllm(running=3000, waiting=0)) == MAX_PER_ENGINE   # vLLM's largest default
    assert next_slots(MAX_PER_ENGINE, _vllm(running=3000, waiting=0, engines=2)) == 2 * MAX_PER_ENGINE


def _serve_vllm(ours: int, max_num_seqs: int, kv_requests: int) -> VllmLoad:
    """A vLLM that runs at most max_num_seqs, and as many as its KV cache holds (kv_requests), of ours."""
    running = min(ours, max_num_seqs, kv_requests)
    return _vllm(running, ours - running, kv=running / kv_requests)


@pytest.mark.parametrize("max_num_seqs, kv_requests", [(256, 10**6), (1024, 10**6), (48, 10**6), (256, 100),
                                                       (3, 10**6)])
def test_vllm_sizing_settles_at_what_the_server_runs_plus_a_short_queue(max_num_seqs, kv_requests):
    """From START, read after read, one budgetq worker alone at the server: it reaches the server's
    bound (max_num_seqs, or what its KV cache holds) within ~log2 reads and then holds, queue kept short."""
    slots, ours, seen = 8, 8, []
    for _ in range(40):
        load = _serve_vllm(ours, max_num_seqs, kv_requests)
        slots = next_slots(slots, load)
        ours = next_target(ServerLoad(slots, load.running, load.waiting), ours)
        seen.append((slots, ours))
    bound = min(max_num_seqs, kv_requests)
    assert len(set(seen[-10:])) == 1, seen                 # settled: no oscillation
    slots, ours = seen[-1]
    assert KV_HIGH * bound <= slots <= bound
    assert ours - slots == queue_target(slots)           # the queue at the server is the short one
