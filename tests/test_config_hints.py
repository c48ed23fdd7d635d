"""Config ergonomics: dataset-level sampling shorthand, and "did you mean" for unknown fields."""

from __future__ import annotations

import pytest

from budgetq.shared.config_load import load_config
from budgetq.shared.errors import ConfigError


def _load(tmp_path, text: str):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return load_config(path, env={})


def _line(message: str, where: str) -> str:
    """The line of a config error that names ``where`` (the only one, or one of several)."""
    return next(ln for ln in message.splitlines() if ln.strip().startswith(where + ":") or f": {where}: " in ln)


DS = "datasets:\n  - {name: A1, path: x.jsonl, budget: 1M, %s}\n"


def test_dataset_level_sampling_parameters_are_shorthand_for_sampling(tmp_path):
    cfg = _load(tmp_path, DS % "max_tokens: 4096, temperature: 0.2, top_p: 0.9, top_k: 20, min_p: 0.05, "
                                "stop: ['</s>'], seed: 7, repetition_penalty: 1.1, "
                                "sampling: {extra: {frequency_penalty: 0.1}}")
    s = cfg.datasets[0].sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.min_p, s.stop, s.seed, s.repetition_penalty) == \
        (4096, 0.2, 0.9, 20, 0.05, ["</s>"], 7, 1.1)
    assert s.extra == {"frequency_penalty": 0.1} and cfg.datasets[0].max_tokens == 4096


def test_the_same_value_in_both_places_is_fine_but_two_values_are_an_error(tmp_path):
    assert _load(tmp_path, DS % "max_tokens: 64, sampling: {max_tokens: 64}").datasets[0].max_tokens == 64
    with pytest.raises(ConfigError) as exc:
        _load(tmp_path, DS % "temperature: 0.2, sampling: {temperature: 1.0}")
    assert "datasets.0: " in str(exc.value)
    assert "dataset A1: temperature is given twice, 0.2 at the dataset level and 1.0 as sampling.temperature" \
        in str(exc.value)


def test_a_bad_shorthand_value_names_its_field_under_sampling(tmp_path):
    with pytest.raises(ConfigError, match=r"datasets\.0\.sampling\.max_tokens: .*greater than 0.*\(got -1\)"):
        _load(tmp_path, DS % "max_tokens: -1")


@pytest.mark.parametrize(("field", "where", "hint"), [
    ("max_tokenz: 3", "datasets.0.max_tokenz", "did you mean `sampling.max_tokens`?"),
    ("temprature: 1", "datasets.0.temprature", "did you mean `sampling.temperature`?"),
    ("prompt_feild: q", "datasets.0.prompt_feild", "did you mean `prompt_field`?"),
    ("sampling: {temprature: 1}", "datasets.0.sampling.temprature", "did you mean `temperature`?"),
    ("sampling: {ignore_eos: true}", "datasets.0.sampling.ignore_eos", "go under sampling.extra"),
])
def test_unknown_dataset_fields_suggest_the_close_match(tmp_path, field, where, hint):
    with pytest.raises(ConfigError) as exc:
        _load(tmp_path, DS % field)
    line = _line(str(exc.value), where)
    assert hint in line and "Extra inputs are not permitted" in line


@pytest.mark.parametrize(("text", "where", "hint"), [
    ("dataset: []\n", "dataset", "did you mean `datasets`?"),
    ("server: {tokeniser: x}\n", "server.tokeniser", "did you mean `tokenizer`?"),
    ("worker: {concurency: 8}\n", "worker.concurency", "did you mean `concurrency`?"),
    ("monitor: {zzz: 1}\n", "monitor.zzz", "known fields: host, password, port, username"),
])
def test_unknown_fields_anywhere_suggest_the_close_match(tmp_path, text, where, hint):
    with pytest.raises(ConfigError) as exc:
        _load(tmp_path, text)
    line = _line(str(exc.value), where)
    assert hint in line
