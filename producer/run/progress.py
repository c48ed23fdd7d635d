"""Progress of a long producer run: rich bars on a terminal, periodic log lines otherwise.

The producer loop calls ``update()`` every tick (often: it is throttled here) and
``close()`` once at the end. Numbers come from shared.status, so the bars, ``budgetq
status`` and the monitor always agree.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, TextIO

import redis

from budgetq.shared import server_faults
from budgetq.shared.config import Config
from budgetq.shared.ledger import STATES, read_ledgers
from budgetq.shared.status import dataset_snapshots, format_duration, format_eta, read_fleet, server_now
from budgetq.shared.tokens import format_tokens

log = logging.getLogger("budgetq.progress")
BAR_REFRESH_S = 0.5
FAULTS_EVERY_S = 5.0     # how often the servers' faults are read (shared/server_faults.py)
FAULTS_REPEAT_S = 30.0   # an unchanged diagnosis is said again this often: a stall never looks quiet
# Prompts queued and no live worker is said once it lasted this long: workers started beside the
# producer (compose) take a few seconds to register, and that is not worth a warning.
NO_WORKER_GRACE_S = 10.0
_NO_WORKER = "no worker"  # what is said, for the repeat rule: the line itself changes with the count


class ProgressReporter:
    """``mode`` is cfg.producer.progress: auto (bars if ``stream`` is a terminal, else log lines),
    bars (always bars), log (always log lines every progress_interval_s), off."""

    def __init__(self, cfg: Config, conn: redis.Redis, stream: TextIO | None = None,
                 names: list[str] | None = None) -> None:
        self.cfg = cfg
        self.conn = conn
        self.names = names if names is not None else [d.name for d in cfg.datasets]
        self.stream = stream if stream is not None else sys.stdout
        mode = cfg.producer.progress
        if mode == "auto":
            mode = "bars" if _isatty(self.stream) else "log"
        self.mode = mode
        self.interval_s = BAR_REFRESH_S if mode == "bars" else cfg.producer.progress_interval_s
        self._last = float("-inf")
        self._progress: Any = None
        self._tasks: dict[str, Any] = {}
        self._rehomed: list[tuple[logging.StreamHandler, TextIO]] = []
        self._faults_read = float("-inf")
        self._said: tuple[str | None, float] = (None, float("-inf"))  # (what was said last, when)
        self._no_worker_since: float | None = None
        self.no_worker_grace_s = NO_WORKER_GRACE_S
        self._logged: dict[str, str] = {}  # dataset -> its last log line (the last one is not said twice)

    def _read(self) -> list[dict[str, Any]] | None:
        try:
            return dataset_snapshots(self.conn, self.names, server_now(self.conn), history_s=0)
        except redis.RedisError as exc:  # a display must never be what stops the run
            log.debug("progress: cannot read status: %s", exc)
            return None

    def update(self, force: bool = False, final: bool = False) -> None:
        self._fleet(time.monotonic(), force)
        if self.mode == "off" or not self.names:
            return
        now = time.monotonic()
        if not force and now - self._last < self.interval_s:
            return
        self._last = now
        snaps = self._read()
        if snaps is None:
            return
        if self.mode == "bars":
            self._draw(snaps)
        else:
            for d in snaps:
                self._log_line(d, final)

    def _fleet(self, now: float, force: bool = False) -> None:
        """Say in one line why nothing lands: the servers fail (``2/2 servers failing: HTTP 500
        text/html``) or no worker takes the queued prompts (``no worker is running: 262 prompts
        queued (...)``); when it starts, when it changes, every FAULTS_REPEAT_S while it lasts, and
        when it ends."""
        if not force and now - self._faults_read < FAULTS_EVERY_S:
            return
        self._faults_read = now
        try:
            fleet = read_fleet(self.conn)
            ledgers = read_ledgers(self.conn, self.names).values() if not fleet.workers else []
        except redis.RedisError as exc:
            log.debug("progress: cannot read the workers and server faults: %s", exc)
            return
        line = server_faults.diagnosis(fleet.faults)
        key = line
        queued, running = sum(led["queued"] for led in ledgers), sum(led["running"] for led in ledgers)
        if fleet.workers or not queued + running:
            self._no_worker_since = None
        elif line is None:
            if self._no_worker_since is None:
                self._no_worker_since = now
            if now - self._no_worker_since >= self.no_worker_grace_s:
                line, key = server_faults.no_worker(queued, running), _NO_WORKER
        said, at = self._said
        if key is not None and (key != said or now - at >= FAULTS_REPEAT_S):
            log.warning("%s", line)
            self._said = (key, now)
        elif key is None and said is not None:
            if fleet.workers:
                if said == _NO_WORKER:
                    log.warning("%d worker%s running now", fleet.workers, "s" if fleet.workers != 1 else "")
                else:
                    log.warning("servers answer again")
                self._said = (None, now)
            elif not queued + running:  # no worker, but nothing waits either: nothing to say
                self._said = (None, now)
            # else no worker is left to see the servers: the no-worker line follows once its grace is over

    def close(self) -> None:
        """A last update (every dataset's final numbers), then release the terminal."""
        if self.mode == "off":
            return
        self.update(force=True, final=True)
        if self._progress is not None:
            self._progress.stop()
            for handler, stream in self._rehomed:
                handler.setStream(stream)
            self._rehomed.clear()
            self._progress = None

    def _log_line(self, d: dict[str, Any], final: bool = False) -> None:
        """A dataset's line; the final one (``close``) only if it says something new: a run that
        ended just after a periodic line printed the same final line twice."""
        led = d["ledger"]
        pct = d["used_pct"] if d["used_pct"] is not None else 0.0
        rate = "done" if d["tok_s"] is None else f"{d['tok_s']:.0f} tok/s, ETA {format_eta(d['eta_s'], d['eta_by'])}"
        if d["state"] in ("paused", "held"):  # why the ETA is "-" (the hold's reason is the producer's own line)
            rate = f"{d['state']}, {rate}"
        said = f"{pct:.2f} {d['used']} {d['budget']} {rate}"
        if final and self._logged.get(d["dataset"]) == said:
            return
        self._logged[d["dataset"]] = said
        log.info("progress %s %.2f%% (%s / %s tokens, %s)", d["dataset"], pct,
                 format_tokens(d["used"]), format_tokens(d["budget"]), rate,
                 extra={"dataset": d["dataset"], "state": d["state"], "used": d["used"], "budget": d["budget"],
                        "tok_s": d["tok_s"], "eta_s": d["eta_s"], "eta_by": d["eta_by"], "stop": d["stop"],
                        "in_flight": d["in_flight"],
                        **{state: led[state] for state in STATES}, "committed": led["rows"],
                        "invalid": led["invalid"], "unread": led["unread"],
                        "unaccounted": led["unaccounted"]})

    def _start_bars(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn

        console = Console(file=self.stream, force_terminal=True if self.cfg.producer.progress == "bars" else None)
        width = max(len(n) for n in self.names)
        # The bar takes whatever room the numbers leave: 10 columns at 90, none at 80 (the numbers stay).
        self._progress = Progress(
            TextColumn(f"[bold]{{task.description:<{width}}}"), BarColumn(bar_width=None),
            TextColumn("{task.fields[pct]:>6.2f}%"), TextColumn("{task.fields[used]:>7}/{task.fields[budget]:<7}"),
            TextColumn("{task.fields[tok_s]:>6} tok/s"),
            TextColumn("ETA {task.fields[eta]:>6} {task.fields[eta_by]:<8}"),  # and the end it comes to
            TextColumn("{task.fields[in_flight]:>4} in flight"),
            console=console, auto_refresh=False, transient=False, redirect_stderr=True, redirect_stdout=True)
        before = sys.stderr
        self._progress.start()
        if sys.stderr is before:
            return  # rich did not redirect (not a terminal)
        # Log handlers hold the stderr they were created with; point ours at rich's proxy so
        # log lines print above the bars instead of through them.
        for h in logging.getLogger().handlers:
            if isinstance(h, logging.StreamHandler) and h.stream is before:
                self._rehomed.append((h, before))
                h.setStream(sys.stderr)

    def _draw(self, snaps: list[dict[str, Any]]) -> None:
        if self._progress is None:
            self._start_bars()
        for d in snaps:
            fields = {"pct": d["used_pct"] or 0.0, "used": format_tokens(d["used"]),
                      "budget": format_tokens(d["budget"]),
                      "tok_s": "-" if d["tok_s"] is None else format_tokens(round(d["tok_s"])),
                      "eta": format_duration(d["eta_s"]), "in_flight": d["in_flight"],
                      "eta_by": d["eta_by"] or ""}  # the end it comes to: budget, prompts or deadline
            total = max(1, d["budget"])
            if d["dataset"] not in self._tasks:
                self._tasks[d["dataset"]] = self._progress.add_task(d["dataset"], total=total, **fields)
            self._progress.update(self._tasks[d["dataset"]], total=total, completed=min(d["used"], total), **fields)
        self._progress.refresh()


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
