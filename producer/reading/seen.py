"""The prompt ids a producer has read so far, compactly: the duplicate check of a run.

A run can read millions of ids; a Python ``set`` of 16-byte ``bytes`` costs ~100 bytes an
id. This keeps the 16-byte sha256 prefix of each id (shared.identity.digest) in two
``uint64`` numpy arrays, an open-addressing table with linear probing, grown x2 at 2/3 load:
17 / load = 26-51 bytes an id (tests/test_identity.py measures it; a Python set: ~77).
A false "duplicate" needs two ids whose 128-bit digests agree.
"""

from __future__ import annotations

import numpy as np

from budgetq.shared.identity import digest

_MAX_LOAD = 2 / 3


class SeenIds:
    def __init__(self, capacity: int = 1 << 12) -> None:
        size = 1 << max(4, (capacity - 1).bit_length())
        self._hi = np.zeros(size, dtype=np.uint64)
        self._lo = np.zeros(size, dtype=np.uint64)
        self._used = np.zeros(size, dtype=bool)
        self._mask = size - 1
        self.count = 0

    @property
    def nbytes(self) -> int:
        return self._hi.nbytes + self._lo.nbytes + self._used.nbytes

    def add(self, pid: str) -> bool:
        """Record ``pid``; True if it is new, False if it was seen before."""
        d = digest(pid)
        hi, lo = int.from_bytes(d[:8], "little"), int.from_bytes(d[8:], "little")
        if self._insert(hi, lo):
            self.count += 1
            if self.count > _MAX_LOAD * len(self._hi):
                self._grow()
            return True
        return False

    def _insert(self, hi: int, lo: int) -> bool:
        i = hi & self._mask
        while self._used[i]:
            if self._hi[i] == hi and self._lo[i] == lo:
                return False
            i = (i + 1) & self._mask
        self._used[i] = True
        self._hi[i] = hi
        self._lo[i] = lo
        return True

    def _grow(self) -> None:
        his, los = self._hi[self._used], self._lo[self._used]
        size = 2 * len(self._hi)
        self._hi = np.zeros(size, dtype=np.uint64)
        self._lo = np.zeros(size, dtype=np.uint64)
        self._used = np.zeros(size, dtype=bool)
        self._mask = size - 1
        for hi, lo in zip(his.tolist(), los.tolist(), strict=True):
            self._insert(hi, lo)

    def __len__(self) -> int:
        return self.count
