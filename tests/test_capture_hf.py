"""The transformers capture backend: a tiny random Llama (built here, never downloaded) in the features worker.

The captured bytes are checked against the model's own ``output_hidden_states``, bit for bit in bfloat16,
row for row with the tokens; then the whole path runs for real (Redis, RQ, `budgetq features-worker`
subprocesses, shards, SpecForge's offline files), including a worker SIGKILLed mid-run.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest
import yaml

torch = pytest.importorskip("torch")

from budgetq.hidden_states.capture.decode import HiddenStatesError  # noqa: E402
from budgetq.hidden_states.capture.transformers_backend import HookedModel, TransformersBackend, load_model, take_batch  # noqa: E402
from budgetq.hidden_states.schema import FeaturesPayload  # noqa: E402
from budgetq.hidden_states.store.safetensors_io import read_header, read_tensor  # noqa: E402
from budgetq.hidden_states.store.shards import features_dir, index_rows  # noqa: E402
from budgetq.shared import keys  # noqa: E402
from budgetq.shared.config import Config  # noqa: E402
from budgetq.shared.config_features import FeaturesModelConfig  # noqa: E402
from budgetq.shared.config_load import load_config  # noqa: E402
from budgetq.shared.errors import ConfigError  # noqa: E402
from tests.helpers import PY, ROOT, Procs, stock_rq_worker, wait_for  # noqa: E402
from tests.test_features import run_features, run_features_with_a_worker, write_rows  # noqa: E402
from tests.tiny_llama import make_tiny_llama  # noqa: E402
from tests.tiny_tokenizer import make_tiny_tokenizer  # noqa: E402

HIDDEN, LAYERS = 64, 8   # default aux layers of 8: [1, 3, 4]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[str, str]:
    """(tokenizer path, model path): a random Llama whose vocabulary is the tiny tokenizer's."""
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("tiny")
    tok = make_tiny_tokenizer(d / "tok")
    return tok, make_tiny_llama(d / "llama", len(AutoTokenizer.from_pretrained(tok)), HIDDEN, LAYERS)


def _bf16(data: bytes | memoryview, shape: list[int]) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.bfloat16).reshape(shape)


def same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit for bit: same dtype, shape and 16-bit patterns (torch.equal compares values: +0 == -0, and a NaN
    never equals itself)."""
    assert got.dtype == want.dtype and got.element_size() == 2, (got.dtype, want.dtype)
    return got.shape == want.shape and torch.equal(got.contiguous().view(torch.int16),
                                                   want.contiguous().view(torch.int16))


def _own(model, ids: list[int]) -> tuple:
    """The model's own hidden_states tuple (embeddings first) for one sample, alone."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False).hidden_states


