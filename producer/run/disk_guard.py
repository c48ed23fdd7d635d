"""The output volume: is output_dir usable, is there room, and the producer's hold when it is not.

One place for what both passes need: ``preflight`` (before anything is written to Redis),
``free_bytes``/``probe`` (free space, writability), ``is_disk_fault`` (an OSError that is the
disk's, not a bug's), and ``OutputGuard``, generation's hold: below ``min_free_mb`` free, or
after a write failed (disk full, read-only, permission), the producer stops enqueueing and
sets ``Conf.HOLD`` on its datasets, which reserve.lua treats like a pause, so workers stop
reserving. Results already generated stay in Redis's results streams (the collector only moves
its cursor past what was fsynced) and are written when the guard lets go: by itself once the
volume has room again, or on the next start. The features pass's estimate-based guard is in
hidden_states/collect/guard.py and uses the same free-space rule.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import redis

from budgetq.shared import keys
from budgetq.shared.errors import BudgetqError
from budgetq.shared.stats import Conf

log = logging.getLogger("budgetq.producer")
MB = 2**20
# What a full, read-only or forbidden volume raises; any other OSError is not the disk's.
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG,
                         errno.EIO})
# A hold taken for low space lets go only above min_free_mb plus this share of it, so a volume
# that hovers at the limit does not flap between holding and admitting (one line each way).
RELEASE_SLACK = 0.05
RETRY_WRITE_S = 2.0   # while a write fails, try again at most this often


def is_disk_fault(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in DISK_ERRNOS


def _existing(path: Path) -> Path:
    """``path`` or its nearest existing ancestor (what a missing output_dir would be created in)."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: Path) -> int:
    """Free bytes for an unprivileged writer on the volume that holds (or would hold) ``path``."""
    return shutil.disk_usage(_existing(path)).free


def probe(path: Path) -> str | None:
    """Why files cannot be created in ``path`` (or where it would be created), or None if they can.

    Tried for real (a probe file, removed at once): as root, os.access says yes to a directory
    on a read-only mount or under a permission rule that still refuses the write.
    """
    target = Path(path)
    if target.exists() and not target.is_dir():
        return "it exists and is not a directory"
    base = _existing(target)
    if not base.is_dir():
        return f"{base} is not a directory"
    try:
        fd, name = tempfile.mkstemp(prefix=".budgetq-probe-", dir=base)
        try:
            os.write(fd, b"\n")
        finally:
            os.close(fd)
            os.unlink(name)
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        if base != Path(os.path.abspath(target)):
            return f"it does not exist and cannot be created in {base} ({why})"
        return why
    return None


def low_space(path: Path, min_free: int) -> str | None:
    """Why the volume of ``path`` has no room (under ``min_free`` bytes free), or None."""
    free = free_bytes(path)
    if free < min_free:
        return f"{free / MB:.1f} MB free, under min_free_mb {min_free / MB:g}"
    return None


def preflight(out_dir: Path, min_free_mb: float) -> None:
    """output_dir exists or can be created, takes files, and has min_free_mb free: else one line."""
    why = probe(out_dir) or low_space(out_dir, int(min_free_mb * MB))
    if why is not None:
        raise BudgetqError(f"output_dir {out_dir}: {why}; nothing was started (fix it, or set output_dir "
                           "to a writable directory with room)")


def output_error(out_dir: Path, exc: OSError) -> BudgetqError:
    """An OSError met while preparing output_dir, as the one line the operator sees."""
    where = exc.filename or out_dir
    return BudgetqError(f"output_dir {out_dir}: cannot write {where}: {exc.strerror or exc}")


class OutputGuard:
    """Generation's disk guard: whether the producer may admit work and write results now.

    ``admitting()`` is asked before each round of enqueueing; ``write_failed(exc)`` is told of a
    failed write; ``may_write()`` says whether to try writing again. The hold it takes is
    mirrored into Redis (``Conf.HOLD`` on each dataset) by ``sync`` on every tick, so a Redis
    outage while it changes only delays it.
    """

    def __init__(self, conn: redis.Redis, out_dir: Path, min_free_mb: float, datasets: list[str]) -> None:
        self.conn = conn
        self.out_dir = out_dir
        self.min_free = int(min_free_mb * MB)
        self.datasets = datasets
        self.reason: str | None = None   # why admissions are held; None: admitting
        self.write_fault = False         # the last write failed: results wait in Redis
        self._tried_at = 0.0
        self._synced: str | None = "?"   # what Redis holds; "?" = unknown, written on the first sync

    @property
    def held(self) -> bool:
        return self.reason is not None

    def _hold(self, reason: str) -> None:
        if self.reason is None:
            log.error("output_dir %s: %s; admissions held (workers stop taking new prompts), every result "
                      "stays in Redis until it is written; they resume by themselves once there is room",
                      self.out_dir, reason)
        self.reason = reason

    def _release(self) -> None:
        if self.reason is not None:
            log.warning("output_dir %s: writable again with %.0f MB free; admitting and writing again",
                        self.out_dir, free_bytes(self.out_dir) / MB)
        self.reason = None
        self.write_fault = False

    def write_failed(self, exc: OSError) -> None:
        self.write_fault = True
        self._tried_at = time.monotonic()
        self._hold(f"writing {exc.filename or 'a result file'} failed: {exc.strerror or exc}")

    def may_write(self) -> bool:
        """Try writing results now? Always, unless a write failed: then once the volume takes a file
        again, at most every RETRY_WRITE_S."""
        if not self.write_fault:
            return True
        if time.monotonic() - self._tried_at < RETRY_WRITE_S:
            return False
        self._tried_at = time.monotonic()
        return probe(self.out_dir) is None

    def wrote(self) -> None:
        """A write went through: the fault (if any) is over; admissions wait for room, if short."""
        self.write_fault = False

    def admitting(self) -> bool:
        """May the producer enqueue more (and workers reserve)? Checks free space each time."""
        free = free_bytes(self.out_dir)
        if self.write_fault:
            return False
        if free < self.min_free:
            self._hold(f"{free / MB:.1f} MB free, under min_free_mb {self.min_free / MB:g}")
            return False
        if self.reason is not None and free < self.min_free * (1 + RELEASE_SLACK):
            return False
        self._release()
        return True

    def sync(self) -> None:
        """Write the hold (or its end) into each dataset's conf, if Redis does not hold it yet."""
        want = self.reason
        if want == self._synced:
            return
        pipe = self.conn.pipeline()
        for ds in self.datasets:
            if want is None:
                pipe.hdel(keys.conf_key(ds), Conf.HOLD)
            else:
                pipe.hset(keys.conf_key(ds), Conf.HOLD, want)
        pipe.execute()
        self._synced = want
