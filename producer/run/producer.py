"""The producer's main loop: register budgets, enqueue with back-pressure, collect, summarise.

Restart-safe: a new producer on the same Redis and output dir continues where the last one
stopped. Prompts already committed (done set), already queued or running, or failed
(waiting for `budgetq retry-failed`) are not enqueued again; rows on disk that Redis forgot
are adopted first. Job ids come from shared/identity.py; a dataset whose Redis state was
written with the old id scheme is recognised under both (producer/run/migrate.py). A bad row
costs only that row: whatever goes wrong reading, mapping, tokenizing or enqueueing it is
recorded in out/<ds>.invalid.jsonl with the reason, once (a restart that reads the same
row again does not record it twice), and counted. A dataset is complete when its reading
has ended (every row read, or budget reached) and no job of it is queued or started; a
paused dataset's queued jobs keep the run waiting until it is resumed. The output volume and the
datasets are checked before anything is written to Redis; the disk guard
(producer/run/disk_guard.py) then holds admissions while the volume is full or read-only and keeps
results in Redis."""

from __future__ import annotations

import json
import logging
import time

import redis
from rq import Queue
from rq.queue import EnqueueData
from rq.serializers import JSONSerializer

from budgetq.producer.reading.reader import Invalid, Prompt, read_prompts
from budgetq.producer.reading.row_count import count_rows
from budgetq.producer.run.budget_loop import BudgetLoop
from budgetq.producer.run.collector import Collector
from budgetq.producer.run.disk_guard import OutputGuard, is_disk_fault, output_error, preflight
from budgetq.producer.run.feed import Answer, Feed, answers, recorded_invalid, refuse_suffix
from budgetq.producer.run.hooks import make_capture
from budgetq.producer.run.id_rule import record_id_field, settle_id_field
from budgetq.producer.run.meta import check_and_write_meta
from budgetq.producer.run.migrate import uses_legacy_ids
from budgetq.producer.run.reconcile import adopt_missing, rows_on_disk
from budgetq.producer.run.run_report import RunClock, end_of_run, summary_rows, warn_cut_rows
from budgetq.shared import jobs, keys, presence
from budgetq.shared.budget import dataset_state, register_dataset
from budgetq.shared.config import Config, DatasetConfig
from budgetq.shared.config_quality import validator_warnings
from budgetq.shared.errors import BudgetqError
from budgetq.shared.identity import job_id, legacy_job_id
from budgetq.shared.logs import safe
from budgetq.shared.maintenance import Maintenance
from budgetq.shared.redis_conn import connect
from budgetq.shared.retry import REDIS_DOWN
from budgetq.shared.sampling import resolve_datasets
from budgetq.shared.schema import JobPayload
from budgetq.shared.stats import Conf, Stat
from budgetq.shared.tokens import format_tokens

log = logging.getLogger("budgetq.producer")
JOB_FUNC = "budgetq.worker.job.run_prompt"  # by name: producer never imports worker
# RQ job statuses that mean "this prompt is already in the system": never enqueue it again.
# Canceled (skipped by the budget) is one: reopen.lua requeues those once the budget admits them.
_LIVE = {b"queued", b"started", b"scheduled", b"deferred", b"failed", b"canceled"}


def _payload(ds: DatasetConfig, a: Answer, engine_dir: str | None = None) -> dict:
    """``engine_dir``: features.vllm.single_pass, a capture: features dataset (one request a row only)."""
    p = a.prompt
    return JobPayload(id=a.id, dataset=ds.name, messages=p.messages, input_ids=p.input_ids,
                      prompt_tokens=p.prompt_tokens, sampling=a.sampling(ds), sample=a.sample,
                      chat_template_kwargs=ds.chat_template_kwargs or None, thinking=ds.thinking, turns=p.turns,
                      hidden_states_dir=engine_dir if p.turns is None else None,
                      ).model_dump(mode="json", exclude_none=True)


