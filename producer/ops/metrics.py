"""Prometheus exposition of a status snapshot (``/metrics`` of the monitor).

A custom collector built from one snapshot per scrape: the numbers come from Redis, which
every worker and the producer write, so any number of monitors report the same totals and a
restarted monitor loses nothing (no in-process counters).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from budgetq.shared.ends import Stop
from budgetq.shared.ledger import STATES
from budgetq.shared.status import COUNT_FIELDS

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (metric name, help, snapshot field) of the per-dataset gauges.
_DATASET_GAUGES = (
    ("budgetq_budget_tokens", "Token budget of the dataset.", "budget"),
    ("budgetq_used_tokens", "Tokens counted toward the budget.", "used"),
    ("budgetq_reserved_tokens", "Tokens reserved by requests in flight.", "reserved"),
    ("budgetq_in_flight", "Requests of the dataset in flight at the servers.", "in_flight"),
    ("budgetq_queued_jobs", "Jobs waiting in the dataset's RQ queue.", "queued"),
)
# Reasons named per endpoint in budgetq_endpoint_faults; the rest are summed under "(other)". Reasons
# are a small vocabulary (HTTP status and body type, timeout, refused, ...) but a fallback is an
# exception's class name: the cap keeps one odd server from growing the label set without bound.
MAX_REASONS = 12


class SnapshotCollector:
    """Yields every budgetq metric from one snapshot dict (see shared.status.snapshot)."""

    def __init__(self, snap: dict[str, Any]) -> None:
        self.snap = snap

    def collect(self) -> Iterator[Metric]:
        ds_list = self.snap["datasets"]
        for name, help_text, field in _DATASET_GAUGES:
            g = GaugeMetricFamily(name, help_text, labels=["dataset"])
            for d in ds_list:
                g.add_metric([d["dataset"]], float(d[field]))
            yield g
        tok_s = GaugeMetricFamily("budgetq_tokens_per_second", "Counted tokens per second over the last minute "
                                  "(absent once the dataset is done).", labels=["dataset"])
        eta = GaugeMetricFamily("budgetq_eta_seconds", "Estimated seconds until the dataset ends: the first of its "
                                "budget, its prompts and the deadline (absent while there is no rate, and once the "
                                "dataset is done).", labels=["dataset"])
        ledger = GaugeMetricFamily("budgetq_ledger_prompts", "Prompts (answers, with samples) of the dataset by "
                                   "the state they are in now (the ledger; they sum to "
                                   "budgetq_ledger_entered_prompts).", labels=["dataset", "state"])
        entered = GaugeMetricFamily("budgetq_ledger_entered_prompts", "Prompts (answers, with samples) enqueued or "
                                    "adopted from disk.", labels=["dataset"])
        unaccounted = GaugeMetricFamily("budgetq_ledger_unaccounted_prompts", "Entered minus the sum of the "
                                        "states: 0 when every prompt is accounted for (absent for a dataset whose "
                                        "state predates the ledger).", labels=["dataset"])
        unread = GaugeMetricFamily("budgetq_ledger_unread_prompts", "Rows of the dataset's file not read (yet, "
                                   "or because the budget came first), in answers (x samples; up to max_samples "
                                   "for auto); absent while the file's size is unknown.", labels=["dataset"])
        stop = GaugeMetricFamily("budgetq_stop", "1 for the dataset's stop reason, 0 for the others (budget "
                                 "reached, deadline, out of prompts, held, paused, interrupted, running).",
                                 labels=["dataset", "reason"])
        failed_registry = GaugeMetricFamily("budgetq_failed_registry_jobs", "Jobs in RQ's failed registry "
                                            "(retryable with retry-failed).", labels=["dataset"])
        paused = GaugeMetricFamily("budgetq_paused", "1 while an operator has paused the dataset.",
                                   labels=["dataset"])
        held = GaugeMetricFamily("budgetq_held", "1 while the producer holds the dataset's admissions (the output "
                                 "disk is full or read-only; the reason is in status).", labels=["dataset"])
        exhausted = GaugeMetricFamily("budgetq_exhausted", "1 once no new request can be admitted.",
                                      labels=["dataset"])
        jobs = CounterMetricFamily("budgetq_jobs", "Job events, cumulative (how often each happened; where the "
                                   "prompts are now is budgetq_ledger_prompts).", labels=["dataset", "state"])
        tokens = CounterMetricFamily("budgetq_tokens", "Tokens generated by the servers (generated, = spent), "
                                     "kept as rows (kept), cut by max_tokens and kept aside (truncated), "
                                     "discarded by the guard or a gate (discarded), and generated for no result "
                                     "(wasted: aborted or rejected).", labels=["dataset", "kind"])
        discarded = CounterMetricFamily("budgetq_discarded_tokens", "Completion tokens of the answers the "
                                        "degeneration guard or a quality gate discarded, by reason (loop, empty, "
                                        "unclosed_reasoning, think_tags, validator).", labels=["dataset", "reason"])
        discarded_answers = CounterMetricFamily("budgetq_discarded_answers", "Answers the guard or a gate "
                                                "discarded, by reason (retried ones too).",
                                                labels=["dataset", "reason"])
        for d in ds_list:
            if d["tok_s"] is not None:
                tok_s.add_metric([d["dataset"]], float(d["tok_s"]))
            led = d["ledger"]
            # The failed registry is the ledger's "failed" (the snapshot's failed_registry until schema 3).
            failed_registry.add_metric([d["dataset"]], float(led["failed"]))
            for state in STATES:
                ledger.add_metric([d["dataset"], state], float(led[state]))
            entered.add_metric([d["dataset"]], float(led["entered"]))
            if led["unaccounted"] is not None:
                unaccounted.add_metric([d["dataset"]], float(led["unaccounted"]))
            if led.get("unread") is not None:
                unread.add_metric([d["dataset"]], float(led["unread"]))
            for reason in Stop:
                stop.add_metric([d["dataset"], str(reason)], 1.0 if d.get("stop") == reason else 0.0)
            if d["eta_s"] is not None:
                eta.add_metric([d["dataset"]], float(d["eta_s"]))
            paused.add_metric([d["dataset"]], 1.0 if d["paused"] else 0.0)
            held.add_metric([d["dataset"]], 1.0 if d["hold"] else 0.0)
            exhausted.add_metric([d["dataset"]], 1.0 if d["exhausted"] else 0.0)
            for state in COUNT_FIELDS:
                jobs.add_metric([d["dataset"], state], float(d["counts"][state]))
            for kind in ("generated", "wasted", "spent", "kept", "truncated", "discarded"):
                tokens.add_metric([d["dataset"], kind], float(d["tokens"].get(kind, 0)))
            for reason, v in (d.get("discarded_by_reason") or {}).items():
                discarded.add_metric([d["dataset"], reason], float(v["tokens"]))
                discarded_answers.add_metric([d["dataset"], reason], float(v["answers"]))
        yield from (failed_registry, tok_s, eta, ledger, entered, unaccounted, unread, stop, paused, held, exhausted,
                    jobs, tokens, discarded, discarded_answers)
        yield GaugeMetricFamily("budgetq_stalled", "1 while no prompt can move: no live worker while prompts "
                                "wait, or every server failing (the line is the snapshot's stall).",
                                value=1.0 if self.snap["stall"] else 0.0)
        yield GaugeMetricFamily("budgetq_producer_running", "1 while a producer runs (its presence key is fresh); "
                                "0 once it ended or was killed (shared/presence.py).",
                                value=1.0 if self.snap.get("producer") else 0.0)

        yield GaugeMetricFamily("budgetq_workers", "Live workers.", value=float(len(self.snap["workers"])))
        w_in = GaugeMetricFamily("budgetq_worker_in_flight", "Jobs a worker has in flight.", labels=["worker"])
        w_conc = GaugeMetricFamily("budgetq_worker_concurrency", "A worker's concurrency.", labels=["worker"])
        for w in self.snap["workers"]:
            w_in.add_metric([w["name"]], float(w["in_flight"]))
            w_conc.add_metric([w["name"]], float(w["concurrency"]))
        yield from (w_in, w_conc)

        healthy = GaugeMetricFamily("budgetq_endpoint_healthy", "1 if any live worker sees the endpoint "
                                    "healthy, 0 if none does (absent when no worker reports it).",
                                    labels=["endpoint"])
        e_in = GaugeMetricFamily("budgetq_endpoint_in_flight", "Requests in flight to the endpoint, "
                                 "summed over workers.", labels=["endpoint"])
        e_fail = GaugeMetricFamily("budgetq_endpoint_failures", "Consecutive failures seen, summed over "
                                   "workers.", labels=["endpoint"])
        for e in self.snap["endpoints"]:
            if e["healthy"] is not None:
                healthy.add_metric([e["url"]], 1.0 if e["healthy"] else 0.0)
            e_in.add_metric([e["url"]], float(e["in_flight"]))
            e_fail.add_metric([e["url"]], float(e["failures"]))
        yield from (healthy, e_in, e_fail)
        # prefix routing: how much of the prompts the servers found in their caches.
        e_prompt = GaugeMetricFamily("budgetq_endpoint_prompt_tokens", "Prompt tokens of answered requests, "
                                     "summed over live workers' lifetimes.", labels=["endpoint"])
        e_cached = GaugeMetricFamily("budgetq_endpoint_cached_tokens", "Of those, tokens the server had in its "
                                     "prefix cache (SGLang cached_tokens).", labels=["endpoint"])
        for e in self.snap["endpoints"]:
            e_prompt.add_metric([e["url"]], float(e.get("prompt_tokens", 0)))
            e_cached.add_metric([e["url"]], float(e.get("cached_tokens", 0)))
        yield from (e_prompt, e_cached)
        yield from _server_load(self.snap["endpoints"])
        yield from _faults(self.snap["server_faults"])
        yield from _features_bytes(self.snap.get("features") or {})
        yield GaugeMetricFamily("budgetq_snapshot_timestamp_seconds", "Redis time of this snapshot.",
                                value=float(self.snap["generated_at"]))


def _features_bytes(features: dict[str, dict[str, Any]]) -> Iterator[Metric]:
    """Hidden states on disk against each dataset's disk budget (shared/features_bytes.py)."""
    written = GaugeMetricFamily("budgetq_features_bytes_written", "Bytes of hidden states indexed on disk.",
                                labels=["dataset"])
    budget = GaugeMetricFamily("budgetq_features_max_bytes", "The dataset's disk budget: its share of "
                               "features.max_bytes (absent when unbounded).", labels=["dataset"])
    stopped = GaugeMetricFamily("budgetq_features_stopped", "1 once the dataset's capture stopped at its disk "
                                "budget.", labels=["dataset"])
    for name, f in features.items():
        written.add_metric([name], float(f["bytes_written"]))
        if f["max_bytes"] is not None:
            budget.add_metric([name], float(f["max_bytes"]))
        stopped.add_metric([name], 1.0 if f["stop"] else 0.0)
    yield from (written, budget, stopped)


