"""Server faults: transient ones are retried, permanent ones fail one prompt with the server's reason."""

from __future__ import annotations

import json
import subprocess

from aiohttp import web
from rq import Queue
from rq.registry import FailedJobRegistry
from rq.serializers import JSONSerializer

from budgetq.shared import jobs, keys
from budgetq.shared.budget import register_dataset
from budgetq.shared.config import DatasetConfig
from budgetq.shared.schema import JobPayload, Message
from budgetq.simulator.local import free_port
from tests.helpers import PY, ROOT, check_invariants, run_to_completion, sim_get, write_config, write_dataset

FAST = {"heartbeat_ttl_s": 3, "maintenance_interval_s": 0.5, "control_interval_s": 0.2}
RETRY = {"backoff_base_s": 0.02, "backoff_max_s": 0.2, "max_attempts": 12, "eject_after_failures": 50}


def _failed(conn, ds: str) -> FailedJobRegistry:
    return jobs.registry(FailedJobRegistry, ds, conn)


def test_transient_faults_are_retried_and_the_run_completes(tmp_path, redis_url, conn, sim_factory):
    sim = sim_factory("--speedup", "50", "--length-mean", "200", "--seed", "5", "--error-rate", "0.15",
                      "--error-codes", "500,502,503,429", "--drop-rate", "0.05", "--spike-rate", "0.05",
                      "--spike-s", "0.3")
    ids = write_dataset(tmp_path / "D.jsonl", 200)
    cfg = write_config(tmp_path, redis_url, [sim], [{"name": "D", "path": str(tmp_path / "D.jsonl"),
                                                     "budget": "10M", "id_field": "id",
                                                     "sampling": {"max_tokens": 1000}}],
                       worker={"concurrency": 16, **FAST}, server=RETRY)
    run_to_completion(cfg, tmp_path, timeout_s=120)
    stats = sim_get(sim, "/sim/stats")
    injected = sum(n for kind, n in stats["errors"].items() if kind.isdigit()) + stats["dropped"]
    retried = int(conn.hget(keys.stats_key("D"), "retried") or 0)
    print(f"injected faults: {stats['errors']} errors, {stats['dropped']} dropped connections; "
          f"retried {retried} times; all {len(ids)} prompts committed")
    assert injected > 10 and retried >= injected
    states = check_invariants(conn, tmp_path / "out", "D", ids)
    assert states["committed"] == 200 and states["failed"] == 0
    # a dropped connection wasted what the server had generated; retries never re-count it
    assert int(conn.get(keys.used_key("D"))) == sum(
        r["completion_tokens"] for r in map(json.loads, (tmp_path / "out" / "D.jsonl").read_text().splitlines()))


def test_permanent_error_fails_the_prompt_with_the_servers_reason_and_retry_failed_requeues(
        tmp_path, redis_url, conn, sim_factory):
    sim = sim_factory("--speedup", "100", "--length-mean", "50", "--context-length", "64")
    path = tmp_path / "D.jsonl"
    ids = write_dataset(path, 30)
    long_rows = [json.dumps({"id": f"long{i}", "prompt": "word " * 400}) for i in range(3)]
    path.write_text(path.read_text() + "\n".join(long_rows) + "\n")
    cfg = write_config(tmp_path, redis_url, [sim], [{"name": "D", "path": str(path), "budget": "10M",
                                                     "id_field": "id", "sampling": {"max_tokens": 32}}],
                       worker={"concurrency": 8, **FAST}, server=RETRY)
    run_to_completion(cfg, tmp_path, timeout_s=60)
    failed = _failed(conn, "D")
    assert sorted(failed.get_job_ids(cleanup=False)) == ["D--long0", "D--long1", "D--long2"]
    job = failed.job_class.fetch("D--long0", connection=conn, serializer=JSONSerializer)
    reason = job.latest_result().exc_string
    assert "HTTP 400" in reason and "longer than the model's context length" in reason
    assert int(conn.hget(keys.stats_key("D"), "failed")) == 3
    # one attempt each: a 400 is not retried
    assert sim_get(sim, "/sim/stats")["errors"]["context_length"] == 3
    check_invariants(conn, tmp_path / "out", "D", [*ids, "long0", "long1", "long2"])

    out = subprocess.run([*PY, "retry-failed", "D", "-c", str(cfg)], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and "D: requeued 3 failed jobs" in out.stdout
    assert failed.get_job_count(cleanup=False) == 0 and conn.llen(keys.rq_queue_key("D")) == 3
    assert conn.xlen(keys.CONTROL_LOG) >= 1
    subprocess.run([*PY, "worker", "--burst", "-c", str(cfg)], cwd=ROOT, check=True, timeout=60)
    assert failed.get_job_count(cleanup=False) == 3  # still too long: failed again, with the reason


def test_a_bad_payload_or_an_unreadable_response_fails_one_prompt_only(tmp_path, redis_url, conn):
    # A server that answers 200 with JSON of the wrong shape for prompts mentioning "weird".
    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        if "weird" in body["messages"][-1]["content"]:
            return web.json_response({"choices": []})
        return web.json_response({"choices": [{"message": {"role": "assistant", "content": "ok"},
                                               "finish_reason": "stop"}],
                                  "usage": {"prompt_tokens": 3, "completion_tokens": 1}})

    async def health(_request: web.Request) -> web.Response:
        return web.Response()

    import asyncio
    import threading

    port = free_port()
    loop = asyncio.new_event_loop()
    app = web.Application()
    app.add_routes([web.post("/v1/chat/completions", chat), web.get("/health", health)])
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        register_dataset(conn, DatasetConfig(name="D", path="x", budget="1M", sampling={"max_tokens": 10}))
        q = Queue(keys.queue_name("D"), connection=conn, serializer=JSONSerializer)
        for i, text in enumerate(["fine", "weird one", "fine again"]):
            p = JobPayload(id=f"p{i}", dataset="D", messages=[Message(role="user", content=text)],
                           sampling={"max_tokens": 10})
            q.enqueue("budgetq.worker.job.run_prompt", p.model_dump(mode="json"), job_id=f"D-p{i}")
        q.enqueue("budgetq.worker.job.run_prompt", {"id": "broken"}, job_id="D-broken")  # not a valid payload
        cfg = write_config(tmp_path, redis_url, [f"http://127.0.0.1:{port}"], [], worker=FAST, server=RETRY)
        subprocess.run([*PY, "worker", "--burst", "-c", str(cfg)], cwd=ROOT, check=True, timeout=60)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.run_until_complete(runner.cleanup())  # its sockets, then the loop: nothing left to the GC
        loop.close()
    failed = _failed(conn, "D")
    assert sorted(failed.get_job_ids(cleanup=False)) == ["D-broken", "D-p1"]
    fetch = failed.job_class.fetch
    assert "unexpected response" in fetch("D-p1", connection=conn,
                                          serializer=JSONSerializer).latest_result().exc_string
    assert "unreadable job payload" in fetch("D-broken", connection=conn,
                                             serializer=JSONSerializer).latest_result().exc_string
    assert int(conn.get(keys.used_key("D"))) == 2 and conn.scard(keys.done_key("D")) == 2
