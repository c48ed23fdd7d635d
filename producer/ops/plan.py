"""``budgetq plan``: what a deadline and a total mean per dataset, before or during a run.

Per dataset: its weight, its effective budget (producer/run/allocation.py's water-filling, as the
producer's budget loop computes it), the prompts that budget needs at the mean length (measured,
or prior_mean_tokens before any result) against the prompts it has, and when it would finish at
the fleet's rate (``--tok-s``, or the rate the live run measured). Reads Redis if it answers
(live settings, what is spent), writes nothing.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import redis

from budgetq.producer.ops.check import check_dataset
from budgetq.producer.run.allocation import Claim, byte_shares, deadline_total, water_fill
from budgetq.shared import features_bytes, keys, run_plan
from budgetq.shared.config import Config
from budgetq.shared.ends import tokens_to_end
from budgetq.shared.redis_conn import connect_once
from budgetq.shared.status import format_duration
from budgetq.shared.tokens import format_tokens


@dataclass
class PlanRow:
    name: str
    weight: float
    cap: int | None
    budget: int
    used: int
    mean: float
    available: int          # prompts not yet done
    needed: int             # prompts the rest of the budget takes at the mean
    finish: float | None    # unix time, at the fleet's rate shared by the datasets still running
    # hidden states (docs/hidden_states.md "Disk as a budget"): bytes a token takes on disk, what the
    # token budget takes at that rate, the dataset's disk budget (its share of features.max_bytes)
    bytes_per_token: int | None = None
    features_bytes: int | None = None
    disk_budget: int | None = None
    # samples: auto: the file's prompts and max_samples (how many answers a prompt the budget needs)
    prompts: int = 0
    max_samples: int | None = None

    @property
    def runs_out(self) -> bool:
        return self.needed > self.available


@dataclass
class Plan:
    now: float
    deadline: float | None
    total_budget: int | None
    tok_s: float | None
    rate_source: str
    tail_s: float
    rows: list[PlanRow]
    redis_error: str | None = None
    note: str | None = None
    # bytes/token and the bytes of the whole budget at the hidden sizes of SHOWN_HIDDEN (and the model's)
    disk_table: list[dict] = field(default_factory=list)


def _redis_view(cfg: Config, timeout_s: float) -> tuple[dict[str, Any], str | None]:
    try:
        conn = connect_once(cfg.redis_url, timeout_s)
        try:
            out: dict[str, Any] = {"state": run_plan.read_state(conn), "settings": None, "used": {}, "done": {},
                                   "stats": {}}
            if conn.exists(keys.PLAN):
                out["settings"] = run_plan.read_settings(conn)
            for ds in cfg.datasets:
                out["used"][ds.name] = int(conn.get(keys.used_key(ds.name)) or 0)
                out["done"][ds.name] = int(conn.scard(keys.done_key(ds.name)))
                st = conn.hmget(keys.stats_key(ds.name), ["committed", "sum_tokens"])
                out["stats"][ds.name] = (int(float(st[0] or 0)), int(float(st[1] or 0)))
            return out, None
        finally:
            conn.close()
    except (redis.RedisError, ValueError) as exc:
        return {"state": None, "settings": None, "used": {}, "done": {}, "stats": {}}, f"{type(exc).__name__}: {exc}"


def _finish_times(now: float, remaining: dict[str, float], tok_s: float) -> dict[str, float]:
    """Processor sharing: the fleet's rate split evenly among the datasets still running."""
    left = {n: r for n, r in remaining.items() if r > 0}
    out = {n: now for n, r in remaining.items() if r <= 0}
    t = now
    while left:
        share = tok_s / len(left)
        name = min(left, key=lambda n: left[n])
        dt = left[name] / share
        t += dt
        for n in left:
            left[n] -= share * dt
        out[name] = t
        del left[name]
    return out


