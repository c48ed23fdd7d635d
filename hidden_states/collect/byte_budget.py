"""Disk as a budget: each dataset's hidden states stop at its share of features.max_bytes, one for the run.

The shares are producer/run/allocation.py's ``byte_shares`` (features.max_bytes water-filled by the
datasets' weights, as the token budgets are; a dataset's own ``features_max_bytes`` caps its share) over
every dataset of the run that captures hidden states, not only those of this pass: the config's ``capture:
features`` datasets (or all of them where none is), the datasets this pass captures, and any that a pass
registered in Redis (``keys.FEATURES_BUDGET_DATASETS``). What each has written, its weight and whether it is
done capturing are read from Redis (``keys.features_bytes_key``), so `features -d A` then `features -d B`,
two such passes at once on two hosts, and `produce`'s inline capture (inline.py runs this same pass) share
one features.max_bytes: a pass splits what the others have not written, and holds a weighted share for a
dataset that has not started yet unless it is done (its rows all captured: it keeps what it wrote).

Before a sample is admitted, what the dataset has on disk, plus what is buffered and in flight, plus the
sample (at the bytes per token learnt from results, or from the model's config.json before the first) must
fit under its share; the first that does not stops the dataset's admissions with a one-line reason
(shared/features_bytes.py ``STOP``). What is in flight is still written. Only the holder of a dataset's lock
(one process) admits its samples, so its in-flight bytes are known where they are checked.

The bytes written are counted in Redis as samples are indexed (features_mark.lua, once per sample; reset
to what is on disk when the pass opens the store, which only the lock holder does), with the share, the
weight, ``done`` and the stop reason beside them, for `budgetq status`, /metrics, the monitor and the
other passes.
"""

from __future__ import annotations

import logging
from typing import cast

import redis

from budgetq.producer.run.allocation import byte_shares
from budgetq.shared import features_bytes, keys
from budgetq.shared.config import Config
from budgetq.shared.errors import ConfigError
from budgetq.shared.redis_conn import text
from budgetq.shared.scripts import run

log = logging.getLogger("budgetq.features")


class ByteBudget:
    def __init__(self, cfg: Config, conn: redis.Redis, names: list[str]) -> None:
        self.conn = conn
        self.cfg = cfg
        self.total = cfg.features.max_bytes
        self.names = list(names)   # the datasets this pass captures (it holds their locks)
        capturing = [ds.name for ds in cfg.datasets if ds.capture == "features"] or [ds.name for ds in cfg.datasets]
        # The run's datasets that share features.max_bytes; registered so that a pass over others counts them.
        self.run_names = sorted(set(capturing) | set(names))
        conn.sadd(keys.FEATURES_BUDGET_DATASETS, *self.run_names)
        self.weights = {n: cfg.dataset(n).weight for n in names}
        self.caps = {n: cfg.dataset(n).features_max_bytes for n in names}
        self.config_bpt = features_bytes.config_bytes_per_token(cfg)
        self.shares: dict[str, int | None] = {n: None for n in names}
        self.done: dict[str, bool] = {}
        self.stopped: dict[str, str] = {}   # dataset -> why its admissions stopped

    def sync(self, ds: str, written: int, tokens: int, opening: bool = False) -> None:
        """The count set to what is on disk (the pass opened or reconciled the store; it holds the dataset's
        lock, so nothing else writes it); ``opening``: no stop yet, not done, its weight and cap recorded."""
        with self.conn.pipeline() as pipe:
            pipe.hset(keys.features_bytes_key(ds), mapping={"written": written, "tokens": tokens})
            if opening:
                cap = self.caps.get(ds)
                pipe.hset(keys.features_bytes_key(ds), mapping={
                    "stop": "", "share": "", "done": "", "weight": self.weights[ds], "cap": "" if cap is None else cap})
                self.done.pop(ds, None)
            pipe.execute()

    def mark(self, ds: str, samples: list[tuple[str, int, int]]) -> None:
        """Samples (id, bytes, tokens) now indexed: done in Redis, their bytes counted once."""
        for i in range(0, len(samples), 1000):
            run(self.conn, features_bytes.mark_done(ds, samples[i:i + 1000]))

    def _others(self) -> dict[str, dict[str, str]]:
        """The run's other datasets as Redis has them: written, weight, cap, done (another pass, another host)."""
        names = sorted({*self.run_names, *map(text, cast(set, self.conn.smembers(keys.FEATURES_BUDGET_DATASETS)))}
                       - set(self.names))
        pipe = self.conn.pipeline(transaction=False)
        for n in names:
            pipe.hgetall(keys.features_bytes_key(n))
        return {n: {k.decode(): v.decode() for k, v in h.items()} for n, h in zip(names, pipe.execute(), strict=True)}

    def _config_weight(self, n: str) -> tuple[float, int | None]:
        try:
            ds = self.cfg.dataset(n)
        except ConfigError:  # a dataset another config registered: its recorded weight, else 1
            return 1.0, None
        return ds.weight, ds.features_max_bytes

    def resplit(self, written: dict[str, int], finished: set[str]) -> None:
        """Recompute the shares over the run's datasets (one done capturing keeps only what it wrote; the
        rest goes to the others); ``written``/``finished``: this pass's own datasets."""
        weights, caps, floors = dict(self.weights), {}, dict(written)
        for n in self.names:
            caps[n] = written.get(n, 0) if n in finished else self.caps[n]
        if self.total is not None:  # without a total each dataset's own cap: nothing to read
            for n, h in self._others().items():
                w, cap = self._config_weight(n)
                weights[n] = float(h.get("weight") or w)
                floors[n] = int(h.get("written") or 0)
                cap = int(h["cap"]) if h.get("cap") else cap
                caps[n] = floors[n] if h.get("done") else cap
        shares = byte_shares(self.total, weights, caps, floors)
        own = {n: shares[n] for n in self.names}
        done = {n: n in finished for n in self.names}
        changed = {n: s for n, s in own.items() if s != self.shares.get(n)}
        flipped = {n: d for n, d in done.items() if d != self.done.get(n)}
        self.shares.update(own)
        self.done.update(done)
        if changed or flipped:
            pipe = self.conn.pipeline(transaction=False)
            for n, s in changed.items():
                pipe.hset(keys.features_bytes_key(n), "share", "" if s is None else s)
            for n, d in flipped.items():
                pipe.hset(keys.features_bytes_key(n), "done", "1" if d else "")
            pipe.execute()

    def admit(self, ds: str, tokens: int, outstanding_tokens: int, on_disk: int, buffered: int,
              learnt_bpt: float | None) -> bool:
        if ds in self.stopped:
            return False
        share = self.shares.get(ds)
        bpt = learnt_bpt if learnt_bpt is not None else self.config_bpt
        if share is None or bpt is None:
            return True
        coming = buffered + (outstanding_tokens + tokens) * bpt
        if on_disk + coming <= share:
            return True
        whole = f"features.max_bytes {self.total} split by weight" if self.total is not None else ""
        own = f"features_max_bytes {self.caps[ds]}" if self.caps[ds] is not None else ""
        self.stopped[ds] = (f"dataset {ds}: {features_bytes.STOP}: its share is {share} bytes "
                            f"({'; '.join(x for x in (whole, own) if x)}), {on_disk} on disk, ~{coming:.0f} more "
                            f"coming at {bpt:.0f} bytes/token; raise features.max_bytes (or the dataset's "
                            "features_max_bytes) to go on")
        self.conn.hset(keys.features_bytes_key(ds), "stop", self.stopped[ds])
        log.error("features: admissions stopped: %s", self.stopped[ds])
        return False
