"""``budgetq features``: the hidden-state pass over what generation committed (docs/hidden_states.md).

Runs where the output disk is (the producer's side: the producer owns the output disk). For each dataset it:
- opens the dataset's feature store (hidden_states/store/shards.py), which repairs a crash, and marks
  every sample on disk done in Redis (``bq:{ds}:features:done``);
- enqueues one features job per committed row not done and not already queued or started (RQ queue
  ``bq-<ds>-features``, JSON serializer, at most features.high_water queued), while the disk guard lets it;
- collects the workers' decoded tensors from ``bq:{ds}:features:results``, writes them as shards, then marks
  them done and deletes their stream entries (in that order: a crash in between leaves entries it drops);
- requeues jobs whose lease lapsed (a features worker died); exits once every row is captured, failed
  (reported, with why) or refused by the disk guard. Restart-safe.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import chain
from typing import cast

import redis
from rq import Queue
from rq.serializers import JSONSerializer

from budgetq.hidden_states.collect.byte_budget import ByteBudget
from budgetq.hidden_states.collect.guard import DiskGuard
from budgetq.hidden_states.collect.inputs import FeaturesInputError, RowTail, conversation_ids
from budgetq.hidden_states.collect.lock import CollectorLock, new_owner
from budgetq.hidden_states.collect.report import Report, failures
from budgetq.hidden_states.schema import FeaturesMeta, FeaturesPayload
from budgetq.hidden_states.store.shards import FeatureStore, features_root
from budgetq.producer.reading.tokenize import load_tokenizer
from budgetq.shared import jobs, keys
from budgetq.shared.config import Config, DatasetConfig
from budgetq.shared.errors import ConfigError
from budgetq.shared.identity import job_id
from budgetq.shared.redis_conn import text
from budgetq.shared.scripts import run_many
from budgetq.shared.stats import Stat

log = logging.getLogger("budgetq.features")
JOB_FUNC = "budgetq.hidden_states.capture.features_worker.run_features_job"
FAILURE_TTL_S = 7 * 86400
READ_COUNT = 4          # stream entries per read: each may be hundreds of MB
INDEX_READ_COUNT = 256  # features.store: entries are index messages (a shard's name, token ids)
MAINTAIN_EVERY_S = 2.0
# Rows tokenized and enqueued per round of the loop: the first jobs reach the workers after this many rows,
# not after features.high_water of them (~1 ms a row to tokenize), and results are collected in between.
ENQUEUE_CHUNK = 32
# --follow: a shard still short of shard_mb is written after this long without new results, so what
# trickles in reaches the disk (and leaves Redis) in bounded time.
FOLLOW_FLUSH_IDLE_S = 30.0
MB = 2**20
SAMPLE_HEADER_BYTES = 400   # a sample's share of its shard's JSON header (3 tensor entries, metadata), generous
_LIVE = {b"queued", b"started", b"deferred", b"scheduled"}


@dataclass
class DatasetPass:
    ds: DatasetConfig
    store: FeatureStore
    queue: Queue
    tail: RowTail
    rows: Iterator
    rows_done: bool = False
    held_back: FeaturesPayload | None = None
    enqueued: int = 0
    already: int = 0
    invalid: list[str] = field(default_factory=list)
    outstanding: dict[str, int] = field(default_factory=dict)  # prompt id -> tokens, enqueued, not yet back
    captured: int = 0
    duplicates: int = 0
    cursor: str = "-"
    consumed: list[tuple[bytes, int]] = field(default_factory=list)  # stream entries read, not yet deleted
    unmarked: list[tuple[str, int, int]] = field(default_factory=list)  # on disk, not yet done in Redis: id, B, tokens
    relost: set[str] = field(default_factory=set)  # ids whose job Redis lost, enqueued again (_requeue_lost)
    unstored: dict[str, str] = field(default_factory=dict)  # id -> why its worker's shard was not adopted
    last_result: float = 0.0   # monotonic time of the last stream read that got something
    failed_checked: float = 0.0  # monotonic time of the last _forget_failed


class FeaturesPass:
    def __init__(self, cfg: Config, conn: redis.Redis, names: list[str] | None = None, follow: bool = False,
                 owner: str | None = None) -> None:
        if not cfg.server.tokenizer:
            raise ConfigError("budgetq features needs server.tokenizer: the conversation is re-tokenized with the "
                              "model's chat template to find the answer's tokens (the loss mask)")
        self.cfg = cfg
        self.conn = conn
        # follow: rows committed while the pass runs are captured too (beside `produce`); ends on SIGINT/SIGTERM only.
        self.follow = follow
        self._unfollow = threading.Event()  # end_follow(): read the files to their end once more, then finish
        self.tokenizer = load_tokenizer(cfg.server.tokenizer)
        self.guard = DiskGuard(cfg)
        self.stop = threading.Event()
        self.passes: list[DatasetPass] = []
        self.lock = CollectorLock(conn, owner or new_owner())  # owner: see CollectorLock
        chosen = [cfg.dataset(n) for n in names] if names else cfg.datasets
        self.lock.take([ds.name for ds in chosen])
        self.bytes = ByteBudget(cfg, conn, [ds.name for ds in chosen])  # disk as a budget (byte_budget.py)
        for ds in chosen:
            store = FeatureStore(features_root(cfg), ds.name, cfg.features.shard_bytes)
            self._mark_done(ds.name, sorted(store.ids))
            self.bytes.sync(ds.name, store.bytes_on_disk, store.tokens_on_disk, opening=True)
            queue = Queue(keys.features_queue_name(ds.name), connection=conn, serializer=JSONSerializer)
            tail = RowTail(cfg.output_dir / f"{ds.name}.jsonl")
            self.passes.append(DatasetPass(ds, store, queue, tail, tail.new_rows()))
            conn.sadd(keys.FEATURES_DATASETS, ds.name)
            if store.recovered.tmp_removed or store.recovered.reindexed or store.recovered.duplicates_removed:
                log.warning("features %s: repaired after a crash: %d unfinished shard writes removed, %d samples "
                            "indexed, %d second copies removed", ds.name, store.recovered.tmp_removed,
                            store.recovered.reindexed, store.recovered.duplicates_removed)

    def release(self) -> None:
        self.lock.release()

    def _mark_done(self, ds: str, ids: list[str]) -> None:
        for i in range(0, len(ids), 1000):
            self.conn.sadd(keys.features_done_key(ds), *ids[i:i + 1000])

    def end_follow(self) -> None:
        """Stop following (thread-safe): every row is on disk; read each file to its end once more, then end."""
        self._unfollow.set()

    def _stop_following(self) -> None:
        self.follow = False
        for p in self.passes:
            # A fresh read from where the current one will have stopped: it opens the file after
            # end_follow() was called, so it sees every line committed before that.
            p.rows = chain(p.rows, p.tail.new_rows())

    # -- the loop ------------------------------------------------------------------------
    def run(self, poll_s: float = 0.05) -> Report:
        last_maintain = 0.0
        finished = False
        while not self.stop.is_set():
            if self.follow and self._unfollow.is_set():
                self._stop_following()
            progressed = False
            for p in self.passes:
                # Collect first: results already waiting (a restart, a plain rq worker) are not enqueued again.
                if self._collect(p):
                    progressed = True
                    p.last_result = time.monotonic()
                elif self.follow and p.store.buffer and time.monotonic() - p.last_result > FOLLOW_FLUSH_IDLE_S:
                    self._flush(p)
                progressed |= self._enqueue(p)
            if time.monotonic() - last_maintain > MAINTAIN_EVERY_S:
                self.lock.refresh()
                self._maintain()
                last_maintain = time.monotonic()
            if all(self._finished(p) for p in self.passes):
                finished = True
                break
            if not progressed:
                time.sleep(poll_s)
        for p in self.passes:
            self._collect(p)
            self._flush(p)
            if finished:  # no features job queued or running: what a killed worker left can be settled now
                p.store.reconcile()
                p.store.sweep_leftovers()
                self._mark_done(p.ds.name, sorted(p.store.ids))
                self.bytes.sync(p.ds.name, p.store.bytes_on_disk, p.store.tokens_on_disk)
        if finished:  # Redis learns which datasets are done (the other passes' get what they left)
            self.bytes.resplit({p.ds.name: p.store.bytes_on_disk for p in self.passes},
                               {p.ds.name for p in self.passes if p.rows_done and not p.outstanding})
        rep = self._report()
        self.release()
        return rep

    def _finished(self, p: DatasetPass) -> bool:
        if self.follow or not (p.rows_done or self.guard.reason or p.ds.name in self.bytes.stopped):
            return False
        name = keys.features_name(p.ds.name)
        pipe = self.conn.pipeline(transaction=False)
        pipe.llen(keys.rq_queue_key(name))
        pipe.zcard(keys.rq_wip_key(name))
        pipe.xrange(keys.features_results_key(p.ds.name), min=f"({p.cursor}" if p.cursor != "-" else "-", count=1)
        queued, started, unread = pipe.execute()
        return queued == 0 and started == 0 and not unread and not self._requeue_lost(p)

    def _requeue_lost(self, p: DatasetPass) -> bool:
        """Jobs this pass enqueued that neither came back nor failed while none is queued or running:
        Redis lost them (a crash past its last AOF fsync). Their rows are read again and enqueued anew,
        once; what is still missing after that is reported as failed."""
        self._forget_failed(p)
        lost = set(p.outstanding) - p.relost
        if not lost:
            return False
        log.warning("features %s: %d jobs are gone from Redis (restarted without them?); enqueueing their rows "
                    "again", p.ds.name, len(lost))
        for pid in lost:
            p.outstanding.pop(pid, None)
        p.relost |= lost
        p.rows = chain(p.rows, (r for r in RowTail(p.tail.path).new_rows() if r.id in lost))
        p.rows_done = False
        return True

    # -- enqueue -------------------------------------------------------------------------
    def _next_payload(self, p: DatasetPass) -> FeaturesPayload | None:
        """The next row to capture as a payload (rows on disk or that cannot be tokenized are passed over)."""
        if p.held_back is not None:
            out, p.held_back = p.held_back, None
            return out
        kwargs = dict(p.ds.chat_template_kwargs)
        for row in p.rows:
            if p.store.has(row.id):
                p.already += 1
                continue
            try:
                ids, start, end = conversation_ids(self.tokenizer, row, kwargs)
            except FeaturesInputError as exc:
                p.invalid.append(str(exc))
                log.warning("features %s: %s", p.ds.name, exc)
                continue
            return FeaturesPayload(id=row.id, dataset=p.ds.name, input_ids=ids, loss_start=start, loss_end=end,
                                   dtype=self.cfg.features.dtype, engine_file=row.hidden_states_file)
        if self.follow:
            p.rows = p.tail.new_rows()  # what the collector appends from now on
        else:
            p.rows_done = True
        return None

    def _enqueue(self, p: DatasetPass) -> bool:
        if p.rows_done or self.guard.reason or p.ds.name in self.bytes.stopped:
            return False
        self.bytes.resplit({q.ds.name: q.store.bytes_on_disk for q in self.passes},
                           {q.ds.name for q in self.passes if q.rows_done and not q.outstanding})
        room = min(ENQUEUE_CHUNK,
                   self.cfg.features.high_water - self.conn.llen(keys.rq_queue_key(keys.features_name(p.ds.name))))
        batch: list[FeaturesPayload] = []
        outstanding_tokens = sum(sum(q.outstanding.values()) for q in self.passes)
        while len(batch) < room:
            payload = self._next_payload(p)
            if payload is None:
                break
            on_disk = sum(q.store.bytes_on_disk for q in self.passes)
            tokens_on_disk = sum(q.store.tokens_on_disk for q in self.passes)
            self.guard.disk_bytes_per_token = on_disk / tokens_on_disk if tokens_on_disk else None
            buffered = sum(q.store.buffer_bytes for q in self.passes)
            jobs_out = sum(len(q.outstanding) for q in self.passes) + len(batch)
            n = len(payload.input_ids)
            if not (self.guard.admit(n, outstanding_tokens, jobs_out, on_disk, buffered) and self.bytes.admit(
                    p.ds.name, n, sum(p.outstanding.values()) + sum(len(b.input_ids) for b in batch),
                    p.store.bytes_on_disk, p.store.buffer_bytes, self.guard.bytes_per_token)):
                p.held_back = payload  # sent once the guard knows bytes per token, or never (reason set)
                if self.guard.reason is not None:
                    log.error("features: admissions stopped: %s", self.guard.reason)
                break
            outstanding_tokens += n
            batch.append(payload)
        return self._push(p, batch) > 0

    def _push(self, p: DatasetPass, batch: list[FeaturesPayload]) -> int:
        if not batch:
            return 0
        name = keys.features_name(p.ds.name)
        jids = [job_id(name, b.id) for b in batch]
        pipe = self.conn.pipeline(transaction=False)
        for jid in jids:
            pipe.hget(keys.rq_job_key(jid), "status")
        statuses = pipe.execute()
        data = []
        for b, jid, status in zip(batch, jids, statuses, strict=True):
            p.outstanding[b.id] = len(b.input_ids)
            if status in _LIVE:  # queued or running from an earlier pass: its result will come
                continue
            data.append(Queue.prepare_data(JOB_FUNC, args=(b.model_dump(),), job_id=jid, timeout=-1,
                                           result_ttl=jobs.RESULT_TTL_S, failure_ttl=FAILURE_TTL_S,
                                           description=f"{p.ds.name}:features"))
        if data:
            with self.conn.pipeline() as pipe:
                # failed in an earlier pass, enqueued again now
                pipe.zrem(f"rq:failed:{keys.queue_name(name)}", *[d.job_id for d in data])
                p.queue.enqueue_many(data, pipeline=pipe)
                pipe.execute()
        p.enqueued += len(data)
        return len(batch)

    # -- collect -------------------------------------------------------------------------
    def _collect(self, p: DatasetPass) -> bool:
        key = keys.features_results_key(p.ds.name)
        got = False
        limit = min(self.cfg.features.shard_bytes, int(self.cfg.features.redis_max_mb * MB / 2))
        # Index messages (features.store) are small: many a read; tensor entries may be hundreds of MB each.
        count = INDEX_READ_COUNT if self.cfg.features.store else READ_COUNT
        while True:
            entries = cast(list[tuple[bytes, dict[bytes, bytes]]],
                           self.conn.xrange(key, min=f"({p.cursor}" if p.cursor != "-" else "-", count=count))
            if not entries:
                break
            got = True
            for eid, fields in entries:
                p.cursor = eid.decode()
                data = fields.get(b"data", b"")
                p.consumed.append((eid, len(data) + len(fields.get(b"aux", b""))))
                try:
                    meta = FeaturesMeta.model_validate_json(fields[b"meta"])
                except (ValueError, KeyError) as exc:
                    log.error("features %s: unreadable stream entry %s dropped: %s", p.ds.name, p.cursor, exc)
                    continue
                p.outstanding.pop(meta.id, None)
                if meta.shard is not None:
                    self._adopt(p, meta)
                    continue
                # what the sample will weigh in a shard: tensor, token ids (4 B) and mask (1 B), header entries
                self.guard.learn_wire(meta.shape[0], len(data) + len(fields.get(b"aux", b"")),
                                      5 * meta.shape[0] + SAMPLE_HEADER_BYTES)
                aux = fields.get(b"aux")
                if p.store.add(meta, data, aux):
                    p.captured += 1
                else:
                    p.duplicates += 1  # a retried job's second copy
                if p.store.buffer_bytes >= limit:
                    self._flush(p)
        if p.store.adopted:
            self._flush(p)
        # Jobs that failed are not coming back: stop counting them as outstanding. Every few seconds, not at
        # every idle poll (50 ms): it reads the status of each outstanding job. The end of the pass checks anew.
        if p.outstanding and not got and time.monotonic() - p.failed_checked > MAINTAIN_EVERY_S:
            self._forget_failed(p)
        return got

    def _adopt(self, p: DatasetPass, meta: FeaturesMeta) -> None:
        """An index message: the worker wrote the sample's shard in features.store itself."""
        verdict = p.store.adopt(meta)
        if verdict == "new":
            p.captured += 1
            self.guard.learn(meta.shape[0], meta.shard_bytes or 0)
        elif verdict == "duplicate":
            p.duplicates += 1  # a retried job's second copy (its shard is deleted)
        elif not p.store.has(meta.id):  # enqueued again once nothing runs; if still not adopted, reported with why
            why = f"its worker announced a shard name no features worker writes: {meta.shard!r}"  # (logged by adopt)
            if verdict == "missing":
                why = (f"its worker's shard {meta.shard!r} is not in {p.store.dir}: the features workers' "
                       "features.store must be the collector's directory (one shared volume)")
                if not p.unstored:  # one line, not one per sample of a misconfigured run
                    log.error("features %s: %s; its job runs again", p.ds.name, why)
            p.unstored[meta.id] = why
            p.outstanding[meta.id] = len(meta.input_ids)

    def _flush(self, p: DatasetPass) -> None:
        # Kept in p.unmarked until Redis has them: a Redis error here (the producer's capture goes on
        # through outages) marks them at the next flush.
        p.store.flush()
        p.unmarked += p.store.flushed
        if p.unmarked:  # done and their bytes counted in one script (once per sample), then the entries go
            self.bytes.mark(p.ds.name, p.unmarked)
            p.unmarked.clear()
        if p.consumed:
            with self.conn.pipeline() as pipe:
                pipe.xdel(keys.features_results_key(p.ds.name), *[e for e, _ in p.consumed])
                pipe.decrby(keys.features_pending_key(p.ds.name), sum(n for _, n in p.consumed))
                pipe.execute()
            p.consumed.clear()

    def _forget_failed(self, p: DatasetPass) -> None:
        p.failed_checked = time.monotonic()
        name = keys.features_name(p.ds.name)
        pipe = self.conn.pipeline(transaction=False)
        pids = list(p.outstanding)
        for pid in pids:
            pipe.hget(keys.rq_job_key(job_id(name, pid)), "status")
        for pid, status in zip(pids, pipe.execute(), strict=True):
            if status == b"failed":
                p.outstanding.pop(pid, None)

    # -- maintenance ---------------------------------------------------------------------
    def _maintain(self) -> None:
        """Requeue features jobs whose lease lapsed (their worker died), as the generation
        maintenance pass does for generation queues (shared/maintenance.py)."""
        now = time.time()
        for p in self.passes:
            name = keys.features_name(p.ds.name)
            members = self.conn.zrangebyscore(keys.rq_wip_key(name), "-inf", now)
            calls = [jobs.requeue(name, text(m), text(m).rsplit(":", 1)[0], Stat.RECOVERED,
                                  only_if_expired_before=now) for m in cast(list[bytes], members)]
            n = sum(1 for r in run_many(self.conn, calls) if r is True)
            if n:
                log.warning("features %s: requeued %d jobs of a features worker that stopped heartbeating",
                            p.ds.name, n)

    # -- report --------------------------------------------------------------------------
    def _report(self) -> Report:
        rep = Report(stopped_by="; ".join(r for r in (self.guard.reason, *self.bytes.stopped.values()) if r) or None)
        for p in self.passes:
            failed = failures(self.conn, p.ds.name, sorted(p.relost - p.store.ids), p.unstored)
            rep.failed[p.ds.name] = failed
            if p.rows_done and not self.guard.reason and not failed and not self.stop.is_set():
                self.conn.srem(keys.FEATURES_DATASETS, p.ds.name)
            rep.datasets[p.ds.name] = {
                "samples_on_disk": len(p.store.ids), "captured": p.captured, "enqueued": p.enqueued,
                "already_on_disk": p.already, "duplicates_dropped": p.duplicates, "invalid": len(p.invalid),
                "failed": len(failed), "bytes_on_disk": p.store.bytes_on_disk,
                "bytes_per_token": round(p.store.bytes_per_token or 0.0, 1)}
        return rep
