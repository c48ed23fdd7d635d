"""samples: N downstream of generation: the hidden-states pass, the specforge-offline export and features.store
keep every answer (``p3``, ``p3#2``, ``p3#3``) apart, each with its own row's tokens and vectors.

Real processes: `budgetq sim --enable-return-hidden-states` (generation and prefills), `budgetq worker`,
`budgetq produce`, `budgetq features-worker`, `budgetq features` and `budgetq export`. The tokenizer knows the
simulator's words (simulator/texts.py VOCAB) and the prompt ids, so every answer tokenizes to ids of its own:
nothing in these checks can pass by two answers of a prompt looking alike.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import yaml

from budgetq.hidden_states.capture.decode import from_dtype
from budgetq.hidden_states.collect.export import offline_path
from budgetq.hidden_states.store.safetensors_io import read_header, read_tensor
from budgetq.hidden_states.store.shards import INCOMING, WORKER_SHARD_NAME, features_dir, index_rows
from budgetq.shared import keys
from budgetq.shared.identity import answer_id
from budgetq.simulator.hidden import vectors
from budgetq.simulator.texts import VOCAB
from tests.helpers import PY, ROOT, Procs, rows, write_dataset
from tests.test_features import HIDDEN, run_features
from tests.tiny_tokenizer import make_tiny_tokenizer

DS = "S"
PROMPTS = 5
SAMPLES = 3


class Answer:
    """What one answer's hidden states must be, from its own committed row alone (not from the pass)."""

    def __init__(self, row: dict, tokenizer) -> None:
        self.id: str = str(row["id"])
        self.row = row
        msgs = [{"role": m["role"], "content": m["content"]} for m in row["conversations"]]
        self.input_ids: list[int] = list(tokenizer.apply_chat_template(msgs, tokenize=True,
                                                                       return_dict=True)["input_ids"])
        self.start = len(tokenizer.apply_chat_template(msgs[:-1], add_generation_prompt=True, tokenize=True,
                                                       return_dict=True)["input_ids"])
        # The answer's own words, one token each (the tokenizer knows every simulator word): its output tokens.
        self.output_ids: list[int] = tokenizer.convert_tokens_to_ids(msgs[-1]["content"].split())

    @property
    def loss_mask(self) -> list[int]:
        return [0] * self.start + [1] * (len(self.input_ids) - self.start)


def _setup(tmp_path: Path, redis_url: str, sim: str, store: Path | None = None) -> tuple[Path, list[str]]:
    """Config of one dataset with samples: 3 over 5 prompts; returns it and the 15 answer ids."""
    ids = write_dataset(tmp_path / f"{DS}.jsonl", PROMPTS)
    tok = make_tiny_tokenizer(tmp_path / "tok", words=[*VOCAB, *ids])
    features: dict = {"dtype": "float16", "shard_mb": 0.004, "concurrency": 4, "decode_processes": 1}
    if store is not None:
        features["store"] = str(store)
    cfg = {"redis_url": redis_url, "output_dir": str(tmp_path / "out"),
           "server": {"urls": [sim], "api": "generate", "tokenizer": tok},
           "worker": {"heartbeat_ttl_s": 2, "maintenance_interval_s": 0.5, "concurrency": 8},
           "producer": {"progress": "off", "report": False}, "features": features,
           "datasets": [{"name": DS, "path": str(tmp_path / f"{DS}.jsonl"), "budget": "1M", "id_field": "id",
                         "samples": SAMPLES, "sampling": {"max_tokens": 40, "temperature": 1.0, "seed": 5},
                         "prior_mean_tokens": 20}]}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, [str(answer_id(p, k)) for p in ids for k in range(1, SAMPLES + 1)]


def _sim(sim_factory) -> str:
    return sim_factory("--speedup", "200", "--length-mean", "15", "--seed", "9", "--enable-return-hidden-states",
                       "--hidden-size", str(HIDDEN))