def test_layers_are_sglangs_and_specforges_eagle3_capture():
    """SpecForge's aux layers (outputs of 1, L/2-1, L-4) are the inputs of SGLang's layers_to_capture."""
    from budgetq.hidden_states.capture.transformers_backend import aux_layers_for, default_aux_layers
    from tests.test_features import _wheel_source

    src = _wheel_source("srt/models/llama.py")
    assert "self.model.layers_to_capture = [2, num_layers // 2, num_layers - 3]" in src
    assert "self.model.layers_to_capture = [val + 1 for val in layer_ids]" in src
    for n in (8, 16, 32, 61, 80):
        assert [i + 1 for i in default_aux_layers(n)] == [2, n // 2, n - 3]
    assert aux_layers_for(32, [0, 7, 30]) == [0, 7, 30]
    with pytest.raises(ConfigError, match=r"features.model.aux_layers \[1, 40\].*32 layers"):
        aux_layers_for(32, [1, 40])


def test_captured_bytes_are_the_models_own_hidden_states_bit_for_bit(tiny):
    zero, minus_zero = torch.zeros(1, dtype=torch.bfloat16), -torch.zeros(1, dtype=torch.bfloat16)
    assert torch.equal(zero, minus_zero) and not same_bits(zero, minus_zero), "the comparison below is of bits"
    _, path = tiny
    hooked = load_model(FeaturesModelConfig(path=path, attn_implementation="eager"), "bfloat16")
    # Hooks on exactly the aux layers and the final norm, nothing else.
    hooked_layers = [i for i, layer in enumerate(hooked.layers) if layer._forward_hooks]
    assert hooked_layers == [1, 3, 4] and len(hooked.norm._forward_hooks) == 1
    rng = np.random.default_rng(3)
    samples = [rng.integers(0, hooked.vocab, n).tolist() for n in (9, 31, 2, 17, 1)]
    got = hooked.run(samples)  # one padded batch
    for ids, c in zip(samples, got, strict=True):
        assert not isinstance(c, HiddenStatesError)
        own = _own(hooked.model, ids)
        assert c.shape == [len(ids), HIDDEN] and c.aux_shape == [len(ids), 3 * HIDDEN]
        assert same_bits(_bf16(c.data, c.shape), own[-1][0]), "target = the final norm's output"
        want_aux = torch.cat([own[i + 1][0] for i in (1, 3, 4)], dim=-1)
        assert same_bits(_bf16(c.aux, c.aux_shape), want_aux), "aux = outputs of decoder layers 1, 3, 4"
    # sdpa (transformers' default): a padded batch's kernels differ from a lone sample's in the last bits, so the
    # reference is the model's own output_hidden_states on the same padded batch; a batch of one is its own pass.
    sdpa = load_model(FeaturesModelConfig(path=path, attn_implementation="sdpa", aux_layers=[0, 6]), "bfloat16")
    assert [i for i, layer in enumerate(sdpa.layers) if layer._forward_hooks] == [0, 6]
    got = sdpa.run(samples)
    longest = max(map(len, samples))
    ids = torch.tensor([s + [0] * (longest - len(s)) for s in samples])
    mask = torch.tensor([[1] * len(s) + [0] * (longest - len(s)) for s in samples])
    with torch.inference_mode():
        own = sdpa.model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False).hidden_states
    for row, (s, c) in enumerate(zip(samples, got, strict=True)):
        assert same_bits(_bf16(c.data, c.shape), own[-1][row, :len(s)])
        assert same_bits(_bf16(c.aux, c.aux_shape), torch.cat([own[1][row, :len(s)], own[7][row, :len(s)]], -1))
    alone = sdpa.run([samples[1]])[0]
    assert same_bits(_bf16(alone.data, alone.shape), _own(sdpa.model, samples[1])[-1][0])


def test_float16_output_and_last_layer_only(tiny):
    _, path = tiny
    hooked = load_model(FeaturesModelConfig(path=path, dtype="bfloat16", aux_layers=[]), "float16")
    c = hooked.run([[3, 4, 5]])[0]
    assert c.aux is None and c.aux_shape is None and len(c.data) == 3 * HIDDEN * 2
    own = _own(hooked.model, [3, 4, 5])[-1][0].to(torch.float16)
    assert same_bits(torch.frombuffer(bytearray(c.data), dtype=torch.float16).reshape(3, HIDDEN), own)


