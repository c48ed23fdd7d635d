"""One collector per dataset for the features pass (``bq:{ds}:features:lock``): two would both write
the same stream entries into shards. Held with a TTL, refreshed by the pass; a holder killed on this
host is recognised by its pid and taken over at once."""

from __future__ import annotations

import logging
import os
import socket
import uuid

import redis

from budgetq.shared import keys
from budgetq.shared.errors import BudgetqError
from budgetq.shared.redis_conn import text

log = logging.getLogger("budgetq.features")
LOCK_TTL_S = 30            # refreshed every few seconds by the pass; a killed pass's lock lapses after this


def new_owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


class CollectorLock:
    """The locks of one pass. ``owner`` is ``host:pid:nonce``; a caller that may build its pass again
    after a failed start in the same process (hidden_states/collect/inline.py) passes a fixed one, so the locks its
    first try took count as its own."""

    def __init__(self, conn: redis.Redis, owner: str) -> None:
        self.conn = conn
        self.owner = owner
        self.names: list[str] = []

    def take(self, names: list[str]) -> None:
        taken: list[str] = []
        for name in names:
            key = keys.features_lock_key(name)
            if self.conn.set(key, self.owner, nx=True, ex=LOCK_TTL_S):
                taken.append(name)
                continue
            holder = text(self.conn.get(key))
            if holder == self.owner:
                taken.append(name)
                continue
            if _dead_here(holder):  # a pass killed on this machine: no need to wait for the TTL
                log.warning("dataset %s: taking over the features lock of %s (that process is gone)", name, holder)
                self.conn.set(key, self.owner, ex=LOCK_TTL_S)
                taken.append(name)
                continue
            for t in taken:
                self.conn.delete(keys.features_lock_key(t))
            raise BudgetqError(f"dataset {name}: another `budgetq features` is running for it, or a `budgetq "
                               f"produce` with capture: features ({holder}); one at a time writes its shards "
                               f"(its lock lapses {LOCK_TTL_S} s after it stops)")
        self.names = taken

    def refresh(self) -> None:
        for name in self.names:
            key = keys.features_lock_key(name)
            if self.conn.get(key) not in (self.owner.encode(), None):
                raise BudgetqError(f"dataset {name}: lost the features lock to {text(self.conn.get(key))}: "
                                   "stopping before two collectors write the same shards")
            self.conn.set(key, self.owner, ex=LOCK_TTL_S)

    def release(self) -> None:
        for name in self.names:
            key = keys.features_lock_key(name)
            if self.conn.get(key) == self.owner.encode():
                self.conn.delete(key)


def _dead_here(holder: str) -> bool:
    """True if the lock holder ``host:pid:nonce`` ran on this host and that pid no longer exists."""
    parts = holder.rsplit(":", 2)
    if len(parts) != 3 or parts[0] != socket.gethostname() or not parts[1].isdigit():
        return False
    try:
        os.kill(int(parts[1]), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False
