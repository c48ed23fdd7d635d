"""Quality gates on finished answers (worker/quality.py, worker/discard.py) and the dataset's
guard/gates/retry_discarded/budget_counts settings (shared/config_quality.py, shared/config.py)."""

from __future__ import annotations

import asyncio
import functools
import importlib
import json
import sys
import textwrap

import pytest

from budgetq.shared.budget import quality_json
from budgetq.shared.config import DatasetConfig
from budgetq.shared.config_load import load_config
from budgetq.shared.config_quality import GatesConfig, GuardConfig
from budgetq.shared.errors import ConfigError
from budgetq.worker import discard, quality, turns
from budgetq.worker.sglang_wire import Completion
from tests.helpers import wait_for


def answer(text: str, reasoning: str | None = None, finish: str = "stop", tokens: int = 10,
           cut: tuple[str, dict] | None = None) -> Completion:
    return Completion(text=text, reasoning=reasoning, prompt_tokens=5, completion_tokens=tokens,
                      finish_reason=finish, endpoint="http://e", latency_s=0.1, discard=cut)


GATES = GatesConfig()


@pytest.mark.parametrize(("out", "why"), [
    (answer("The answer is 4."), None),
    (answer("4", reasoning="2 + 2 is 4"), None),
    (answer("<think>2 + 2</think>\n\nThe answer is 4."), None),               # inline, closed: fine
    (answer(""), "empty"),
    (answer("  \n "), "empty"),
    (answer("", reasoning=""), "empty"),
    (answer("", reasoning="let me think... and think", finish="length"), "unclosed_reasoning"),
    (answer("<think>let me think about this for a long", finish="length"), "unclosed_reasoning"),
    (answer("<think>\n", finish="stop"), "unclosed_reasoning"),
    (answer("The answer is 4.</think>", reasoning="hmm"), "think_tags"),
    (answer("Sure. <think>more thinking</think> 4", reasoning="hmm"), "think_tags"),
    (answer("<think>a</think> 4 <think>b</think>"), "think_tags"),             # a second block after the answer
    (answer("x", cut=("loop", {"period": 1})), "loop"),                        # the stream's guard decided
])
def test_gates_name_the_reason(out: Completion, why: str | None) -> None:
    assert quality.check(out, GATES) == why


def test_gates_can_be_turned_off_one_by_one_or_all() -> None:
    assert quality.check(answer(""), GatesConfig(empty=False)) is None
    assert quality.check(answer("", reasoning="r"), GatesConfig(unclosed_reasoning=False)) is None
    assert quality.check(answer("a</think>", reasoning="r"), GatesConfig(think_tags=False)) is None
    off = DatasetConfig(name="a", path="p", gates="off").gates
    assert quality.check(answer(""), off) is None and quality.check(answer("<think>x"), off) is None


def test_a_loop_at_the_tail_of_an_answer_not_streamed_through_the_guard() -> None:
    looped = answer(" ".join(f"w{i}" for i in range(200)) + " yes and no" * 600, finish="length", tokens=2000)
    assert quality.check(looped, GATES, GuardConfig()) == "loop"
    assert quality.check(looped, GATES, GuardConfig(enabled=False)) is None
    assert quality.check(looped, GATES) is None   # no guard given: the gates alone


MODULES = ("myval", "badimport", "hangimport")   # each test imports its own copy


@pytest.fixture
def validators(tmp_path, monkeypatch):
    (tmp_path / "myval.py").write_text(textwrap.dedent("""
        import threading
        CALLS = []
        RELEASE = threading.Event()   # the test sets it: what hangs ends
        def no_sorry(answer):
            CALLS.append(answer)
            if "sorry" in answer["content"].lower():
                return "a refusal:\\n  it says sorry"
            return None
        def broken(answer):
            raise KeyError("content_x")
        def hangs_on_hang(answer):
            if answer["content"] == "hang":
                RELEASE.wait()
            return None
        NOT_A_FUNCTION = 3
    """))
    (tmp_path / "badimport.py").write_text("import no_such_module_37\n")
    (tmp_path / "hangimport.py").write_text("import myval\nmyval.RELEASE.wait()\ndef f(answer):\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    forget = (quality.load_validator.cache_clear, quality._imports.clear, quality._hung.clear, quality._running.clear,
              quality._log_once.cache_clear, *[functools.partial(sys.modules.pop, m, None) for m in MODULES])
    for f in forget:
        f()
    yield
    import myval
    myval.RELEASE.set()
    wait_for(lambda: not any(quality._running.values()) and all(f.done() for f in quality._imports.values()), 30,
             "the hung validator calls and imports end once released")
    for f in forget:
        f()


