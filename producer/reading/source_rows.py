"""What every format reader yields (``SourceRow`` / ``SourceError``) and what they share.

Its own module so that producer/reading/sources.py (JSONL, JSON arrays, the format dispatch) and
producer/reading/arrow_sources.py (Parquet, HF datasets) both import it and not each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

HF_PREFIX = "hf://"
CHUNK = 1 << 20          # bytes read at a time while scanning files
TAKE_WINDOW = 1024       # rows fetched per random-access batch when shuffled


@dataclass(frozen=True)
class SourceRow:
    line: int
    data: dict[str, Any]


@dataclass(frozen=True)
class SourceError:
    line: int
    reason: str


SourceItem = SourceRow | SourceError


def permutation(n: int, seed: int) -> np.ndarray:
    """numpy's ``default_rng(seed).permutation(n)``: the same seed on the same input, the same order."""
    import numpy as np  # lazily: a run that does not shuffle never pays for it

    return np.random.default_rng(seed).permutation(n)
