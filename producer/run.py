"""The producer's main loop: register budgets, enqueue with back-pressure, collect, summarise.

Restart-safe: a new producer on the same Redis and output dir continues where the last one
stopped. Prompts already committed (done set), already queued or running, or failed
(waiting for `budgetq retry-failed`) are not enqueued again; rows on disk that Redis forgot
are adopted first. A dataset is complete when its reading has ended (rows exhausted, or
budget reached) and no job of it is queued or started; a paused dataset's queued jobs keep
the run waiting until it is resumed.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

from rq import Queue
from rq.registry import CanceledJobRegistry, FailedJobRegistry
from rq.serializers import JSONSerializer

from producer.collector import Collector
from producer.meta import check_and_write_meta
from producer.reader import Filtered, Invalid, Prompt, read_prompts
from producer.reconcile import adopt_missing, rows_on_disk
from shared import keys
from shared.budget import dataset_state, register_dataset
from shared.config import Config, DatasetConfig
from shared.maintenance import Maintenance
from shared.redis_conn import connect
from shared.retry import REDIS_DOWN
from shared.sampling import resolve_datasets
from shared.schema import JobPayload, safe_job_id

log = logging.getLogger("budgetq.producer")
JOB_FUNC = "worker.job.run_prompt"  # by name: producer never imports worker
FAILURE_TTL_S = 7 * 86400
# RQ job statuses that mean "this prompt is already in the system": never enqueue it again.
_LIVE = {b"queued", b"started", b"scheduled", b"deferred", b"failed"}


@dataclass
class Feed:
    ds: DatasetConfig
    rows: Iterator[Prompt | Invalid | Filtered]
    queue: Queue
    enqueued: int = 0
    invalid: int = 0
    filtered: int = 0
    already_done: int = 0
    already_live: int = 0
    ended: bool = False      # every row read
    halted: bool = False     # budget reached: reading paused (resumes if the budget is raised)
    complete: bool = False

    @property
    def stop_reason(self) -> str:
        if self.halted:
            return "budget reached"
        return "rows exhausted" if self.ended else "running"


def _payload(ds: DatasetConfig, p: Prompt) -> dict:
    return JobPayload(id=p.id, dataset=ds.name, messages=p.messages, input_ids=p.input_ids,
                      prompt_tokens=p.prompt_tokens, sampling=ds.sampling,
                      chat_template_kwargs=ds.chat_template_kwargs or None,
                      thinking=ds.thinking).model_dump(mode="json", exclude_none=True)


class Producer:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.conn = connect(cfg.redis_url)
        self.feeds: list[Feed] = []
        resolve_datasets(cfg.datasets, cfg.server.tokenizer)  # before meta.json records them
        for ds in cfg.datasets:
            register_dataset(self.conn, ds)
            q = Queue(keys.queue_name(ds.name), connection=self.conn, serializer=JSONSerializer)
            self.feeds.append(Feed(ds, read_prompts(ds, cfg.server), q))
        self.collector = Collector(self.conn, cfg.output_dir, [d.name for d in cfg.datasets])
        for ds in cfg.datasets:
            for warning in check_and_write_meta(cfg, ds, cfg.output_dir):
                log.warning(warning)
            adopted, tokens = adopt_missing(self.conn, rows_on_disk(cfg.output_dir, ds), ds.name)
            if adopted:
                log.warning("dataset %s: %d rows on disk were not in Redis's done set (Redis lost data?): "
                            "adopted them (+%d tokens) so they are not generated again", ds.name, adopted, tokens)
        self.maintenance = Maintenance(self.conn, cfg.worker.maintenance_interval_s)
        self.stop_requested = False
        self._maintained_at = 0.0
        self._invalid_files = {d.name: cfg.output_dir / f"{d.name}.invalid.jsonl" for d in cfg.datasets}

    def _record_invalid(self, f: Feed, bad: Invalid) -> None:
        f.invalid += 1
        msg = f"dataset {f.ds.name}: {f.ds.path}:{bad.line}: invalid row: {bad.reason}"
        log.warning(msg)
        with open(self._invalid_files[f.ds.name], "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"line": bad.line, "file": str(f.ds.path), "reason": bad.reason}) + "\n")
        self.conn.hincrby(keys.stats_key(f.ds.name), "invalid", 1)

    def _reopen(self, f: Feed) -> None:
        """The budget was raised after it was reached: skipped jobs run after all, reading resumes."""
        registry = CanceledJobRegistry(f.queue.name, connection=self.conn, serializer=JSONSerializer)
        ids = registry.get_job_ids(cleanup=False)
        for job_id in ids:
            registry.requeue(job_id)
        f.halted = False
        log.info("dataset %s: budget raised: requeued %d skipped jobs, reading resumes", f.ds.name, len(ids))

    def _fill(self, f: Feed) -> None:
        state = dataset_state(self.conn, f.ds.name)
        if state.exhausted:
            if not f.halted:
                f.halted = True
                log.info("dataset %s: budget reached (%d / %d); no more enqueueing", f.ds.name, state.used,
                         state.limit)
            return
        if f.halted:
            self._reopen(f)
        if f.ended:
            return
        room = self.cfg.high_water - f.queue.count
        batch: list[Prompt] = []
        while len(batch) < room:
            item = next(f.rows, None)
            if item is None:
                f.ended = True
                break
            if isinstance(item, Invalid):
                self._record_invalid(f, item)
            elif isinstance(item, Filtered):
                f.filtered += 1
            else:
                batch.append(item)
        if batch:
            self._enqueue(f, batch)

    def _enqueue(self, f: Feed, batch: list[Prompt]) -> None:
        job_ids = [safe_job_id(f.ds.name, p.id) for p in batch]
        pipe = self.conn.pipeline(transaction=False)
        pipe.smismember(keys.done_key(f.ds.name), job_ids)
        for jid in job_ids:
            pipe.hget(keys.rq_job_key(jid), "status")
        done, *statuses = pipe.execute()
        unique: dict[str, Prompt] = {}
        for jid, p, is_done, status in zip(job_ids, batch, done, statuses, strict=True):
            if is_done:
                f.already_done += 1
            elif status in _LIVE:
                f.already_live += 1  # queued or running from an earlier producer, or failed
            elif jid in unique:
                log.warning("dataset %s: line %d repeats prompt id %s; kept once", f.ds.name, p.line, p.id)
            else:
                unique[jid] = p
        if not unique:
            return
        data = [Queue.prepare_data(JOB_FUNC, args=(_payload(f.ds, p),), job_id=jid, timeout=-1,
                                   result_ttl=500, failure_ttl=FAILURE_TTL_S, description=f"{f.ds.name}:{p.id}")
                for jid, p in unique.items()]
        canceled = CanceledJobRegistry(f.queue.name, connection=self.conn, serializer=JSONSerializer).key
        with self.conn.pipeline() as pipe:
            pipe.zrem(canceled, *unique)  # skipped before, enqueued again now
            f.queue.enqueue_many(data, pipeline=pipe)
            pipe.execute()
        f.enqueued += len(unique)

    def _check_complete(self, f: Feed) -> None:
        if not (f.ended or f.halted):
            return
        pipe = self.conn.pipeline(transaction=False)
        pipe.llen(keys.rq_queue_key(f.ds.name))
        pipe.llen(keys.rq_intermediate_key(f.ds.name))
        pipe.zcard(keys.rq_wip_key(f.ds.name))
        queued, parked, started = pipe.execute()
        f.complete = queued + parked + started == 0

    def tick(self) -> int:
        for f in self.feeds:
            self._fill(f)
        wrote = self.collector.drain()
        if time.monotonic() - self._maintained_at > self.cfg.worker.maintenance_interval_s:
            self._maintained_at = time.monotonic()
            self.maintenance.run_once()
        for f in self.feeds:
            self._check_complete(f)
        return wrote

    def run(self, on_tick=None) -> list[dict]:
        poll = self.cfg.producer.poll_interval_s
        outage_logged = False
        while True:
            try:
                wrote = self.tick()
                if outage_logged:
                    log.warning("redis reachable again; continuing")
                    outage_logged = False
            except REDIS_DOWN as exc:
                if not outage_logged:
                    log.warning("redis unreachable (%s); the producer waits and retries", exc)
                    outage_logged = True
                time.sleep(1.0)
                continue
            if on_tick is not None:
                on_tick(self)
            if all(f.complete for f in self.feeds) or self.stop_requested:
                self.collector.drain()
                if self.stop_requested:
                    log.warning("stopped on request with the run unfinished; `budgetq produce` again continues it")
                break
            if not wrote:
                time.sleep(poll)
        self._warn_cut_rows()
        return self.summary()

    def _warn_cut_rows(self) -> None:
        """keep=all kept answers cut by max_tokens: a drafter trained on them (SpecForge appends
        an end-of-turn) learns stops the model never made. Say so loudly, once per dataset."""
        for f in self.feeds:
            if (n := self.collector.cut_kept.get(f.ds.name, 0)) and f.ds.keep == "all":
                log.warning("dataset %s: %d row(s) written this run were cut by max_tokens (finish_reason "
                            "length) and kept (keep: all); for drafter training use keep: complete, or "
                            "`budgetq export --format specforge`, which leaves them out", f.ds.name, n)

    def summary(self) -> list[dict]:
        rows = []
        for f in self.feeds:
            st = dataset_state(self.conn, f.ds.name)
            failed = FailedJobRegistry(f.queue.name, connection=self.conn,
                                       serializer=JSONSerializer).get_job_count(cleanup=False)
            rows.append({
                "dataset": f.ds.name, "budget": st.limit, "used": st.used, "rows": self.collector.rows(f.ds.name),
                "truncated": st.stats.get("truncated", 0), "enqueued": f.enqueued,
                "skipped": st.stats.get("skipped", 0), "aborted": st.stats.get("aborted", 0), "failed": failed,
                "invalid": f.invalid, "filtered": f.filtered, "already_done": f.already_done,
                "wasted_tokens": st.stats.get("wasted_tokens", 0), "stop": f.stop_reason,
            })
        return rows
