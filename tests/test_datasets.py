"""Dataset inputs: every format, field mapping, regeneration, limit/shuffle/filter, tokenizer, meta."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from tiny_tokenizer import make_tiny_tokenizer

from budgetq.cli.main import main
from budgetq.producer.reading import sources
from budgetq.producer.reading.reader import Filtered, Invalid, Prompt, read_prompts
from budgetq.producer.run.meta import check_and_write_meta
from budgetq.shared.config import Config, DatasetConfig, ServerConfig
from budgetq.shared.errors import ConfigError

FORMATS = ("jsonl", "json", "parquet", "hf")
ROOT = Path(__file__).resolve().parent.parent


# ---- helpers -----------------------------------------------------------------------------

def write(fmt: str, path: Path, rows: list[dict]) -> Path:
    """Write ``rows`` as ``fmt`` at ``path`` (+ extension; a directory for hf) and return it."""
    if fmt == "jsonl":
        out = path.with_suffix(".jsonl")
        out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "json":
        out = path.with_suffix(".json")
        out.write_text(json.dumps(rows, indent=1))
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        out = path.with_suffix(".parquet")
        pq.write_table(pa.Table.from_pylist(rows), out, row_group_size=700)
    else:
        import datasets

        out = path.with_name(path.name + "_hf")
        datasets.Dataset.from_list(rows).save_to_disk(str(out))
    return out


def ds_cfg(path: Path | str, **kw) -> DatasetConfig:
    return DatasetConfig(name="T", path=str(path), budget="1M", **kw)


def read(ds: DatasetConfig, server: ServerConfig | None = None) -> list:
    return list(read_prompts(ds, server or ServerConfig()))


def prompts(items: list) -> list[Prompt]:
    return [i for i in items if isinstance(i, Prompt)]


def reasons(items: list) -> dict[int, str]:
    return {i.line: i.reason for i in items if isinstance(i, Invalid)}


@pytest.fixture(scope="session")
def tok_path(tmp_path_factory) -> str:
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


# ---- formats ---------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_reads_the_same_prompts_with_the_same_ids(fmt, tmp_path):
    rows = [{"prompt": f"question {i}", "n": i, "tags": ["a", "b"]} for i in range(5)]
    got = read(ds_cfg(write(fmt, tmp_path / "d", rows)))
    ref = read(ds_cfg(write("jsonl", tmp_path / "ref", rows)))
    assert [(p.line, p.messages[0].content) for p in got] == [(i + 1, f"question {i}") for i in range(5)]
    assert [p.id for p in got] == [p.id for p in ref]  # content hash is format-independent
    assert all(p.messages[0].role == "user" and p.input_ids is None for p in got)


def test_format_comes_from_the_extension_or_the_format_field(tmp_path):
    rows = [{"prompt": "hello"}]
    pq_file = write("parquet", tmp_path / "d", rows)
    odd = tmp_path / "rows.bin"
    odd.write_bytes(pq_file.read_bytes())
    with pytest.raises(ConfigError, match="cannot tell the format of .*rows.bin.*set format"):
        read(ds_cfg(odd))
    assert prompts(read(ds_cfg(odd, format="parquet")))[0].messages[0].content == "hello"
    # a .json file of one object per line is read as JSONL under format auto
    lines = tmp_path / "lines.json"
    lines.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    assert [p.messages[0].content for p in prompts(read(ds_cfg(lines)))] == ["a", "b"]
    # ... but forced to format json it is not an array, and says so
    bad = read(ds_cfg(lines, format="json"))
    assert len(bad) == 1 and "not a JSON array" in bad[0].reason and "format: jsonl" in bad[0].reason
    txt = tmp_path / "rows.txt"
    txt.write_text('{"prompt": "c"}\n')
    assert prompts(read(ds_cfg(txt, format="jsonl")))[0].messages[0].content == "c"
    hf_dir = write("hf", tmp_path / "d", rows)
    assert prompts(read(ds_cfg(hf_dir, format="hf")))[0].messages[0].content == "hello"
    with pytest.raises(ConfigError, match="not a datasets save_to_disk directory"):
        read(ds_cfg(tmp_path, format="hf"))
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        read_prompts(ds_cfg(tmp_path / "missing.jsonl"), ServerConfig())


def test_bad_jsonl_rows_are_invalid_with_line_and_reason(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "first"}\n\n{not json\n{"id": 1}\n{"prompt": "  "}\n[1, 2]\n'
                     b'{"prompt": 5}\n{"prompt": "caf\xe9"}\n{"prompt": "last"}\n')
    items = read(ds_cfg(path))
    assert [p.line for p in prompts(items)] == [1, 9]
    assert reasons(items) == {
        3: "bad JSON at column 2: Expecting property name enclosed in double quotes",
        4: "missing field 'prompt'",
        5: "field 'prompt' is empty",
        6: "row is an array, not a JSON object",
        7: "field 'prompt' is a number, not a string",
        8: "not valid UTF-8 (byte 16)",
    }


def test_a_line_cut_short_is_an_unterminated_string_in_a_whole_sentence(tmp_path):
    """Python says "Invalid control character at" for a JSONL line cut inside a string (it meets the
    newline): the reason is whole, names the column and the real problem."""
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "fine"}\n{"id": "x", "prompt": "hello wor\n{"prompt": "a\tb"}\n'
                    '{"prompt": "ok"}\n{"prompt": "last one cut')
    items = read(ds_cfg(path))
    assert [p.line for p in prompts(items)] == [1, 4]
    cut = "unterminated string: it starts at this column and never ends (is the line cut short?)"
    assert reasons(items) == {
        2: f"bad JSON at column 23: {cut}",
        3: "bad JSON at column 14: a tab inside a string: JSON needs it escaped (e.g. \\t)",
        5: f"bad JSON at column 12: {cut}",
    }
    # a line break inside a string that does end (on a later line): said as such
    path = tmp_path / "d.json"
    path.write_text('[{"prompt": "a"},\n {"prompt": "two\nlines"}]\n')
    assert reasons(read(ds_cfg(path)))[2] == ("bad JSON in element 2 at file line 2: a line break inside a string: "
                                              "JSON needs it escaped (write \\n) (column 16 of the element's line 1)")


def test_bad_json_array_elements_name_the_element_and_file_line(tmp_path):
    path = tmp_path / "d.json"
    path.write_text('\n[\n {"prompt": "a"},\n {"prompt": oops},\n 7,\n {"text": "no prompt"},\n {"prompt": "b"},\n]\n')
    items = read(ds_cfg(path))
    assert [(p.line, p.messages[0].content) for p in prompts(items)] == [(1, "a"), (5, "b")]
    r = reasons(items)
    assert r[2].startswith("bad JSON in element 2 at file line 4: Expecting value")
    assert r[3] == "element 3 is a number, not a JSON object"
    assert r[4] == "row 4: missing field 'prompt'"
    assert r[6] == "element 6 (file line 8) is empty: two commas in a row or a trailing comma"
    path.write_text('[{"prompt": "a"}, {"prompt": "b"')
    items = read(ds_cfg(path))
    assert len(prompts(items)) == 1 and "not closed: element 2" in reasons(items)[2]


@pytest.mark.parametrize("chunk", [1, 3, 7, 1 << 20])
def test_json_array_scanner_agrees_with_json_load_across_chunk_boundaries(chunk, tmp_path, monkeypatch):
    rows = [{"prompt": 'brackets ] } [ { , and "quotes"', "k": [1, [2, {"x": "]"}]]},
            {"prompt": "back\\slash at end\\", "e": "\\\""}, {"prompt": "ünïcødé — 漢字 \n newline"},
            {"prompt": "", "deep": {"a": {"b": [{"c": ","}]}}}]
    path = tmp_path / "d.json"
    path.write_text(json.dumps(rows, ensure_ascii=False))
    monkeypatch.setattr(sources, "CHUNK", chunk)
    items = read(ds_cfg(path, prompt_field="prompt"))
    assert [p.messages[0].content for p in prompts(items)] == [r["prompt"] for r in rows[:3]]
    assert reasons(items) == {4: "row 4: field 'prompt' is empty"}


def test_parquet_and_hf_bad_rows_name_the_row(tmp_path):
    rows = [{"prompt": "ok", "id": "a"}, {"prompt": None, "id": "b"}, {"prompt": "x", "id": None}]
    for fmt in ("parquet", "hf"):
        items = read(ds_cfg(write(fmt, tmp_path / fmt, rows), id_field="id"))
        assert [p.id for p in prompts(items)] == ["a"]
        assert reasons(items) == {2: "row 2: field 'prompt' is null, not a string",
                                  3: "row 3: missing id field 'id'"}


def test_arrow_values_json_cannot_hold_still_get_a_stable_id(tmp_path):
    import datetime as dt

    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    table = pa.table({"prompt": ["a", "b"], "blob": [b"\x00\x01", b"\x02"],
                      "at": [dt.datetime(2024, 1, 1), dt.datetime(2024, 1, 2)]})
    pq.write_table(table, path)
    first = [p.id for p in prompts(read(ds_cfg(path)))]
    assert len(set(first)) == 2 and first == [p.id for p in prompts(read(ds_cfg(path)))]


def test_hf_dataset_dict_picks_train_or_the_configured_split(tmp_path):
    import datasets

    def split(name: str) -> datasets.Dataset:
        return datasets.Dataset.from_list([{"prompt": f"{name} {i}"} for i in range(2)])

    two = tmp_path / "two"
    datasets.DatasetDict({"train": split("train"), "test": split("test")}).save_to_disk(str(two))
    assert prompts(read(ds_cfg(two)))[0].messages[0].content == "train 0"
    assert prompts(read(ds_cfg(two, split="test")))[0].messages[0].content == "test 0"
    with pytest.raises(ConfigError, match=r"split 'dev' not in .* \(splits: train, test\)"):
        read(ds_cfg(two, split="dev"))
    other = tmp_path / "other"
    datasets.DatasetDict({"a": split("a"), "b": split("b")}).save_to_disk(str(other))
    with pytest.raises(ConfigError, match="has splits a, b; set split"):
        read(ds_cfg(other))
    with pytest.raises(ConfigError, match="subset applies to hub datasets"):
        read(ds_cfg(two, subset="en"))


def test_hub_dataset_that_cannot_be_reached_is_a_config_error(monkeypatch):
    import datasets
    import huggingface_hub

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    ds = ds_cfg("hf://budgetq-tests/no-such-dataset")
    items = read_prompts(ds, ServerConfig())  # no network touched until the first row is asked for
    with pytest.raises(ConfigError, match="cannot load hf://budgetq-tests/no-such-dataset from the Hugging Face hub"):
        next(items)


def test_hub_dataset_picks_its_split_before_downloading(monkeypatch):
    import datasets

    calls = []
    monkeypatch.setattr(datasets, "get_dataset_split_names", lambda name, subset: ["test", "train"])

    def load_dataset(name, subset, split):  # stands in for the hub: only the chosen split comes back
        calls.append((name, subset, split))
        return datasets.Dataset.from_list([{"prompt": f"{split} row"}])

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    items = read(ds_cfg("hf://org/chat", subset="en"))
    assert calls == [("org/chat", "en", "train")] and prompts(items)[0].messages[0].content == "train row"
    monkeypatch.setattr(datasets, "get_dataset_split_names", lambda name, subset: ["a", "b"])
    with pytest.raises(ConfigError, match="has splits a, b; set split"):
        read(ds_cfg("hf://org/chat"))


# ---- field mapping and regeneration ------------------------------------------------------------

def test_messages_and_sharegpt_map_to_chat_messages_in_both_key_styles(tmp_path):
    convo = [{"from": "system", "value": "be brief"}, {"from": "human", "value": "hi"},
             {"from": "gpt", "value": "hello"}, {"from": "human", "value": "and then?"}]
    role_style = [{"role": t["from"].replace("human", "user").replace("gpt", "assistant"), "content": t["value"]}
                  for t in convo]
    expect = [("system", "be brief"), ("user", "hi"), ("assistant", "hello"), ("user", "and then?")]
    for field, rows in (("conversations", [{"conversations": convo}, {"conversations": role_style}]),
                        ("messages", [{"messages": role_style}])):
        kw = {"conversations_field": field} if field == "conversations" else {"messages_field": field}
        for p in prompts(read(ds_cfg(write("jsonl", tmp_path / field, rows), **kw))):
            assert [(m.role, m.content) for m in p.messages] == expect
    aliases = [{"from": a, "value": "x"} for a in ("chatgpt", "bing", "bard", "assistant")]
    rows = [{"c": [{"from": "user", "value": "q"}, *aliases, {"from": "human", "value": "q2"}]}]
    msgs = prompts(read(ds_cfg(write("jsonl", tmp_path / "aliases", rows), conversations_field="c")))[0].messages
    # consecutive assistant turns are merged into one (producer/reading/conversations.py, rule 5)
    assert [(m.role, m.content) for m in msgs] == [("user", "q"), ("assistant", "x\n\nx\n\nx\n\nx"), ("user", "q2")]


def test_conversations_are_regenerated_from_the_last_user_turn(tmp_path):
    rows = [
        {"c": [{"from": "human", "value": "q1"}, {"from": "gpt", "value": "a1"},
               {"from": "human", "value": "q2"}, {"from": "gpt", "value": "a2"}, {"from": "gpt", "value": "a2b"}]},
        {"c": [{"from": "human", "value": "only"}, {"from": "gpt", "value": "old answer"}]},
        {"c": [{"from": "gpt", "value": "no question"}]},
        {"c": [{"from": "system", "value": "s"}]},
        {"c": [{"from": "human", "value": "q"}, {"from": "narrator", "value": "?"}]},
        {"c": [{"from": "human", "value": "q"}, {"value": "no role"}]},
        {"c": [{"from": "human", "value": "q"}, {"from": "human", "value": None}]},
        {"c": [{"from": "human", "value": "   "}, {"from": "gpt", "value": "a"}]},
        {"c": "not a list"},
    ]
    items = read(ds_cfg(write("jsonl", tmp_path / "d", rows), conversations_field="c"))
    got = {p.line: [(m.role, m.content) for m in p.messages] for p in prompts(items)}
    assert got == {1: [("user", "q1"), ("assistant", "a1"), ("user", "q2")], 2: [("user", "only")]}
    assert reasons(items) == {
        3: "field 'c' has no user turn",
        4: "field 'c' has no user turn",
        5: "c[1]: unknown role 'narrator' in 'from' (known: system, human, user, gpt, assistant, chatgpt, bing, bard)",
        6: "c[1] has no 'from' or 'role'",
        7: "c[1] has no 'value' or 'content'",
        8: "c[0]: empty user turn",
        9: "field 'c' is a string, not a list",
    }


def test_bundled_sharegpt_example_reads_as_regenerable_prompts():
    ds = ds_cfg(ROOT / "examples" / "data" / "sharegpt.jsonl", conversations_field="conversations",
                id_field="id", system_prompt="Answer briefly.")
    items = read(ds)
    assert len(prompts(items)) == 12 and not reasons(items)
    for p in prompts(items):
        assert p.messages[0].role == "system" and p.messages[-1].role == "user"
    assert [m.content for m in prompts(items)[3].messages][:1] == ["You are a patient tutor."]


def test_system_prompt_is_prepended_unless_the_conversation_has_one(tmp_path):
    rows = [{"m": [{"role": "user", "content": "q"}]},
            {"m": [{"role": "system", "content": "own"}, {"role": "user", "content": "q"}]}]
    items = prompts(read(ds_cfg(write("jsonl", tmp_path / "d", rows), messages_field="m", system_prompt="cfg")))
    assert [[m.role + ":" + m.content for m in p.messages] for p in items] == [
        ["system:cfg", "user:q"], ["system:own", "user:q"]]
    plain = prompts(read(ds_cfg(write("jsonl", tmp_path / "p", [{"prompt": "q"}]), system_prompt="cfg")))
    assert [(m.role, m.content) for m in plain[0].messages] == [("system", "cfg"), ("user", "q")]


def test_id_field_is_used_and_a_missing_one_is_invalid(tmp_path):
    rows = [{"uid": 7, "prompt": "a"}, {"prompt": "b"}, {"uid": "", "prompt": "c"}, {"uid": "x", "prompt": "d"}]
    items = read(ds_cfg(write("jsonl", tmp_path / "d", rows), id_field="uid"))
    assert [p.id for p in prompts(items)] == [7, "x"]  # an integer id stays an integer
    assert reasons(items) == {2: "missing id field 'uid'", 3: "id field 'uid' is empty"}


# ---- limit, shuffle, filter ----------------------------------------------------------------------

def test_limit_counts_valid_prompts_and_stops_reading(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "aa"}\n{bad\n{"prompt": "bb"}\n{"prompt": "t"}\n{"prompt": "cc"}\n{bad again\n')
    items = read(ds_cfg(path, limit=3, min_prompt_chars=2))
    assert [type(i).__name__ for i in items] == ["Prompt", "Invalid", "Prompt", "Filtered", "Prompt"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_shuffle_is_a_seeded_permutation(fmt, tmp_path):
    n = 2100  # several take windows and Parquet row groups
    path = write(fmt, tmp_path / "d", [{"prompt": f"q{i}"} for i in range(n)])
    order = [p.line for p in prompts(read(ds_cfg(path, shuffle=True, shuffle_seed=7)))]
    assert sorted(order) == list(range(1, n + 1)) and order != sorted(order)
    assert order == [p.line for p in prompts(read(ds_cfg(path, shuffle=True, shuffle_seed=7)))]
    assert order != [p.line for p in prompts(read(ds_cfg(path, shuffle=True, shuffle_seed=8)))]
    jsonl = write("jsonl", tmp_path / "ref", [{"prompt": f"q{i}"} for i in range(n)])
    assert order == [p.line for p in prompts(read(ds_cfg(jsonl, shuffle=True, shuffle_seed=7)))]
    first = prompts(read(ds_cfg(path, shuffle=True, shuffle_seed=7, limit=5)))
    assert [p.line for p in first] == order[:5]
    assert all(p.messages[0].content == f"q{p.line - 1}" for p in prompts(read(ds_cfg(path, shuffle=True))))


def test_shuffled_json_array_keeps_bad_elements_invalid(tmp_path):
    path = tmp_path / "d.json"
    path.write_text('[{"prompt": "a"}, {"prompt": 1}, {"prompt": "b"}, {"prompt": "c"}]')
    items = read(ds_cfg(path, shuffle=True, shuffle_seed=1))
    assert sorted(p.line for p in prompts(items)) == [1, 3, 4]
    assert reasons(items) == {2: "row 2: field 'prompt' is a number, not a string"}


def test_length_filter_skips_rows_without_making_them_invalid(tmp_path):
    rows = [{"prompt": "x" * n} for n in (3, 10, 50, 12)]
    items = read(ds_cfg(write("jsonl", tmp_path / "d", rows), min_prompt_chars=5, max_prompt_chars=20))
    assert [p.line for p in prompts(items)] == [2, 4]
    filtered = {i.line: i.reason for i in items if isinstance(i, Filtered)}
    assert filtered == {1: "prompt has 3 characters, fewer than min_prompt_chars 5",
                        3: "prompt has 50 characters, more than max_prompt_chars 20"}
    assert not reasons(items)
    # the system prompt counts: it is part of what is sent
    items = read(ds_cfg(write("jsonl", tmp_path / "s", rows[:1]), min_prompt_chars=5, system_prompt="sys"))
    assert len(prompts(items)) == 1


# ---- tokenizer -----------------------------------------------------------------------------------

def test_generate_mode_sends_the_chat_template_as_input_ids(tmp_path, tok_path):
    from transformers import AutoTokenizer

    rows = [{"c": [{"from": "human", "value": "hello, what is the answer?"}, {"from": "gpt", "value": "hi"},
                   {"from": "human", "value": "explain the answer"}, {"from": "gpt", "value": "old"}]}]
    server = ServerConfig(api="generate", tokenizer=tok_path)
    ds = ds_cfg(write("jsonl", tmp_path / "d", rows), conversations_field="c", system_prompt="you are helpful")
    (p,) = prompts(read(ds, server))
    tok = AutoTokenizer.from_pretrained(tok_path)
    text = tok.apply_chat_template([m.model_dump() for m in p.messages], add_generation_prompt=True, tokenize=False)
    assert text.endswith("explain the answer<|im_end|>\n<|im_start|>assistant\n") and "old" not in text
    assert p.input_ids == tok.encode(text, add_special_tokens=False)
    # system 2+3+1, user 2+7+1 ("hello , what is the answer ?"), assistant 2+1+1, user 2+3+1, prompt 2
    assert p.prompt_tokens == len(p.input_ids) == 28
    # chat_template_kwargs reach the template (Qwen3-style enable_thinking adds <think></think>)
    thinking_off = ds.model_copy(update={"chat_template_kwargs": {"enable_thinking": False}})
    (q,) = prompts(read(thinking_off, server))
    assert q.input_ids[-2:] == tok.convert_tokens_to_ids(["<think>", "</think>"]) and q.prompt_tokens == 30


def test_chat_mode_with_a_tokenizer_counts_tokens_but_sends_none(tmp_path, tok_path):
    ds = ds_cfg(write("jsonl", tmp_path / "d", [{"prompt": "hello"}]))
    (p,) = prompts(read(ds, ServerConfig(api="chat", tokenizer=tok_path)))
    # <|im_start|> user hello <|im_end|> <|im_start|> assistant
    assert p.input_ids is None and p.prompt_tokens == 6
    (p2,) = prompts(read(ds))
    assert p2.prompt_tokens is None


def test_too_long_prompts_are_invalid_with_the_numbers(tmp_path, tok_path):
    rows = [{"prompt": "hello"}, {"prompt": " ".join(["word"] * 30)}]
    path = write("jsonl", tmp_path / "d", rows)
    server = ServerConfig(api="generate", tokenizer=tok_path)
    items = read(ds_cfg(path, max_prompt_tokens=20), server)
    assert [p.line for p in prompts(items)] == [1]
    assert reasons(items) == {2: "prompt has 35 tokens, more than max_prompt_tokens 20"}
    ctx = server.model_copy(update={"context_length": 100})
    items = read(ds_cfg(path, sampling={"max_tokens": 70}), ctx)
    assert reasons(items) == {2: "prompt has 35 tokens, more than the 30 that server.context_length 100 leaves "
                                 "after sampling.max_tokens 70"}
    with pytest.raises(ConfigError, match="context_length 100 leaves no room .*max_tokens 100"):
        read_prompts(ds_cfg(path, sampling={"max_tokens": 100}), ctx)
    with pytest.raises(ConfigError, match="max_prompt_tokens needs server.tokenizer"):
        read_prompts(ds_cfg(path, max_prompt_tokens=20), ServerConfig())


def test_a_row_the_chat_template_rejects_is_invalid_with_its_message(tmp_path, tok_path):
    import shutil

    strict = tmp_path / "strict_tok"
    shutil.copytree(tok_path, strict)
    template = strict / "chat_template.jinja"
    template.write_text("{% if messages | length > 1 %}{{ raise_exception('one turn only') }}{% endif %}"
                        + template.read_text())
    rows = [{"c": [{"from": "human", "value": "hi"}]},
            {"c": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "a"}, {"from": "human", "value": "b"}]}]
    items = read(ds_cfg(write("jsonl", tmp_path / "d", rows), conversations_field="c"),
                 ServerConfig(api="generate", tokenizer=str(strict)))
    assert [p.line for p in prompts(items)] == [1]
    assert reasons(items)[2].startswith("chat template failed:") and "one turn only" in reasons(items)[2]


def test_a_tokenizer_that_cannot_load_names_its_path(tmp_path, tok_path):
    path = write("jsonl", tmp_path / "d", [{"prompt": "hello"}])
    with pytest.raises(ConfigError, match=f"cannot load a tokenizer from '{tmp_path}/nowhere'"):
        read_prompts(ds_cfg(path), ServerConfig(api="generate", tokenizer=str(tmp_path / "nowhere")))
    from transformers import AutoTokenizer

    plain_dir = tmp_path / "no_template"
    tok = AutoTokenizer.from_pretrained(tok_path)
    tok.chat_template = None
    tok.save_pretrained(str(plain_dir))
    (plain_dir / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(ConfigError, match="has no chat template"):
        read_prompts(ds_cfg(path), ServerConfig(api="generate", tokenizer=str(plain_dir)))


# ---- meta.json -----------------------------------------------------------------------------------

def test_meta_is_written_once_and_a_changed_temperature_warns(tmp_path):
    out = tmp_path / "out"
    cfg = Config(server={"urls": ["http://gpu1:30000"], "model": "qwen", "api_key": "secret"},
                 datasets=[{"name": "B2", "path": "b2.jsonl", "budget": "1M", "sampling": {"temperature": 0.7}}])
    assert check_and_write_meta(cfg, cfg.datasets[0], out) == []
    first = json.loads((out / "B2.meta.json").read_text())
    assert first["sampling"]["temperature"] == 0.7 and first["model"] == "qwen" and first["resumed"] == []
    assert first["server"] == {"urls": ["http://gpu1:30000"], "api": "chat"} and "created_at" in first
    assert "secret" not in (out / "B2.meta.json").read_text()
    assert check_and_write_meta(cfg, cfg.datasets[0], out) == []
    hot = cfg.datasets[0].model_copy(update={"sampling": cfg.datasets[0].sampling.model_copy(
        update={"temperature": 1.0})})
    warnings = check_and_write_meta(cfg, hot, out)
    assert len(warnings) == 1
    assert warnings[0].startswith(f"dataset B2: sampling.temperature changed from 0.7 to 1.0 since {out}/B2.meta.json")
    assert f"rows already in {out}/B2.jsonl were generated with 0.7" in warnings[0]
    record = json.loads((out / "B2.meta.json").read_text())
    assert record["sampling"]["temperature"] == 0.7 and record["created_at"] == first["created_at"]
    assert [r["changed"] for r in record["resumed"]] == [
        {}, {"sampling.temperature": {"from": 0.7, "to": 1.0}}]
    assert check_and_write_meta(cfg, hot, out) == []  # compared with the settings last in force
    moved = cfg.model_copy(update={"server": cfg.server.model_copy(update={"model": "llama"})})
    assert [w.split(" since ")[0] for w in check_and_write_meta(moved, hot, out)] == [
        "dataset B2: model changed from qwen to llama"]
    (out / "B2.meta.json").write_text("{torn")
    with pytest.raises(ConfigError, match="B2.meta.json is not a budgetq meta record"):
        check_and_write_meta(cfg, hot, out)


# ---- end to end: producer + worker + simulator, one dataset per input format ----------------------

def _wait_for_queues(conn, names: list[str], prod) -> None:
    from rq import Queue
    from rq.serializers import JSONSerializer

    from budgetq.shared import keys

    queues = [Queue(keys.queue_name(n), connection=conn, serializer=JSONSerializer) for n in names]
    deadline = time.monotonic() + 60
    while not all(q.count for q in queues):
        if prod.poll() is not None:
            raise AssertionError(f"producer exited early: {prod.stderr.read()}")
        assert time.monotonic() < deadline, "producer enqueued nothing within 60 s"
        time.sleep(0.05)


def test_every_input_format_end_to_end_in_chat_mode(tmp_path, redis_url, conn, sim_factory, tok_path):
    sim = sim_factory("--speedup", "500", "--length-mean", "40")
    long_prompt = " ".join(["word"] * 20)
    jsonl = write("jsonl", tmp_path / "j", [{"id": f"j{i}", "prompt": long_prompt if i == 3 else f"hello {i}"}
                                            for i in range(8)])
    array = tmp_path / "a.json"
    msgs = [json.dumps({"messages": [{"role": "user", "content": f"what is {i}?"}]}) for i in range(6)]
    msgs.insert(2, '{"messages": oops}')
    array.write_text("[\n" + ",\n".join(msgs) + "\n]\n")
    parquet = write("parquet", tmp_path / "p", [{"conversations": [
        {"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"old a{i}"},
        {"from": "human", "value": f"q{i} again"}, {"from": "gpt", "value": f"old b{i}"}]} for i in range(6)])
    hf = write("hf", tmp_path / "h", [{"question": "x" * (3 if i == 0 else 10 + i)} for i in range(8)])
    out = tmp_path / "out"
    datasets_cfg = [
        {"name": "J", "path": str(jsonl), "id_field": "id", "max_prompt_tokens": 12},
        {"name": "A", "path": str(array), "messages_field": "messages"},
        {"name": "P", "path": str(parquet), "conversations_field": "conversations", "system_prompt": "be brief"},
        {"name": "H", "path": str(hf), "prompt_field": "question", "shuffle": True, "limit": 4,
         "min_prompt_chars": 5},
    ]
    for d in datasets_cfg:
        d.update(budget="1M", sampling={"max_tokens": 200})
    cfg = {"redis_url": redis_url, "server": {"urls": [sim], "api": "chat", "tokenizer": tok_path},
           "output_dir": str(out), "worker": {"concurrency": 16}, "datasets": datasets_cfg}
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    py = [sys.executable, "-m", "budgetq.cli", "--log-level", "WARNING"]
    prod = subprocess.Popen([*py, "produce", "-c", str(cfg_path)], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _wait_for_queues(conn, ["J", "A", "P", "H"], prod)
        worker = subprocess.run([*py, "worker", "-c", str(cfg_path), "--burst"], cwd=ROOT, timeout=120,
                                capture_output=True, text=True)
        assert worker.returncode == 0, worker.stderr
        stdout, stderr = prod.communicate(timeout=120)
    finally:
        if prod.poll() is None:
            prod.kill()
    assert prod.returncode == 0, stderr

    def rows(name: str) -> list[dict]:
        return [json.loads(line) for line in (out / f"{name}.jsonl").read_text().splitlines()]

    all_rows = {n: rows(n) for n in ("J", "A", "P", "H")}
    for name, got in all_rows.items():
        for r in got:  # SpecForge reads id and conversations: [..., user, assistant]
            assert isinstance(r["id"], str) and r["dataset"] == name
            assert all(set(t) == {"role", "content"} for t in r["conversations"])
            assert [t["role"] for t in r["conversations"][-2:]] == ["user", "assistant"]
    assert sorted(r["id"] for r in all_rows["J"]) == sorted(f"j{i}" for i in range(8) if i != 3)
    (too_long,) = [json.loads(x) for x in (out / "J.invalid.jsonl").read_text().splitlines()]
    assert too_long["line"] == 4 and too_long["reason"] == "prompt has 25 tokens, more than max_prompt_tokens 12"
    assert len(all_rows["A"]) == 6
    (bad,) = [json.loads(x) for x in (out / "A.invalid.jsonl").read_text().splitlines()]
    assert bad["line"] == 3 and bad["reason"].startswith("bad JSON in element 3 at file line 4")
    for r in all_rows["P"]:
        i = r["conversations"][1]["content"][1:]
        assert [(t["role"], t["content"]) for t in r["conversations"][:-1]] == [
            ("system", "be brief"), ("user", f"q{i}"), ("assistant", f"old a{i}"), ("user", f"q{i} again")]
        assert r["conversations"][-1]["content"] != f"old b{i}"
    assert len(all_rows["P"]) == 6
    questions = {r["conversations"][0]["content"] for r in all_rows["H"]}
    assert len(questions) == 4 and "xxx" not in questions  # limit 4, the 3-character row filtered
    requests = json.loads(urllib.request.urlopen(sim + "/sim/requests").read())
    assert len(requests) == sum(len(v) for v in all_rows.values())  # invalid rows never reached the server
    # and the results export to Parquet in SpecForge's layout
    assert main(["export", "-c", str(cfg_path), "--dataset", "P"]) == 0
    table = pq.read_table(out / "P.parquet")
    # (Parquet structs have every key: reasoning_content is null on turns without one)
    got = [[{k: v for k, v in t.items() if v is not None} for t in c]
           for c in table.column("conversations").to_pylist()]
    assert table.num_rows == 6 and got == [r["conversations"] for r in all_rows["P"]]