def _generate_and_capture(cfg: Path, tmp_path: Path) -> None:
    """`worker` + `features-worker` up; `produce` to its end, then `features` to its end."""
    procs = Procs(cfg, tmp_path)
    try:
        procs.worker()
        procs.start("features-worker")
        producer = procs.producer()
        assert producer.wait(120) == 0, Procs.log(producer)
        res = run_features(cfg, timeout=120)
        assert res.returncode == 0, res.stdout + res.stderr
    finally:
        procs.stop_all()


def _answers(tmp_path: Path, want: list[str]) -> dict[str, Answer]:
    """Every answer's expectation, from out/S.jsonl; the rows are one per answer, each of its own prompt."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    out = rows(tmp_path / "out" / f"{DS}.jsonl")
    assert sorted(str(r["id"]) for r in out) == sorted(want)
    answers = {str(r["id"]): Answer(r, tokenizer) for r in out}
    for a in answers.values():
        prompt, _, k = a.id.partition("#")
        assert a.row["sample"] == (int(k) if k else 1) and a.row["conversations"][0]["content"] == f"question {prompt}"
        assert tokenizer.unk_token_id not in a.input_ids, f"{a.id}: every token is one of its own"
        assert a.input_ids[a.start:a.start + len(a.output_ids)] == a.output_ids
    # The answers of a prompt differ (own seed, own request) and share the prompt's tokens; prompts differ.
    for p in {a.partition("#")[0] for a in want}:
        mine = [answers[str(answer_id(p, k))] for k in range(1, SAMPLES + 1)]
        assert len({tuple(a.output_ids) for a in mine}) == SAMPLES, f"{p}: its {SAMPLES} answers are not distinct"
        assert len({tuple(a.input_ids[:a.start]) for a in mine}) == 1
    assert len({tuple(a.input_ids[:a.start]) for a in answers.values()}) == PROMPTS
    return answers


def _check_store(root: Path, answers: dict[str, Answer]) -> list[dict]:
    """Each answer indexed once, in one shard, with its own row's token ids, loss mask and (bit for bit) the
    simulator's vectors of exactly those tokens; returns the index rows."""
    d = features_dir(root, DS)
    index = index_rows(d / "index.jsonl")
    assert sorted(r["id"] for r in index) == sorted(answers), "one index row per answer id, p3#2 and p3#3 too"
    headers = {p.name: read_header(p)[0] for p in d.glob("*.safetensors")}
    in_shards = sorted(s["id"] for h in headers.values() for s in json.loads(h["__metadata__"]["samples"]))
    assert in_shards == sorted(answers), "each answer in exactly one shard"
    assert {r["shard"] for r in index} == set(headers), "every shard indexed, none twice"
    for h in headers.values():
        samples = json.loads(h["__metadata__"]["samples"])
        assert len({s["key"] for s in samples}) == len(samples), "tensor keys unique within a shard"
    for r in index:
        a = answers[r["id"]]
        assert r["input_ids"] == a.input_ids, f"{a.id}: index tokens are not this answer's row"
        assert r["loss_mask"] == a.loss_mask, f"{a.id}: loss mask is not this answer's span"
        path = d / r["shard"]
        ids_t = np.frombuffer(read_tensor(path, f"{r['key']}.input_ids").data, "<i4")
        assert ids_t.tolist() == a.input_ids, f"{a.id}: shard tokens are not this answer's row"
        t = read_tensor(path, f"{r['key']}.hidden_state")
        assert t.shape == [len(a.input_ids), HIDDEN]
        want = vectors(np.array(a.input_ids), np.arange(len(a.input_ids)), HIDDEN)
        assert np.array_equal(from_dtype(t.data, r["dtype"], t.shape), want), f"{a.id}: not its own prefill"
    return index


def test_features_pass_gives_every_answer_its_own_hidden_states(tmp_path, redis_url, conn, sim_factory):
    cfg, want = _setup(tmp_path, redis_url, _sim(sim_factory))
    _generate_and_capture(cfg, tmp_path)
    answers = _answers(tmp_path, want)
    index = _check_store(tmp_path / "out", answers)
    assert len({r["shard"] for r in index}) > 1, "several answers per shard: their keys must not collide"
    assert {m.decode() for m in conn.smembers(keys.features_done_key(DS))} == set(want)
    assert conn.zcard(f"rq:finished:{keys.features_queue_name(DS)}") == len(want), "one features job an answer"
    res = run_features(cfg, "--check")
    assert res.returncode == 0 and f"{DS}: consistent" in res.stdout, res.stdout + res.stderr