def make_plan(cfg: Config, tok_s: float | None = None, timeout_s: float = 3.0, now: float | None = None,
              from_config: bool = False) -> Plan:
    """The plan of the live run (its settings in Redis), or of the config's run: settings when no
    run has started or ``from_config`` (what if: `budgetq plan --deadline ... --total-budget ...`)."""
    now = time.time() if now is None else now
    view, err = _redis_view(cfg, timeout_s)
    settings = view["settings"]
    if settings is None or from_config:  # the config's values (a relative deadline counted from now)
        settings = run_plan.PlanSettings(run_plan.parse_deadline(cfg.run.deadline, now), cfg.run.total_budget,
                                         {d.name: d.weight for d in cfg.datasets})
    state = view["state"] or {}
    source = "--tok-s"
    if tok_s is None and state.get("tok_s"):
        tok_s, source = float(state["tok_s"]), "measured on the live run"
    elif tok_s is None:
        source = "unknown"
    tail = float(state.get("tail_s") or 0.0)
    claims, rows = [], []
    for ds in cfg.datasets:
        chk = check_dataset(ds, cfg)
        used = view["used"].get(ds.name, 0)
        done = view["done"].get(ds.name, 0)
        committed, sum_tokens = view["stats"].get(ds.name, (0, 0))
        mean = sum_tokens / committed if committed >= 20 else float(ds.prior_mean)
        # valid: unique ids (producer/reading/tally.py); samples: N answers each, done counts answers
        available = max(0, chk.valid * ds.answers_max - done)
        can = used + int(available * mean)
        cap = can if ds.budget is None else min(ds.budget, can)
        claims.append(Claim(ds.name, settings.weight(ds.name), floor=used, cap=cap))
        rows.append(PlanRow(ds.name, settings.weight(ds.name), ds.budget, ds.budget or 0, used, mean, available, 0,
                            None, prompts=chk.valid, max_samples=ds.max_samples if ds.samples == "auto" else None))
    totals = []
    note = None
    if settings.total_budget is not None:
        totals.append(settings.total_budget)
    if settings.deadline is not None:
        if tok_s:
            totals.append(deadline_total(sum(r.used for r in rows), 0, tok_s, now, settings.deadline, tail))
        else:
            note = "the deadline needs a rate: pass --tok-s N (or plan during a run, which measures it)"
    # As the budget loop computes it; without a total or a usable deadline, each dataset's own budget.
    shares = water_fill(min(totals), claims) if totals else {r.name: r.cap or r.used for r in rows}
    for r in rows:
        r.budget = shares[r.name]
        r.needed = math.ceil(max(0, r.budget - r.used) / r.mean) if r.mean > 0 else 0
    table = _disk(cfg, rows)
    if tok_s:
        # Each dataset's end (shared/ends.py): its budget or its prompts, whichever comes first.
        remaining = {r.name: tokens_to_end(r.budget - r.used, r.available, r.mean)[0] for r in rows}
        for name, t in _finish_times(now, remaining, tok_s).items():
            next(r for r in rows if r.name == name).finish = t
    return Plan(now, settings.deadline, settings.total_budget, tok_s, source, tail, rows, err, note, table)


def _disk(cfg: Config, rows: list[PlanRow]) -> list[dict]:
    """Hidden states on disk: per dataset the bytes a token takes (the model's config.json, the layers the
    backend stores, features.dtype), what its token budget takes at that rate, its share of
    features.max_bytes (split by weight over the datasets that capture, or all of them: as `budgetq features`
    would); and the same for the hidden sizes of SHOWN_HIDDEN, the budgets' sum at each."""
    bpt = features_bytes.config_bytes_per_token(cfg)
    capturing = [ds for ds in cfg.datasets if ds.capture == "features"] or cfg.datasets
    shares = byte_shares(cfg.features.max_bytes, {ds.name: ds.weight for ds in capturing},
                         {ds.name: ds.features_max_bytes for ds in capturing}, {})
    for r in rows:
        r.bytes_per_token = bpt
        r.features_bytes = None if bpt is None else r.budget * bpt
        r.disk_budget = shares.get(r.name)
    layers = features_bytes.stored_layers(cfg)
    tokens = sum(r.budget for r in rows)
    shape = features_bytes.model_shape(cfg)
    hidden = sorted({*features_bytes.SHOWN_HIDDEN, *([shape[0]] if shape else [])})
    out = []
    for h in hidden:
        bf16, fp8 = (features_bytes.bytes_per_token(h, layers, d) for d in ("bfloat16", "fp8"))
        out.append({"hidden": h, "layers": layers, "model": bool(shape and shape[0] == h), "bf16_per_token": bf16,
                    "fp8_per_token": fp8, "tokens": tokens, "bf16_bytes": tokens * bf16, "fp8_bytes": tokens * fp8})
    return out


