"""Property-based: random Unicode ids, duplicate patterns, row shapes and config values.

Invariants: the reader never raises and accounts for every line; every valid row with a new
id comes out exactly once (end to end, through a real producer, worker and `budgetq sim`);
no process ends with a traceback; used equals the tokens of the rows on disk.
Example counts: 150 for the reader, 4 end to end (each is a full run, ~5 s).
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from budgetq.producer.reading.reader import Invalid, Prompt, read_prompts
from budgetq.shared import keys
from budgetq.shared.config import DatasetConfig, ServerConfig
from budgetq.shared.identity import IdError, has_surrogate, id_value, prompt_id
from tests.helpers import Procs, check_invariants, rows, wait_for, write_config

ANY_CHAR = st.characters(min_codepoint=0, max_codepoint=0x10FFFF, exclude_categories=())
IDS = (st.text(ANY_CHAR, min_size=0, max_size=40) | st.integers(-10**20, 10**20) | st.booleans() | st.none()
       | st.floats(allow_nan=True) | st.lists(st.integers(), max_size=2) | st.dictionaries(st.text(max_size=3),
                                                                                         st.integers(), max_size=1)
       | st.sampled_from(["p0", "p1", "café", "a b", "-x", "1-x0"]))
PROMPTS = st.text(ANY_CHAR, max_size=30) | st.integers() | st.none() | st.sampled_from(["q", "  ", ""])
MISSING = object()
ROW = st.tuples(IDS | st.just(MISSING), PROMPTS | st.just(MISSING))
GARBAGE = st.text(st.characters(exclude_characters="\n", exclude_categories=("Cs",)), max_size=20).map("#".__add__)
LINE = ROW | GARBAGE | st.just("")


def _line(item) -> str:
    if isinstance(item, str):
        return item  # garbage or blank
    rid, prompt = item
    row = {}
    if rid is not MISSING:
        row["pid"] = rid  # a named id field: every row must have it (the default `id` may fall back to hashes)
    if prompt is not MISSING:
        row["prompt"] = prompt
    return json.dumps(row)


def _expected(items) -> tuple[list[str | int], int]:
    """(ids of the valid rows that come out, in order; number of bad lines incl. duplicates)."""
    valid, bad, seen = [], 0, set()
    for item in items:
        if isinstance(item, str):
            bad += item != ""
            continue
        rid, prompt = item
        ok_prompt = isinstance(prompt, str) and prompt.strip() != "" and not has_surrogate(prompt)
        try:
            pid = prompt_id(rid, "id") if rid is not MISSING and rid is not None else None
        except IdError:
            pid = None
        if not ok_prompt or pid is None or pid in seen:
            bad += 1
            continue
        seen.add(pid)
        valid.append(id_value(rid, "id"))  # as the row keeps it: an integer stays an integer
    return valid, bad


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(items=st.lists(LINE, max_size=25))
def test_the_reader_accounts_for_every_line_and_keeps_each_id_once(items):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "d.jsonl"
        path.write_text("".join(_line(i) + "\n" for i in items))
        ds = DatasetConfig(name="P", path=str(path), budget=1, id_field="pid")
        out = list(read_prompts(ds, ServerConfig()))
    want, bad = _expected(items)
    assert [p.id for p in out if isinstance(p, Prompt)] == want
    invalid = [i for i in out if isinstance(i, Invalid)]
    assert len(invalid) == bad and all(i.reason for i in invalid)
    assert sorted(i.line for i in out) == [n for n, it in enumerate(items, 1) if it != ""]


NAMES = st.from_regex(re.compile(r"[A-Za-z0-9_]{1,6}(-[A-Za-z0-9_]{1,6}){0,2}"), fullmatch=True)


@settings(max_examples=4, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(names=st.lists(NAMES, min_size=2, max_size=2, unique=True), data=st.data(),
       high_water=st.integers(1, 6), concurrency=st.integers(1, 6), shuffle=st.booleans())
def test_every_valid_unique_row_comes_out_exactly_once_end_to_end(tmp_path, redis_url, sim_factory, names, data,
                                                                  high_water, concurrency, shuffle):
    conn = redis.Redis.from_url(redis_url)
    conn.flushall()  # our private test server: each example starts clean
    if not hasattr(test_every_valid_unique_row_comes_out_exactly_once_end_to_end, "sim"):
        test_every_valid_unique_row_comes_out_exactly_once_end_to_end.sim = sim_factory(
            "--speedup", "1000", "--length-mean", "20")
    sim = test_every_valid_unique_row_comes_out_exactly_once_end_to_end.sim
    work = Path(tempfile.mkdtemp(dir=tmp_path))
    specs, expected = [], {}
    for name in names:
        items = data.draw(st.lists(ROW, min_size=1, max_size=10), label=name)
        (work / f"{name}.jsonl").write_text("".join(_line(i) + "\n" for i in items))
        expected[name] = _expected(items)
        specs.append({"name": name, "path": str(work / f"{name}.jsonl"), "budget": "1M", "id_field": "pid",
                      "shuffle": shuffle, "sampling": {"max_tokens": 100}})
    cfg = write_config(work, redis_url, [sim], specs, producer={"high_water": high_water},
                       worker={"concurrency": concurrency})
    procs = Procs(cfg, work)
    try:
        procs.worker()
        # ready before the producer starts: a dataset of only bad rows ends the run at once, and a
        # SIGINT during the worker's imports would print a KeyboardInterrupt traceback
        wait_for(lambda: conn.scard(keys.WORKERS) > 0, 60, "the worker to register")
        producer = procs.producer()
        assert producer.wait(120) == 0, Procs.log(producer)
    finally:
        procs.stop_all()
    logs = "".join(Procs.log(p) for p in procs.procs)
    assert "Traceback" not in logs, logs[-3000:]
    for name in names:
        want, bad = expected[name]
        got = [r["id"] for r in rows(work / "out" / f"{name}.jsonl")]
        assert sorted(got, key=repr) == sorted(want, key=repr)
        assert len(rows(work / "out" / f"{name}.invalid.jsonl")) == bad
        check_invariants(conn, work / "out", name, want)
