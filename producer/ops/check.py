"""``budgetq check``: what a run would do, without starting it (and without writing to Redis).

Reads every dataset with the producer's own reader (``read_prompts``: same mapping, filters,
tokenizer and limits as a run), streaming, and counts valid, invalid (by reason) and filtered
rows as the producer's summary does (producer/reading/tally.py: a repeated id is an invalid
row, the first row with an id wins), prompt lengths, and what the budget buys at ``prior_mean_tokens``.
It then asks Redis (reads only: a read-only ACL user is enough) how far a previous run got, and each
server what it serves (``probe``, passed in: the HTTP client is the worker's, never imported here).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import redis

from budgetq.producer.ops.check_quality import quality_line, samples_lines
from budgetq.producer.reading.mapping import prompt_chars
from budgetq.producer.reading.reader import DUPLICATE, Invalid, Prompt, read_prompts
from budgetq.producer.reading.tally import RowTally
from budgetq.producer.run import disk_guard
from budgetq.producer.run.disk_guard import MB
from budgetq.producer.run.feed import refuse_suffix
from budgetq.shared import keys, server_kind
from budgetq.shared.config import Config, DatasetConfig
from budgetq.shared.errors import BudgetqError, ConfigError
from budgetq.shared.logs import redact_url
from budgetq.shared.redis_conn import connect_once, describe
from budgetq.shared.server_kind import SGLANG_MODEL
from budgetq.shared.stats import Stat
from budgetq.shared.tokens import format_tokens

# "row 12: field 'prompt' is empty" and "field 'prompt' is empty" are one reason; so are
# "bad JSON at column 3: ..." and "bad JSON at column 9: ...", and "prompt has 3,000,000 bytes"
# and "prompt has 12 bytes". A whole number only: the 8 of "UTF-8" is part of a word.
_ROW_PREFIX = re.compile(r"^row \d+: ")
_NUMBER = re.compile(r"(?<![\w.,-])-?\d+(?:[.,]\d+)*(?![\w-])")
# What a row weighs on disk, for the output estimate: the answer's text at ~6 bytes a token (JSON
# escapes and non-ASCII text weigh more than English's ~4), the prompt's characters (+10% for
# escapes) and ~512 bytes of ids, counts and settings. It errs on the heavy side.
BYTES_PER_TOKEN = 6
ROW_OVERHEAD = 512


def reason_key(reason: str) -> str:
    """An invalid row's reason with its numbers (row, column, sizes) as N, for counting by reason."""
    return _NUMBER.sub("N", _ROW_PREFIX.sub("", reason))


@dataclass
class Stats:
    """Count, mean, min, max of a stream of numbers, in constant memory."""

    count: int = 0
    total: int = 0
    min: int | None = None
    max: int | None = None

    def add(self, value: int) -> None:
        self.count += 1
        self.total += value
        self.min = value if self.min is None else min(self.min, value)
        self.max = value if self.max is None else max(self.max, value)

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None

    def as_dict(self) -> dict[str, Any]:
        return {"count": self.count, "mean": self.mean, "min": self.min, "max": self.max}