def test_specforge_offline_export_has_one_file_per_answer_with_its_data(tmp_path, redis_url, conn, sim_factory):
    torch = pytest.importorskip("torch", reason="export --format specforge-offline writes torch.save files")
    cfg, want = _setup(tmp_path, redis_url, _sim(sim_factory))
    _generate_and_capture(cfg, tmp_path)
    answers = _answers(tmp_path, want)
    index = _check_store(tmp_path / "out", answers)
    exp = tmp_path / "exp"
    res = subprocess.run([*PY, "export", "-c", str(cfg), "--dataset", DS, "--format", "specforge-offline", "--out",
                          str(exp)], cwd=ROOT, capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert res.returncode == 0, res.stdout + res.stderr
    target = exp / f"{DS}.specforge-offline"
    files = sorted(str(p.relative_to(target)) for p in target.rglob("*") if p.is_file())
    assert files == sorted(offline_path(i) for i in range(len(want))), "one file per answer, nothing else"
    # data_<i>.ckpt is index row i's answer: its tokens, loss mask and vectors, and no other answer's
    seen: dict[tuple[int, ...], str] = {}
    for idx, r in enumerate(index):
        a = answers[r["id"]]
        point = torch.load(target / offline_path(idx), weights_only=True)
        assert set(point) == {"input_ids", "loss_mask", "hidden_state"}
        assert point["input_ids"].tolist() == a.input_ids, f"data_{idx}.ckpt is not answer {a.id}'s tokens"
        assert point["loss_mask"].tolist() == a.loss_mask, f"data_{idx}.ckpt: not answer {a.id}'s loss mask"
        want_hs = vectors(np.array(a.input_ids), np.arange(len(a.input_ids)), HIDDEN).astype(np.float16)
        assert list(point["hidden_state"].shape) == [1, len(a.input_ids), HIDDEN]
        assert np.array_equal(point["hidden_state"][0].numpy(), want_hs), f"data_{idx}.ckpt: not {a.id}'s vectors"
        seen[tuple(a.input_ids)] = a.id
    assert sorted(seen.values()) == sorted(want), "every answer exported once, p3#2 and p3#3 each their own"
    # The row export keeps each answer apart too: its own string id and its own conversation.
    res = subprocess.run([*PY, "export", "-c", str(cfg), "--dataset", DS, "--format", "specforge", "--out",
                          str(exp)], cwd=ROOT, capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert res.returncode == 0, res.stdout + res.stderr
    exported = {r["id"]: r for r in rows(exp / f"{DS}.specforge.jsonl")}
    assert sorted(exported) == sorted(want)
    for a in answers.values():
        assert exported[a.id]["conversations"] == a.row["conversations"], f"{a.id}: another answer's conversation"


def test_features_store_keeps_answer_ids_apart_in_worker_shards(tmp_path, redis_url, conn, sim_factory):
    store = tmp_path / "store"
    cfg, want = _setup(tmp_path, redis_url, _sim(sim_factory), store=store)
    _generate_and_capture(cfg, tmp_path)
    answers = _answers(tmp_path, want)
    index = _check_store(store, answers)
    d = features_dir(store, DS)
    shards = sorted(p.name for p in d.glob("*.safetensors"))
    assert len(shards) == len(want) and all(WORKER_SHARD_NAME.fullmatch(s) for s in shards), \
        f"one worker shard (w-<16 hex>.safetensors) per answer: {shards}"
    assert len({r["key"] for r in index}) == len(want), "each answer its own tensor key"
    assert not list((d / INCOMING).glob("*")), "nothing left in incoming/"
    assert not features_dir(tmp_path / "out", DS).exists(), "with features.store nothing goes under output_dir"
    assert {m.decode() for m in conn.smembers(keys.features_done_key(DS))} == set(want)
    res = run_features(cfg, "--check")
    assert res.returncode == 0 and f"{DS}: consistent" in res.stdout, res.stdout + res.stderr
