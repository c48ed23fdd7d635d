"""The producer's main loop: register budgets, enqueue with back-pressure, collect, summarise."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import redis
from rq import Queue
from rq.serializers import JSONSerializer

from producer.collector import Collector
from producer.reader import Filtered, Invalid, Prompt, read_prompts
from shared import keys
from shared.budget import dataset_state, register_dataset
from shared.config import Config, DatasetConfig
from shared.schema import JobPayload, safe_job_id

log = logging.getLogger("budgetq.producer")
# Stats fields that mark a job as finished one way or another (the producer waits on them).
TERMINAL_STATS = ("committed", "skipped", "failed", "duplicate", "paused", "already_done")
JOB_FUNC = "worker.job.run_prompt"  # by name: producer never imports worker


@dataclass
class Feed:
    ds: DatasetConfig
    rows: Iterator[Prompt | Invalid]
    queue: Queue
    terminal_at_start: int
    enqueued: int = 0
    invalid: int = 0
    already_done: int = 0
    open: bool = True
    stop_reason: str = ""
    invalid_log: list[str] = field(default_factory=list)


def _terminal(conn: redis.Redis, ds: str) -> int:
    vals = conn.hmget(keys.stats_key(ds), list(TERMINAL_STATS))
    return sum(int(v or 0) for v in vals)


def _payload(ds: DatasetConfig, p: Prompt) -> dict:
    return JobPayload(id=p.id, dataset=ds.name, messages=p.messages, sampling=ds.sampling).model_dump(mode="json")


class Producer:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.conn = redis.Redis.from_url(cfg.redis_url)
        self.feeds: list[Feed] = []
        for ds in cfg.datasets:
            if not Path(ds.path).exists():
                raise FileNotFoundError(f"dataset {ds.name}: file not found: {ds.path}")
        for ds in cfg.datasets:
            register_dataset(self.conn, ds)
            q = Queue(keys.queue_name(ds.name), connection=self.conn, serializer=JSONSerializer)
            # Jobs left queued by an earlier producer are rebuilt from the source: dropping
            # them avoids pushing one id twice (RQ would then run it twice).
            q.empty()
            rows = (r for r in read_prompts(ds, cfg.server) if not isinstance(r, Filtered))  # Filtered: lead's to count
            self.feeds.append(Feed(ds, rows, q, _terminal(self.conn, ds.name)))
        self.collector = Collector(self.conn, cfg.output_dir, [d.name for d in cfg.datasets])
        self._invalid_files = {d.name: cfg.output_dir / f"{d.name}.invalid.jsonl" for d in cfg.datasets}

    def _record_invalid(self, f: Feed, bad: Invalid) -> None:
        f.invalid += 1
        msg = f"dataset {f.ds.name}: {f.ds.path}:{bad.line}: invalid row: {bad.reason}"
        log.warning(msg)
        with open(self._invalid_files[f.ds.name], "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"line": bad.line, "file": str(f.ds.path), "reason": bad.reason}) + "\n")
        self.conn.hincrby(keys.stats_key(f.ds.name), "invalid", 1)

    def _fill(self, f: Feed) -> None:
        state = dataset_state(self.conn, f.ds.name)
        if state.exhausted:
            f.open, f.stop_reason = False, "budget reached"
            log.info("dataset %s: budget reached (%d / %d); no more enqueueing", f.ds.name, state.used, state.limit)
            return
        room = self.cfg.high_water - f.queue.count
        if room <= 0:
            return
        batch: list[Prompt] = []
        while len(batch) < room:
            item = next(f.rows, None)
            if item is None:
                f.open, f.stop_reason = False, "rows exhausted"
                break
            if isinstance(item, Invalid):
                self._record_invalid(f, item)
            else:
                batch.append(item)
        if not batch:
            return
        job_ids = [safe_job_id(f.ds.name, p.id) for p in batch]
        done = self.conn.smismember(keys.done_key(f.ds.name), job_ids)
        unique: dict[str, Prompt] = {}
        for jid, p, is_done in zip(job_ids, batch, done, strict=True):
            if is_done:
                f.already_done += 1
            elif jid in unique:
                log.warning("dataset %s: line %d repeats prompt id %s; kept once", f.ds.name, p.line, p.id)
            else:
                unique[jid] = p
        if not unique:
            return
        data = [Queue.prepare_data(JOB_FUNC, args=(_payload(f.ds, p),), job_id=jid, timeout=-1,
                                   result_ttl=500, failure_ttl=7 * 86400, description=f"{f.ds.name}:{p.id}")
                for jid, p in unique.items()]
        with self.conn.pipeline() as pipe:
            f.queue.enqueue_many(data, pipeline=pipe)
            pipe.execute()
        f.enqueued += len(unique)

    def finished(self, f: Feed) -> bool:
        return not f.open and _terminal(self.conn, f.ds.name) - f.terminal_at_start >= f.enqueued

    def run(self, on_tick=None) -> list[dict]:
        poll = self.cfg.producer.poll_interval_s
        while True:
            for f in self.feeds:
                if f.open:
                    self._fill(f)
            wrote = self.collector.drain()
            if on_tick is not None:
                on_tick(self)
            if all(self.finished(f) for f in self.feeds):
                self.collector.drain()
                break
            if not wrote:
                time.sleep(poll)
        return self.summary()

    def summary(self) -> list[dict]:
        rows = []
        for f in self.feeds:
            st = dataset_state(self.conn, f.ds.name)
            rows.append({
                "dataset": f.ds.name, "budget": st.limit, "used": st.used, "rows": self.collector.rows(f.ds.name),
                "enqueued": f.enqueued, "skipped": st.stats.get("skipped", 0), "failed": st.stats.get("failed", 0),
                "invalid": f.invalid, "already_done": f.already_done, "stop": f.stop_reason,
            })
        return rows