@dataclass
class DatasetCheck:
    name: str
    path: str
    budget: int
    mode: str
    count: str
    prior_mean_tokens: int
    samples: int = 1   # answers per prompt (samples: auto: max_samples): the budget, done and the needs count answers
    auto: bool = False  # samples: auto: answers are drawn in rounds while the budget admits them, up to samples
    # producer/reading/tally.py's counts: valid (unique ids), invalid (duplicates included),
    # duplicates (of the invalid rows), filtered
    valid: int = 0
    duplicates: int = 0
    invalid: int = 0
    invalid_by_reason: dict[str, int] = field(default_factory=dict)
    # reason -> first line (JSONL) or row (other formats) it was seen at, and that row's own
    # reason (its numbers, not N: what the report prints)
    first_at: dict[str, int] = field(default_factory=dict)
    first_reason: dict[str, str] = field(default_factory=dict)
    position: str = "line"   # what first_at counts: "line" (JSONL) or "row" (other formats)
    filtered: int = 0
    prompt_chars: Stats = field(default_factory=Stats)
    prompt_tokens: Stats | None = None  # only with server.tokenizer
    # regenerate: all: requests per conversation (one per user turn); None otherwise
    requests: Stats | None = None
    read_s: float = 0.0
    # From Redis, if a run already started: tokens counted and prompts done.
    used: int | None = None
    done: int | None = None
    discarded: int = 0   # of the done prompts, those that ended discarded (guard or gate)
    quality: str = ""    # the guard, gates, retry_discarded and budget_counts, in one line (quality_line)
    error: str | None = None
    # Derived by finish():
    unique: int = 0   # = valid (kept for readers of --json from before valid meant unique ids)
    responses_needed: int = 0
    runs_out: bool = False
    expected_tokens: int = 0
    expected_bytes: int = 0   # what its rows will add to output_dir (see BYTES_PER_TOKEN)
    est_s: float | None = None

    @property
    def ok(self) -> bool:
        """Can this dataset run: readable, with at least one valid prompt."""
        return self.error is None and self.unique > 0

    def finish(self, tok_s: float | None) -> None:
        """What the budget buys at prior_mean_tokens, whether the prompts last, and how long it takes."""
        self.unique = self.valid
        left = max(0, self.budget - (self.used or 0))
        # regenerate: all: a row is a conversation of several requests (prompt tokens are already
        # summed over them)
        per_row = self.requests.mean if self.requests is not None and self.requests.mean else 1.0
        generated = per_row * self.prior_mean_tokens
        per_response = generated
        if self.count == "total" and self.prompt_tokens is not None and self.prompt_tokens.mean:
            per_response += round(self.prompt_tokens.mean)  # prompt tokens count toward the budget too
        self.responses_needed = math.ceil(left / per_response)
        available = max(0, self.unique * self.samples - (self.done or 0))
        self.runs_out = available < self.responses_needed
        responses = min(available, self.responses_needed)
        # Generated (completion) tokens: what the servers' tok/s is measured in.
        self.expected_tokens = round(responses * generated)
        self.expected_bytes = round(responses * (generated * BYTES_PER_TOKEN + ROW_OVERHEAD
                                                 + 1.1 * (self.prompt_chars.mean or 0)))
        self.est_s = self.expected_tokens / tok_s if tok_s else None

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["prompt_chars"] = self.prompt_chars.as_dict()
        out["prompt_tokens"] = self.prompt_tokens.as_dict() if self.prompt_tokens else None
        out["requests"] = self.requests.as_dict() if self.requests else None
        out["ok"] = self.ok
        return out


def check_dataset(ds: DatasetConfig, cfg: Config) -> DatasetCheck:
    """Stream ``ds`` through the producer's reader and count what a run would see."""
    out = DatasetCheck(ds.name, ds.path, ds.budget or 0, ds.mode, ds.count, ds.prior_mean, ds.answers_max,
                       ds.samples == "auto")
    out.quality = quality_line(ds)
    if ds.regenerate == "all":
        out.requests = Stats()
    started = time.perf_counter()
    tally = RowTally()
    try:
        for item in read_prompts(ds, cfg.server):
            item = refuse_suffix(ds, item)  # as the producer does (samples > 1)
            tally.add(item)
            if isinstance(item, Prompt):
                out.prompt_chars.add(prompt_chars(item.messages + (item.turns or [])))
                if out.requests is not None:
                    out.requests.add(1 + len(item.turns or []))
                if item.prompt_tokens is not None:
                    if out.prompt_tokens is None:
                        out.prompt_tokens = Stats()
                    out.prompt_tokens.add(item.prompt_tokens)
            elif isinstance(item, Invalid):
                # every repeated id is one reason ("duplicate id"), whatever the id
                key = DUPLICATE if item.duplicate else reason_key(item.reason)
                out.invalid_by_reason[key] = out.invalid_by_reason.get(key, 0) + 1
                if key not in out.first_at:
                    out.first_at[key] = item.line
                    out.first_reason[key] = _ROW_PREFIX.sub("", item.reason)
                    # the reader names the row in the reason of every format but JSONL (lines)
                    out.position = "row" if _ROW_PREFIX.match(item.reason) else out.position
    except (BudgetqError, OSError, ValueError) as exc:
        # A missing file, an unreadable tokenizer, a broken Parquet file: this dataset cannot
        # run, the others are still checked.
        out.error = f"{type(exc).__name__}: {exc}" if not isinstance(exc, BudgetqError) else str(exc)
    out.valid, out.invalid, out.duplicates, out.filtered = tally.valid, tally.invalid, tally.duplicates, tally.filtered
    out.read_s = time.perf_counter() - started
    return out


@dataclass
class RedisCheck:
    url: str  # host:port/db, no credentials
    ok: bool
    error: str | None = None


def check_redis(cfg: Config, datasets: list[DatasetCheck], timeout_s: float) -> RedisCheck:
    """Reads only (GET, SCARD): works with a read-only ACL user, changes no key."""
    where = describe(cfg.redis_url)
    try:
        conn = connect_once(cfg.redis_url, timeout_s)
        try:
            for d in datasets:
                used = conn.get(keys.used_key(d.name))
                d.used = int(used) if used is not None else None
                d.done = int(conn.scard(keys.done_key(d.name))) if used is not None else None
                d.discarded = int(conn.hget(keys.stats_key(d.name), Stat.DISCARDED) or 0) if used is not None else 0
        finally:
            conn.close()
    except (redis.RedisError, ValueError) as exc:  # ValueError: a URL redis-py cannot parse
        return RedisCheck(where, False, redact_url(f"{type(exc).__name__}: {exc}"))
    return RedisCheck(where, True)


