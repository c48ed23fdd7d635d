from pathlib import Path

import pytest
import yaml

from budgetq.shared.config_load import load_config
from budgetq.shared.errors import ConfigError
from budgetq.shared.tokens import parse_tokens

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("text,value", [("10M", 10_000_000), ("2.5k", 2500), ("10_000_000", 10_000_000),
                                        (123, 123), ("1g", 1_000_000_000), (" 7 ", 7)])
def test_budget_strings_parse(text, value):
    assert parse_tokens(text) == value


@pytest.mark.parametrize("bad", ["ten", "1.5", "-3", "5x", True, 2.5])
def test_bad_budget_strings_are_rejected_with_the_value(bad):
    with pytest.raises(ValueError, match="token count"):
        parse_tokens(bad)


def test_example_config_documents_every_field():
    cfg = load_config(ROOT / "examples" / "budgetq.yaml", env={})
    ds = cfg.datasets[0]
    assert ds.budget == 10_000_000 and ds.messages_field == "messages" and ds.prior_mean == 3793
    assert cfg.server.api == "chat" and cfg.high_water == 4 * cfg.worker.concurrency
    # examples/ links to budgetq/examples (shipped in the wheel): compare resolved paths.
    assert ds.path == str((ROOT / "examples" / "data" / "b2.jsonl").resolve())


def _write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_bad_value_error_names_field_and_value(tmp_path):
    p = _write(tmp_path, "datasets:\n  - name: X\n    path: x.jsonl\n    budget: lots\n")
    with pytest.raises(ConfigError) as e:
        load_config(p, env={})
    assert "datasets.0.budget" in str(e.value) and "lots" in str(e.value)


def test_unknown_field_is_named(tmp_path):
    p = _write(tmp_path, "server:\n  urlz: [http://x]\n")
    with pytest.raises(ConfigError, match="server.urlz"):
        load_config(p, env={})


def test_bad_api_and_url_are_named(tmp_path):
    with pytest.raises(ConfigError, match="server.api"):
        load_config(_write(tmp_path, "server:\n  api: grpc\n"), env={})
    with pytest.raises(ConfigError, match="ftp://x"):
        load_config(_write(tmp_path, "server:\n  urls: [ftp://x]\n"), env={})


def test_duplicate_dataset_names_rejected(tmp_path):
    p = _write(tmp_path, "datasets:\n  - {name: A, path: a, budget: 1k}\n  - {name: A, path: b, budget: 1k}\n")
    with pytest.raises(ConfigError, match="'A' appears twice"):
        load_config(p, env={})


def test_env_overrides_file_and_flags_override_env(tmp_path):
    p = _write(tmp_path, "redis_url: redis://file:1/0\nserver:\n  urls: [http://file:1]\n")
    env = {"BUDGETQ_REDIS_URL": "redis://env:2/0", "BUDGETQ_SERVER_URLS": "http://a:1, http://b:2/",
           "BUDGETQ_API_KEY": "sekrit"}
    cfg = load_config(p, env=env)
    assert cfg.redis_url == "redis://env:2/0"
    assert cfg.server.urls == ["http://a:1", "http://b:2"]
    assert cfg.server.api_key == "sekrit" and "sekrit" not in repr(cfg.server)
    cfg = load_config(p, {("redis_url",): "redis://flag:3/0"}, env=env)
    assert cfg.redis_url == "redis://flag:3/0"


def test_missing_file_and_bad_yaml_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "nope.yaml", env={})
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(_write(tmp_path, "a: [1,\n"), env={})


def test_example_config_names_every_field_of_the_model():
    """Every field of the config model is a key of examples/budgetq.yaml at its place (parsed, so
    ``name:`` inside ``username:`` or in a comment does not count); a list of models counts a
    field if any of its entries sets it."""
    from pydantic import BaseModel

    from budgetq.shared.config import Config

    example = yaml.safe_load((ROOT / "examples" / "budgetq.yaml").read_text())

    def models(annotation: object) -> list[type[BaseModel]]:
        inner = getattr(annotation, "__args__", (annotation,))
        return [t for t in inner if isinstance(t, type) and issubclass(t, BaseModel)]

    def entries(value: object) -> list[dict]:
        if isinstance(value, dict):
            return [value]
        return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []

    def walk(model: type[BaseModel], found: list[dict], prefix: str) -> list[str]:
        missing = []
        for name, field in model.model_fields.items():
            values = [e[name] for e in found if name in e]
            if not values:
                missing.append(prefix + name)
                continue
            for sub in models(field.annotation):
                missing += walk(sub, [d for v in values for d in entries(v)], f"{prefix}{name}.")
        return missing

    assert walk(Config, [example], "") == []