def verdict(out: Completion, gates: GatesConfig) -> str | None:
    """What the worker's job flow decides (discard.reason: the gates, then the validator)."""
    why = asyncio.run(discard.reason(out, discard.Quality(None, gates, 0)))
    return None if why is None else why[0]


def test_a_user_validator_is_loaded_once_and_its_reason_kept(validators) -> None:
    gates = GatesConfig(validator="myval:no_sorry")
    assert verdict(answer("Sorry, I cannot."), gates) == "validator:a refusal: it says sorry"
    assert verdict(answer("4", reasoning="2+2"), gates) is None
    import myval  # the module the worker imported once: the same object, both calls seen
    assert [c["content"] for c in myval.CALLS] == ["Sorry, I cannot.", "4"]
    assert myval.CALLS[1] == {"content": "4", "reasoning": "2+2", "finish_reason": "stop", "prompt_tokens": 5,
                              "completion_tokens": 10}
    assert quality.load_validator.cache_info().misses == 1
    # A built-in gate comes first: the validator is not asked about an empty answer.
    assert verdict(answer(""), gates) == "empty" and len(myval.CALLS) == 2


def test_a_validator_that_cannot_be_used_is_one_line(validators) -> None:
    for spec, words in (("nosuchmod_37:f", "cannot import nosuchmod_37: ModuleNotFoundError"),
                        ("badimport:f", "cannot import badimport: ModuleNotFoundError"),
                        ("myval:missing", "myval has no function missing"),
                        ("myval:NOT_A_FUNCTION", "myval has no function NOT_A_FUNCTION")):
        with pytest.raises(quality.ValidatorError) as e:
            verdict(answer("4"), GatesConfig(validator=spec))
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(f"gates.validator {spec}: ") and words in msg


def test_a_validator_that_could_not_be_imported_is_tried_again_by_the_next_job(validators, tmp_path) -> None:
    """Installed while the worker runs (then `budgetq retry-failed`): the next job imports it."""
    gates = GatesConfig(validator="late_mod_39:f")
    with pytest.raises(quality.ValidatorError):
        verdict(answer("4"), gates)
    (tmp_path / "late_mod_39.py").write_text("def f(answer):\n    return 'late but here'\n")
    importlib.invalidate_caches()
    assert verdict(answer("4"), gates) == "validator:late but here"
    sys.modules.pop("late_mod_39", None)


def test_a_validator_that_raises_discards_the_answer_with_why(validators, caplog) -> None:
    gates = GatesConfig(validator="myval:broken")
    for _ in range(3):
        assert verdict(answer("4"), gates) == "validator:raised KeyError: 'content_x'"
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "myval:broken" in errors[0].getMessage()   # logged once, not per answer


def test_a_validator_whose_import_hangs_is_given_up_after_its_time_limit(validators) -> None:
    """Its import runs in a thread: past validator_timeout_s the job gets one line, and every later one the
    same line at once (the hung import holds the module's lock: no second import is tried)."""
    gates = GatesConfig(validator="hangimport:f", validator_timeout_s=0.3)
    for _ in range(2):
        with pytest.raises(quality.ValidatorError) as e:
            verdict(answer("4"), gates)
        assert str(e.value) == ("gates.validator hangimport:f: importing hangimport did not finish within 0.3 s "
                                "(gates.validator_timeout_s)")
    assert len(quality._imports) == 1, "imported once, not once per job"


def test_a_validator_call_that_hangs_discards_that_answer_and_holds_a_few_threads(validators, caplog) -> None:
    """A call past validator_timeout_s discards its answer with why, and the next answers are judged as usual.
    At most THREADS_MAX calls run at once: with all of them hung, an answer waits its time limit for one,
    then is discarded without a call (the threads held stay THREADS_MAX, not one per answer); once the hung
    calls return, the validator is called again."""
    # 1.5 s: an answer that does not hang is judged well within it even on a loaded machine
    gates = GatesConfig(validator="myval:hangs_on_hang", validator_timeout_s=1.5)
    late = "validator:did not return within 1.5 s (gates.validator_timeout_s)"
    spec = "myval:hangs_on_hang"

    async def scenario() -> tuple[list, list, tuple | None, tuple | None]:
        q = discard.Quality(None, gates, 0)
        first = [await discard.reason(answer("hang"), q), await discard.reason(answer("4"), q)]
        # the first hung call holds a thread; a wave of answers that hang takes the others
        wave = await asyncio.gather(*[discard.reason(answer(t), q) for t in ["hang"] * (quality.THREADS_MAX - 1)])
        assert quality._running[spec] == quality.THREADS_MAX
        blocked = await discard.reason(answer("4"), q)
        import myval
        myval.RELEASE.set()
        await asyncio.to_thread(wait_for, lambda: quality._running[spec] == 0, 30, "hung calls return")
        return first, wave, blocked, await discard.reason(answer("4"), q)

    first, wave, blocked, after = asyncio.run(scenario())
    assert first == [(late, {}), None] and wave == [(late, {})] * (quality.THREADS_MAX - 1)
    assert blocked == (f"validator:not called: its {quality.THREADS_MAX} calls running did not return within 1.5 s",
                       {})
    assert after is None
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 2 and "did not return within 1.5 s" in errors[0] and "not called" in errors[1], errors