def _server_load(endpoints: list[dict[str, Any]]) -> Iterator[Metric]:
    """What each server is, and its own load as a worker last read it (absent until one did)."""
    info = GaugeMetricFamily("budgetq_endpoint_server_info", "1 per endpoint a worker has asked: its kind "
                             "(sglang, vllm, openai) and the model its requests name.",
                             labels=["endpoint", "kind", "model"])
    running = GaugeMetricFamily("budgetq_endpoint_server_running", "Requests the server runs (all clients), "
                                "as last read (SGLang /v1/loads, vLLM /metrics).", labels=["endpoint"])
    waiting = GaugeMetricFamily("budgetq_endpoint_server_waiting", "Requests waiting at the server (all "
                                "clients), as last read.", labels=["endpoint"])
    kv = GaugeMetricFamily("budgetq_endpoint_kv_cache_usage", "The server's KV cache use, 0..1 (vLLM), as last "
                           "read.", labels=["endpoint"])
    for e in endpoints:
        if e.get("kind"):
            info.add_metric([e["url"], e["kind"], e.get("model") or ""], 1.0)
        load = e.get("load") or {}
        for family, key in ((running, "running"), (waiting, "waiting"), (kv, "kv_cache_use")):
            if load.get(key) is not None:
                family.add_metric([e["url"]], float(load[key]))
    yield from (info, running, waiting, kv)


