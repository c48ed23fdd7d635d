"""Quality gates on finished answers (worker/quality.py, worker/discard.py) and the dataset's
guard/gates/retry_discarded/budget_counts settings (shared/config_quality.py, shared/config.py)."""

from __future__ import annotations

import json
import textwrap

import pytest

from budgetq.shared.budget import quality_json
from budgetq.shared.config import DatasetConfig
from budgetq.shared.config_load import load_config
from budgetq.shared.config_quality import GatesConfig, GuardConfig
from budgetq.shared.errors import ConfigError
from budgetq.worker import discard, quality, turns
from budgetq.worker.sglang_wire import Completion


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


@pytest.fixture
def validators(tmp_path, monkeypatch):
    (tmp_path / "myval.py").write_text(textwrap.dedent("""
        CALLS = []
        def no_sorry(answer):
            CALLS.append(answer)
            if "sorry" in answer["content"].lower():
                return "a refusal:\\n  it says sorry"
            return None
        def broken(answer):
            raise KeyError("content_x")
        NOT_A_FUNCTION = 3
    """))
    (tmp_path / "badimport.py").write_text("import no_such_module_37\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    quality.load_validator.cache_clear()
    yield
    quality.load_validator.cache_clear()


def test_a_user_validator_is_loaded_once_and_its_reason_kept(validators) -> None:
    gates = GatesConfig(validator="myval:no_sorry")
    assert quality.check(answer("Sorry, I cannot."), gates) == "validator:a refusal: it says sorry"
    assert quality.check(answer("4", reasoning="2+2"), gates) is None
    import myval  # the module the worker imported once: the same object, both calls seen
    assert [c["content"] for c in myval.CALLS] == ["Sorry, I cannot.", "4"]
    assert myval.CALLS[1] == {"content": "4", "reasoning": "2+2", "finish_reason": "stop", "prompt_tokens": 5,
                              "completion_tokens": 10}
    assert quality.load_validator.cache_info().misses == 1
    # A built-in gate comes first: the validator is not asked about an empty answer.
    assert quality.check(answer(""), gates) == "empty" and len(myval.CALLS) == 2


def test_a_validator_that_cannot_be_used_is_one_line(validators) -> None:
    for spec, words in (("nosuchmod_37:f", "cannot import nosuchmod_37: ModuleNotFoundError"),
                        ("badimport:f", "cannot import badimport: ModuleNotFoundError"),
                        ("myval:missing", "myval has no function missing"),
                        ("myval:NOT_A_FUNCTION", "myval has no function NOT_A_FUNCTION")):
        with pytest.raises(quality.ValidatorError) as e:
            quality.check(answer("4"), GatesConfig(validator=spec))
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(f"gates.validator {spec}: ") and words in msg


def test_a_validator_that_raises_discards_the_answer_with_why(validators, caplog) -> None:
    gates = GatesConfig(validator="myval:broken")
    for _ in range(3):
        assert quality.check(answer("4"), gates) == "validator:raised KeyError: 'content_x'"
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "myval:broken" in errors[0].getMessage()   # logged once, not per answer


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
    assert discard.reason(conv, q) == ("empty", {})
    conv = turns.Conversation([answer("fine"), answer("x", cut=("loop", {"period": 3}))])
    assert discard.reason(conv, q) == ("loop", {"period": 3})
    assert discard.reason(answer("fine"), q) is None


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
    why, details = discard.reason(looped, discard.settings(""))
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