@dataclass
class ServerCheck:
    url: str
    ok: bool
    models: list[str]
    model_path: str | None
    error: str | None = None
    kind: str | None = None         # shared/server_kind.py: sglang, vllm, openai (None: not known)
    model: str | None = None        # the model its requests will name, when resolved (server.model unset)


def model_matches(configured: str | None, models: list[str], model_path: str | None) -> bool:
    """``server.model`` names what the server serves: a /v1/models id, its model_path, or the
    path's last part. ``default`` (any name, to SGLang) and unset accept whatever one model it serves."""
    if configured in (None, SGLANG_MODEL):
        return True
    names = set(models)
    if model_path:
        names |= {model_path, model_path.rstrip("/").rsplit("/", 1)[-1]}
    return configured in names


Probe = Callable[[str], Any]  # url -> object with .models, .model_path, .error, .kind (worker.sglang_client.ServerInfo)


def check_server(cfg: Config, url: str, probe: Probe) -> ServerCheck:
    info = probe(url)
    if info.error:
        return ServerCheck(url, False, [], None, info.error)
    kind = getattr(info, "kind", None)
    if not model_matches(cfg.server.model, info.models, info.model_path):
        served = ", ".join(repr(m) for m in info.models) or repr(info.model_path)
        return ServerCheck(url, False, info.models, info.model_path,
                           f"server.model {cfg.server.model!r} is not what it serves ({served})", kind)
    try:  # the worker's rule: unset, a server that is not SGLang gets the one model it lists
        model = server_kind.resolve_model(cfg.server.model, kind or server_kind.OPENAI, info.models, url)
    except ConfigError as exc:
        return ServerCheck(url, False, info.models, info.model_path, str(exc), kind)
    return ServerCheck(url, True, info.models, info.model_path, None, kind,
                       model if cfg.server.model is None and kind != server_kind.SGLANG else None)


@dataclass
class OutputCheck:
    """output_dir: can files be created there, and does the estimated output fit above min_free_mb."""
    path: str
    ok: bool
    free_bytes: int | None
    expected_bytes: int
    min_free_bytes: int
    error: str | None = None


def check_output(cfg: Config, datasets: list[DatasetCheck]) -> OutputCheck:
    """A probe file (created and removed at once) and the volume's free space against the estimate."""
    path, min_free = str(cfg.output_dir), int(cfg.min_free_mb * MB)
    expected = sum(d.expected_bytes for d in datasets)
    why = disk_guard.probe(cfg.output_dir) or disk_guard.low_space(cfg.output_dir, min_free)
    if why is not None:
        return OutputCheck(path, False, None, expected, min_free, why)
    free = disk_guard.free_bytes(cfg.output_dir)
    if expected > free - min_free:
        return OutputCheck(path, False, free, expected, min_free,
                           f"~{expected / MB:,.1f} MB of rows expected would not fit: {free / MB:,.1f} MB free, "
                           f"min_free_mb {cfg.min_free_mb:g} kept free (free space, or lower min_free_mb)")
    return OutputCheck(path, True, free, expected, min_free)


@dataclass
class CheckReport:
    datasets: list[DatasetCheck]
    redis: RedisCheck
    servers: list[ServerCheck]
    tok_s: float | None
    output: OutputCheck | None = None
    strict: bool = False   # `check --strict`: a dataset with invalid rows fails the check too

    @property
    def with_invalid(self) -> list[DatasetCheck]:
        """The datasets that fail --strict: invalid rows (repeated ids included; filtered ones are not errors)."""
        return [d for d in self.datasets if d.invalid] if self.strict else []

    @property
    def ok(self) -> bool:
        return all(d.ok for d in self.datasets) and self.redis.ok and all(s.ok for s in self.servers) \
            and bool(self.datasets) and (self.output is None or self.output.ok) and not self.with_invalid

    @property
    def est_s(self) -> float | None:
        """All datasets share the servers: the run takes their tokens together at tok_s."""
        return sum(d.expected_tokens for d in self.datasets) / self.tok_s if self.tok_s else None

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "strict": self.strict, "tok_s": self.tok_s, "est_s": self.est_s,
                "datasets": [d.as_dict() for d in self.datasets], "redis": asdict(self.redis),
                "servers": [asdict(s) for s in self.servers],
                "output": asdict(self.output) if self.output is not None else None}