def test_batches_pack_by_token_count_and_bad_input_fails_one_job(tiny, tmp_path):
    assert take_batch([[1] * 10, [1] * 10, [1] * 30], 60) == 2      # 3 x 30 would pad to 90
    assert take_batch([[1] * 100, [1] * 2], 50) == 1                 # too long alone: runs alone
    assert take_batch([[1] * 5] * 7, 20) == 4
    tok, path = tiny
    cfg = Config.model_validate({"features": {"backend": "transformers", "model": {
        "path": path, "max_batch_tokens": 64, "batch_wait_s": 0.05}}})

    async def main() -> tuple:
        b = TransformersBackend(cfg)
        await b.start()
        try:
            ps = [FeaturesPayload(id=f"p{i}", dataset="A", input_ids=list(range(1, 2 + i * 3)), loss_start=0,
                                  loss_end=1) for i in range(6)]
            got = await asyncio.gather(*[b.capture(p, p.id, lambda _n: None) for p in ps])
            with pytest.raises(HiddenStatesError, match="token id 9999 is outside the model's vocabulary"):
                await b.capture(FeaturesPayload(id="x", dataset="A", input_ids=[1, 9999], loss_start=0, loss_end=1),
                                "x", lambda _n: None)
            return got, b.passes, b.batched
        finally:
            await b.close()

    got, passes, batched = asyncio.run(main())
    assert [c.shape[0] for c in got] == [1 + i * 3 for i in range(6)]
    assert batched == 6 and 1 < passes < 6, "six samples in a few token-bounded passes"
    with pytest.raises(ValueError, match="features.backend transformers needs features.model.path"):
        Config.model_validate({"features": {"backend": "transformers"}})
    with pytest.raises(ConfigError, match="features.model.path .*cannot load the model"):
        load_model(FeaturesModelConfig(path=str(tmp_path / "nothing")), "bfloat16")


