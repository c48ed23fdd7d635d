"""Discarded answers in the ledger (commit.lua, shared/ledger.py, the status snapshot, the collector)
on a real Redis: a state of its own, retried at most once, spent and kept tokens side by side,
and budget_counts kept | spent with soft and strict budgets."""

from __future__ import annotations

import json

from budgetq.producer.run.collector import Collector
from budgetq.shared import budget, keys
from budgetq.shared.budget import Admission, Outcome, dataset_state, register_dataset
from budgetq.shared.config import DatasetConfig
from budgetq.shared.ledger import STATES, read_ledger
from budgetq.shared.scripts import run
from budgetq.shared.status import dataset_snapshots


def _ds(conn, budget_=1000, mode="soft", max_tokens=100, prior=50, **extra) -> DatasetConfig:
    ds = DatasetConfig(name="D", path="x.jsonl", budget=budget_, mode=mode, prior_mean_tokens=prior,
                       sampling={"max_tokens": max_tokens}, **extra)
    register_dataset(conn, ds)
    return ds


def _row(job: str, completion: int, reason: str | None = None, attempt: int = 1) -> str:
    row: dict = {"id": job, "completion_tokens": completion, "prompt_tokens": 5, "content": "x"}
    if reason:
        row["discard"] = {"reason": reason, "key": f"{job}#{attempt}", "completion_tokens": completion,
                          "prompt_tokens": 5}
    return json.dumps(row)


def _go(conn, job: str, completion: int, reason: str | None = None, retry: bool = False, attempt: int = 1,
        max_tokens: int = 100, finish: str = "stop") -> Outcome:
    r = run(conn, budget.reserve("D", job, max_tokens))
    assert r.status is Admission.ADMIT, r
    return run(conn, budget.commit("D", job, 5, completion, finish, _row(job, completion, reason, attempt),
                                   discard=reason, retry=retry))


def _enter(conn, n: int) -> None:
    conn.hincrby(keys.stats_key("D"), "enqueued", n)   # as the producer counts what it enqueued


def test_a_discarded_answer_is_a_state_of_its_own_and_every_prompt_is_in_one(conn) -> None:
    _ds(conn)
    _enter(conn, 4)
    assert _go(conn, "a", 40) is Outcome.COMMITTED
    assert _go(conn, "b", 100, "loop") is Outcome.DISCARDED
    assert _go(conn, "c", 0, "empty") is Outcome.DISCARDED
    assert _go(conn, "d", 30, "validator:mentions a refusal") is Outcome.DISCARDED
    led = read_ledger(conn, "D")
    assert "discarded" in STATES
    assert (led["rows"], led["discarded"], led["balanced"]) == (1, 3, True)
    assert sum(led[s] for s in STATES) == led["entered"] == 4
    # Done: never admitted again, a second commit of it (a crash's retry) counts nothing.
    assert run(conn, budget.reserve("D", "b", 100)).status is Admission.DONE
    assert run(conn, budget.commit("D", "b", 5, 100, "stop", _row("b", 100, "loop"), discard="loop")) \
        is Outcome.DUPLICATE
    st = dataset_state(conn, "D")
    assert st.used == 40 and st.reserved == 0 and st.in_flight == 0   # kept (the default): rows only
    assert st.stats["kept_tokens"] == 40 and st.stats["generated_tokens"] == 170
    assert st.stats["discarded_tokens"] == 130 and st.stats["discarded"] == 3
    assert conn.hgetall(keys.discards_key("D")) == {b"loop": b"1", b"loop:tokens": b"100", b"empty": b"1",
                                                    b"empty:tokens": b"0", b"validator": b"1",
                                                    b"validator:tokens": b"30"}