def test_quality_settings_reach_the_worker_through_the_conf() -> None:
    ds = DatasetConfig(name="a", path="p", guard={"min_span_tokens": 200}, gates={"validator": "m:f"},
                       retry_discarded=1)
    guard, gates, retry = quality.settings(quality_json(ds))
    assert guard.min_span_tokens == 200 and gates.validator == "m:f" and retry == 1
    q = discard.settings(quality_json(ds))
    assert q.retry_discarded == 1 and q.make_guard() is not None and q.make_guard()() is not q.make_guard()()
    off = discard.settings(quality_json(DatasetConfig(name="a", path="p", guard="off")))
    assert off.make_guard() is None and off.guard is None
    # A dataset registered by an older producer (no field), or a value that is not ours: the defaults.
    for raw in ("", "not json", json.dumps({"guard": {"min_span_tokens": "many"}}), "[]"):
        guard, gates, retry = quality.settings(raw)
        assert guard == GuardConfig() and gates == GatesConfig() and retry == 0


def test_discard_reason_over_a_conversation() -> None:
    q = discard.settings("")
    conv = turns.Conversation([answer("fine"), answer("")])
    assert asyncio.run(discard.reason(conv, q)) == ("empty", {})
    conv = turns.Conversation([answer("fine"), answer("x", cut=("loop", {"period": 3}))])
    assert asyncio.run(discard.reason(conv, q)) == ("loop", {"period": 3})
    assert asyncio.run(discard.reason(answer("fine"), q)) is None


def test_defaults_and_one_line_shorthands() -> None:
    ds = DatasetConfig(name="a", path="p")
    assert ds.guard.enabled and ds.guard == GuardConfig() and ds.gates == GatesConfig()
    assert ds.retry_discarded == 0 and ds.budget_counts == "kept"
    assert not DatasetConfig(name="a", path="p", guard=False).guard.enabled
    assert DatasetConfig(name="a", path="p", guard="on").guard.enabled


@pytest.mark.parametrize(("yaml_line", "field"), [
    ("guard: maybe", "guard"),
    ("guard: {max_period_tokens: 0}", "guard.max_period_tokens"),
    ("guard: {min_repeats: 1}", "guard.min_repeats"),
    ("guard: {period: 3}", "guard.period"),
    ("gates: {validator: not-a-spec}", "gates.validator"),
    ("gates: {emtpy: false}", "gates.emtpy"),
    ("retry_discarded: 2", "retry_discarded"),
    ("budget_counts: all", "budget_counts"),
])
def test_bad_values_are_one_line_naming_the_field(tmp_path, yaml_line: str, field: str) -> None:
    p = tmp_path / "c.yaml"
    p.write_text(f"datasets:\n  - name: a\n    path: x.jsonl\n    {yaml_line}\n")
    with pytest.raises(ConfigError) as e:
        load_config(p, env={})
    msg = str(e.value)
    assert "\n" not in msg and field in msg, msg


def test_a_loop_found_at_the_end_has_its_details() -> None:
    looped = answer(" ".join(f"w{i}" for i in range(200)) + " yes and no" * 600, finish="length", tokens=2000)
    why, details = asyncio.run(discard.reason(looped, discard.settings("")))
    assert why == "loop" and details["period_chars"] == len(" yes and no") and details["repeats"] >= 4
    assert details["cut_tokens"] == 2000 and 0 < details["onset_tokens"] < 2000


def test_check_says_what_the_worker_will_discard() -> None:
    from budgetq.producer.ops.check import quality_line

    line = quality_line(DatasetConfig(name="a", path="p"))
    assert line == ("guard: loops of 1-300 tokens cut once they span 384 tokens and 4 repeats; gates: empty, "
                    "unclosed_reasoning, think_tags; retry_discarded 0; budget counts kept tokens")
    line = quality_line(DatasetConfig(name="a", path="p", guard="off", gates={"validator": "nosuch_37.mod:f"},
                                      budget_counts="spent"))
    assert line.startswith("guard: off; ") and "budget counts spent tokens" in line
    assert "validator nosuch_37.mod:f (nosuch_37.mod is not importable here: the workers need it)" in line