def _literal_fields(model, prefix: str = ""):
    """(dotted name, field) of every Literal-valued field in the config model and its sections."""
    from typing import Literal, get_args, get_origin

    from pydantic import BaseModel

    def inner(annotation):
        for arg in get_args(annotation) or ():
            yield arg
            yield from inner(arg)

    for name, field in model.model_fields.items():
        kinds = [field.annotation, *inner(field.annotation)]
        if any(get_origin(k) is Literal for k in kinds):
            yield prefix + name, field
        for sub in kinds:
            if isinstance(sub, type) and issubclass(sub, BaseModel):
                yield from _literal_fields(sub, f"{prefix}{name}.")


def test_literal_words_yaml_reads_as_booleans_are_taken_as_written():
    """`progress: off` is False to YAML 1.1 (so are no/on/yes): every such word of a Literal field is
    taken as the word, not refused with "(got False)"."""
    from typing import Annotated, Literal, get_args, get_origin

    from pydantic import TypeAdapter

    from budgetq.shared.config import Config

    found = []
    for where, field in _literal_fields(Config):
        words = [w for a in (field.annotation, *get_args(field.annotation)) if get_origin(a) is Literal
                 for w in get_args(a)]
        for word in words:
            as_yaml = yaml.safe_load(f"v: {word}")["v"]
            if isinstance(as_yaml, bool):
                typ = Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation
                assert TypeAdapter(typ).validate_python(as_yaml) == word, (where, word)
                found.append(f"{where}: {word}")
    assert found == ["producer.progress: off"]   # the walk saw the field the bug was in


def test_producer_progress_off_in_plain_yaml(tmp_path):
    assert load_config(_write(tmp_path, "producer: {progress: off}\n"), env={}).producer.progress == "off"
    assert load_config(_write(tmp_path, "producer: {progress: 'off'}\n"), env={}).producer.progress == "off"
    assert load_config(_write(tmp_path, "producer: {progress: on}\n"), env={}).producer.progress == "auto"
    with pytest.raises(ConfigError, match=r"producer.progress: Input should be .*\(got 'of'\)"):
        load_config(_write(tmp_path, "producer: {progress: of}\n"), env={})


def _not_defaults(model, validated, node, prefix: str = ""):
    """(dotted name, line) of every key of the YAML mapping ``node`` whose value is not the model's
    default: required fields, sections that default to null, and values that differ once validated."""
    from pydantic import BaseModel

    def section(annotation):
        inner = getattr(annotation, "__args__", (annotation,))
        return next((t for t in inner if isinstance(t, type) and issubclass(t, BaseModel)), None)

    for key, value_node in node.value:
        name, field = key.value, model.model_fields[key.value]
        here = (prefix + name, key.start_mark.line)
        value, sub = getattr(validated, name), section(field.annotation)
        if field.is_required():
            yield here
            continue
        default = field.get_default(call_default_factory=True)
        if sub is not None and isinstance(value_node, yaml.SequenceNode):
            for i, item in enumerate(value_node.value):
                yield from _not_defaults(sub, value[i], item, f"{prefix}{name}.{i}.")
        elif sub is not None and isinstance(value_node, yaml.MappingNode) and default is not None:
            yield from _not_defaults(sub, value, value_node, f"{prefix}{name}.")
        elif value != default:
            yield here


def test_example_config_marks_every_value_that_is_not_the_default():
    """Its header says the values are the defaults except those marked "example": hold it to that,
    both ways (an unmarked non-default, or a marked default, fails)."""
    from budgetq.shared.config import Config

    path = ROOT / "examples" / "budgetq.yaml"
    text = path.read_text()
    lines = text.splitlines()
    found = dict(_not_defaults(Config, load_config(path, env={}), yaml.compose(text)))
    assert {"datasets.0.messages_field", "datasets.0.budget", "datasets.0.sampling.temperature",
            "features.model"} <= set(found), found   # the walk sees what differs

    def comment(line: int) -> str:
        return lines[line].split("#", 1)[1].strip() if "#" in lines[line] else ""

    unmarked = [name for name, line in found.items() if not comment(line).startswith("example")]
    assert unmarked == [], unmarked
    marked = {i for i in range(len(lines)) if comment(i).startswith("example") and not lines[i].startswith("#")}
    assert marked == set(found.values()), sorted(lines[i] for i in marked - set(found.values()))
