"""budgetq's rows through SpecForge's own preprocessing (the specforge 0.2.0 wheel from PyPI).

The tests that need SpecForge's code download the pinned wheel (tests/specforge_helper.py)
and skip, saying why, when it cannot be had. Its validator lives in scripts/, which no
published artifact ships: ``validate_row`` restates its contract (the helper names the file
and function). Everything else here runs budgetq for real: a producer, burst workers and the
simulator in generate mode with a tokenizer whose template adds its own system prompt.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from budgetq.cli.main import main
from budgetq.producer.ops.export import export_specforge
from budgetq.producer.reading.conversations import (
    normalise,
    specforge_problem,
    template_default_system,
    with_template_system,
)
from budgetq.shared.identity import job_id
from budgetq.shared.schema import Message
from budgetq.worker.sglang_wire import job_id_of_rid
from tests.helpers import PY, ROOT, rows, sim_get, write_config
from tests.specforge_helper import SpecForgeUnavailable, load_specforge, numpy_tensors, validate_row
from tests.tiny_tokenizer import CHAT_TEMPLATE, make_tiny_tokenizer

DEFAULT_SYSTEM = "you are a helpful assistant ."
# Qwen2.5-like: its own default system prompt when the conversation has none; Qwen3-like:
# an assistant message's reasoning_content rendered as <think> ... </think> before its content.
TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\n" + DEFAULT_SYSTEM + "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and m['reasoning_content'] is defined and m['reasoning_content'] %}"
    "<think>\n{{ m['reasoning_content'] }}\n</think>\n\n{% endif %}"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = ["tok", "hmm", "q1", "q2", "a1", "old", "first", "second", "more", "late", "rule", "only"]


@pytest.fixture(scope="module")
def sf():
    try:
        return load_specforge()
    except SpecForgeUnavailable as exc:
        pytest.skip(f"SpecForge's own code not run: {exc}")


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory) -> str:
    path = make_tiny_tokenizer(tmp_path_factory.mktemp("tok"), words=WORDS)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return path


def _tok(path: str):
    return numpy_tensors(AutoTokenizer.from_pretrained(path))


def _ids(tok, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def _masked(sf, tok, conversation: list[dict], template: str = "qwen", last_only: bool = True) -> tuple[list, list]:
    """SpecForge's preprocess_conversations on one conversation: (input_ids, the masked ids)."""
    out = sf.preprocessing.preprocess_conversations(tok, [conversation], sf.template.TEMPLATE_REGISTRY.get(template),
                                                    max_length=4096, train_only_last_turn=last_only)
    ids, mask = list(out["input_ids"][0][0]), list(out["loss_mask"][0][0])
    return ids, [i for i, m in zip(ids, mask, strict=True) if m]


DATA = [
    {"id": "regular", "m": [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
                            {"role": "user", "content": "q2"}, {"role": "assistant", "content": "old"}]},
    {"id": "two-assistants", "m": [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "first"},
                                   {"role": "assistant", "content": "second"}, {"role": "user", "content": "q2"}]},
    {"id": "assistant-first", "m": [{"role": "assistant", "content": "old"}, {"role": "user", "content": "q1"}]},
    {"id": "two-users", "m": [{"role": "user", "content": "q1"}, {"role": "user", "content": "more"}]},
    {"id": "empty-turn", "m": [{"role": "user", "content": "q1"}, {"role": "assistant", "content": " "},
                               {"role": "user", "content": "q2"}]},
    {"id": "late-system", "m": [{"role": "user", "content": "q1"}, {"role": "system", "content": "rule"},
                                {"role": "user", "content": "q2"}]},
    {"id": "single", "m": [{"role": "user", "content": "only"}]},
]


def _run(cfg: Path) -> None:
    prod = subprocess.Popen([*PY, "produce", "-c", str(cfg)], cwd=ROOT)
    try:
        subprocess.run([*PY, "worker", "--burst", "-c", str(cfg)], cwd=ROOT, check=True, timeout=60)
        while prod.poll() is None:   # a burst worker for whatever was enqueued after the last one left
            subprocess.run([*PY, "worker", "--burst", "-c", str(cfg)], cwd=ROOT, check=True, timeout=60)
    finally:
        assert prod.wait(60) == 0


