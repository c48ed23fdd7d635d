"""The one configuration model: a YAML file, overridden by env vars, overridden by CLI flags."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from shared.errors import ConfigError
from shared.tokens import parse_tokens

TokenCount = Annotated[int, BeforeValidator(parse_tokens)]
_NAME = re.compile(r"^[A-Za-z0-9_-]+$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ServerConfig(_Strict):
    urls: list[str] = Field(default_factory=lambda: ["http://127.0.0.1:30000"], min_length=1)
    api: Literal["chat", "generate"] = "chat"
    model: str = "default"
    # Never logged or put in job payloads: workers read it from their own config/env.
    api_key: str | None = Field(default=None, repr=False)
    timeout_s: float = Field(default=3600.0, gt=0)

    @model_validator(mode="after")
    def _check_urls(self) -> ServerConfig:
        for url in self.urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"server.urls: {url!r} is not an http(s) URL")
        self.urls = [u.rstrip("/") for u in self.urls]
        return self


class DatasetConfig(_Strict):
    name: str
    path: Path
    budget: TokenCount
    mode: Literal["soft", "strict"] = "soft"
    prompt_field: str | None = None
    messages_field: str | None = None
    system_prompt: str | None = None
    id_field: str | None = None
    max_tokens: int = Field(default=8192, gt=0)
    temperature: float = Field(default=0.7, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    # Expected mean response length before the first results arrive (soft-mode reservations).
    prior_mean_tokens: int | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _check(self) -> DatasetConfig:
        if not _NAME.match(self.name):
            raise ValueError(f"dataset name {self.name!r} may hold only letters, digits, '_' and '-'")
        if self.prompt_field and self.messages_field:
            raise ValueError(f"dataset {self.name}: set prompt_field or messages_field, not both")
        if not self.prompt_field and not self.messages_field:
            self.prompt_field = "prompt"
        return self

    @property
    def prior_mean(self) -> int:
        return self.prior_mean_tokens or max(1, self.max_tokens // 4)


class WorkerConfig(_Strict):
    concurrency: int = Field(default=64, gt=0)
    # How long a job may be in flight without a heartbeat before RQ sees it abandoned.
    heartbeat_ttl_s: int = Field(default=60, gt=0)


class ProducerConfig(_Strict):
    # Max queued jobs per dataset; None = 4 x worker concurrency.
    high_water: int | None = Field(default=None, gt=0)
    poll_interval_s: float = Field(default=0.05, gt=0)


class Config(_Strict):
    redis_url: str = "redis://127.0.0.1:6379/0"
    server: ServerConfig = Field(default_factory=ServerConfig)
    output_dir: Path = Path("out")
    datasets: list[DatasetConfig] = Field(default_factory=list)
    worker: WorkerConfig = Field(default_factory=WorkerConfig)
    producer: ProducerConfig = Field(default_factory=ProducerConfig)

    @model_validator(mode="after")
    def _unique(self) -> Config:
        seen: set[str] = set()
        for ds in self.datasets:
            if ds.name in seen:
                raise ValueError(f"datasets: name {ds.name!r} appears twice")
            seen.add(ds.name)
        return self

    @property
    def high_water(self) -> int:
        return self.producer.high_water or 4 * self.worker.concurrency

    def dataset(self, name: str) -> DatasetConfig:
        for ds in self.datasets:
            if ds.name == name:
                return ds
        raise ConfigError(f"no dataset named {name!r} in the config")


_ENV = {
    "BUDGETQ_REDIS_URL": ("redis_url",),
    "BUDGETQ_SERVER_URLS": ("server", "urls"),
    "BUDGETQ_API_KEY": ("server", "api_key"),
    "BUDGETQ_SERVER_API": ("server", "api"),
    "BUDGETQ_OUTPUT_DIR": ("output_dir",),
}


def _set(raw: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for part in path[:-1]:
        raw = raw.setdefault(part, {})
    raw[path[-1]] = value


def _describe(err: ValidationError, source: str) -> str:
    lines = [f"invalid config {source}:"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        got = f" (got {e['input']!r})" if "input" in e and not isinstance(e["input"], dict) else ""
        lines.append(f"  {loc}: {e['msg']}{got}")
    return "\n".join(lines)


def load_config(path: str | Path | None = None, overrides: dict[tuple[str, ...], Any] | None = None,
                env: dict[str, str] | None = None) -> Config:
    """Load YAML (if given), apply env overrides, then CLI overrides; errors name field and value."""
    env = os.environ if env is None else env
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
            if isinstance(ds, dict) and isinstance(ds.get("path"), str) and not os.path.isabs(ds["path"]):
                cand = base / ds["path"]
                if cand.exists() or not Path(ds["path"]).exists():
                    ds["path"] = str(cand)
    for var, key_path in _ENV.items():
        if env.get(var):
            value: Any = env[var]
            if key_path == ("server", "urls"):
                value = [u.strip() for u in value.split(",") if u.strip()]
            _set(raw, key_path, value)
    for key_path, value in (overrides or {}).items():
        if value is not None:
            _set(raw, key_path, value)
    try:
        return Config.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, source)) from None