def test_retry_discarded_sends_a_prompt_again_once_never_twice(conn) -> None:
    _ds(conn, retry_discarded=1)
    _enter(conn, 1)
    assert _go(conn, "a", 100, "loop", retry=True) is Outcome.RETRY
    st = dataset_state(conn, "D")
    led = read_ledger(conn, "D")
    # Not done: its ticket is given back and it may be admitted again (another seed, worker/discard.py).
    assert st.reserved == 0 and st.in_flight == 0 and led["discarded"] == 0 and led["rows"] == 0
    assert st.stats["discard_retried"] == 1 and st.stats["discarded_tokens"] == 100
    # The second attempt is discarded too: even asked to retry (another worker, a restarted job), it ends.
    assert _go(conn, "a", 100, "loop", retry=True, attempt=2) is Outcome.DISCARDED
    assert run(conn, budget.reserve("D", "a", 100)).status is Admission.DONE
    led = read_ledger(conn, "D")
    assert (led["discarded"], led["balanced"]) == (1, True)
    st = dataset_state(conn, "D")
    assert st.stats["discard_retried"] == 1 and st.stats["discarded"] == 1 and st.stats["discarded_tokens"] == 200


def test_a_retried_prompt_whose_second_answer_is_good_is_a_row(conn, tmp_path) -> None:
    _ds(conn, retry_discarded=1)
    _enter(conn, 1)
    assert _go(conn, "a", 100, "unclosed_reasoning", retry=True) is Outcome.RETRY
    assert _go(conn, "a", 60, attempt=2) is Outcome.COMMITTED
    led = read_ledger(conn, "D")
    assert (led["rows"], led["discarded"], led["balanced"]) == (1, 0, True)
    # Both answers reach disk: the row, and the refused attempt with its reason and tokens.
    col = Collector(conn, tmp_path, ["D"])
    assert col.drain() == 2
    rows = [json.loads(x) for x in (tmp_path / "D.jsonl").read_text().splitlines()]
    side = [json.loads(x) for x in (tmp_path / "D.discarded.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == ["a"] and rows[0]["completion_tokens"] == 60
    assert len(side) == 1 and side[0]["discard"]["reason"] == "unclosed_reasoning"
    assert side[0]["discard"]["completion_tokens"] == 100


def test_the_collector_writes_each_discarded_attempt_once_across_restarts(conn, tmp_path) -> None:
    _ds(conn, retry_discarded=1)
    assert _go(conn, "a", 100, "loop", retry=True) is Outcome.RETRY
    assert _go(conn, "a", 90, "loop", attempt=2) is Outcome.DISCARDED
    assert _go(conn, "b", 0, "empty") is Outcome.DISCARDED
    entries = conn.xrange(keys.results_key("D"))
    assert Collector(conn, tmp_path, ["D"]).drain() == 3
    # A producer that died before moving the cursor: the same entries again, to a new collector.
    conn.delete(keys.cursor_key("D"))
    for _eid, fields in entries:
        conn.xadd(keys.results_key("D"), fields)
    col = Collector(conn, tmp_path, ["D"])
    assert col.drain() == 0
    lines = [json.loads(x) for x in (tmp_path / "D.discarded.jsonl").read_text().splitlines()]
    assert sorted((r["id"], r["discard"]["reason"], r["discard"]["completion_tokens"]) for r in lines) == \
        [("a", "loop", 90), ("a", "loop", 100), ("b", "empty", 0)]
    assert not (tmp_path / "D.jsonl").exists() or (tmp_path / "D.jsonl").read_text() == ""


def test_budget_counts_spent_counts_every_answer_under_a_ticket(conn) -> None:
    _ds(conn, budget_=10_000, keep="complete", budget_counts="spent")
    assert _go(conn, "a", 40) is Outcome.COMMITTED
    assert _go(conn, "b", 100, "loop") is Outcome.DISCARDED
    assert _go(conn, "c", 100, finish="length") is Outcome.TRUNCATED
    st = dataset_state(conn, "D")
    assert st.budget_counts == "spent"
    assert st.used == 240 and st.stats["kept_tokens"] == 40 and st.stats["generated_tokens"] == 240


def test_soft_budget_crossed_by_a_discarded_answer_with_spent(conn) -> None:
    _ds(conn, budget_=150, max_tokens=100, prior=50, budget_counts="spent")
    for j in "abc":
        assert run(conn, budget.reserve("D", j, 100)).status is Admission.ADMIT
    assert run(conn, budget.commit("D", "a", 5, 100, "stop", _row("a", 100))) is Outcome.COMMITTED
    # The loop's 100 tokens cross 150: the other admission is withdrawn, as a crossing row's would be.
    assert run(conn, budget.commit("D", "b", 5, 100, "stop", _row("b", 100, "loop"), discard="loop")) \
        is Outcome.DISCARDED
    st = dataset_state(conn, "D")
    assert st.used == 200 and st.in_flight == 0 and st.exhausted
    assert run(conn, budget.commit("D", "c", 5, 50, "stop", _row("c", 50))) is Outcome.REJECTED
    assert dataset_state(conn, "D").used == 200   # within [budget, budget + max_tokens)


def test_soft_budget_with_kept_is_not_moved_by_discarded_answers(conn) -> None:
    _ds(conn, budget_=150, max_tokens=100, prior=50)
    for j in "abcd":
        assert _go(conn, j, 100, "loop") is Outcome.DISCARDED
    st = dataset_state(conn, "D")
    assert st.used == 0 and not st.exhausted and st.stats["generated_tokens"] == 400
    assert _go(conn, "e", 100) is Outcome.COMMITTED
    assert _go(conn, "f", 60) is Outcome.CROSSED
    assert dataset_state(conn, "D").used == 160


def test_strict_budget_holds_for_spent_and_for_kept(conn) -> None:
    """Strict reserves max_tokens: a budget of 250 admits two answers of up to 100, whatever becomes of
    them, and used never passes it; with kept, discarded answers give their admission back."""
    for counts, expect_used in (("spent", 200), ("kept", 0)):
        conn.flushdb()
        _ds(conn, budget_=250, mode="strict", max_tokens=100, budget_counts=counts)
        out = []
        for j in "abcdef":
            r = run(conn, budget.reserve("D", j, 100))
            if r.status is not Admission.ADMIT:
                out.append(r.status)
                continue
            out.append(run(conn, budget.commit("D", j, 5, 100, "stop", _row(j, 100, "loop"), discard="loop")))
        st = dataset_state(conn, "D")
        assert st.used == expect_used <= 250
        if counts == "spent":
            assert out[:2] == [Outcome.DISCARDED] * 2 and set(out[2:]) == {Admission.EXHAUSTED}
        else:
            assert out == [Outcome.DISCARDED] * 6


def test_status_shows_spent_and_kept_side_by_side_with_discarded_by_reason(conn) -> None:
    _ds(conn)
    _enter(conn, 3)
    _go(conn, "a", 40)
    _go(conn, "b", 100, "loop")
    _go(conn, "c", 7, "validator:too short")
    snap = dataset_snapshots(conn, ["D"], now=0.0)[0]
    assert snap["budget_counts"] == "kept"
    assert snap["ledger"]["discarded"] == 2 and snap["ledger"]["balanced"]
    assert snap["counts"]["discarded"] == 2
    tok = snap["tokens"]
    assert (tok["spent"], tok["kept"], tok["discarded"], tok["counted"]) == (147, 40, 107, 40)
    assert snap["discarded_by_reason"] == {"loop": {"answers": 1, "tokens": 100},
                                           "validator": {"answers": 1, "tokens": 7}}


def test_reconcile_adopts_discarded_prompts_but_not_attempts_sent_again(conn, tmp_path) -> None:
    """Redis lost: a prompt that ended discarded is done again (in the ledger's discarded state, not
    truncated), a refused attempt that was sent again is not (its prompt is generated again)."""
    from budgetq.producer.run.reconcile import reconcile
    from budgetq.shared.config import Config
    from budgetq.shared.identity import job_id

    ds = DatasetConfig(name="D", path="x.jsonl", budget=1000)
    cfg = Config(output_dir=tmp_path, datasets=[ds])
    (tmp_path / "D.jsonl").write_text(json.dumps({"id": "a", "completion_tokens": 40, "prompt_tokens": 5}) + "\n")
    side = [{"id": "b", "completion_tokens": 100, "discard": {"reason": "loop", "retried": False, "key": "b#1"}},
            {"id": "c", "completion_tokens": 90, "discard": {"reason": "loop", "retried": True, "key": "c#1"}},
            {"id": "a", "completion_tokens": 70, "discard": {"reason": "empty", "retried": True, "key": "a#1"}}]
    (tmp_path / "D.discarded.jsonl").write_text("".join(json.dumps(r) + "\n" for r in side))
    report = reconcile(conn, cfg, ds)
    assert report.adopted == 2
    done = conn.smembers(keys.done_key("D"))
    assert done == {job_id("D", "a").encode(), job_id("D", "b").encode()}
    led = read_ledger(conn, "D")
    assert (led["rows"], led["truncated"], led["discarded"], led["balanced"]) == (1, 0, 1, True)
    assert dataset_state(conn, "D").used == 40


def test_every_view_shows_discarded_and_spent_beside_kept(conn, redis_url) -> None:
    """status (table and --json), /metrics and the monitor page read one snapshot; the summary its rows."""
    from pathlib import Path

    from rich.console import Console

    from budgetq.cli.status_view import render, summary_table
    from budgetq.producer.ops import metrics
    from budgetq.shared.status import snapshot

    _ds(conn)
    _enter(conn, 3)
    _go(conn, "a", 40)
    _go(conn, "b", 100, "loop")
    _go(conn, "c", 7, "validator:too short")
    snap = snapshot(conn, redis_url)
    d = snap["datasets"][0]
    assert d["ledger"]["discarded"] == 2 and d["tokens"]["spent"] == 147 and d["tokens"]["kept"] == 40
    json.dumps(snap)   # --json
    console = Console(width=400, record=True)
    console.print(render(snap))
    text = console.export_text()
    assert "tokens: spent and kept" in text and "loop 1 (100), validator 1 (7)" in text
    assert "discarded" in text.split("tokens: spent and kept")[0]   # the datasets table's column
    prom = metrics.render(snap).decode()
    assert 'budgetq_ledger_prompts{dataset="D",state="discarded"} 2.0' in prom
    assert 'budgetq_tokens_total{dataset="D",kind="spent"} 147.0' in prom
    assert 'budgetq_tokens_total{dataset="D",kind="kept"} 40.0' in prom
    assert 'budgetq_discarded_tokens_total{dataset="D",reason="loop"} 100.0' in prom
    page = (Path(metrics.__file__).parent / "static" / "monitor.html").read_text()
    assert "led.discarded" in page and "renderTokens(snap.datasets)" in page and "discarded_by_reason" in page
    row = {"dataset": "D", "budget": 1000, "used": 40, "rows": 1, "truncated": 0, "discarded": 2, "running": 0,
           "skipped": 0, "failed": 0, "queued": 0, "unread": 0, "invalid": 0, "duplicate_ids": 0, "filtered": 0,
           "source_rows": 3, "unaccounted": 0, "aborted": 0, "wasted_tokens": 0, "spent_tokens": 147,
           "kept_tokens": 40, "discarded_by_reason": d["discarded_by_reason"], "stop": "budget"}
    console = Console(width=400, record=True)
    console.print(summary_table([row]))
    summary = console.export_text()
    assert "discarded" in summary and "147" in summary and "loop 1 (100)" in summary


def test_discarded_answers_feed_the_mean_per_request(conn) -> None:
    """reserve.lua's mean is sum_completion over (committed + truncated + extra_requests): a discarded
    answer's requests are all extra, whether it took one request or several (regenerate: all)."""
    _ds(conn)
    _go(conn, "a", 40)
    _go(conn, "b", 100, "loop")
    assert run(conn, budget.reserve("D", "c", 100)).status is Admission.ADMIT
    run(conn, budget.commit("D", "c", 5, 90, "stop", _row("c", 90, "empty"), lengths=[30, 60], discard="empty"))
    st = dataset_state(conn, "D").stats
    requests = st["committed"] + st.get("truncated", 0) + st["extra_requests"]
    assert requests == 4 and st["sum_completion"] == 40 + 100 + 90