def test_rows_pass_specforge_validator_and_preprocessing_with_the_answer_masked_exactly(
        tmp_path, redis_url, conn, sim_factory, tok_path, sf, monkeypatch):
    sim = sim_factory("--speedup", "200", "--length-mean", "30", "--reasoning-tokens-frac", "0.5", "--seed", "3")
    src = tmp_path / "D.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in DATA))
    cfg = write_config(tmp_path, redis_url, [sim], [{
        "name": "D", "path": str(src), "budget": "1M", "id_field": "id", "messages_field": "m",
        "thinking": "separate", "sampling": {"max_tokens": 4000}}], server={"api": "generate", "tokenizer": tok_path})
    _run(cfg)
    out = tmp_path / "out"
    bad = [json.loads(line) for line in (out / "D.invalid.jsonl").read_text().splitlines()]
    invalid = {r["line"]: r["reason"] for r in bad}
    assert set(invalid) == {5, 6}, invalid   # recorded invalid with the reason, never sent
    assert "empty assistant turn" in invalid[5] and "system turn after a user turn" in invalid[6]

    assert main(["export", "-c", str(cfg), "--format", "specforge"]) == 0
    exported = rows(out / "D.specforge.jsonl")
    assert sorted(r["id"] for r in exported) == ["assistant-first", "regular", "single", "two-assistants",
                                                  "two-users"]
    tok = _tok(tok_path)
    by_job = {job_id_of_rid(r["rid"]): r for r in sim_get(sim, "/sim/requests")}
    for row in exported:
        # SpecForge's validator. --expect-reasoning wants reasoning on *every* assistant message:
        # with regenerate: last, only single-turn rows have that (older turns are the dataset's)
        single = sum(m["role"] == "assistant" for m in row["conversations"]) == 1
        assert validate_row(row, expect_reasoning=single) >= 1
        assert "reasoning_content" not in row
        reply = row["conversations"][-1]
        assert reply["reasoning_content"].strip()
        # the template's own system prompt is written in, so SpecForge does not put its own there
        assert row["conversations"][0] == {"role": "system", "content": DEFAULT_SYSTEM}
        sent = by_job[job_id("D", row["id"])]
        # SpecForge's general parser ("qwen" template), the last turn only (regenerate: last)
        ids, masked = _masked(sf, tok, row["conversations"])
        assert masked == _ids(tok, reply["content"] + "<|im_end|>"), row["id"]
        assert ids[len(ids) - len(masked):] == masked   # the answer is the end of the sequence
        # ... and what precedes the answer is exactly the prompt the server was sent
        prompt = ids[:len(ids) - len(masked)]
        assert len(prompt) == sent["prompt_tokens"] and prompt[:8] == sent["input_ids_head"], row["id"]
        # SpecForge's thinking parser ("qwen3-thinking"): the reasoning is trained on too
        _, masked = _masked(sf, tok, row["conversations"], template="qwen3-thinking")
        assert masked == _ids(tok, f"<think>\n{reply['reasoning_content']}\n</think>\n\n{reply['content']}<|im_end|>")

    # build_eagle3_dataset over the file as SpecForge's online path loads it
    import datasets

    ds = datasets.load_dataset("json", data_files=str(out / "D.specforge.jsonl"), split="train",
                               cache_dir=str(tmp_path / "hf"))
    # set_format("torch") only changes how columns are handed out; there is no torch here
    real_set_format = datasets.Dataset.set_format

    def set_format(self, type=None, *args, **kwargs):  # noqa: A002 - datasets' own parameter name
        if type != "torch":
            real_set_format(self, type, *args, **kwargs)

    monkeypatch.setattr(datasets.Dataset, "set_format", set_format)
    built = sf.preprocessing.build_eagle3_dataset(ds, tok, chat_template="qwen", max_length=4096, num_proc=None,
                                                  train_only_last_turn=True)
    want = sorted(len(_ids(tok, r["conversations"][-1]["content"] + "<|im_end|>")) for r in exported)
    assert sorted(sum(m[0]) for m in built["loss_mask"]) == want


def test_irregular_shapes_mis_mask_in_specforge_unless_normalised(sf, tok_path):
    tok = _tok(tok_path)
    answer = {"role": "assistant", "content": "tok tok"}
    want = _ids(tok, "tok tok<|im_end|>")
    raw = [Message(**t) for t in DATA[1]["m"]]            # user, assistant, assistant, user
    # as the dataset has it, SpecForge's GeneralParser cuts at the second assistant turn:
    # the answer is dropped and the mask covers the dataset's own old text
    _, masked = _masked(sf, tok, [m.model_dump() for m in raw] + [answer])
    assert masked != want and masked
    fixed = normalise(raw, "m")
    assert [(m.role, m.content) for m in fixed] == [("user", "q1"), ("assistant", "first\n\nsecond"), ("user", "q2")]
    _, masked = _masked(sf, tok, [m.model_dump() for m in fixed] + [answer])
    assert masked == want
    # a leading assistant turn: dropped by normalise, so the row SpecForge sees starts with the user
    fixed = normalise([Message(**t) for t in DATA[2]["m"]], "m")
    assert [m.role for m in fixed] == ["user"]
    # every assistant turn trains by default (train_only_last_turn false): the old answer too
    _, all_turns = _masked(sf, tok, DATA[0]["m"][:3] + [answer], last_only=False)
    assert all_turns == _ids(tok, "a1<|im_end|>") + want


