"""Ids: one default (`id_field: id`) in code, example and README; integer ids stay integers in the
rows; the ids a dataset's state was made with are kept across restarts and upgrades."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from budgetq.producer.reading.reader import Invalid, Prompt, read_prompts
from budgetq.producer.run.id_rule import settle_id_field
from budgetq.shared import keys
from budgetq.shared.config import DatasetConfig, ServerConfig
from budgetq.shared.errors import ConfigError
from budgetq.shared.identity import job_id, stable_id
from budgetq.shared.schema import JobPayload, ResultRow

ROOT = Path(__file__).resolve().parent.parent


def _write(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _ds(path: str, **extra) -> DatasetConfig:
    return DatasetConfig(name="A", path=path, budget="1M", sampling={"max_tokens": 10}, **extra)


def _ids(ds: DatasetConfig) -> list:
    return [p.id for p in read_prompts(ds, ServerConfig()) if isinstance(p, Prompt)]


def test_one_default_in_code_example_and_readme():
    default = DatasetConfig.model_fields["id_field"].default
    assert default == "id"
    example = yaml.safe_load((ROOT / "budgetq" / "examples" / "budgetq.yaml").read_text())
    assert all(ds["id_field"] == default for ds in example["datasets"])
    readme = (ROOT / "README.md").read_text()
    assert re.search(r"`id_field`[^.]*default[^.]*`id`|`id_field: id`[^.]*default", readme), "README states the default"


def test_a_dataset_with_an_id_column_uses_it_and_integers_stay_integers(tmp_path):
    rows = [{"id": 7, "prompt": "a"}, {"id": "x", "prompt": "b"}, {"id": 9.0, "prompt": "c"}]
    path = _write(tmp_path / "a.jsonl", rows)
    assert _ids(_ds(path)) == [7, "x", 9]
    assert sorted(_ids(_ds(path, shuffle=True, shuffle_seed=3)), key=str) == [7, 9, "x"]   # same ids, seeded order
    # no id column: content hashes, as before
    bare = _write(tmp_path / "b.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    assert _ids(_ds(bare)) == [stable_id({"prompt": "a"}), stable_id({"prompt": "b"})]
    # an id column: a row without one is invalid, naming the field (not silently hashed)
    mixed = _write(tmp_path / "m.jsonl", [{"id": 1, "prompt": "a"}, {"prompt": "b"}])
    items = list(read_prompts(_ds(mixed), ServerConfig()))
    assert isinstance(items[1], Invalid) and items[1].reason == "missing id field 'id'"
    # null: always hashes; another name: that field
    assert _ids(_ds(path, id_field=None)) == [stable_id(r) for r in rows]


def test_an_integer_id_is_an_integer_in_the_row_and_a_string_in_every_key():
    payload = JobPayload.model_validate(json.loads(JobPayload(
        id=12, dataset="A", messages=[{"role": "user", "content": "q"}], sampling={}).model_dump_json()))
    assert payload.id == 12 and job_id("A", payload.id) == job_id("A", "12") == "A--12"
    from budgetq.worker.process import build_row
    from budgetq.worker.sglang_wire import Completion

    out = Completion(text="a", reasoning=None, prompt_tokens=1, completion_tokens=1, finish_reason="stop", endpoint="e",
                     latency_s=0.1)
    row = build_row(payload, out, "m")
    line = json.loads(row.model_dump_json())
    assert line["id"] == 12   # the file: an integer, as the dataset gave it
    back = ResultRow.model_validate(line)
    assert back.id == "12" and json.loads(back.model_dump_json())["id"] == 12   # readers get the key; round trip
    text = build_row(payload.model_copy(update={"id": "12"}), out, "m")
    assert json.loads(text.model_dump_json())["id"] == "12"   # a string id stays a string


def test_state_from_an_earlier_version_keeps_its_content_hash_ids(tmp_path, conn):
    rows = [{"id": i, "prompt": f"q{i}"} for i in range(5)]
    path = _write(tmp_path / "a.jsonl", rows)
    # what an earlier version left (id_field unset then = content hashes): two prompts done
    conn.sadd(keys.done_key("A"), *(job_id("A", stable_id(r)) for r in rows[:2]))
    ds = _ds(path)
    assert settle_id_field(conn, ds, tmp_path / "out") is None
    assert _ids(ds) == [stable_id(r) for r in rows]   # the same ids: nothing runs twice
    assert json.loads(conn.hget(keys.conf_key("A"), "id_field")) is None   # recorded for every later start
    assert settle_id_field(conn, _ds(path), tmp_path / "out") is None
    with pytest.raises(ConfigError, match=r"ids from content hashes .*id_field: uid would give every prompt a new id"):
        settle_id_field(conn, _ds(path, id_field="uid"), tmp_path / "out")


def test_earlier_state_made_from_the_id_field_keeps_it_and_a_new_dataset_records_its_rule(tmp_path, conn):
    rows = [{"id": f"p{i}", "prompt": f"q{i}"} for i in range(5)]
    path = _write(tmp_path / "a.jsonl", rows)
    conn.sadd(keys.done_key("A"), job_id("A", "p0"))   # an earlier run with id_field: id
    assert settle_id_field(conn, _ds(path), tmp_path / "out") == "id"
    conn.delete(keys.done_key("A"), keys.conf_key("A"))
    # a new dataset: the config's rule, recorded; meta.json of an earlier version counts too
    out = tmp_path / "out"
    out.mkdir()
    (out / "A.meta.json").write_text(json.dumps({"source": {"fields": {"id_field": None}}, "resumed": []}))
    assert settle_id_field(conn, _ds(path), out) is None   # its rows were made with hashes
    conn.delete(keys.conf_key("A"))
    (out / "A.meta.json").unlink()
    assert settle_id_field(conn, _ds(path), out) == "id"
    assert json.loads(conn.hget(keys.conf_key("A"), "id_field")) == "id"
