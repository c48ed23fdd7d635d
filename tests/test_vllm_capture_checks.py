"""The vllm capture backend without vLLM: a file of an unexpected dtype fails its job once, saying so (a real
features worker against a stand-in server that writes such files); the fault point vllm-mid-request kills a
features worker with its prefill sent and its answer unread; the final norm applied to vLLM's last layer is the
one the model's config.json names (RMSNorm or LayerNorm)."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import yaml

from budgetq.hidden_states.capture.decode import HiddenStatesError
from budgetq.hidden_states.capture.vllm_backend import read_engine_file
from budgetq.hidden_states.capture.vllm_layout import layout_for, load_final_norm
from budgetq.hidden_states.schema import FeaturesPayload
from budgetq.hidden_states.store import fault_points
from budgetq.hidden_states.store.safetensors_io import Tensor, write_atomic
from budgetq.hidden_states.store.shards import features_dir, index_rows
from budgetq.shared import keys
from budgetq.shared.errors import ConfigError
from tests.helpers import PY, ROOT, Procs
from tests.test_features import write_rows
from tests.tiny_tokenizer import make_tiny_tokenizer

HIDDEN, LAYERS = 4, 8      # layer ids [2, 4, 5, 8]: aux [1, 3, 4] + the target


def _model_dir(where: Path, config: dict, tensors: dict[str, np.ndarray]) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    (where / "config.json").write_text(json.dumps({"num_hidden_layers": LAYERS, "hidden_size": HIDDEN,
                                                   "model_type": "llama", **config}))
    write_atomic(where / "model.safetensors",
                 [Tensor(k, "F32", [HIDDEN], v.astype("<f4").tobytes()) for k, v in tensors.items()], {})
    return where


def _engine_file(path: Path, ids: list[int], x: np.ndarray, dtype: str = "F32", ids_dtype: str = "I64") -> None:
    """An engine file as vLLM's connector writes it, in any dtype safetensors has (the store's own writer knows
    only the ones it writes, so the file is put together here)."""
    np_dtype = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4"}
    tensors = [("hidden_states", dtype, list(x.shape), x.astype(np_dtype[dtype]).tobytes()),
               ("token_ids", ids_dtype, [len(ids)], np.asarray(ids, np_dtype[ids_dtype]).tobytes())]
    header, offset = {}, 0
    for name, dt, shape, data in tensors:
        header[name] = {"dtype": dt, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(t[3] for t in tensors))


def test_an_engine_file_of_another_dtype_is_a_hidden_states_error(tmp_path):
    d = _model_dir(tmp_path / "m", {"rms_norm_eps": 1e-5}, {"model.norm.weight": np.ones(HIDDEN)})
    lay, norm = layout_for(d, None), load_final_norm(d, HIDDEN)
    ids = [5, 6, 7]
    x = np.random.default_rng(0).normal(size=(3, len(lay.layer_ids), HIDDEN))
    p = FeaturesPayload(id="a", dataset="A", input_ids=ids, loss_start=1, loss_end=3)
    path = tmp_path / "f.safetensors"
    _engine_file(path, ids, x, "F64")
    with pytest.raises(HiddenStatesError, match="hidden_states of dtype F64, not one of F32, F16, BF16"):
        read_engine_file(str(path), p, lay, norm)
    _engine_file(path, ids, x, "F32", ids_dtype="F32")
    with pytest.raises(HiddenStatesError, match="token_ids of dtype F32"):
        read_engine_file(str(path), p, lay, norm)
    _engine_file(path, ids, x, "F16")        # a dtype it reads
    assert read_engine_file(str(path), p, lay, norm).shape == [3, HIDDEN]


class _WritesF64(BaseHTTPRequestHandler):
    """A stand-in for vLLM's hidden-states server: each prefill's file holds float64 states (no vLLM writes
    those), as vLLM would write it: at the path the request names, then the answer naming it. ``requests``: the
    sample (its encoded id) of each prefill, read whole."""

    requests: list[str] = []
    dtype = "F64"

    def _answer(self, status: int, out: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/v1/models":      # what tells the worker it is vLLM
            self._answer(200, json.dumps({"object": "list", "data": [{"id": "m", "object": "model",
                                                                      "owned_by": "vllm"}]}).encode())
        else:
            self._answer(404, b"{}")

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/v1/completions":
            self._answer(404, b"{}")
            return
        path = body["kv_transfer_params"]["hidden_states_path"]
        type(self).requests.append(Path(path).name.split(".")[0])   # the sample's encoded id starts the name
        ids = body["prompt"]
        x = np.zeros((len(ids), 4, HIDDEN))
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        _engine_file(Path(path), ids, x, self.dtype)
        out = json.dumps({"id": "cmpl-1", "object": "text_completion", "model": "m",
                          "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                          "usage": {"prompt_tokens": len(ids), "completion_tokens": 1},
                          "kv_transfer_params": {"hidden_states_path": path}}).encode()
        self._answer(200, out)

    def log_message(self, *args) -> None:
        pass


class _WritesF32(_WritesF64):
    requests: list[str] = []
    dtype = "F32"


def _stand_in(tmp_path: Path, redis_url: str, handler: type[_WritesF64],
              rows: int) -> tuple[ThreadingHTTPServer, Path, Path]:
    """(the stand-in server, config, store): a vllm features pass of ``rows`` samples of dataset A against it."""
    handler.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    model = _model_dir(tmp_path / "model", {"rms_norm_eps": 1e-5}, {"model.norm.weight": np.ones(HIDDEN)})
    store = tmp_path / "store"
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({
        "redis_url": redis_url, "output_dir": str(tmp_path / "out"),
        "server": {"urls": ["http://127.0.0.1:9"], "model": "m", "tokenizer": make_tiny_tokenizer(tmp_path / "tok")},
        "worker": {"heartbeat_ttl_s": 2, "maintenance_interval_s": 0.5},
        "features": {"backend": "vllm", "store": str(store), "concurrency": 2, "model": {"path": str(model)},
                     "server": {"urls": [f"http://127.0.0.1:{server.server_port}"]}},
        "datasets": [{"name": "A", "path": str(tmp_path / "none.jsonl"), "budget": "1k"}]}))
    write_rows(tmp_path / "out", "A", rows)
    return server, cfg, store


def test_a_features_worker_killed_mid_request_dies_with_its_request_sent_and_nothing_stored(tmp_path, redis_url,
                                                                                           conn, monkeypatch):
    """BUDGETQ_FAULT_POINT=vllm-mid-request (tests/test_vllm_features.py kills a worker there on vLLM itself): the
    worker SIGKILLs itself once its first prefill is sent whole, before it reads the answer; a second worker then
    does every sample, that one again included (its request sent twice, every other once)."""
    server, cfg, store = _stand_in(tmp_path, redis_url, _WritesF32, 3)
    d = features_dir(store, "A")
    procs = Procs(cfg, tmp_path)
    runner = subprocess.Popen([*PY, "features", "-c", str(cfg)], cwd=ROOT, env=dict(os.environ),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        monkeypatch.setenv(fault_points.ENV, fault_points.VLLM_MID_REQUEST)
        victim = procs.start("features-worker", "--concurrency", "1")
        monkeypatch.delenv(fault_points.ENV)
        assert victim.wait(120) == -signal.SIGKILL, Procs.log(victim)[-3000:]
        assert len(_WritesF32.requests) == 1, _WritesF32.requests     # its one prefill, read whole by the server
        assert index_rows(d / "index.jsonl") == [] and not list(d.glob("*.safetensors"))
        procs.start("features-worker")
        out, err = runner.communicate(timeout=120)
        assert runner.returncode == 0 and "A: 3 samples on disk" in out, out + err
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.communicate()
        procs.stop_all()
        server.shutdown()
        server.server_close()
    samples = _WritesF32.requests
    assert len(samples) == 4 and samples.count(samples[0]) == 2 and len(set(samples)) == 3, samples
    assert len(index_rows(d / "index.jsonl")) == 3


def test_a_features_job_whose_engine_file_has_another_dtype_fails_once_saying_so(tmp_path, redis_url, conn):
    server, cfg, store = _stand_in(tmp_path, redis_url, _WritesF64, 3)
    procs = Procs(cfg, tmp_path)
    try:
        procs.start("features-worker")
        res = subprocess.run([*PY, "features", "-c", str(cfg)], cwd=ROOT, capture_output=True, text=True,
                             timeout=120, env=dict(os.environ))
    finally:
        procs.stop_all()
        server.shutdown()
        server.server_close()
    # every job failed at its first attempt, with the reason, and none went back to its queue for another
    assert res.returncode == 1, res.stdout + res.stderr
    assert "hidden_states of dtype F64" in res.stdout + res.stderr, res.stdout + res.stderr
    assert conn.zcard(f"rq:failed:{keys.features_queue_name('A')}") == 3
    assert len(_WritesF64.requests) == 3, _WritesF64.requests
    assert index_rows(features_dir(store, "A") / "index.jsonl") == []
    assert not list((features_dir(store, "A") / "incoming").glob("*")), "a failed job removes the engine's file"


def _layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, eps: float) -> np.ndarray:
    mu = x.mean(-1, keepdims=True)
    out = (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * w
    return out if b is None else out + b


def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * w


@pytest.mark.parametrize("eps_key", ["layer_norm_eps", "layer_norm_epsilon"])
def test_the_final_norm_is_the_one_config_json_names(tmp_path, eps_key):
    # an offset mean: RMSNorm and LayerNorm then differ clearly
    x = np.random.default_rng(1).normal(loc=3.0, size=(5, HIDDEN)).astype(np.float32)
    w, b = np.array([1.0, 2.0, 0.5, 1.5]), np.array([0.1, -0.2, 0.3, 0.0])
    # StableLM-like: LayerNorm with a bias
    d = _model_dir(tmp_path / "ln", {eps_key: 1e-5, "model_type": "stablelm"},
                   {"model.norm.weight": w, "model.norm.bias": b})
    norm = load_final_norm(d, HIDDEN)
    assert np.allclose(norm(x), _layer_norm(x, w, b, 1e-5), atol=1e-5)
    assert norm.kind == "LayerNorm"     # what the features worker's start line names
    assert not np.allclose(norm(x), _rms_norm(x, w, 1e-5), atol=1e-2), "the check tells the two norms apart"
    # Cohere-like: LayerNorm without a bias
    d = _model_dir(tmp_path / "ln-nobias", {eps_key: 1e-5, "model_type": "cohere"}, {"model.norm.weight": w})
    assert np.allclose(load_final_norm(d, HIDDEN)(x), _layer_norm(x, w, None, 1e-5), atol=1e-5)


def test_rmsnorm_where_config_json_says_rms_norm_eps_and_an_error_where_it_says_neither(tmp_path):
    x = np.random.default_rng(2).normal(loc=3.0, size=(5, HIDDEN)).astype(np.float32)
    w = np.array([1.0, 2.0, 0.5, 1.5])
    d = _model_dir(tmp_path / "rms", {"rms_norm_eps": 1e-6, "layer_norm_eps": 1e-5}, {"model.norm.weight": w})
    norm = load_final_norm(d, HIDDEN)
    assert np.allclose(norm(x), _rms_norm(x, w, 1e-6), atol=1e-5) and norm.kind == "RMSNorm"
    with pytest.raises(ConfigError, match="no rms_norm_eps or layer_norm_eps"):
        load_final_norm(_model_dir(tmp_path / "none", {}, {"model.norm.weight": w}), HIDDEN)
    with pytest.raises(ConfigError, match="an RMSNorm .* has no bias"):
        load_final_norm(_model_dir(tmp_path / "rms-bias", {"rms_norm_eps": 1e-6},
                                   {"model.norm.weight": w, "model.norm.bias": w}), HIDDEN)
