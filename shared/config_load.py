"""Loading the config model: a YAML file, overridden by env vars, overridden by CLI flags; every
error names the field and the value (and the field meant, when a name is close to a known one)."""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from budgetq.shared.config import Config, DatasetConfig
from budgetq.shared.errors import ConfigError
from budgetq.shared.schema import SamplingParams

_ENV = {
    "BUDGETQ_REDIS_URL": ("redis_url",),
    "BUDGETQ_SERVER_URLS": ("server", "urls"),
    "BUDGETQ_API_KEY": ("server", "api_key"),
    "BUDGETQ_SERVER_API": ("server", "api"),
    "BUDGETQ_TOKENIZER": ("server", "tokenizer"),
    "BUDGETQ_OUTPUT_DIR": ("output_dir",),
    "BUDGETQ_MONITOR_HOST": ("monitor", "host"),
    "BUDGETQ_MONITOR_PORT": ("monitor", "port"),
    "BUDGETQ_MONITOR_USERNAME": ("monitor", "username"),
    "BUDGETQ_MONITOR_PASSWORD": ("monitor", "password"),
}


def _set(raw: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for part in path[:-1]:
        raw = raw.setdefault(part, {})
    raw[path[-1]] = value


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside a field's annotation (``X``, ``list[X]``, ``X | None``), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        if (found := _model_in(arg)) is not None:
            return found
    return None


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The model that holds the field at ``loc`` (list indexes skipped), e.g. DatasetConfig for
    ``datasets.0.max_tokenz``."""
    model: type[BaseModel] | None = Config
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part) if model is not None else None
        if field is None:
            return None
        model = _model_in(field.annotation)
    return model


def _did_you_mean(loc: tuple[Any, ...]) -> str:
    """`` (did you mean `sampling.max_tokens`?)`` for an unknown field close to a known one."""
    model = _model_at(loc)
    if model is None or not loc or not isinstance(loc[-1], str):
        return ""
    names = {n: n for n in model.model_fields}
    if model is DatasetConfig:
        names.update({n: f"sampling.{n}" for n in SamplingParams.model_fields if n != "extra"})
    close = difflib.get_close_matches(loc[-1], list(names), n=1, cutoff=0.6)
    if close:
        return f" (did you mean `{names[close[0]]}`?)"
    if model is SamplingParams:
        return f" (other SGLang sampling parameters go under sampling.extra, e.g. extra: {{{loc[-1]}: ...}})"
    return f" (known fields: {', '.join(sorted(model.model_fields))})"


def _origin(loc: tuple[Any, ...], origins: Mapping[tuple[str, ...], str]) -> str | None:
    """The flag or env var a field's value came from (``--deadline``), if not from the file."""
    for path, name in origins.items():
        if loc[:len(path)] == path:
            return name
    return None


def _describe(err: ValidationError, source: str, origins: Mapping[tuple[str, ...], str]) -> str:
    """One error: one line (``invalid config X: field: message``, or ``--deadline 40: message``
    for a flag's value, ``$BUDGETQ_X: message`` for an env var's), as every error of the CLI is;
    several: a heading, then one line each."""
    lines, from_file = [], False
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        shown = repr(e.get("input"))
        origin = _origin(tuple(e["loc"]), origins)
        if origin is not None and origin.startswith("-"):
            # the flag and its value as typed; a message that starts by naming them says the rest
            msg = re.sub(rf"^\w+ {re.escape(shown)}: ", "", msg)
            lines.append(f"{origin} {e.get('input')}: {msg}")
            continue
        # our own messages name the value already ("(got -5)" for -5 or "-5"): "(got ...)" once, not twice
        got = f" (got {shown})" if "input" in e and not isinstance(e["input"], dict) and shown not in msg \
            and "(got " not in msg else ""
        hint = _did_you_mean(tuple(e["loc"])) if e["type"] == "extra_forbidden" else ""
        lines.append(f"{'$' + origin if origin else loc}: {msg}{hint}{got}")
        from_file = from_file or origin is None
    head = f"invalid config {source}: " if from_file else ""
    if len(lines) == 1:
        return head + lines[0]
    return "\n  ".join([f"{head}{len(lines)} errors:", *lines])


def _is_local_path(path: str) -> bool:
    return "://" not in path and not os.path.isabs(path)


def load_config(path: str | Path | None = None, overrides: dict[tuple[str, ...], Any] | None = None,
                env: Mapping[str, str] | None = None, flags: Mapping[tuple[str, ...], str] | None = None) -> Config:
    """Load YAML (if given), apply env overrides, then CLI overrides; errors name field and value,
    and the flag (``flags``: field -> ``--deadline``) or env var a bad value came from."""
    origins: dict[tuple[str, ...], str] = {}
    environ: Mapping[str, str] = os.environ if env is None else env
    raw: dict[str, Any] = {}
    source = "(defaults)"
    if path is not None:
        source = str(path)
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read config {path}: {exc.strerror}") from exc
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"config {path} is not valid YAML: {exc}") from exc
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config {path}: top level must be a mapping, got {type(loaded).__name__}")
        raw = loaded or {}
        base = Path(path).resolve().parent
        # Relative dataset paths are relative to the config file, so a config works from any cwd.
        for ds in raw.get("datasets") or []:
            if isinstance(ds, dict) and isinstance(ds.get("path"), str) and _is_local_path(ds["path"]):
                cand = base / ds["path"]
                if cand.exists() or not Path(ds["path"]).exists():
                    ds["path"] = str(cand)
    for var, key_path in _ENV.items():
        if environ.get(var):
            value: Any = environ[var]
            if key_path == ("server", "urls"):
                value = [u.strip() for u in value.split(",") if u.strip()]
            _set(raw, key_path, value)
            origins[key_path] = var
    for key_path, value in (overrides or {}).items():
        if value is not None:
            _set(raw, key_path, value)
            if flags and key_path in flags:
                origins[key_path] = flags[key_path]
    try:
        return Config.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, source, origins)) from None
