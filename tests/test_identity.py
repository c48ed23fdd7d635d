"""The identity scheme (shared/identity.py), dataset names, the seen-set and safe logs: unit and
property-based tests (hypothesis, modest example counts so the suite stays fast)."""

from __future__ import annotations

import io
import json
import logging
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rq.job import validate_job_id

from budgetq.producer.reading.seen import SeenIds
from budgetq.shared import keys
from budgetq.shared.config import DatasetConfig
from budgetq.shared.identity import (
    NAME_MAX,
    IdError,
    check_name,
    encode_id,
    job_id,
    legacy_job_id,
    prompt_id,
    split_job_id,
    stable_id,
)
from budgetq.shared.logs import JsonFormatter, RedactFilter, TextFormatter, escape, safe

# Any code point, surrogates included (json.loads accepts "\ud800").
ANY_TEXT = st.text(st.characters(min_codepoint=0, max_codepoint=0x10FFFF, exclude_categories=()), min_size=1,
                   max_size=300)
NAMES = st.from_regex(re.compile(r"[A-Za-z0-9_]{1,8}(-[A-Za-z0-9_]{1,8}){0,3}"), fullmatch=True)
FEW = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("pid", ["café", "a b", "x/y", "a.b", "-lead", "1-x0", "\n", "x" * 10_000, "\ud800x",
                                 "日本語", "a\x1b[2Jb", "_ok", "ok-1"])
def test_any_prompt_id_gives_an_rq_legal_job_id_without_a_dot(pid):
    jid = job_id("A-1", pid)
    validate_job_id(jid)  # RQ's own check: this is what killed the producer on "café"
    assert "." not in jid  # the worker appends .<hex> per attempt to make SGLang rids
    assert split_job_id(jid) == ("A-1", encode_id(pid))
    assert job_id("A-1", pid) == jid  # stable
    assert len(jid) <= NAME_MAX + 2 + 1 + 32 + 1 + 40


def test_readable_ids_stay_readable_and_others_are_hashed_with_a_prefix():
    assert job_id("A1", "p0") == "A1--p0"
    assert job_id("A1", "ok-1_x") == "A1--ok-1_x"
    hashed = job_id("A1", "café au lait")
    assert re.fullmatch(r"A1---[0-9a-f]{32}-caf_au_lait", hashed), hashed
    assert re.fullmatch(r"A1---[0-9a-f]{32}", job_id("A1", "日本")), "no ASCII: hash only"
    assert job_id("A1", "x" * 100) == "A1--" + "x" * 100
    assert job_id("A1", "x" * 101).startswith("A1---")


def test_job_ids_of_different_datasets_never_collide():
    # the old formula `<ds>-<id>`: dataset A id 1-x0 and dataset A-1 id x0 were the same job
    assert legacy_job_id("A", "1-x0") == legacy_job_id("A-1", "x0")
    assert job_id("A", "1-x0") != job_id("A-1", "x0")


@FEW
@given(ds1=NAMES, ds2=NAMES, id1=ANY_TEXT, id2=ANY_TEXT)
def test_job_ids_are_rq_legal_and_unique_per_dataset_and_id(ds1, ds2, id1, id2):
    j1, j2 = job_id(ds1, id1), job_id(ds2, id2)
    for j in (j1, j2):
        validate_job_id(j)
        assert "." not in j
    assert split_job_id(j1)[0] == ds1
    assert (j1 == j2) == ((ds1, id1) == (ds2, id2))
    # the readable form of one id is never the hashed form of another
    assert (encode_id(id1) == encode_id(id2)) == (id1 == id2)


@pytest.mark.parametrize(("value", "want"), [("a", "a"), (7, "7"), (-3, "-3"), (3.0, "3"), (10**30, str(10**30))])
def test_ids_accepted_and_their_string_form(value, want):
    assert prompt_id(value, "id") == want


@pytest.mark.parametrize(("value", "msg"), [
    (["l"], "id field 'id' is an array (['l'])"), ({"a": 1}, "id field 'id' is an object"),
    (True, "id field 'id' is a boolean (True)"), (1.5, "non-integral number (1.5)"),
    (float("nan"), "non-integral number (nan)"), ("", "id field 'id' is empty"),
    (None, "id field 'id' is null"), (b"x", "is a bytes"), ("a\ud800", "lone surrogate ('\\ud800')"),
])
def test_ids_refused_name_the_field_and_type(value, msg):
    with pytest.raises(IdError, match=re.escape(msg)):
        prompt_id(value, "id")


@pytest.mark.parametrize("name", ["A1\n", "A--B", "-A", "A-", "", "a b", "café", "x" * 65, "A.1", "A/1",
                                  "A-features"])