def _faults(views: list[dict[str, Any]]) -> Iterator[Metric]:
    """Failed answers per endpoint and reason, and whether the endpoint counts as failing."""
    failing = GaugeMetricFamily("budgetq_endpoint_failing", "1 while the endpoint fails (every live worker has "
                                "it ejected, or its last answers were faults); see the snapshot's diagnosis.",
                                labels=["endpoint"])
    # A gauge, not a counter: the sum is over live workers' lifetimes, so it drops when a worker leaves
    # (a counter that goes down would read as a reset to rate()).
    faults = GaugeMetricFamily("budgetq_endpoint_faults", "Failed answers of the endpoint by reason, summed over "
                               "live workers' lifetimes.", labels=["endpoint", "reason"])
    for v in views:
        failing.add_metric([v["url"]], 1.0 if v["failing"] else 0.0)
        ranked = sorted(v["counts"].items(), key=lambda kv: (-kv[1], kv[0]))
        named, rest = ranked[:MAX_REASONS], ranked[MAX_REASONS:]
        for reason, n in named:
            faults.add_metric([v["url"], reason], float(n))
        if rest:
            faults.add_metric([v["url"], "(other)"], float(sum(n for _r, n in rest)))
    yield from (failing, faults)


def render(snap: dict[str, Any]) -> bytes:
    """The Prometheus text exposition of one snapshot."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(snap))
    return generate_latest(registry)
