"""The one configuration model (its loading: config_load.py; the features: section: config_features.py;
server: config_server.py; a dataset's guard and gates: config_quality.py)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from budgetq.shared.config_features import FeaturesConfig
from budgetq.shared.config_fields import Budget, Strict, TokenCount, TotalBudget, yaml_bools
from budgetq.shared.config_quality import Gates, GatesConfig, Guard, GuardConfig
from budgetq.shared.config_server import ServerConfig as ServerConfig  # re-exported: its old home
from budgetq.shared.errors import ConfigError
from budgetq.shared.identity import NAME_PATTERN, IdError, check_name
from budgetq.shared.sampling import extra_key_errors
from budgetq.shared.schema import SamplingParams

# Dataset names: the rule lives in shared/identity.py (job ids and key names depend on it).
_NAME = re.compile(NAME_PATTERN.pattern)
# Sampling parameters a dataset may also give at its own level, as shorthand for sampling.<name>.
SAMPLING_SHORTHAND = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "stop", "seed")


def greedy_reason(sp: SamplingParams) -> str:
    """What in ``sp`` makes decoding greedy (every answer the same), or "" when it samples."""
    if sp.temperature == 0:
        return "temperature 0"
    if sp.top_k == 1:
        return "top_k 1"
    return ""


class DatasetConfig(Strict):
    name: str
    # A file (JSONL, JSON array, Parquet), a `datasets.save_to_disk` directory, or
    # `hf://org/name` for a hub dataset (needs network).
    path: str
    format: Literal["auto", "jsonl", "json", "parquet", "hf"] = "auto"
    split: str | None = None          # for HF datasets (default: the only split, or "train")
    subset: str | None = None         # HF config name
    # The dataset's own cap. Optional with run.total_budget or run.deadline: its effective budget
    # is then its weighted share, capped by this (docs/budget.md "Deadline and total").
    budget: Budget | None = None
    # Share of run.total_budget and of the deadline's tokens, relative to the other datasets'.
    weight: float = Field(default=1.0, gt=0, le=1e6)
    # soft: reserve the expected length, land in [budget, budget + max_tokens);
    # strict: reserve max_tokens, never pass the budget; drain: no reservations (the naive
    # policy, for comparison: in-flight requests all count, overshoot ~ in-flight x mean).
    mode: Literal["soft", "strict", "drain"] = "soft"
    # What counts toward the budget: completion tokens, or prompt + completion.
    count: Literal["completion", "total"] = "completion"
    # complete: responses cut by max_tokens (finish_reason=length) go to
    # out/<name>.truncated.jsonl and do not count toward the budget.
    keep: Literal["all", "complete"] = "all"
    # Field mapping: exactly one of these (default prompt_field "prompt").
    prompt_field: str | None = None
    messages_field: str | None = None        # list of {role, content}
    conversations_field: str | None = None   # ShareGPT: list of {from, value} or {role, content}
    system_prompt: str | None = None
    # Multi-turn rows: `last` answers the last user turn again, earlier turns (the dataset's own
    # old answers included) stay as context, so train SpecForge with train_only_last_turn: true.
    # `all` drops the dataset's answers and asks every user turn in order, each with the model's
    # own earlier answers as context (one job, one row per conversation; worker/turns.py), so
    # train with train_only_last_turn: false.
    regenerate: Literal["last", "all"] = "last"
    # Where prompt ids come from (docs/datasets.md "Ids"). `id` (the default): the dataset's `id`
    # field when its first row has one (then every row must), else a content hash. Another name:
    # that field, on every row. null: always a content hash. A restart keeps the ids a dataset's
    # state was written with (producer/run/id_rule.py).
    id_field: str | None = "id"
    limit: int | None = Field(default=None, gt=0)   # at most this many valid prompts
    # Independent answers per prompt (docs/datasets.md "Samples per prompt"): the first keeps the
    # prompt's id, the k-th is `<id>#<k>`, each with its own seed, row and share of the budget.
    # `auto`: one answer a prompt, and once every prompt is answered while the budget still admits
    # requests, further answers in rounds (every prompt its 2nd before any its 3rd) up to max_samples.
    samples: Annotated[int, Field(ge=1, le=1000)] | Literal["auto"] = 1
    max_samples: int | None = Field(default=None, ge=2, le=1000)   # samples: auto's cap (required with it)
    shuffle: bool = False
    shuffle_seed: int = 0
    min_prompt_chars: int | None = Field(default=None, ge=0)   # filter: shorter prompts are skipped
    max_prompt_chars: int | None = Field(default=None, gt=0)   # filter: longer prompts are skipped
    max_prompt_tokens: int | None = Field(default=None, gt=0)  # longer prompts are recorded invalid
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    # Reasoning models: `separate` keeps reasoning in its own field, `inline` puts it back
    # into the assistant content as <think>...</think>, `drop` discards it.
    thinking: Literal["separate", "inline", "drop"] = "separate"
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    # Expected mean response length before the first results arrive (soft-mode reservations).
    prior_mean_tokens: int | None = Field(default=None, gt=0)
    # Soft mode's end game: admissions keep this many standard deviations of what the requests
    # in flight may still produce free of the budget (sd x sqrt(in flight)), so few requests
    # are still running (and aborted) when the budget is crossed. 0 = today's plain taper;
    # higher = less waste, a slower last few percent (docs/budget.md has the measured trade).
    end_margin_z: float = Field(default=1.0, ge=0, le=10)
    # features: `budgetq produce` also captures each committed row's hidden states (the features
    # pass, docs/hidden_states.md) and ends only once every row has them; none: it does not.
    capture: Literal["none", "features"] = "none"
    # This dataset's hidden states stop before they pass this many bytes on disk (10G-style counts); with
    # features.max_bytes it caps the dataset's weighted share of it (docs/hidden_states.md "Disk as a budget").
    features_max_bytes: TokenCount | None = None
    # The degeneration guard (worker/degeneration.py): on by default; `guard: off` turns it off,
    # `guard: {max_period_tokens: 300, min_span_tokens: 384, min_repeats: 4}` tunes it.
    guard: Guard = Field(default_factory=GuardConfig)
    # Quality gates on finished answers (worker/quality.py): empty, unclosed_reasoning, think_tags
    # (each on by default) and validator: "module:function". `gates: off`: none.
    gates: Gates = Field(default_factory=GatesConfig)
    # A prompt whose answer the guard or a gate discarded is sent again this many times (0 or 1)
    # with another seed; its discarded answers stay in out/<name>.discarded.jsonl either way.
    retry_discarded: int = Field(default=0, ge=0, le=1)
    # What the budget bounds (docs/budget.md "Spent and kept"). kept: the tokens of the rows kept
    # (out/<name>.jsonl), so a budget buys that much training data whatever the guard and gates
    # throw away; spent: every token generated under an admission (discarded and truncated answers
    # too), so a budget bounds GPU time.
    budget_counts: Literal["kept", "spent"] = "kept"

    @model_validator(mode="before")
    @classmethod
    def _sampling_shorthand(cls, data: Any) -> Any:
        """``max_tokens: 4096`` at the dataset level means ``sampling: {max_tokens: 4096}``.

        People write it that way (it is how most generation scripts take it); the same
        parameter given in both places with different values is an error, not a silent pick.
        """
        if not isinstance(data, dict) or not any(k in data for k in SAMPLING_SHORTHAND):
            return data
        data = dict(data)
        sampling = data.get("sampling")
        if isinstance(sampling, SamplingParams):
            sampling = sampling.model_dump(exclude_unset=True)
        if sampling is None:
            sampling = {}
        if not isinstance(sampling, dict):
            return data  # the field's own validator names the bad value
        sampling = dict(sampling)
        label = f"dataset {data['name']}" if isinstance(data.get("name"), str) else "dataset"
        for key in SAMPLING_SHORTHAND:
            if key not in data:
                continue
            value = data.pop(key)
            if key in sampling and sampling[key] != value:
                raise ValueError(f"{label}: {key} is given twice, {value!r} at the dataset level and "
                                 f"{sampling[key]!r} as sampling.{key}: keep one")
            sampling[key] = value
        data["sampling"] = sampling
        return data

    @field_validator("samples", mode="before")
    @classmethod
    def _check_samples(cls, v: Any) -> Any:
        # One line, not pydantic's two (one per member of the union): what samples takes.
        ok = v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 1000)
        if not ok:
            raise ValueError(f"samples takes a whole number of answers per prompt, 1 to 1000, or auto (got {v!r})")
        return v

    @field_validator("name")
    @classmethod
    def _check_name(cls, name: str) -> str:
        try:
            return check_name(name)  # fullmatch: "A1\n" and "A--B" are refused, as are names over 64 chars
        except IdError as exc:
            raise ValueError(str(exc)) from None

    @model_validator(mode="after")
    def _check(self) -> DatasetConfig:
        fields = [f for f in (self.prompt_field, self.messages_field, self.conversations_field) if f]
        if len(fields) > 1:
            raise ValueError(f"dataset {self.name}: set one of prompt_field, messages_field, "
                             f"conversations_field (got {', '.join(fields)})")
        if not fields:
            self.prompt_field = "prompt"
        if self.samples == "auto" and self.max_samples is None:
            raise ValueError(f"dataset {self.name}: samples: auto needs max_samples (the most answers a prompt "
                             "may give, e.g. max_samples: 4)")
        if self.samples != "auto" and self.max_samples is not None:
            raise ValueError(f"dataset {self.name}: max_samples {self.max_samples} is samples: auto's cap, but "
                             f"samples is {self.samples}: set samples: auto or drop max_samples")
        greedy = greedy_reason(self.sampling)
        if self.answers_max > 1 and greedy:
            raise ValueError(f"dataset {self.name}: samples: {self.samples} with {greedy} (greedy decoding) "
                             f"writes {self.answers_max} identical answers per prompt: raise the temperature or "
                             "set samples: 1")
        if self.min_prompt_chars is not None and self.max_prompt_chars is not None \
                and self.min_prompt_chars > self.max_prompt_chars:
            raise ValueError(f"dataset {self.name}: min_prompt_chars {self.min_prompt_chars} > "
                             f"max_prompt_chars {self.max_prompt_chars}")
        return self

    @property
    def answers_max(self) -> int:
        """The most answers one prompt gives: ``samples``, or ``max_samples`` with samples: auto."""
        return self.samples if isinstance(self.samples, int) else (self.max_samples or 1)

    @property
    def max_tokens(self) -> int:
        return self.sampling.max_tokens

    @property
    def prior_mean(self) -> int:
        return self.prior_mean_tokens or max(1, self.max_tokens // 4)


class WorkerConfig(Strict):
    # Requests in flight per worker process, or auto: sized from each server's /server_info and
    # /v1/loads, split among the workers sharing it (worker/capacity.py).
    concurrency: Annotated[int, Field(gt=0)] | Literal["auto"] = 64
    # concurrency auto: how often the servers are re-read and the shares re-split.
    capacity_interval_s: float = Field(default=5.0, gt=0)
    # A job's lease: a worker that stops heartbeating (killed, frozen, cut off) loses its jobs
    # this long after its last heartbeat; they are re-enqueued within one maintenance interval.
    heartbeat_ttl_s: int = Field(default=30, ge=2)
    maintenance_interval_s: float = Field(default=5.0, gt=0)
    # How often a worker re-reads budgets and pauses (and aborts requests of datasets whose
    # budget was crossed), and refreshes its in-flight reservations.
    control_interval_s: float = Field(default=0.5, gt=0)
    # SIGTERM/SIGINT: stop taking jobs, let requests in flight finish this long, requeue the rest.
    grace_s: float = Field(default=30.0, ge=0)
    # How the taper estimates a running request's final length: `censored` counts requests in
    # flight as "at least g tokens" (Kaplan-Meier) next to the completed ones; `completed` uses
    # completed lengths only, which early in a run are the short ones (the estimate the end
    # game used before the censored one, kept to compare: bench/end_game.py).
    taper_estimate: Literal["censored", "completed"] = "censored"


class ProducerConfig(Strict):
    # Max queued jobs per dataset; None = 4 x worker concurrency.
    high_water: int | None = Field(default=None, gt=0)
    poll_interval_s: float = Field(default=0.05, gt=0)
    # Progress display: bars on a terminal, log lines otherwise (auto), or force one. A bare
    # `off` in YAML is False: taken as "off" (and on/yes/true as "auto").
    progress: Annotated[Literal["auto", "bars", "log", "off"], yaml_bools("off", "auto")] = "auto"
    progress_interval_s: float = Field(default=10.0, gt=0)
    # Write the run report (<output_dir>/report.html, `budgetq report`) as produce ends, complete or not.
    # Drawing it takes seconds (matplotlib); false skips it, `budgetq report` draws it at any time.
    report: bool = True
    # How long RQ keeps a finished job (its hash, finished-registry entry and result), as RQ's
    # own result_ttl: rq-dashboard shows finished jobs this long. 0 deletes a job as it
    # finishes (what RQ's worker does with result_ttl=0), a third less Redis CPU per prompt at
    # fleet scale (docs/benchmarks.md "Ceiling"); the rows are in the output files either way.
    result_ttl_s: int = Field(default=500, ge=0)


class RunConfig(Strict):
    """Budgets in what the operator has: a deadline and a total, split by weight (docs/budget.md)."""

    # A time the run must end by: a duration from the first start ("12h", "90m") or an ISO time
    # ("2026-12-05T08:00:00Z"); None = none. Kept in Redis: a restart keeps the same time.
    deadline: str | None = None
    # Tokens over all datasets, split by weight (water-filling); None = per-dataset budgets only.
    total_budget: TotalBudget | None = None
    # Admissions stop this quantile of the measured response times before the deadline, so the
    # last responses finish by it; what still runs at the deadline is aborted (and sent again by a
    # later run). Higher: less waste, a little idle time at the end.
    tail_quantile: float = Field(default=0.95, gt=0, lt=1)
    # The fleet's tok/s is measured over this many seconds (a slower or faster fleet moves the
    # budgets within about this long).
    rate_window_s: float = Field(default=60.0, gt=0)
    # How often the producer recomputes the effective budgets (and reads live changes).
    control_interval_s: float = Field(default=1.0, gt=0)

    @field_validator("deadline", mode="before")
    @classmethod
    def _check_deadline(cls, v: Any) -> Any:
        from budgetq.shared.deadline_spec import PlanError, check_deadline_spec

        if v is None or isinstance(v, str):
            try:
                return check_deadline_spec(v)
            except PlanError as exc:
                raise ValueError(str(exc)) from None
        raise ValueError(f"deadline {v!r}: expected a duration like 12h or an ISO time in quotes")


class MonitorConfig(Strict):
    # The web monitor (budgetq monitor, or the producer with --monitor): page, JSON API, /metrics.
    host: str = "127.0.0.1"
    port: int = Field(default=9200, gt=0, lt=65536)
    # HTTP basic auth for the monitor; required when host is not a loopback address.
    username: str | None = None
    password: str | None = Field(default=None, repr=False)



class Config(Strict):
    redis_url: str = Field(default="redis://127.0.0.1:6379/0", repr=False)
    # How long worker, producer and monitor wait for Redis at start (backoff, a log line);
    # 0 = fail at once. Once running, they wait out outages of any length.
    redis_wait_s: float = Field(default=300.0, ge=0)
    server: ServerConfig = Field(default_factory=ServerConfig)
    output_dir: Path = Path("out")
    # Free space kept untouched on output_dir's volume: generation holds admissions under it
    # (producer/run/disk_guard.py), the features pass stops before it (whatever features.max_bytes says).
    min_free_mb: float = Field(default=1024.0, ge=0)
    datasets: list[DatasetConfig] = Field(default_factory=list)
    worker: WorkerConfig = Field(default_factory=WorkerConfig)
    producer: ProducerConfig = Field(default_factory=ProducerConfig)
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    features: FeaturesConfig = Field(default_factory=FeaturesConfig)  # hidden states
    run: RunConfig = Field(default_factory=RunConfig)  # deadline and total budget (docs/budget.md)

    @model_validator(mode="before")
    @classmethod
    def _min_free_moved(cls, raw: Any) -> Any:
        """features.min_free_mb is the old spelling of min_free_mb (one volume, one setting)."""
        feats = raw.get("features") if isinstance(raw, dict) else None
        if not isinstance(feats, dict) or "min_free_mb" not in feats:
            return raw
        feats = dict(feats)
        old = feats.pop("min_free_mb")
        if "min_free_mb" in raw and raw["min_free_mb"] != old:
            raise ValueError(f"min_free_mb {raw['min_free_mb']!r} and features.min_free_mb {old!r}: set only "
                             "min_free_mb (features.min_free_mb is its old name)")
        return {**raw, "features": feats, "min_free_mb": raw.get("min_free_mb", old)}

    @model_validator(mode="after")
    def _unique(self) -> Config:
        seen: set[str] = set()
        for ds in self.datasets:
            if ds.name in seen:
                raise ValueError(f"datasets: name {ds.name!r} appears twice")
            seen.add(ds.name)
        return self

    @model_validator(mode="after")
    def _budget_or_run(self) -> Config:
        """Without run.total_budget or run.deadline, each dataset needs its own budget."""
        if self.run.total_budget is None and self.run.deadline is None:
            missing = [ds.name for ds in self.datasets if ds.budget is None]
            if missing:
                raise ValueError(f"dataset {missing[0]}: budget is required unless run.total_budget or "
                                 "run.deadline is set")
        return self

    @model_validator(mode="after")
    def _capture_has_a_tokenizer(self) -> Config:
        """capture: features re-tokenizes each row with the chat template to find the answer's tokens."""
        for ds in self.datasets:
            if ds.capture == "features" and not self.server.tokenizer:
                raise ValueError(f"dataset {ds.name}: capture: features needs server.tokenizer (the rows are "
                                 "re-tokenized with the model's chat template to find the answer's tokens)")
        return self

    @model_validator(mode="after")
    def _extra_fits_api(self) -> Config:
        """sampling.extra goes to SGLang as is: a key its API rejects would fail every prompt,
        one it ignores would silently do nothing. Caught here, before anything is sent."""
        errors = [f"dataset {ds.name}: {e}" for ds in self.datasets
                  for e in extra_key_errors(self.server.api, ds.sampling.extra)]
        if errors:
            raise ValueError("; ".join(errors))
        return self

    @property
    def high_water(self) -> int:
        per_worker = self.worker.concurrency if isinstance(self.worker.concurrency, int) else 256
        return self.producer.high_water or 4 * per_worker

    def dataset(self, name: str) -> DatasetConfig:
        for ds in self.datasets:
            if ds.name == name:
                return ds
        raise ConfigError(f"no dataset named {name!r} in the config")