def test_bad_dataset_names_are_refused_naming_the_value(name):
    with pytest.raises(ValueError) as err:
        DatasetConfig(name=name, path="x.jsonl", budget=1)
    assert "dataset name" in str(err.value)
    assert repr(name)[:40] in str(err.value) or "longer than 64" in str(err.value)


@FEW
@given(name=st.text(st.characters(max_codepoint=0x2FF, exclude_categories=()), max_size=70))
def test_a_name_is_accepted_exactly_when_it_fullmatches_and_fits(name, tmp_path_factory):
    ok = bool(re.fullmatch(r"[A-Za-z0-9_]+(-[A-Za-z0-9_]+)*", name)) and len(name) <= 64 \
        and not name.endswith("-features")
    try:
        check_name(name)
        accepted = True
    except IdError as exc:
        accepted = False
        assert "dataset name" in str(exc)
    assert accepted == ok
    if accepted:  # every file the producer makes from it can be created
        d = tmp_path_factory.mktemp("n")
        for suffix in (".jsonl", ".invalid.jsonl", ".truncated.jsonl", ".meta.json"):
            (d / f"{name}{suffix}").write_text("")


def test_stable_id_is_stable_and_survives_lone_surrogates():
    assert stable_id({"b": 1, "a": "x"}) == stable_id({"a": "x", "b": 1})
    assert len(stable_id({"p": "\ud800"})) == 24


@FEW
@given(ids=st.lists(st.sampled_from(["a", "b", "c", "é", "x" * 50]) | ANY_TEXT, max_size=60))
def test_seen_set_agrees_with_a_python_set(ids):
    seen, ref = SeenIds(capacity=4), set()
    for pid in ids:
        assert seen.add(pid) == (pid not in ref)
        ref.add(pid)
    assert len(seen) == len(ref)


def test_seen_set_bytes_per_id(capsys):
    seen = SeenIds()
    n = 200_000
    for i in range(n):
        seen.add(f"id-{i}")
    per_id = seen.nbytes / n
    assert not seen.add("id-7") and seen.add("id-new")
    assert per_id <= 60, per_id  # 17 bytes a slot at 1/3..2/3 load: 26-51 bytes an id
    with capsys.disabled():
        print(f"\nSeenIds: {per_id:.1f} bytes/id at {n} ids (a Python set of 16-byte digests: ~77)")


def _render(formatter: logging.Formatter, msg: str, *args, exc: BaseException | None = None, **extra) -> str:
    log = logging.getLogger("budgetq.test.safe")
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    handler.setFormatter(formatter)
    handler.addFilter(RedactFilter())
    log.handlers, log.propagate = [handler], False
    try:
        if exc is not None:
            try:
                raise exc
            except BaseException:
                log.exception(msg, *args, extra=extra)
        else:
            log.warning(msg, *args, extra=extra)
    finally:
        log.handlers = []
    return buf.getvalue()


FORGED = "p1\n2026-01-01 00:00:00,000 budgetq.producer WARNING all good\r\x1b[2J\u2028\x85"


def test_a_crafted_id_cannot_forge_a_text_log_line():
    out = _render(TextFormatter(), "dataset %s: id %s", "A1", FORGED, field=FORGED)
    assert out.count("\n") == 1 and len(out.splitlines()) == 1
    assert "\\n2026-01-01" in out and "\\x1b[2J" in out and "\\u2028" in out and "\\x85" in out
    out = _render(TextFormatter(), "row %s", "x", exc=ValueError(FORGED))
    lines = out.splitlines()
    assert lines[1] == "Traceback (most recent call last):"
    assert lines[-1].startswith("ValueError: p1\\n2026-01-01") and not any(
        ln.startswith("2026-01-01") for ln in lines)


def test_a_crafted_id_cannot_forge_a_json_log_line():
    out = _render(JsonFormatter(), "id %s", FORGED, field=FORGED)
    assert len(out.splitlines()) == 1
    rec = json.loads(out)
    assert rec["msg"] == f"id {FORGED}" and rec["field"] == FORGED  # escaped on the wire, exact when read


@FEW
@given(text=ANY_TEXT)
def test_any_text_logs_as_exactly_one_line(text):
    for fmt in (TextFormatter(), JsonFormatter()):
        out = _render(fmt, "v=%s", text)
        assert len(out.rstrip("\n").splitlines()) == 1 and out.endswith("\n")
    assert "\n" not in escape(text) and len(safe(text).splitlines()) <= 1


def test_a_dataset_name_never_meets_another_datasets_hidden_states_jobs():
    """<ds>-features names ds's features queue and job ids (keys.features_name): a dataset of
    that name is refused, so neither its queue nor any of its job ids can be ds's features ones."""
    with pytest.raises(IdError, match="may not end in '-features'.*of dataset 'A'"):
        check_name(keys.features_name("A"))
    assert keys.features_queue_name("A") != keys.queue_name("A") and check_name("features") == "features"
