"""`budgetq export`: results JSONL -> Parquet, streamed, SpecForge's conversations layout."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from budgetq.cli.main import main
from budgetq.producer.ops.export import SCHEMA, export_parquet
from budgetq.shared.schema import ResultRow


def result(i: int, reasoning: str | None = None) -> dict:
    reply = {"role": "assistant", "content": f"answer {i} ✓"}
    if reasoning is not None:
        reply["reasoning_content"] = reasoning
    return ResultRow(id=f"p{i}", dataset="B2", prompt_tokens=10 + i,
                     completion_tokens=100 + i, finish_reason="stop" if i % 2 else "length", model="qwen",
                     endpoint="http://gpu1:30000", latency_s=1.5 + i,
                     conversations=[{"role": "system", "content": "be brief"}, {"role": "user", "content": f"q{i}"},
                                    reply]).model_dump(mode="json")


def as_parquet(row: dict) -> dict:
    """``row`` as Parquet gives it back: every turn has reasoning_content (null where absent), and a
    single-request row has a null ``turns`` (the per-request counts of regenerate: all), and a row without
    features.vllm.single_pass a null ``hidden_states_file``, and a samples: 1 row a null ``sample``."""
    turns = [{"reasoning_content": None, **t} for t in row["conversations"]]
    return {"turns": None, "hidden_states_file": None, "sample": None, **row, "conversations": turns}


def write_results(path: Path, rows: list[dict], bad: dict[int, str] | None = None) -> None:
    lines = [json.dumps(r, ensure_ascii=False) for r in rows]
    for at, text in sorted((bad or {}).items()):
        lines.insert(at - 1, text)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def test_schema_has_every_result_row_field():
    assert SCHEMA.names == [n for n, f in ResultRow.model_fields.items() if not f.exclude]  # int_id: not a column
    assert SCHEMA.field("conversations").type == pa.list_(pa.struct([
        ("role", pa.string()), ("content", pa.string()), ("reasoning_content", pa.string())]))


def test_parquet_round_trip_keeps_rows_order_and_conversations_layout(tmp_path):
    rows = [result(i, reasoning="thought" if i == 3 else None) for i in range(7)]
    src = tmp_path / "B2.jsonl"
    write_results(src, rows)
    meta = tmp_path / "B2.meta.json"
    meta.write_text(json.dumps({"dataset": "B2", "sampling": {"temperature": 0.7}}))
    res = export_parquet(src, tmp_path / "x" / "B2.parquet", meta=meta, batch_rows=3)
    assert (res.rows, res.malformed) == (7, 0)
    pf = pq.ParquetFile(res.target)
    assert pf.metadata.num_row_groups == 3  # written in batches, not as one table
    table = pf.read()
    assert table.to_pylist() == [as_parquet(r) for r in rows]
    assert json.loads(table.schema.metadata[b"budgetq.meta"])["sampling"]["temperature"] == 0.7
    first = table.slice(0, 1).to_pylist()[0]
    assert first["conversations"][-1] == {"role": "assistant", "content": "answer 0 ✓", "reasoning_content": None}
    assert not (tmp_path / "x" / "B2.parquet.tmp").exists()


def test_malformed_lines_are_reported_with_file_and_line_and_skipped(tmp_path):
    src = tmp_path / "B2.jsonl"
    no_tokens = {k: v for k, v in result(9).items() if k != "completion_tokens"}
    bad_turn = {**result(8), "conversations": [{"role": "user"}]}
    write_results(src, [result(i) for i in range(4)],
                  bad={2: '{"id": "torn', 4: json.dumps(no_tokens), 5: json.dumps(bad_turn), 6: "[1]"})
    res = export_parquet(src, tmp_path / "B2.parquet")
    assert (res.rows, res.malformed) == (4, 4)
    assert res.reports == [
        f"{src}:2: malformed row skipped: bad JSON at column 8: unterminated string: it starts at this column and "
        "never ends (is the line cut short?)",
        f"{src}:4: malformed row skipped: completion_tokens: Field required",
        f"{src}:5: malformed row skipped: conversations.0.content: Field required",
        f"{src}:6: malformed row skipped: row is an array, not a JSON object",
    ]
    assert [r["id"] for r in pq.read_table(res.target).to_pylist()] == ["p0", "p1", "p2", "p3"]


def test_hugging_face_datasets_reads_the_export_as_chat_turns(tmp_path):
    import datasets

    src = tmp_path / "B2.jsonl"
    write_results(src, [result(i) for i in range(3)])
    res = export_parquet(src, tmp_path / "B2.parquet")
    ds = datasets.load_dataset("parquet", data_files=str(res.target), split="train", cache_dir=str(tmp_path / "c"))
    assert ds[1]["id"] == "p1"
    assert ds[1]["conversations"] == as_parquet(result(1))["conversations"]


def test_cli_exports_each_dataset_and_reports_what_it_skipped(tmp_path, capsys):
    out = tmp_path / "out"
    cfg = {"output_dir": str(out), "datasets": [{"name": n, "path": "x.jsonl", "budget": "1M"} for n in ("A", "B")]}
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    write_results(out / "A.jsonl", [result(i) for i in range(3)], bad={2: "{oops"})
    assert main(["export", "-c", str(cfg_path), "--dataset", "A", "--format", "parquet",
                 "--out", str(tmp_path / "pq")]) == 0
    got = capsys.readouterr()
    assert f"A: 3 rows -> {tmp_path}/pq/A.parquet, 1 malformed line(s) skipped" in got.out
    assert f"{out}/A.jsonl:2: malformed row skipped: bad JSON" in got.err
    assert pq.read_table(tmp_path / "pq" / "A.parquet").num_rows == 3
    # every dataset by default; B has no results yet: said so, exit 1, A still exported
    assert main(["export", "-c", str(cfg_path)]) == 1
    got = capsys.readouterr()
    assert f"A: 3 rows -> {out}/A.parquet" in got.out and f"B: no {out}/B.jsonl: nothing to export" in got.err
    assert main(["export", "-c", str(cfg_path), "--dataset", "Z"]) == 2
    assert "no dataset named 'Z'" in capsys.readouterr().err
