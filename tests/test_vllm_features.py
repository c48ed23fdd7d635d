"""features.backend vllm on a real vLLM server (its CPU build, SmolLM2-135M: 30 layers, hidden 576).

The server is started with exactly the flags ``budgetq features --server-flags`` prints, except its KV
connector: tests/vllm_cpu_connector.py, the stock one made to copy synchronously (the stock one needs CUDA).
What the worker stores is compared with transformers' own float32 forward pass (``output_hidden_states``), per
token, per block (the target and each aux layer), by cosine: vLLM serves bf16, so bits cannot match, and the
thresholds are the ones transformers' own bf16 pass meets; negative controls (a neighbouring layer, the last
layer without the final norm) show the comparison can fail. Then the whole path: ``budgetq features`` and two
``features-worker`` processes, one SIGKILLed mid-request (a fault point), each sample in exactly one shard,
``--check``, the ``specforge-offline`` export read by SpecForge's own loader.

Token counts stay small (SmolLM2's template, its default system prompt included: ~40-60 tokens a sample).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import yaml

torch = pytest.importorskip("torch")

from budgetq.hidden_states.capture.decode import from_dtype  # noqa: E402
from budgetq.hidden_states.capture.vllm_backend import VllmBackend, read_engine_file, wait_written  # noqa: E402
from budgetq.hidden_states.capture.vllm_layout import layout_for  # noqa: E402
from budgetq.hidden_states.schema import FeaturesPayload  # noqa: E402
from budgetq.hidden_states.store import fault_points  # noqa: E402
from budgetq.hidden_states.store.shards import features_dir, index_rows  # noqa: E402
from budgetq.shared.config import Config  # noqa: E402
from budgetq.shared.identity import encode_id  # noqa: E402
from tests.helpers import PY, ROOT, Procs, wait_for  # noqa: E402
from tests.metrics_proxy import MetricsProxy  # noqa: E402
from tests.specforge_helper import SpecForgeUnavailable, load_specforge_offline  # noqa: E402
from tests.test_features import run_features, write_rows  # noqa: E402
from tests.test_features_store import exactly_once  # noqa: E402
from tests.vllm_server import MODEL_NAME, hidden_states_server, run_dir, smollm2_hf_dir  # noqa: E402

# Its own work only (func_only): not the shared server's start (tests/vllm_server.py START_TIMEOUT_S bounds that).
pytestmark = pytest.mark.timeout(1500, func_only=True)
HIDDEN, LAYERS = 576, 30
AUX = [1, 14, 26]                    # SpecForge's default for 30 layers: outputs of decoder layers 1, 14, 26
# Per block: mean per-token cosine, lowest per-token cosine (vLLM's bf16 forward pass vs transformers' fp32).
# The lowest is one token's, so it depends on the text: with the simulator's answers as made-up words (issue 37:
# its old "tok tok tok" was itself a loop the guard cuts) one token of p0 at aux layer 14 measured 0.9789.
MEAN_MIN, TOKEN_MIN = 0.999, 0.975
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "Paris is the capital of France."}],
    [{"role": "user", "content": "Write a haiku about rain."},
     {"role": "assistant", "content": "Soft rain on the roof, a quiet song for the night, the garden drinks deep."}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
]


@pytest.fixture(scope="module")
def hs_server(request):
    """(url, model dir): vLLM with `budgetq features --server-flags`' flags and the CPU connector, one
    for the whole run (tests/vllm_server.py ``shared_server``). ``$BUDGETQ_TEST_VLLM_HS_URL``: such a
    server already running (iterating on these tests: a start takes 40 s unloaded, minutes on a busy
    machine)."""
    model = smollm2_hf_dir()
    if os.environ.get("BUDGETQ_TEST_VLLM_HS_URL"):
        return os.environ["BUDGETQ_TEST_VLLM_HS_URL"], model
    return hidden_states_server(run_dir(request.config)).url, model


@pytest.fixture(scope="module")
def reference(hs_server):
    """transformers' own forward passes of the served checkpoint: float32 (the reference) and bfloat16."""
    from transformers import AutoModel, AutoTokenizer

    _, model = hs_server
    fp32 = AutoModel.from_pretrained(model, dtype=torch.float32).eval()
    bf16 = AutoModel.from_pretrained(model, dtype=torch.bfloat16).eval()

    def hidden_states(m, ids: list[int]) -> list[np.ndarray]:
        with torch.inference_mode():
            out = m(input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False).hidden_states
        return [h[0].float().numpy() for h in out]   # [embeddings, layer 0 out, ..., final norm out]

    return AutoTokenizer.from_pretrained(model), lambda ids: hidden_states(fp32, ids), \
        lambda ids: hidden_states(bf16, ids)