def test_without_the_written_system_prompt_specforge_trains_on_another_context(sf, tok_path):
    tok = _tok(tok_path)
    msgs = [Message(role="user", content="q1")]
    assert template_default_system(tok, {}) == DEFAULT_SYSTEM
    written = with_template_system(msgs, tok, {})
    sent = tok.apply_chat_template([m.model_dump() for m in msgs], add_generation_prompt=True, tokenize=False)
    # writing it in changes nothing that is sent
    assert tok.apply_chat_template([m.model_dump() for m in written], add_generation_prompt=True,
                                   tokenize=False) == sent
    answer = {"role": "assistant", "content": "tok"}
    ids, masked = _masked(sf, tok, [m.model_dump() for m in written] + [answer])
    assert ids[:len(ids) - len(masked)] == _ids(tok, sent)
    ids, masked = _masked(sf, tok, [m.model_dump() for m in msgs] + [answer])   # SpecForge's own default instead
    assert ids[:len(ids) - len(masked)] != _ids(tok, sent)


def test_a_template_without_a_default_system_prompt_gets_none_written(tmp_path):
    tok = AutoTokenizer.from_pretrained(make_tiny_tokenizer(tmp_path / "t"))
    assert tok.chat_template == CHAT_TEMPLATE and template_default_system(tok, {}) is None
    msgs = [Message(role="user", content="hi")]
    assert with_template_system(msgs, tok, {}) == msgs


def _result(i: int, finish: str = "stop", **reply) -> dict:
    return {"id": f"p{i}", "dataset": "D", "status": "success", "prompt_tokens": 3, "completion_tokens": 5,
            "finish_reason": finish, "model": "m", "endpoint": "e", "latency_s": 0.1,
            "conversations": [{"role": "user", "content": f"q{i}"},
                              {"role": "assistant", "content": f"answer {i}", **reply}]}


def test_specforge_export_keeps_complete_valid_rows_only_and_never_a_torn_line(tmp_path):
    import datasets

    src = tmp_path / "D.jsonl"
    old_layout = {k: v for k, v in _result(4).items() if k != "status"} | {"reasoning_content": "thought"}
    empty = _result(5)
    empty["conversations"][-1]["content"] = ""
    lines = [json.dumps(_result(0, reasoning_content="r")), json.dumps(_result(1, "length")), json.dumps(_result(2)),
             json.dumps(old_layout), json.dumps(empty), '{"id": "p9", "conver']   # a torn last line
    src.write_text("\n".join(lines))
    with pytest.raises(Exception):   # noqa: B017 - SpecForge's online path cannot load the raw file
        datasets.load_dataset("json", data_files=str(src), split="train", cache_dir=str(tmp_path / "a"))
    res = export_specforge(src, tmp_path / "x" / "D.specforge.jsonl")
    assert (res.rows, res.truncated, res.rejected, res.malformed) == (3, 1, 1, 1)
    got = rows(res.target)
    assert [r["id"] for r in got] == ["p0", "p2", "p4"]
    assert got[0]["conversations"][-1]["reasoning_content"] == "r"
    assert got[2]["conversations"][-1]["reasoning_content"] == "thought" and "reasoning_content" not in got[2]
    for r in got:
        validate_row(r)
    assert res.target.read_text().endswith("\n") and not (tmp_path / "x" / "D.specforge.jsonl.tmp").exists()
    assert len(datasets.load_dataset("json", data_files=str(res.target), split="train",
                                     cache_dir=str(tmp_path / "b"))) == 3
    assert any("p5" not in m and ":5:" in m and "SpecForge would reject" in m for m in res.reports)


