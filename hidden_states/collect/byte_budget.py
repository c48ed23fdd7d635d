"""Disk as a budget: each dataset's hidden states stop at its share of features.max_bytes.

The shares are producer/run/allocation.py's ``byte_shares`` (features.max_bytes water-filled by the
datasets' weights, as the token budgets are; a dataset's own ``features_max_bytes`` caps its share), over
the datasets this pass captures. Before a sample is admitted, what the dataset has on disk, plus what is
buffered and in flight, plus the sample (at the bytes per token learnt from results, or from the model's
config.json before the first) must fit under its share; the first that does not stops the dataset's
admissions with a one-line reason (shared/features_bytes.py ``STOP``). What is in flight is still written.

The bytes written are counted in Redis as samples are indexed (features_mark.lua, once per sample; reset
to what is on disk when the pass opens the store, which only the lock holder does), with the share and
the stop reason beside them, for `budgetq status`, /metrics and the monitor.
"""

from __future__ import annotations

import logging

import redis

from budgetq.producer.run.allocation import byte_shares
from budgetq.shared import features_bytes, keys
from budgetq.shared.config import Config
from budgetq.shared.scripts import run

log = logging.getLogger("budgetq.features")


class ByteBudget:
    def __init__(self, cfg: Config, conn: redis.Redis, names: list[str]) -> None:
        self.conn = conn
        self.total = cfg.features.max_bytes
        self.weights = {n: cfg.dataset(n).weight for n in names}
        self.caps = {n: cfg.dataset(n).features_max_bytes for n in names}
        self.config_bpt = features_bytes.config_bytes_per_token(cfg)
        self.shares: dict[str, int | None] = {n: None for n in names}
        self.stopped: dict[str, str] = {}   # dataset -> why its admissions stopped

    def sync(self, ds: str, written: int, tokens: int, opening: bool = False) -> None:
        """The count set to what is on disk (the pass opened or reconciled the store; it holds the dataset's
        lock, so nothing else writes it); ``opening``: no stop yet."""
        with self.conn.pipeline() as pipe:
            pipe.hset(keys.features_bytes_key(ds), mapping={"written": written, "tokens": tokens})
            if opening:
                pipe.hset(keys.features_bytes_key(ds), mapping={"stop": "", "share": ""})
            pipe.execute()

    def mark(self, ds: str, samples: list[tuple[str, int, int]]) -> None:
        """Samples (id, bytes, tokens) now indexed: done in Redis, their bytes counted once."""
        for i in range(0, len(samples), 1000):
            run(self.conn, features_bytes.mark_done(ds, samples[i:i + 1000]))

    def resplit(self, written: dict[str, int], finished: set[str]) -> None:
        """Recompute the shares (a dataset done capturing keeps only what it wrote; the rest goes to the others)."""
        caps = {n: (written.get(n, 0) if n in finished else c) for n, c in self.caps.items()}
        shares = byte_shares(self.total, self.weights, caps, written)
        changed = {n: s for n, s in shares.items() if s != self.shares.get(n)}
        self.shares.update(shares)
        if changed:
            pipe = self.conn.pipeline(transaction=False)
            for n, s in changed.items():
                pipe.hset(keys.features_bytes_key(n), "share", "" if s is None else s)
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
