"""out/run-log.jsonl: the producer's run log, what `budgetq report` draws "over time" from.

Rows carry no completion time, and Redis may be gone by the morning after, so `produce` writes
what the report needs beside the rows, one JSON object a line, appended (a restart adds to it):

- ``start``: a `produce` began (host, pid, the datasets' configured budget, weight, prior mean,
  max_tokens). A ``start`` with no ``end`` before the next one is a producer that died.
- ``sample``: every few seconds, per dataset: used, budget (it moves with a deadline or a
  total), state, in flight, rows; the live workers; the run's deadline and total.
- ``event``: each new entry of the control logs (people's budget/pause/weight/deadline moves and
  the producer's automatic ones), copied so they outlive Redis.
- ``end``: the producer's end-of-run report (complete or not, the ledger, waste, latencies).

Writing it must never stop a run: a failed sample or write is logged once and skipped.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

import redis

from budgetq.shared import keys, run_plan
from budgetq.shared.config import Config
from budgetq.shared.redis_conn import stream_entries, text
from budgetq.shared.status import dataset_snapshots, live_workers, server_now

log = logging.getLogger("budgetq.report")
RUN_LOG = "run-log.jsonl"
# Samples are dense at first (a 10 s demo still draws a curve) and thin out as the run goes on:
# every elapsed/SAMPLES_AIM seconds, between MIN_EVERY_S and MAX_EVERY_S (57 h: ~7,000 samples, ~2 MB).
MIN_EVERY_S = 0.5
MAX_EVERY_S = 30.0
SAMPLES_AIM = 300
CONTROL_STREAMS = ((keys.CONTROL_LOG, "operator"), (keys.CONTROL_AUTO_LOG, "auto"))


def run_log_path(out_dir: Path) -> Path:
    return Path(out_dir) / RUN_LOG


def _seen_event_ids(path: Path) -> set[str]:
    """The control-log entries an earlier `produce` already copied (a restart copies each once)."""
    seen: set[str] = set()
    if not path.exists():
        return seen
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            if '"event"' not in line:
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue   # a torn last line from a killed producer
            if isinstance(rec, dict) and rec.get("kind") == "event":
                seen.add(str(rec.get("id")))
    return seen


class RunLog:
    """Appends to out/run-log.jsonl; ``tick`` is called every round of the producer's loop."""

    def __init__(self, cfg: Config, conn: redis.Redis) -> None:
        self.cfg = cfg
        self.conn = conn
        self.names = [d.name for d in cfg.datasets]
        self.path = run_log_path(cfg.output_dir)
        self._seen = _seen_event_ids(self.path)
        self._started = time.monotonic()
        self._last = float("-inf")
        self._failed = False
        self._cursor = {stream: "-" for stream, _ in CONTROL_STREAMS}  # read each entry once per produce

    def _append(self, *records: dict[str, Any]) -> None:
        data = "".join(json.dumps(r, separators=(",", ":"), default=str) + "\n" for r in records)
        # A torn last line (a producer killed mid-write) is skipped by the reader; a new line
        # after it must still start on a line of its own.
        with open(self.path, "ab") as fh:
            if fh.tell() > 0:
                with open(self.path, "rb") as rd:
                    rd.seek(-1, os.SEEK_END)
                    if rd.read(1) != b"\n":
                        fh.write(b"\n")
            fh.write(data.encode("utf-8"))

    def _guarded(self, what: str, fn: Any) -> None:
        try:
            fn()
        except (redis.RedisError, OSError, ValueError) as exc:
            if not self._failed:
                log.warning("run log %s: %s failed (%s); the report may miss part of the run", self.path, what, exc)
            self._failed = True

    def start(self) -> None:
        datasets = {d.name: {"budget": d.budget, "weight": d.weight, "prior_mean_tokens": d.prior_mean_tokens,
                             "max_tokens": d.sampling.max_tokens, "count": d.count} for d in self.cfg.datasets}
        self._guarded("start", lambda: self._append(
            {"kind": "start", "t": time.time(), "host": socket.gethostname(), "pid": os.getpid(),
             "datasets": datasets}))
        self.tick(force=True)

    def tick(self, force: bool = False) -> None:
        elapsed = time.monotonic() - self._started
        every = min(MAX_EVERY_S, max(MIN_EVERY_S, elapsed / SAMPLES_AIM))
        if not force and time.monotonic() - self._last < every:
            return
        self._last = time.monotonic()
        self._guarded("sample", lambda: self._append(*self._events(), self._sample()))

    def end(self, report: dict[str, Any]) -> None:
        self.tick(force=True)
        self._guarded("end", lambda: self._append({"kind": "end", "t": time.time(), "report": report}))

    def _sample(self) -> dict[str, Any]:
        now = server_now(self.conn)
        settings = run_plan.read_settings(self.conn)
        snaps = dataset_snapshots(self.conn, self.names, now, history_s=0)
        ds = {s["dataset"]: {"used": s["used"], "budget": s["budget"], "state": s["state"], "paused": s["paused"],
                             "in_flight": s["in_flight"], "rows": s["ledger"]["rows"], "tok_s": s["tok_s"],
                             "tokens": s["tokens"], "ledger": s["ledger"], "weight": settings.weight(s["dataset"]),
                             "discarded_by_reason": s.get("discarded_by_reason")}
              for s in snaps}
        return {"kind": "sample", "t": time.time(), "workers": live_workers(self.conn),
                "deadline": settings.deadline, "total": settings.total_budget, "ds": ds}

    def _events(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for stream, source in CONTROL_STREAMS:
            at = self._cursor[stream]
            entries = stream_entries(self.conn.xrange(stream, min=at if at == "-" else f"({at}",
                                                      count=keys.CONTROL_LOG_MAXLEN))
            for eid, fields in entries:
                self._cursor[stream] = text(eid)
                key = f"{source}:{text(eid)}"
                if key in self._seen:
                    continue
                self._seen.add(key)
                f = {text(k): text(v) for k, v in fields.items()}
                try:
                    ts = float(f.get("ts", ""))
                except ValueError:
                    ts = time.time()
                out.append({"kind": "event", "id": key, "t": ts, "source": source, "who": f.get("who"),
                            "action": f.get("action"), "dataset": f.get("dataset"), "old": f.get("old"),
                            "new": f.get("new")})
        out.sort(key=lambda e: e["t"])
        return out