class Producer:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        preflight(cfg.output_dir, cfg.min_free_mb)  # before anything is written to Redis
        self.conn = connect(cfg.redis_url)
        self.feeds: list[Feed] = []
        resolve_datasets(cfg.datasets, cfg.server.tokenizer)  # before meta.json records them
        for ds in cfg.datasets:  # what can refuse the run only reads Redis: a failed start leaves no bq:* key
            settle_id_field(self.conn, ds, cfg.output_dir, record=False)  # the ids its state was made with
            q = jobs.LeanQueue(keys.queue_name(ds.name), connection=self.conn, serializer=JSONSerializer)
            self.feeds.append(Feed(ds, read_prompts(ds, cfg.server), q,
                                   filtered_recorded=int(self.conn.hget(keys.stats_key(ds.name), Stat.FILTERED) or 0)))
        try:
            self.collector = Collector(self.conn, cfg.output_dir, [d.name for d in cfg.datasets])
            warnings = [w for f in self.feeds for w in (*check_and_write_meta(cfg, f.ds, cfg.output_dir),
                                                        *validator_warnings(f.ds.name, f.ds.gates.validator))]
        except OSError as exc:  # the volume changed since preflight: one line, not a traceback
            raise output_error(cfg.output_dir, exc) from None
        for warning in warnings:
            log.warning(warning)
        self.presence = presence.Presence(self.conn)  # its key, refreshed every tick: status tells a killed producer
        if other := self.presence.others():
            log.warning("another producer (host %s, pid %s) ran this deployment %d s ago or less: if it still "
                        "runs, two producers of one run race each other; stop one", other.get("host"),
                        other.get("pid"), presence.TTL_S)
        self.presence.beat()  # the first write: the datasets below are this producer's from the start
        self.budgets = BudgetLoop(self.conn, cfg)  # hook: run.deadline / run.total_budget set the limits
        for f in self.feeds:
            kept = register_dataset(self.conn, f.ds, keep_limit=self.budgets.active)
            if kept is not None:
                log.info("dataset %s: budget %s (set live) kept; the config's %s is the one already applied (change "
                         "it in the config, or `budgetq budget set`, to move it)", f.ds.name, format_tokens(kept),
                         format_tokens(f.ds.budget or 0))
            f.legacy = uses_legacy_ids(self.conn, f.ds.name)
            record_id_field(self.conn, f.ds)
        # hook: the disk guard; its first sync ends a hold a previous producer left
        self.guard = OutputGuard(self.conn, cfg.output_dir, cfg.min_free_mb, [d.name for d in cfg.datasets])
        self.guard.sync()
        for f in self.feeds:
            ds = f.ds
            adopted, tokens = adopt_missing(self.conn, rows_on_disk(cfg.output_dir, ds), ds.name, legacy=f.legacy)
            if adopted:
                log.warning("dataset %s: %d rows on disk were not in Redis's done set (Redis lost data?): "
                            "adopted them (+%d tokens) so they are not generated again", ds.name, adopted, tokens)
        self.maintenance = Maintenance(self.conn, cfg.worker.maintenance_interval_s)
        self.stop_requested = False
        self._maintained_at = 0.0
        self._invalid_files = {d.name: cfg.output_dir / f"{d.name}.invalid.jsonl" for d in cfg.datasets}
        self._recorded = {d.name: recorded_invalid(self._invalid_files[d.name]) for d in cfg.datasets}
        for f in self.feeds:
            self._count_rows(f.ds)
            self.presence.beat()  # (a large file takes seconds to count)
        self.clock = RunClock(self.conn, [d.name for d in cfg.datasets])  # the end-of-run block's start
        # capture: features: the hook hidden_states registers (producer/run/hooks.py); last: it takes locks
        self.capture = make_capture(cfg)

    def _count_rows(self, ds: DatasetConfig) -> None:
        """The file's rows, for the ledger's ``unread`` and the ETA's prompts left (shared/ends.py)."""
        count = count_rows(ds)
        conf = keys.conf_key(ds.name)
        if count is None:
            self.conn.hdel(conf, Conf.SOURCE_ROWS, Conf.SOURCE_ESTIMATED)
        else:
            self.conn.hset(conf, mapping={Conf.SOURCE_ROWS: count.rows, Conf.SOURCE_ESTIMATED: int(not count.exact)})
        self.conn.hset(conf, mapping={Conf.SOURCE_LIMIT: "" if ds.limit is None else ds.limit,
                                      Conf.SAMPLES: ds.answers_max})  # the ledger counts answers

    def _record_invalid(self, f: Feed, bad: Invalid) -> None:
        """Count a bad row, and write it down unless an earlier run already did (same line, same reason)."""
        f.tally.add(bad)
        if (bad.line, bad.reason) in self._recorded[f.ds.name]:
            return
        self._recorded[f.ds.name].add((bad.line, bad.reason))
        log.warning("dataset %s: %s:%d: invalid row: %s", f.ds.name, f.ds.path, bad.line, bad.reason)
        with open(self._invalid_files[f.ds.name], "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"line": bad.line, "file": str(f.ds.path), "reason": bad.reason}) + "\n")
        self.conn.hincrby(keys.stats_key(f.ds.name), "invalid", 1)

    def _reopen(self, f: Feed) -> None:
        """The budget admits requests: jobs skipped while it was exhausted (raised since, by an
        operator or a new config) run after all, each moved back atomically; reading resumes."""
        moved, _vanished = jobs.reopen_all(self.conn, f.ds.name, jobs.Ending.CANCELED, Stat.REOPENED)
        if f.halted or moved:
            log.info("dataset %s: budget admits requests again: requeued %d skipped jobs, reading resumes",
                     f.ds.name, moved)
        f.halted = False

    def _fill(self, f: Feed) -> None:
        state = dataset_state(self.conn, f.ds.name)
        if state.exhausted:
            if not f.halted:
                f.halted = True
                log.info("dataset %s: budget reached (%d / %d); no more enqueueing", f.ds.name, state.used,
                         state.limit)
            return
        self._reopen(f)
        if f.ended:
            return
        room = self.cfg.high_water - f.queue.count
        while len(f.pending) < room and not f.ended:
            broke = False
            try:
                item = next(f.rows, None)
            except Exception as exc:  # noqa: BLE001 - the source itself broke: end this dataset only
                log.error("dataset %s: reading %s stopped: %s: %s", f.ds.name, f.ds.path, type(exc).__name__, exc)
                self._record_invalid(f, Invalid(0, f"reading stopped: {type(exc).__name__}: {exc}"))
                item, broke = None, True
            if item is None:
                # samples: auto: every prompt once more (feed.py next_round), or the end
                f.ended = broke or not f.next_round(self.cfg.server, self.conn)
                continue
            if f.round > 1:  # samples: auto, a later round: the rows were tallied in round 1
                if isinstance(item, Prompt) and refuse_suffix(f.ds, item) is item:
                    f.pending.extend(answers(f.ds, item, f.round))
                continue
            f.read += 1
            item = refuse_suffix(f.ds, item)  # samples > 1: an id like an answer id is an invalid row
            if isinstance(item, Invalid):
                self._record_invalid(f, item)
            else:
                f.tally.add(item)
                if isinstance(item, Prompt):
                    f.pending.extend(answers(f.ds, item, f.round))
        if f.ended:
            self._mark_ended(f)
        if f.tally.filtered > f.filtered_recorded:  # a restart reads the rows again: count only beyond the last run
            self.conn.hincrby(keys.stats_key(f.ds.name), Stat.FILTERED, f.tally.filtered - f.filtered_recorded)
            f.filtered_recorded = f.tally.filtered
        if f.pending:
            # Kept in f.pending until enqueued: a Redis outage here loses no row.
            self._enqueue(f, f.pending)
            f.pending = []

    def _job_ids(self, f: Feed, p: Answer) -> list[str]:
        """The job ids this prompt may have in Redis: today's, and the old scheme's if it was in use."""
        new = job_id(f.ds.name, p.id)
        return [new, legacy_job_id(f.ds.name, p.id)] if f.legacy else [new]

    def _known(self, f: Feed, batch: list[Answer]) -> list[str | None]:
        """Per prompt: 'done', 'live' (queued, running, failed or skipped-and-kept), or None (new)."""
        ids = [self._job_ids(f, p) for p in batch]
        flat = [j for js in ids for j in js]
        pipe = self.conn.pipeline(transaction=False)
        pipe.smismember(keys.done_key(f.ds.name), flat)
        for jid in flat:
            pipe.hmget(keys.rq_job_key(jid), ["status", "origin"])
        done, *jobs = pipe.execute()
        by_id = {j: (bool(d), st, origin) for j, d, (st, origin) in zip(flat, done, jobs, strict=True)}
        out: list[str | None] = []
        queue = f.queue.name.encode()
        for js in ids:
            state = None
            for j in js:
                is_done, status, origin = by_id[j]
                if is_done:
                    state = "done"
                    break
                # An old-format id may be another dataset's job (the old scheme collided): check its queue.
                if status in _LIVE and (origin is None or origin == queue):
                    state = "live"
            out.append(state)
        return out

    def _enqueue(self, f: Feed, batch: list[Answer]) -> None:
        data: dict[str, EnqueueData] = {}
        states = self._known(f, batch)
        engine_dir = self.cfg.features.engine_dir(f.ds.name) if f.ds.capture == "features" else None
        for p, state in zip(batch, states, strict=True):
            if state is not None:  # done, or queued / running / failed from an earlier producer
                continue
            jid = job_id(f.ds.name, p.id)
            if jid in data:  # the reader drops repeated ids; this only guards a digest collision
                self._record_invalid(f, Invalid(p.line, f"duplicate id {p.id!r} in one batch", duplicate=True))
                continue
            try:
                data[jid] = Queue.prepare_data(JOB_FUNC, args=(_payload(f.ds, p, engine_dir),), job_id=jid, timeout=-1,
                                               result_ttl=self.cfg.producer.result_ttl_s, failure_ttl=jobs.KEEP_S,
                                               description=f"{f.ds.name}:{safe(p.id)[:120]}")
            except Exception as exc:  # noqa: BLE001 - one row that cannot become a job costs only that row
                self._record_invalid(f, Invalid(p.line, f"cannot enqueue: {type(exc).__name__}: {exc}"))
        f.already_done += states.count("done")
        f.already_live += states.count("live")
        if not data:
            return
        try:
            self._push(f, list(data.items()))
        except (*REDIS_DOWN, redis.RedisError):
            raise  # Redis itself: the batch stays pending, the run loop waits
        except Exception:  # noqa: BLE001 - find the row that RQ refuses; the others still go
            for item in data.items():
                try:
                    self._push(f, [item])
                except (*REDIS_DOWN, redis.RedisError):
                    raise
                except Exception as exc:  # noqa: BLE001
                    line = next(p.line for p in batch if job_id(f.ds.name, p.id) == item[0])
                    self._record_invalid(f, Invalid(line, f"cannot enqueue: {type(exc).__name__}: {exc}"))

    def _push(self, f: Feed, items: list[tuple[str, EnqueueData]]) -> None:
        with self.conn.pipeline() as pipe:  # one transaction: the ledger's entry count moves with the queue
            f.queue.enqueue_many([d for _, d in items], pipeline=pipe)
            pipe.hincrby(keys.stats_key(f.ds.name), Stat.ENQUEUED, len(items))
            pipe.execute()
        f.enqueued += len(items)

    def _check_complete(self, f: Feed) -> None:
        if not (f.ended or f.halted):
            f.complete = False  # a budget raised after it halted: reading resumed, so it is not done
            return
        pipe = self.conn.pipeline(transaction=False)
        pipe.llen(keys.rq_queue_key(f.ds.name))
        pipe.llen(keys.rq_intermediate_key(f.ds.name))
        pipe.zcard(keys.rq_wip_key(f.ds.name))
        queued, parked, started = pipe.execute()
        was, f.complete = f.complete, queued + parked + started == 0
        if f.complete and not was and f.ended:  # again: a failover can lose the first mark (stop: running)
            self._mark_ended(f)

    def _mark_ended(self, f: Feed) -> None:
        """Status: done, no ETA; every row is read, so their count is exact now."""
        self.conn.hset(keys.conf_key(f.ds.name), mapping={Conf.SOURCE_ENDED: "1", Conf.SOURCE_ROWS: f.read,
                                                           Conf.SOURCE_ESTIMATED: "0"})

    def _drain(self) -> int:
        """Write the results waiting in Redis, unless the disk guard says the volume refuses them."""
        if not self.guard.may_write():
            return 0
        try:
            wrote = self.collector.drain()
        except OSError as exc:
            if not is_disk_fault(exc):
                raise
            self.guard.write_failed(exc)  # the results stay in Redis, the guard holds admissions
            return 0
        self.guard.wrote()
        return wrote

    def tick(self) -> int:
        self.presence.beat()
        self.budgets.tick(self.feeds)  # hook: before the fills, which act on the limits it writes
        if self.guard.admitting():  # hook: the disk guard; no enqueueing while the output volume is full
            try:
                for f in self.feeds:
                    self._fill(f)
            except OSError as exc:  # writing out/<ds>.invalid.jsonl; what was read stays pending
                if not is_disk_fault(exc):
                    raise
                self.guard.write_failed(exc)
        wrote = self._drain()
        if time.monotonic() - self._maintained_at > self.cfg.worker.maintenance_interval_s:
            self._maintained_at = time.monotonic()
            self.maintenance.run_once()
        for f in self.feeds:
            self._check_complete(f)
        self.capture.tick()  # hook: the hidden-states pass of capture: features datasets runs beside
        self.guard.sync()
        return wrote

    def run(self, on_tick=None) -> dict:
        poll = self.cfg.producer.poll_interval_s
        outage_logged = False
        while True:
            try:
                wrote = self.tick()
                if outage_logged:
                    log.warning("redis reachable again; continuing")
                    outage_logged = False
            except REDIS_DOWN as exc:
                if self.stop_requested:  # a stop must not wait for Redis: the files hold what was collected
                    raise BudgetqError(f"stopped on request while Redis was unreachable ({exc}); what was "
                                       "collected is on disk and `budgetq produce` again continues") from None
                if not outage_logged:
                    log.warning("redis unreachable (%s); the producer waits and retries", exc)
                    outage_logged = True
                time.sleep(1.0)
                continue
            if on_tick is not None:
                on_tick(self)
            # hook: with capture: features datasets, done also waits for every row's hidden states
            if (all(f.complete for f in self.feeds) and self.capture.done(self._drain)
                    and self.budgets.settled(self.feeds)) or self.stop_requested:
                self._drain()
                if self.guard.write_fault and not self.stop_requested:
                    time.sleep(poll)  # every job ended, results wait in Redis for the disk: not done yet
                    continue
                self._warn_unwritten()
                for f in self.feeds:
                    if f.tally.invalid:
                        log.warning("dataset %s: %d invalid rows (%d of them repeat an earlier id); reasons in %s",
                                    f.ds.name, f.tally.invalid, f.tally.duplicates, self._invalid_files[f.ds.name])
                if self.stop_requested:
                    self._mark_interrupted()
                break
            if not wrote:
                time.sleep(poll)
        self.capture.close()  # hook: the hidden-states pass writes what it collected, releases its lock
        warn_cut_rows(self.feeds, self.collector)
        report = self.report()
        self.presence.leave()  # an exception leaves the key to expire: status then says interrupted
        return report

    def _mark_interrupted(self) -> None:
        """Stopped on request: the datasets not complete say ``interrupted`` (shared/ends.py) in the
        summary and in `budgetq status` until the next `budgetq produce` registers them again."""
        left = [f.ds.name for f in self.feeds if not f.complete]
        for name in left:
            self.conn.hset(keys.conf_key(name), Conf.INTERRUPTED, "1")
        if left:
            log.warning("stopped on request with the run unfinished (%s); `budgetq produce` again continues it",
                        ", ".join(left))

    def _warn_unwritten(self) -> None:
        if not self.guard.write_fault:
            return
        waiting = sum(int(self.conn.xlen(keys.results_key(f.ds.name))) for f in self.feeds)
        log.warning("output_dir %s: %d results could not be written (%s); they stay in Redis and the next "
                    "`budgetq produce` writes them once the volume has room", self.cfg.output_dir, waiting,
                    self.guard.reason)

    def summary(self) -> list[dict]:
        """One row per dataset: its ledger, stop reason and what this run did (producer/run/run_report.py)."""
        return summary_rows(self.conn, self.feeds, self.collector, self.clock)

    def report(self) -> dict:
        """The summary rows and the end-of-run block: complete or not, elapsed, tok/s, latencies."""
        return end_of_run(self.summary(), self.clock, self.collector)
