"""vLLM's load, read from its Prometheus ``/metrics`` (worker/capacity.py sizes from it).

vLLM has no ``/server_info`` or ``/v1/loads`` and does not publish its ``max_num_seqs``; its
``/metrics`` has, per engine (``engine="N"``: one per data-parallel rank, summed here), the
scheduler's state (vllm/v1/metrics/loggers.py, set in ``PrometheusStatLogger.record``):

- ``vllm:num_requests_running``: requests in the running batch;
- ``vllm:num_requests_waiting``: waiting requests, = ``num_requests_waiting_by_reason`` summed over
  ``reason="capacity"`` (no room: ``max_num_seqs``, the step's token budget or KV blocks) and
  ``reason="deferred"`` (LoRA budget, KV transfer);
- ``vllm:kv_cache_usage_perc``: the KV cache's used fraction (1 = full);
- ``vllm:num_preemptions_total``: running requests evicted because KV blocks ran out (they are
  recomputed later: work lost).

Its running slots are therefore estimated from the load (worker/capacity.py ``next_slots``).

A worker with a fixed ``concurrency`` sizes nothing, but still reads each vLLM endpoint's load every
``capacity_interval_s`` (``read_loads``) and publishes it, so ``budgetq status`` shows vLLM's running,
waiting and KV cache use whatever the worker's concurrency.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from budgetq.shared import server_kind
from budgetq.worker.endpoints import EndpointPool

log = logging.getLogger("budgetq.capacity")
_READ_TIMEOUT = aiohttp.ClientTimeout(total=5)

_RUNNING, _WAITING = "vllm:num_requests_running", "vllm:num_requests_waiting"
_BY_REASON, _KV, _PREEMPTED = "vllm:num_requests_waiting_by_reason", "vllm:kv_cache_usage_perc", \
    "vllm:num_preemptions_total"
_WANTED = (_RUNNING, _WAITING, _KV, _PREEMPTED)   # _BY_REASON starts with _WAITING


@dataclass(frozen=True)
class VllmLoad:
    running: int
    waiting: int            # for any reason
    waiting_capacity: int   # for room (the reason="capacity" part; all of waiting on a vLLM without it)
    kv_cache_use: float     # 0..1, the fullest engine's
    preemptions: int        # cumulative, summed over engines
    engines: int


def parse_metrics(text: str) -> VllmLoad:
    """The load in a vLLM ``/metrics`` exposition; ValueError if a needed metric is missing or bad.

    Only the lines of the metrics read are parsed (the exposition is ~50 KB of histograms), with
    prometheus_client's parser: labels and escapes as Prometheus writes them."""
    lines = "\n".join(line for line in text.splitlines() if line.startswith(_WANTED)) + "\n"
    found: dict[str, dict[str, float]] = {}
    try:
        for family in text_string_to_metric_families(lines):
            for s in family.samples:
                key = s.labels.get("engine", "0")
                if s.name == _BY_REASON:
                    if s.labels.get("reason") != "capacity":
                        continue
                found.setdefault(s.name, {})[key] = s.value
    except (ValueError, IndexError, TypeError) as exc:   # the parser's errors on a malformed line
        raise ValueError(f"unreadable vLLM metrics: {exc}") from None
    missing = [n for n in (_RUNNING, _WAITING, _KV) if n not in found]
    if missing:
        raise ValueError(f"no {', '.join(missing)} in /metrics (not a vLLM server, or not its v1 engine)")
    values = [v for per in found.values() for v in per.values()]
    if any(v != v or v < 0 or v == float("inf") for v in values):
        raise ValueError("negative, NaN or infinite value in vLLM's load metrics")
    running, waiting = (int(sum(found[n].values())) for n in (_RUNNING, _WAITING))
    by_reason = found.get(_BY_REASON)
    return VllmLoad(running=running, waiting=waiting,
                    waiting_capacity=int(sum(by_reason.values())) if by_reason else waiting,
                    kv_cache_use=max(found[_KV].values()),
                    preemptions=int(sum(found.get(_PREEMPTED, {}).values())),
                    engines=len(found[_RUNNING]))



def load_view(load: VllmLoad, slots: int | None) -> dict:
    """An endpoint's ``load`` as the worker publishes it (``slots``: the running slots sized from, if any)."""
    return {"running": load.running, "waiting": load.waiting, "kv_cache_use": round(load.kv_cache_use, 4),
            "slots": slots, "read_at": round(time.time(), 3)}


async def read_loads(pool: EndpointPool, unreadable: dict[str, str]) -> None:
    """Fixed concurrency: each healthy vLLM endpoint's load, for ``budgetq status`` (nothing is sized from it).
    An endpoint that cannot be read keeps its last load and says why once (``unreadable``: url -> why)."""
    for ep in pool.endpoints:
        if not ep.healthy or ep.kind != server_kind.VLLM:
            continue
        try:
            async with pool.session.get(ep.url + "/metrics", headers=pool.headers, timeout=_READ_TIMEOUT) as resp:
                resp.raise_for_status()
                load = parse_metrics(await resp.text())
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            why = str(exc) or type(exc).__name__
            if unreadable.get(ep.url) != why:
                unreadable[ep.url] = why
                log.info("load: cannot read %s/metrics (%s)", ep.url, why)
            continue
        unreadable.pop(ep.url, None)
        ep.load = load_view(load, None)
