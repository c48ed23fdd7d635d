"""features.dtype fp8: float8_e4m3fn with a float32 scale per token and layer (hidden_states/store/fp8.py).

Its tables against torch's own float8_e4m3fn casts; a shard written in fp8 and read back; and the round trip
through `budgetq export --format specforge-offline` into SpecForge's own offline loader, which reads bf16 of
the right shape, each token within cosine 0.99 of the original."""

from __future__ import annotations

import subprocess
from functools import partial

import numpy as np
import pytest
import yaml

from budgetq.hidden_states.collect.export import export_specforge_offline
from budgetq.hidden_states.schema import FeaturesMeta
from budgetq.hidden_states.store import fp8
from budgetq.hidden_states.store.safetensors_io import read_header, read_tensor
from budgetq.hidden_states.store.shards import FeatureStore, features_dir, index_rows, write_sample_shard

torch = pytest.importorskip("torch")

H = 64


def hidden_like(tokens: int, width: int, seed: int = 0) -> np.ndarray:
    """Values shaped like a transformer's residual stream: mostly small, a few channels far larger."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, width)).astype(np.float32)
    x[:, rng.choice(width, 3, replace=False)] *= 60.0
    return x


def test_the_decode_table_is_torchs_float8_e4m3fn():
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    finite = ~np.isnan(codes)
    assert np.array_equal(np.isnan(fp8.DECODE), ~finite)
    assert np.array_equal(fp8.DECODE[finite], codes[finite])


def test_encoding_is_torchs_cast_of_x_times_448_over_amax():
    """Every code is torch's float8_e4m3fn cast of x * (448 / amax) in float32 (ties to even, -0 kept); the
    scale is amax / 448. Across chunks and at real widths, with ties placed on purpose: test_fp8_chunks.py."""
    x = hidden_like(256, H)
    bf16 = fp8.f32_to_bf16(x).tobytes()
    codes, scales = fp8.quantize(bf16, 256, 1, H)
    ours = np.frombuffer(codes, np.uint8).reshape(256, H)
    xs = torch.from_numpy(fp8.bf16_to_f32(bf16, (256, H)).copy())
    amax = xs.abs().amax(dim=1, keepdim=True)
    # (a tensor divided: torch computes ``448.0 / amax``, a Python number over a tensor, as amax.reciprocal() * 448,
    # two roundings; the float32 quotient is 448 / amax rounded once, what fp8.py computes)
    theirs = (xs * (torch.full_like(amax, 448.0) / amax)).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.array_equal(ours, theirs)
    assert np.array_equal(np.frombuffer(scales, "<f4"), (amax / 448.0).reshape(-1).numpy())
    # no row saturates: its largest value maps to +-448 exactly
    assert np.all(np.abs(fp8.DECODE[ours]).max(axis=1) == 448.0)


def test_bf16_rounding_is_torchs():
    x = hidden_like(64, H, seed=3) * np.float32(1.2345)
    ours = fp8.f32_to_bf16(x)
    theirs = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(ours, theirs)


def test_zero_rows_and_a_round_trip_within_cosine_099():
    x = hidden_like(32, 3 * H)
    x[5] = 0.0
    codes, scales = fp8.quantize(fp8.f32_to_bf16(x).tobytes(), 32, 3, H)
    back = fp8.dequantize(codes, scales, 32, 3, H)
    assert np.all(back[5] == 0) and np.all(np.isfinite(back))
    for layer in range(3):
        a, b = x[:, layer * H:(layer + 1) * H], back[:, layer * H:(layer + 1) * H]
        cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1) + 1e-30)
        assert np.all(cos[np.arange(32) != 5] > 0.99)


def _samples(n: int) -> list[tuple[FeaturesMeta, np.ndarray, np.ndarray]]:
    out = []
    for i in range(n):
        t = 10 + 3 * i
        meta = FeaturesMeta(id=f"p{i}", dataset="A", input_ids=list(range(5, 5 + t)), loss_start=4, loss_end=t,
                            dtype="fp8", shape=[t, H], aux_shape=[t, 3 * H])
        out.append((meta, hidden_like(t, H, seed=i), hidden_like(t, 3 * H, seed=100 + i)))
    return out


def test_an_fp8_shard_holds_codes_and_scales_and_reads_back(tmp_path):
    d = features_dir(tmp_path, "A")
    d.mkdir(parents=True)
    meta, target, aux = _samples(1)[0]
    name, size = write_sample_shard(d, meta, fp8.f32_to_bf16(target).tobytes(), fp8.f32_to_bf16(aux).tobytes())
    header, _ = read_header(d / name)
    t = meta.shape[0]
    key = "p0"
    assert header[f"{key}.hidden_state"]["dtype"] == "F8_E4M3" and header[f"{key}.hidden_state"]["shape"] == [t, H]
    assert header[f"{key}.hidden_state_scale"] == {**header[f"{key}.hidden_state_scale"], "dtype": "F32",
                                                   "shape": [t, 1]}
    assert header[f"{key}.aux_hidden_state_scale"]["shape"] == [t, 3]
    tensors = sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items()
                  if k.endswith(("hidden_state", "hidden_state_scale")))
    assert tensors == t * 4 * H + t * 4 * 4, "a byte a value and a float32 scale per token and layer"
    assert tensors / (2 * t * 4 * H) < 0.54 and size < 2 * t * 4 * H, "about half of bf16 (a few % at H 64)"
    safetensors = pytest.importorskip("safetensors.torch")
    loaded = safetensors.load_file(str(d / name))       # the safetensors package reads it as float8_e4m3fn
    assert loaded[f"{key}.hidden_state"].dtype == torch.float8_e4m3fn
    codes = read_tensor(d / name, f"{key}.hidden_state")
    scales = read_tensor(d / name, f"{key}.hidden_state_scale")
    back = fp8.dequantize(codes.data, scales.data, t, 1, H)
    via_torch = (loaded[f"{key}.hidden_state"].float() * loaded[f"{key}.hidden_state_scale"]).numpy()
    assert np.array_equal(back, via_torch)


def test_fp8_round_trip_through_the_export_into_specforges_loader(tmp_path, specforge_offline):
    """fp8 shards (as features workers write them, adopted by the collector) -> export specforge-offline ->
    SpecForge's OfflineManifestReader, LocalFeatureStore, FeatureDataLoader: bf16 [L, H] and [L, 3H], each
    token within cosine 0.99 of the float32 original."""
    from urllib.parse import urlparse

    sf = specforge_offline
    d = features_dir(tmp_path, "A")
    d.mkdir(parents=True)
    store = FeatureStore(tmp_path, "A", shard_bytes=10**9)
    samples = _samples(4)
    for meta, target, aux in samples:
        name, size = write_sample_shard(d, meta, fp8.f32_to_bf16(target).tobytes(), fp8.f32_to_bf16(aux).tobytes())
        assert store.adopt(meta.model_copy(update={"shard": name, "shard_bytes": size})) == "new"
    assert sorted(store.flush()) == ["p0", "p1", "p2", "p3"]
    res = export_specforge_offline(tmp_path, "A", tmp_path / "exp")
    assert res.written == 4 and res.without_aux == 0
    refs = sf.OfflineManifestReader(str(tmp_path / "exp"), run_id="budgetq", validate_files=True).read()
    assert len(refs) == 4
    loader = sf.FeatureDataLoader(sf.LocalFeatureStore("budgetq"), refs=refs, batch_size=1, drop_last=False,
                                  collate_fn=sf.DataCollatorWithPadding(),
                                  per_sample_transform=partial(sf.normalize_offline_sample, max_len=2048))
    by_file = {r.sample_id: int(urlparse(r.feature_store_uri).path.rsplit("_", 1)[1].split(".")[0]) for r in refs}
    seen = 0
    for batch in loader:
        t = batch.tensors
        meta, target, aux = samples[by_file[batch.sample_ids[0]]]
        n = meta.shape[0]
        assert t["target"].dtype == torch.bfloat16 and tuple(t["target"].shape) == (1, n, H)
        assert t["hidden_state"].dtype == torch.bfloat16 and tuple(t["hidden_state"].shape) == (1, n, 3 * H)
        for got, want in ((t["target"][0], target), (t["hidden_state"][0], aux)):
            cos = torch.nn.functional.cosine_similarity(got.float(), torch.from_numpy(want), dim=-1)
            assert float(cos.min()) >= 0.99, float(cos.min())
        assert t["input_ids"][0].tolist() == meta.input_ids
        seen += 1
    assert seen == 4


def test_the_synthetic_backend_is_refused_without_its_own_section(tmp_path):
    from budgetq.shared.config_load import load_config
    from budgetq.shared.errors import ConfigError

    (tmp_path / "c.yaml").write_text(yaml.safe_dump({
        "server": {"urls": ["http://127.0.0.1:9"]}, "features": {"backend": "synthetic"},
        "datasets": [{"name": "A", "path": str(tmp_path / "a.jsonl"), "budget": "1k"}]}))
    with pytest.raises(ConfigError, match="features.backend synthetic makes up its tensors .* features.synthetic"):
        load_config(tmp_path / "c.yaml")


def test_fp8_through_a_whole_pass_with_the_store(tmp_path, redis_url):
    """`budgetq features` + a features worker (synthetic backend: known tensors, no model) with features.store and
    features.dtype fp8: every row in exactly one fp8 shard, `--check` consistent, and the export's bf16 files
    within cosine 0.99 of the bf16 the backend handed over, token for token."""
    from budgetq.hidden_states.capture.decode import to_dtype
    from tests.helpers import PY, ROOT
    from tests.test_features import features_config, run_features, run_features_with_a_worker, write_rows
    from tests.test_features_store import exactly_once

    cfg = features_config(tmp_path, redis_url, "http://127.0.0.1:9", backend="synthetic", dtype="fp8",
                          synthetic={"hidden_size": H, "aux_layers": 3, "max_tokens": 256})
    raw = yaml.safe_load(cfg.read_text())
    raw["features"]["store"] = str(tmp_path / "store")
    cfg.write_text(yaml.safe_dump(raw))
    ids = write_rows(tmp_path / "out", "A", 8)
    res = run_features_with_a_worker(cfg, tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    exactly_once(tmp_path / "store", ids)
    rows = index_rows(features_dir(tmp_path / "store", "A") / "index.jsonl")
    assert {r["dtype"] for r in rows} == {"fp8"}
    res = run_features(cfg, "--check")
    assert res.returncode == 0 and "consistent" in res.stdout, res.stdout + res.stderr
    done = subprocess.run([*PY, "export", "-c", str(cfg), "--format", "specforge-offline", "--out",
                           str(tmp_path / "exp")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    # what the synthetic backend hands over: the first tokens x H values of its buffer, then the aux block
    values = np.random.default_rng(0).standard_normal((256, 4 * H), dtype=np.float32)
    flat = fp8.bf16_to_f32(to_dtype(values, "bfloat16"), (256 * 4 * H,))
    for i, r in enumerate(rows):
        n = r["shape"][0]
        point = torch.load(tmp_path / "exp" / "A.specforge-offline" / f"rows_0-5000/data_{i}.ckpt")
        for name, want in (("hidden_state", flat[: n * H].reshape(n, H)),
                           ("aux_hidden_state", flat[n * H: 4 * n * H].reshape(n, 3 * H))):
            got = point[name]
            assert got.dtype == torch.bfloat16 and tuple(got.shape) == (1, *want.shape)
            cos = torch.nn.functional.cosine_similarity(got[0].float(), torch.from_numpy(want.copy()), dim=-1)
            assert float(cos.min()) >= 0.99, (r["id"], name, float(cos.min()))