def run_check(cfg: Config, probe: Probe, tok_s: float | None = None, timeout_s: float = 3.0,
              strict: bool = False) -> CheckReport:
    datasets = [check_dataset(ds, cfg) for ds in cfg.datasets]
    rc = check_redis(cfg, datasets, timeout_s)
    for d in datasets:
        d.finish(tok_s)
    servers = [check_server(cfg, url, probe) for url in cfg.server.urls]
    return CheckReport(datasets, rc, servers, tok_s, check_output(cfg, datasets), strict)


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def _stats(s: Stats) -> str:
    return f"mean {s.mean:,.0f}, min {s.min:,}, max {s.max:,}" if s.count else "none"


def format_report(r: CheckReport) -> str:
    lines: list[str] = []
    for d in r.datasets:
        lines.append(f"{d.name}: {'OK' if d.ok else 'CANNOT RUN'}  ({d.path})")
        if d.error:
            lines.append(f"  error: {d.error}")
            continue
        tally = RowTally(d.valid, d.invalid, d.duplicates, d.filtered)
        lines.append(f"  prompts: {tally.describe()}; read in {d.read_s:.1f} s")
        for key, n in sorted(d.invalid_by_reason.items(), key=lambda kv: -kv[1]):
            lines.append(f"    invalid: {n:,} x {d.first_reason[key]} (first at {d.position} {d.first_at[key]})")
        tokens = _stats(d.prompt_tokens) if d.prompt_tokens else "not counted (no server.tokenizer)"
        lines.append(f"  prompt chars: {_stats(d.prompt_chars)}; prompt tokens: {tokens}")
        if d.quality:
            lines.append(f"  {d.quality}")
        if d.requests is not None:
            rq = d.requests
            lines.append(f"  regenerate: all: requests per conversation: mean {rq.mean or 0:.2f}, min {rq.min}, "
                         f"max {rq.max} ({rq.total:,} in all; prompt chars count each user turn once, prompt tokens "
                         "are summed over the requests, before the model's answers join the context)")
        lines += samples_lines(d.auto, d.samples, d.unique, d.responses_needed, d.runs_out)
        done_what = "answers" if d.samples > 1 else "prompts"
        discarded = f" ({d.discarded:,} of them discarded by the guard or a gate)" if d.discarded else ""
        so_far = (f"; {format_tokens(d.used)} used and {d.done:,} {done_what} done already{discarded}"
                  if d.used is not None else "")
        lines.append(f"  budget {format_tokens(d.budget)} ({d.mode}, count {d.count}){so_far}: "
                     f"~{d.responses_needed:,} {'conversations' if d.requests else 'responses'} at "
                     f"prior_mean_tokens {d.prior_mean_tokens:,}")
        if d.runs_out:
            left_what = f"answers ({d.samples} a prompt)" if d.samples > 1 else "left"
            lines.append(f"  RUNS OUT of prompts before its budget: {max(0, d.unique * d.samples - (d.done or 0)):,} "
                         f"{left_what}, ~{d.responses_needed:,} needed")
        if d.est_s is not None:
            lines.append(f"  ~{format_tokens(d.expected_tokens)} tokens to generate: ~{_duration(d.est_s)} "
                         f"at {r.tok_s:,.0f} tok/s")
    if (o := r.output) is not None:
        lines.append(f"output_dir {o.path}: " + (
            f"OK, {(o.free_bytes or 0) / MB:,.0f} MB free, ~{o.expected_bytes / MB:,.1f} MB of rows expected "
            f"(min_free_mb {o.min_free_bytes / MB:g} kept free)" if o.ok else f"FAILED: {o.error}"))
    rd = r.redis
    lines.append(f"redis {rd.url}: " + ("OK" if rd.ok else f"FAILED: {rd.error}"))
    for s in r.servers:
        served = ", ".join(s.models) or (s.model_path or "?")
        if s.kind not in (None, server_kind.SGLANG):
            served += f" ({server_kind.LABELS[s.kind]})"
        if s.model is not None:
            served += f"; requests name {s.model!r} (server.model unset)"
        lines.append(f"server {s.url}: " + (f"OK, serves {served}" if s.ok else f"FAILED: {s.error}"))
    if r.est_s is not None:
        lines.append(f"all datasets: ~{_duration(r.est_s)} at {r.tok_s:,.0f} tok/s")
    if not r.datasets:
        lines.append("no datasets in the config")
    if r.ok:
        lines.append("check: every dataset can run")
    else:
        why = [] if replace(r, strict=False).ok else ["see above"]
        if r.with_invalid:
            why.append("--strict: invalid rows in " + ", ".join(f"{d.name} ({d.invalid:,})" for d in r.with_invalid))
        lines.append(f"check: FAILED ({'; '.join(why)})")
    return "\n".join(lines)