def hf_config(tmp_path: Path, redis_url: str, tiny: tuple[str, str], **features) -> Path:
    tok, model = tiny
    cfg = {"redis_url": redis_url, "output_dir": str(tmp_path / "out"),
           "server": {"urls": ["http://127.0.0.1:9"], "tokenizer": tok},
           "worker": {"heartbeat_ttl_s": 2},
           "features": {"backend": "transformers", "dtype": "bfloat16", "shard_mb": 0.05, "concurrency": 8,
                        "model": {"path": model, "attn_implementation": "eager", "max_batch_tokens": 256},
                        **features},
           "datasets": [{"name": "A", "path": str(tmp_path / "none.jsonl"), "budget": "1k"}]}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def check_hf_samples(out: Path, model_path: str, ids: list[str]) -> None:
    """Every id indexed once; hidden_state and aux_hidden_state equal the model's own pass over input_ids."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_path, dtype=torch.bfloat16, attn_implementation="eager").eval()
    d = features_dir(out, "A")
    rows = index_rows(d / "index.jsonl")
    assert sorted(r["id"] for r in rows) == sorted(ids) and len(rows) == len(set(r["id"] for r in rows))
    in_shards = [s["id"] for shard in sorted(d.glob("*.safetensors"))
                 for s in json.loads(read_header(shard)[0]["__metadata__"]["samples"])]
    assert sorted(in_shards) == sorted(ids), "each sample in exactly one shard"
    for r in rows:
        own = _own(model, r["input_ids"])
        t = read_tensor(d / r["shard"], f"{r['key']}.hidden_state")
        a = read_tensor(d / r["shard"], f"{r['key']}.aux_hidden_state")
        assert t.dtype == "BF16" and t.shape == [len(r["input_ids"]), HIDDEN] and a.shape == [t.shape[0], 3 * HIDDEN]
        assert same_bits(_bf16(t.data, t.shape), own[-1][0]), r["id"]
        assert same_bits(_bf16(a.data, a.shape), torch.cat([own[i + 1][0] for i in (1, 3, 4)], -1)), r["id"]


def capture_and_export(tmp_path: Path, redis_url: str, tiny: tuple[str, str], n: int) -> tuple[Path, Path, list[str]]:
    """n rows captured by `budgetq features` + a transformers `budgetq features-worker`, then exported as
    SpecForge's offline files: (config, out dir, the row ids)."""
    cfg = hf_config(tmp_path, redis_url, tiny)
    out = tmp_path / "out"
    ids = write_rows(out, "A", n)
    res = run_features_with_a_worker(cfg, tmp_path, timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    # SpecForge's offline layout, aux included, from one pass of one worker (no second server)
    res = subprocess.run([*PY, "export", "-c", str(cfg), "--format", "specforge-offline"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "aux_hidden_state" not in res.stdout + res.stderr, res.stdout + res.stderr
    return cfg, out, ids


def test_transformers_backend_end_to_end_with_specforge_export(tmp_path, redis_url, conn, tiny):
    cfg, out, ids = capture_and_export(tmp_path, redis_url, tiny, 14)
    check_hf_samples(out, tiny[1], ids)
    assert len({r["shard"] for r in index_rows(features_dir(out, "A") / "index.jsonl")}) > 1
    res = run_features(cfg, "--check")
    assert res.returncode == 0 and "consistent" in res.stdout, res.stdout + res.stderr
    files = sorted((out / "A.specforge-offline").rglob("*.ckpt"))
    assert len(files) == 14
    point = torch.load(files[0])
    assert set(point) == {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}
    n = point["input_ids"].shape[0]
    assert point["hidden_state"].shape == (1, n, HIDDEN) and point["aux_hidden_state"].shape == (1, n, 3 * HIDDEN)
    assert point["aux_hidden_state"].dtype == torch.bfloat16 and point["input_ids"].dtype == torch.int64


def test_the_export_loads_through_specforges_own_offline_training_path(tmp_path, redis_url, conn, tiny,
                                                                        specforge_offline):
    """The files read as SpecForge's offline trainer reads them (specforge/launch.py's offline runtime:
    OfflineManifestReader lists and, validating, opens every file; LocalFeatureStore reads it;
    FeatureDataLoader applies EAGLE-3's normalize_offline_sample and collates with DataCollatorWithPadding),
    and by its older OfflineEagle3Dataset: every sample once, its tensors bit for bit the model's own pass,
    the loss mask on the answer (SpecForge zeroes the last position)."""
    from functools import partial
    from urllib.parse import urlparse

    from transformers import AutoModel

    sf = specforge_offline
    _, out, ids = capture_and_export(tmp_path, redis_url, tiny, 5)
    target = out / "A.specforge-offline"
    rows = dict(enumerate(index_rows(features_dir(out, "A") / "index.jsonl")))   # data_<i>.ckpt: index row i
    model = AutoModel.from_pretrained(tiny[1], dtype=torch.bfloat16, attn_implementation="eager").eval()

    def check(row: dict, input_ids, loss_mask, target_state, aux_state) -> None:
        own = _own(model, row["input_ids"])
        assert input_ids.tolist() == row["input_ids"] and input_ids.dtype == torch.int64
        assert loss_mask.tolist() == row["loss_mask"][:-1] + [0] and 1 in row["loss_mask"]
        assert same_bits(target_state, own[-1][0]), row["id"]
        assert same_bits(aux_state, torch.cat([own[i + 1][0] for i in (1, 3, 4)], -1)), row["id"]

    refs = sf.OfflineManifestReader(str(target), run_id="budgetq", validate_files=True).read()
    assert len(refs) == 5 and all(r.num_tokens > 0 for r in refs)
    row_of = {r.sample_id: rows[int(Path(urlparse(r.feature_store_uri).path).stem.split("_")[1])] for r in refs}
    loader = sf.FeatureDataLoader(sf.LocalFeatureStore("budgetq"), refs=refs, batch_size=2, drop_last=False,
                                  collate_fn=sf.DataCollatorWithPadding(),
                                  per_sample_transform=partial(sf.normalize_offline_sample, max_len=2048))
    seen = []
    for batch in loader:
        t = batch.tensors
        for j, sid in enumerate(batch.sample_ids):
            row = row_of[sid]
            n = len(row["input_ids"])
            assert t["attention_mask"][j].tolist() == [1] * n + [0] * (t["attention_mask"].shape[1] - n)
            check(row, t["input_ids"][j, :n], t["loss_mask"][j, :n], t["target"][j, :n], t["hidden_state"][j, :n])
            seen.append(row["id"])
    assert sorted(seen) == sorted(ids)
    older = sf.OfflineEagle3Dataset(sf.list_local_files(str(target)))
    assert len(older) == 5
    for i, path in enumerate(older.datapaths):
        item = older[i]
        check(rows[int(Path(path).stem.split("_")[1])], item["input_ids"][0], item["loss_mask"][0],
              item["target"][0], item["hidden_state"][0])


def test_worker_sigkilled_mid_run_then_restarted_loses_and_duplicates_nothing(tmp_path, redis_url, conn, tiny):
    """A transformers features worker SIGKILLed with jobs claimed: their leases lapse, the pass requeues them,
    a fresh worker captures them; every row ends on disk once and matches the model's own pass. (A pass killed
    between a shard's rename and its index rows is the collector's business, whatever the backend:
    tests/test_features.py.)"""
    cfg = hf_config(tmp_path, redis_url, tiny, concurrency=2)
    raw = yaml.safe_load(cfg.read_text())
    raw["features"]["model"]["max_batch_tokens"] = 16   # one sample a pass: slow enough to be killed mid-run
    cfg.write_text(yaml.safe_dump(raw))
    out = tmp_path / "out"
    ids = write_rows(out, "A", 24)
    procs = Procs(cfg, tmp_path)
    index = features_dir(out, "A") / "index.jsonl"
    runner = subprocess.Popen([*PY, "features", "-c", str(cfg)], cwd=ROOT, env=dict(os.environ),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        victim = procs.start("features-worker")
        wait_for(lambda: conn.xlen(keys.features_results_key("A")) + len(index_rows(index)) >= 3, 90,
                 "the first captures")
        wait_for(lambda: conn.zcard(keys.rq_wip_key(keys.features_name("A"))) > 0, 30, "a claimed job")
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        procs.start("features-worker")
        stdout, err = runner.communicate(timeout=240)
        assert runner.returncode == 0, stdout + err
        assert re.search(r"A: 24 samples on disk", stdout), stdout
    finally:
        if runner.poll() is None:
            runner.kill()
        procs.stop_all()
    check_hf_samples(out, tiny[1], ids)
    assert int(conn.get(keys.features_pending_key("A")) or 0) == 0
    assert run_features(cfg, "--check").returncode == 0


def test_hooked_model_needs_layers_and_a_norm():
    class Odd(torch.nn.Module):
        config = None

    with pytest.raises(ConfigError, match="Odd: no .layers and .norm"):
        HookedModel(Odd(), None, "bfloat16")


def test_a_plain_rq_worker_runs_a_transformers_features_job(tmp_path, redis_url, conn, tiny):
    """The fallback job function goes through the configured backend too (the model loaded for the job)."""

    from budgetq.hidden_states.collect.features_pass import FeaturesPass

    cfg_path = hf_config(tmp_path, redis_url, tiny)
    ids = write_rows(tmp_path / "out", "A", 2)
    fp = FeaturesPass(load_config(cfg_path), conn)
    fp._enqueue(fp.passes[0])
    fp.release()
    stock_rq_worker(redis_url, keys.features_queue_name("A"), cfg_path, tmp_path / "rq-worker.log")
    assert conn.xlen(keys.features_results_key("A")) == 2
    res = run_features(cfg_path, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    check_hf_samples(tmp_path / "out", tiny[1], ids)


def test_bench_transformers_smoke_prints_the_ratio():
    """bench/features.py --backend transformers --smoke runs end to end; never a timing target (shared machine)."""
    import sys

    sys.path.insert(0, str(ROOT / "bench"))
    from _common import number, parse_md_tables

    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "features.py"), "--backend", "transformers",
                           "--smoke"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    tables = parse_md_tables(proc.stdout)
    assert len(tables) == 4, proc.stdout
    ratios, where, cpu, http = tables
    assert [r["rep"] for r in ratios] == ["1", "all", "median"]
    assert all(number(r["ratio pipeline / bare"]) > 0 and number(r["forward passes"]) >= 1 for r in ratios)
    # the passes ran inside the pipeline's clock, one after another
    assert all(number(r["pipeline"]) >= number(r["forward passes in the worker"]) > 0 for r in where)
    assert all(number(r["collector (budgetq features)"]) > 0 for r in cpu)
    assert [number(r["tok/s"]) > 0 for r in http] == [True, True]