def cosines(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    got, want = got.astype(np.float64), want.astype(np.float64)
    return (got * want).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(want, axis=-1)


def blocks(data: bytes | memoryview, aux: bytes | memoryview | None, n: int) -> dict[str, np.ndarray]:
    """A stored sample as float32 blocks: target and each aux layer."""
    out = {"target": from_dtype(bytes(data), "bfloat16", [n, HIDDEN])}
    a = from_dtype(bytes(aux or b""), "bfloat16", [n, 3 * HIDDEN])
    out.update({f"aux{layer}": a[:, i * HIDDEN:(i + 1) * HIDDEN] for i, layer in enumerate(AUX)})
    return out


def want_blocks(hs: list[np.ndarray]) -> dict[str, np.ndarray]:
    """The same blocks in transformers' numbering: hidden_states[-1] (after the final norm), hidden_states[a + 1]."""
    return {"target": hs[-1], **{f"aux{a}": hs[a + 1] for a in AUX}}


def vllm_config(url: str, model: Path, store: Path, **extra) -> Config:
    return Config.model_validate({"server": {"model": MODEL_NAME, "tokenizer": str(model)},
                                  "features": {"backend": "vllm", "store": str(store), "model": {"path": str(model)},
                                               "server": {"urls": [url]}, **extra}})


def test_hidden_states_equal_transformers_at_the_same_layers(hs_server, reference, tmp_path):
    url, model = hs_server
    tok, fp32, bf16 = reference
    samples = [[int(i) for i in tok.apply_chat_template(c, tokenize=True)["input_ids"]] for c in CONVERSATIONS]
    cfg = vllm_config(url, model, tmp_path / "store")

    async def capture_all() -> list:
        backend = VllmBackend(cfg)
        await backend.start()
        try:
            out = []
            for i, ids in enumerate([*samples, samples[0]]):   # the first again: a prefix-cache hit
                p = FeaturesPayload(id=f"s{i}", dataset="A", input_ids=ids, loss_start=0, loss_end=len(ids))
                got = await backend.capture(p, f"A-features--s{i}", lambda _n: None)
                assert all(Path(f).exists() for f in got.raw_files[:1]), "the engine's file is kept until stored"
                got.remove_raw_files()
                out.append(got)
            return out
        finally:
            await backend.close()

    got = asyncio.run(capture_all())
    assert not list((features_dir(tmp_path / "store", "A") / "incoming").glob("*"))
    assert bytes(got[3].data) == bytes(got[0].data) and bytes(got[3].aux) == bytes(got[0].aux), \
        "a prefix-cache hit returns the same states (the cached blocks hold them)"
    per_block: dict[str, list[np.ndarray]] = {}
    for ids, g in zip(samples, got, strict=False):
        n = len(ids)
        assert g.shape == [n, HIDDEN] and g.aux_shape == [n, 3 * HIDDEN]
        ref, ref_bf16 = fp32(ids), bf16(ids)
        assert len(ref) == LAYERS + 1
        mine, want, calib = blocks(g.data, g.aux, n), want_blocks(ref), want_blocks(ref_bf16)
        for name in want:
            per_block.setdefault(name, []).append(cosines(mine[name], want[name]))
            per_block.setdefault(f"{name}: transformers bf16", []).append(cosines(calib[name], want[name]))
            # negative control: the next layer's states in place of this one's
            if name.startswith("aux"):
                a = int(name[3:])
                per_block.setdefault(f"{name}: vs layer {a + 1}", []).append(cosines(mine[name], ref[a + 2]))
    stats = {k: (float(np.concatenate(v).mean()), float(np.concatenate(v).min())) for k, v in per_block.items()}
    print(json.dumps({k: [round(m, 5), round(lo, 5)] for k, (m, lo) in stats.items()}, indent=1))
    for name in ("target", *(f"aux{a}" for a in AUX)):
        mean, low = stats[name]
        assert mean >= MEAN_MIN and low >= TOKEN_MIN, (name, mean, low)
        # the thresholds admit what bf16 itself changes: transformers' own bf16 pass meets them
        mean, low = stats[f"{name}: transformers bf16"]
        assert mean >= MEAN_MIN and low >= TOKEN_MIN, (name, "bf16", mean, low)
        if name != "target":   # ...and not a neighbouring layer
            assert stats[f"{name}: vs layer {int(name[3:]) + 1}"][0] <= 0.98, (name, stats)

    # negative control: vLLM's last layer as it is, without the final norm, is not the target
    ids = samples[1]
    path = str(tmp_path / "raw.safetensors")
    body = {"model": MODEL_NAME, "prompt": ids, "max_tokens": 1, "temperature": 0.0,
            "kv_transfer_params": {"hidden_states_path": path}}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        assert json.loads(resp.read())["kv_transfer_params"]["hidden_states_path"] == path
    asyncio.run(wait_written(path, 120))
    p = FeaturesPayload(id="raw", dataset="A", input_ids=ids, loss_start=0, loss_end=len(ids))
    raw = read_engine_file(path, p, layout_for(model, None), lambda x: x)
    pre_norm = cosines(from_dtype(bytes(raw.data), "bfloat16", [len(ids), HIDDEN]), fp32(ids)[-1])
    print("pre-norm last layer vs the target:", round(float(pre_norm.mean()), 5), round(float(pre_norm.min()), 5))
    assert pre_norm.mean() <= 0.9


def test_features_pass_on_vllm_worker_killed_mid_request_then_specforge_reads_the_export(
        hs_server, reference, tmp_path, redis_url, conn, monkeypatch):
    """A features worker SIGKILLed mid-request (fault point vllm-mid-request: its prefill sent whole, the answer not
    read), seen from tests/metrics_proxy.py between it and vLLM: vLLM served the request, the answer never reached
    the worker, nothing was stored; after a restart that sample is prefilled once more and every other once."""
    url, model = hs_server
    _, fp32, _ = reference
    proxy = MetricsProxy(url)
    store = tmp_path / "store"
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({
        "redis_url": redis_url, "output_dir": str(tmp_path / "out"),
        "server": {"urls": ["http://127.0.0.1:9"], "model": MODEL_NAME, "tokenizer": str(model)},
        "worker": {"heartbeat_ttl_s": 2},
        "features": {"backend": "vllm", "store": str(store), "concurrency": 2, "model": {"path": str(model)},
                     "server": {"urls": [proxy.url]}},
        "datasets": [{"name": "A", "path": str(tmp_path / "none.jsonl"), "budget": "1k"}]}))
    ids = write_rows(tmp_path / "out", "A", 6)
    sample_of = {encode_id(i): i for i in ids}      # the engine file a prefill names starts with its sample's id

    def prefilled() -> list[str]:
        return [sample_of[Path(r.hidden_states_path or "").name.split(".")[0]] for r in proxy.requests
                if r.path == "/v1/completions"]

    d = features_dir(store, "A")
    procs = Procs(cfg, tmp_path)
    runner = subprocess.Popen([*PY, "features", "-c", str(cfg)], cwd=ROOT, env=dict(os.environ),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        monkeypatch.setenv(fault_points.ENV, fault_points.VLLM_MID_REQUEST)
        victim = procs.start("features-worker", "--concurrency", "1")    # one request: the one it dies in
        monkeypatch.delenv(fault_points.ENV)
        assert victim.wait(600) == -signal.SIGKILL, Procs.log(victim)[-3000:]
        # It died in its first prefill: sent whole (vLLM served it), its answer not read, nothing stored.
        wait_for(lambda: proxy.requests and proxy.requests[0].status is not None, 120, "vLLM's answer to it")
        (killed,) = proxy.requests
        assert killed.path == "/v1/completions" and killed.status == 200 and not killed.answered, killed
        assert index_rows(d / "index.jsonl") == [] and not list(d.glob("*.safetensors"))
        procs.start("features-worker")
        out, err = runner.communicate(timeout=900)
        assert runner.returncode == 0, out + err
        assert "A: 6 samples on disk" in out, out
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.communicate()
        procs.stop_all()
        proxy.stop()
    # the work redone exactly once: the killed sample prefilled twice (the second answered), every other once
    (first, *after) = prefilled()
    assert sorted(after) == sorted(ids), (first, after)
    assert all(r.answered for r in proxy.requests[1:]), proxy.requests
    exactly_once(store, ids)
    res = run_features(cfg, "--check")
    assert res.returncode == 0 and "consistent" in res.stdout, res.stdout + res.stderr
    res = subprocess.run([*PY, "export", "-c", str(cfg), "--format", "specforge-offline"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "aux_hidden_state" not in res.stdout + res.stderr, res.stdout + res.stderr
    target = tmp_path / "out" / "A.specforge-offline"
    rows = dict(enumerate(index_rows(d / "index.jsonl")))      # data_<i>.ckpt is index row i

    def check(row: dict, input_ids, target_state, aux_state) -> None:
        assert input_ids.tolist() == row["input_ids"]
        ref = want_blocks(fp32(row["input_ids"]))
        n = len(row["input_ids"])
        mine = {"target": target_state.float().numpy(),
                **{f"aux{a}": aux_state.float().numpy()[:, i * HIDDEN:(i + 1) * HIDDEN] for i, a in enumerate(AUX)}}
        for name, want in ref.items():
            c = cosines(mine[name][:n], want)
            assert c.mean() >= MEAN_MIN and c.min() >= TOKEN_MIN, (row["id"], name, c.mean(), c.min())

    try:
        sf = load_specforge_offline()
    except SpecForgeUnavailable as exc:
        pytest.skip(f"captured and exported; SpecForge's own loader not run: {exc}")
    older = sf.OfflineEagle3Dataset(sf.list_local_files(str(target)))
    assert len(older) == 6
    seen = []
    for i, path in enumerate(older.datapaths):
        item = older[i]
        row = rows[int(Path(path).stem.split("_")[1])]
        assert item["loss_mask"][0].tolist() == row["loss_mask"][:-1] + [0] and 1 in row["loss_mask"]
        check(row, item["input_ids"][0], item["target"][0], item["hidden_state"][0])
        seen.append(row["id"])
    assert sorted(seen) == sorted(ids)
    refs = sf.OfflineManifestReader(str(target), run_id="budgetq", validate_files=True).read()
    assert len(refs) == 6 and all(r.num_tokens > 0 for r in refs)


def _produce_with_capture(tmp_path, redis_url, conn, gen_url: str, hs_url: str, model: Path, n: int,
                          features: dict, sampling: dict) -> tuple[Path, Path]:
    """`budgetq produce` of ``n`` prompts with capture: features (generation on ``gen_url``, features jobs on vLLM
    at ``hs_url``): every row once, each sample in one shard. Returns (config, the dataset's features dir)."""
    from tests.helpers import check_invariants, write_dataset

    ids = write_dataset(tmp_path / "A.jsonl", n)
    store = tmp_path / "store"
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({
        "redis_url": redis_url, "output_dir": str(tmp_path / "out"),
        "server": {"urls": [gen_url], "model": MODEL_NAME, "tokenizer": str(model)},
        "worker": {"heartbeat_ttl_s": 5, "maintenance_interval_s": 0.5, "concurrency": 4},
        "producer": {"progress": "off"},
        "features": {"backend": "vllm", "store": str(store), "concurrency": 2, "model": {"path": str(model)},
                     "server": {"urls": [hs_url]}, **features},
        "datasets": [{"name": "A", "path": str(tmp_path / "A.jsonl"), "budget": "1M", "capture": "features",
                      "id_field": "id", "sampling": sampling, "prior_mean_tokens": 12}]}))
    procs = Procs(cfg, tmp_path)
    try:
        procs.worker()
        res = subprocess.run([*PY, "produce", "-c", str(cfg)], cwd=ROOT, env=dict(os.environ), capture_output=True,
                             text=True, timeout=900)
        assert res.returncode == 0, res.stdout + res.stderr
        assert f"hidden states A: {n} samples on disk ({n} captured this run, 0 failed" in res.stdout, res.stdout
    finally:
        procs.stop_all()
    check_invariants(conn, tmp_path / "out", "A", ids)
    exactly_once(store, ids)
    return cfg, features_dir(store, "A")


def _close_to_transformers(d: Path, row: dict, fp32) -> None:
    """The stored sample of index row ``row``, per block, within the cosine bounds of transformers' fp32 pass."""
    from budgetq.hidden_states.store.safetensors_io import read_tensor

    t = read_tensor(d / row["shard"], f"{row['key']}.hidden_state")
    a = read_tensor(d / row["shard"], f"{row['key']}.aux_hidden_state")
    mine, want = blocks(t.data, a.data, len(row["input_ids"])), want_blocks(fp32(row["input_ids"]))
    for name in want:
        c = cosines(mine[name], want[name])
        assert c.mean() >= MEAN_MIN and c.min() >= TOKEN_MIN, (row["id"], name, c.mean(), c.min())


def test_produce_with_capture_features_on_vllm(hs_server, reference, tmp_path, redis_url, conn, sim_factory):
    """capture: features in `budgetq produce`, the features jobs on vLLM (features.server.urls), generation on the
    simulator (a server started for hidden states writes a file for every request it serves: generation goes
    elsewhere). Every row generated once, captured once, in exactly one shard, close to transformers' pass."""
    url, model = hs_server
    _, fp32, _ = reference
    sim = sim_factory("--speedup", "50", "--length-mean", "12")
    cfg, d = _produce_with_capture(tmp_path, redis_url, conn, sim, url, model, 6, {}, {"max_tokens": 16})
    for row in index_rows(d / "index.jsonl"):
        _close_to_transformers(d, row, fp32)
    res = run_features(cfg, "--check")
    assert res.returncode == 0 and "consistent" in res.stdout, res.stdout + res.stderr


def test_single_pass_one_request_gives_the_row_and_its_hidden_states(hs_server, reference, tmp_path, redis_url,
                                                                     conn):
    """features.vllm.single_pass: generation (greedy) on the hidden-states server itself, each request naming a
    file for its hidden states with include_output_tokens. The features jobs store those files, no second prefill:
    each stored sample is prompt + answer but the last sampled token (prompt_tokens + completion_tokens - 1
    tokens, a prefix of the chat template's rendering of the row), close to transformers' own pass over exactly
    those tokens; every row once, every sample in one shard, nothing left in the engine's folder."""
    from budgetq.hidden_states.store.safetensors_io import read_header
    from budgetq.shared.schema import ResultRow

    url, model = hs_server
    tok, fp32, _ = reference
    cfg, d = _produce_with_capture(tmp_path, redis_url, conn, url, url, model, 5, {"vllm": {"single_pass": True}},
                                   {"max_tokens": 12, "temperature": 0.0})
    rows = {r.id: r for r in (ResultRow.model_validate_json(line)
                              for line in (tmp_path / "out" / "A.jsonl").read_text().splitlines())}
    assert all(r.hidden_states_file for r in rows.values()), rows
    for row in index_rows(d / "index.jsonl"):
        r, n = rows[row["id"]], len(row["input_ids"])
        header, _ = read_header(d / row["shard"])
        samples = json.loads(header["__metadata__"]["samples"])
        assert [s.get("source") for s in samples] == ["generation"], (row["id"], samples)
        assert n == r.prompt_tokens + r.completion_tokens - 1, (row["id"], n, r.prompt_tokens, r.completion_tokens)
        msgs = [m.model_dump(exclude_none=True) for m in r.conversations]
        full = [int(i) for i in tok.apply_chat_template(msgs, tokenize=True)["input_ids"]]
        assert row["input_ids"] == full[:n] and 1 in row["loss_mask"], row["id"]
        _close_to_transformers(d, row, fp32)
    assert not [f for f in (d / "engine").glob("*") if f.is_file()], list((d / "engine").iterdir())
    res = run_features(cfg, "--check")
    assert res.returncode == 0 and "consistent" in res.stdout, res.stdout + res.stderr