def format_plan(p: Plan) -> str:
    lines = []
    head = []
    if p.deadline is not None:
        left = p.deadline - p.now
        head.append(f"deadline {run_plan.format_when(p.deadline)} "
                    f"({'in ' + format_duration(left) if left > 0 else 'passed'})")
    if p.total_budget is not None:
        head.append(f"total {format_tokens(p.total_budget)}")
    head.append(f"rate {p.tok_s:,.0f} tok/s ({p.rate_source})" if p.tok_s else "rate unknown")
    if p.tail_s:
        head.append(f"last responses take {p.tail_s:.1f} s")
    lines.append("; ".join(head))
    if p.redis_error:
        lines.append(f"redis not read ({p.redis_error}): nothing spent assumed")
    cols = ("dataset", "weight", "budget", "used", "mean", "prompts needed", "available", "finish")
    table = [cols]
    for r in p.rows:
        finish = "-"
        if r.finish is not None:
            finish = time.strftime("%H:%M:%S", time.gmtime(r.finish)) + f" (+{format_duration(r.finish - p.now)})"
            if p.deadline is not None and r.finish > p.deadline + 1:
                finish += " after the deadline"
        needed = f"{r.needed:,}" + (" RUNS OUT" if r.runs_out else "")
        cap = "" if r.cap is None else f" (cap {format_tokens(r.cap)})"
        table.append((r.name, f"{r.weight:g}", format_tokens(r.budget) + cap, format_tokens(r.used), f"{r.mean:,.0f}",
                      needed, f"{r.available:,}", finish))
    last = max((r.finish for r in p.rows if r.finish is not None), default=None)
    table.append(("all", "", format_tokens(sum(r.budget for r in p.rows)), format_tokens(sum(r.used for r in p.rows)),
                  "", f"{sum(r.needed for r in p.rows):,}", f"{sum(r.available for r in p.rows):,}",
                  "-" if last is None else time.strftime("%H:%M:%S", time.gmtime(last))))
    widths = [max(len(str(row[i])) for row in table) for i in range(len(cols))]
    for row in table:
        lines.append("  ".join(str(c).ljust(w) if i in (0, 7) else str(c).rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths, strict=True))).rstrip())
    for r in p.rows:
        if r.max_samples and r.prompts:  # answers done + needed, over the prompts: the rounds its budget takes
            per = (r.max_samples * r.prompts - r.available + r.needed) / r.prompts
            lines.append(f"{r.name}: samples: auto: ~{per:,.2f} answers per prompt at mean {r.mean:,.0f}"
                         + (f"; the cap binds (max_samples {r.max_samples})" if r.runs_out else ""))
    if p.note:
        lines.append(p.note)
    lines += _format_disk(p)
    return "\n".join(lines)


def _format_disk(p: Plan) -> list[str]:
    fb = features_bytes.format_bytes
    lines = ["", "hidden states on disk (bytes/token: layers stored x hidden x dtype + id and mask; the budget's "
             "tokens at that rate: features also store each prompt's tokens, so with count: completion it is a floor)"]
    for r in p.rows:
        per = (f"{r.bytes_per_token:,} bytes/token" if r.bytes_per_token
               else "bytes/token unknown (no local config.json)")
        first = (r.features_bytes is not None and r.disk_budget is not None and r.features_bytes > r.disk_budget)
        lines.append(f"  {r.name}: {per}, budget {format_tokens(r.budget)} tokens -> {fb(r.features_bytes)}; "
                     f"disk budget {fb(r.disk_budget) if r.disk_budget is not None else 'none'}"
                     + (" (the disk budget stops its capture first)" if first else ""))
    if p.disk_table:
        t = p.disk_table[0]
        lines.append(f"  all {format_tokens(t['tokens'])} tokens, {t['layers']} layers stored:")
        lines.append(f"  {'hidden':>8}  {'bf16 B/token':>12}  {'bf16 total':>10}  {'fp8 B/token':>11}  "
                     f"{'fp8 total':>10}")
        for t in p.disk_table:
            mark = "  (this model)" if t["model"] else ""
            lines.append(f"  {t['hidden']:>8}  {t['bf16_per_token']:>12,}  {fb(t['bf16_bytes']):>10}  "
                         f"{t['fp8_per_token']:>11,}  {fb(t['fp8_bytes']):>10}{mark}")
    return lines