@pytest.mark.parametrize("row", [
    _result(0), _result(1, reasoning_content="r"),
    {**_result(2), "status": "error"}, {**_result(3), "id": ""},
    {**_result(4), "conversations": [{"role": "user", "content": "q"}]},
    {**_result(5), "conversations": [{"role": "assistant", "content": "a"}]},
    {**_result(6), "conversations": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                                     {"role": "assistant", "content": "a"}]},
    {**_result(7), "conversations": [{"role": "user", "content": "q"}, {"role": "system", "content": "s"},
                                     {"role": "assistant", "content": "a"}]},
    {**_result(8), "conversations": [{"role": "user", "content": "q"}, {"role": "user", "content": "q"},
                                     {"role": "assistant", "content": "a"}]},
    {**_result(9), "conversations": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a",
                                                                         "reasoning_content": 3}]},
    {**_result(10), "conversations": [{"role": "system", "content": "s"}]},
])
def test_the_export_check_agrees_with_specforges_validator(row):
    try:
        validate_row(row)
        ok = True
    except ValueError:
        ok = False
    assert (specforge_problem(row) is None) == ok, specforge_problem(row)


def test_kept_truncated_rows_are_announced_and_left_out_of_the_specforge_export(tmp_path, redis_url, conn,
                                                                                sim_factory, capsys):
    sim = sim_factory("--speedup", "200", "--length-mean", "200", "--seed", "4")
    src = tmp_path / "D.jsonl"
    src.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"question {i}"}) + "\n" for i in range(4)))
    cfg = write_config(tmp_path, redis_url, [sim], [{"name": "D", "path": str(src), "budget": "1M", "id_field": "id",
                                                     "keep": "all", "sampling": {"max_tokens": 3}}])
    prod = subprocess.Popen([*PY, "produce", "-c", str(cfg)], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        subprocess.run([*PY, "worker", "--burst", "-c", str(cfg)], cwd=ROOT, check=True, timeout=60)
        while prod.poll() is None:
            subprocess.run([*PY, "worker", "--burst", "-c", str(cfg)], cwd=ROOT, check=True, timeout=60)
    finally:
        _, err = prod.communicate(timeout=60)
    cut = [r for r in rows(tmp_path / "out" / "D.jsonl") if r["finish_reason"] == "length"]
    assert cut, "the lengths drawn should exceed max_tokens 3"
    assert f"dataset D: {len(cut)} row(s) written this run were cut by max_tokens" in err
    assert main(["export", "-c", str(cfg), "--format", "specforge"]) == 0
    assert f"{len(cut)} truncated row(s) left out" in capsys.readouterr().out
    assert len(rows(tmp_path / "out" / "D.specforge.jsonl")) == 4 - len(cut)


def test_regenerate_all_rows_train_every_regenerated_answer_with_train_only_last_turn_false(
        tmp_path, redis_url, conn, sim_factory, tok_path, sf):
    sim = sim_factory("--speedup", "200", "--length-mean", "20", "--reasoning-tokens-frac", "0.5", "--seed", "5")
    src = tmp_path / "D.jsonl"
    data = [{"id": "three", "m": [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "old"},
                                  {"role": "user", "content": "q2"}, {"role": "assistant", "content": "old"},
                                  {"role": "user", "content": "more"}, {"role": "assistant", "content": "old"}]},
            {"id": "two", "m": [{"role": "system", "content": "rule"}, {"role": "user", "content": "q1"},
                                {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}]},
            {"id": "single", "m": [{"role": "user", "content": "only"}]}]
    src.write_text("".join(json.dumps(r) + "\n" for r in data))
    cfg = write_config(tmp_path, redis_url, [sim], [{
        "name": "D", "path": str(src), "budget": "1M", "id_field": "id", "messages_field": "m",
        "regenerate": "all", "thinking": "separate", "sampling": {"max_tokens": 4000}}],
        server={"api": "generate", "tokenizer": tok_path})
    _run(cfg)
    out = tmp_path / "out"
    assert main(["export", "-c", str(cfg), "--format", "specforge"]) == 0
    exported = {r["id"]: r for r in rows(out / "D.specforge.jsonl")}
    assert sorted(exported) == ["single", "three", "two"]
    tok = _tok(tok_path)
    for rid, n in (("three", 3), ("two", 2), ("single", 1)):
        row = exported[rid]
        answers = [m for m in row["conversations"] if m["role"] == "assistant"]
        assert len(answers) == n and all(m["content"] != "old" and m["reasoning_content"] for m in answers)
        # every assistant message is the target's own now: --expect-reasoning holds on every row
        assert validate_row(row, expect_reasoning=True) >= 1
        # SpecForge's general parser with train_only_last_turn: false masks exactly the answers
        _, masked = _masked(sf, tok, row["conversations"], last_only=False)
        assert masked == [i for m in answers for i in _ids(tok, m["content"] + "<|im_end|>")], rid
