"""Named fault points of the hidden-states store, for tests: inert unless ``BUDGETQ_FAULT_POINT`` names one.

``BUDGETQ_FAULT_POINT=<point>`` SIGKILLs the process the first time it reaches ``<point>``, so a test can put a
kill exactly where it claims to (tests/test_store_faults.py checks each one by its on-disk evidence, and by the
line the process writes to stderr just before: ``budgetq fault point <point>: SIGKILL``).
``BUDGETQ_FAULT_POINT=<point>:<ERRNO>[:<n>]`` (``shard-tmp-written:ENOSPC:1``) raises that OSError the first
``n`` times (default 1) the process reaches it instead: a store write that fails, once or for good. Several
points: comma-separated.

The points, in the order a sample's shard goes through them:

- ``shard-tmp-written``: a shard's ``.tmp`` written and fsynced, not yet renamed (``write_atomic``);
- ``shard-renamed``: the shard renamed into place, before anything else happens (``write_atomic``);
- ``before-index-message``: a features worker's shard on disk, its index message not yet sent (``deliver``);
- ``before-index-rows``: the collector's shards on disk, their index rows not yet appended (``flush``);
- ``vllm-mid-request``: a vLLM features worker's prefill request sent, its answer not yet read (vllm_backend.py).

The two older variables (``BUDGETQ_FEATURES_CRASH_AFTER_SHARD``, ``BUDGETQ_FEATURES_WORKER_CRASH_AFTER_SHARD``)
still kill at the last two points.
"""

from __future__ import annotations

import errno
import os
import signal

ENV = "BUDGETQ_FAULT_POINT"
SHARD_TMP_WRITTEN = "shard-tmp-written"
SHARD_RENAMED = "shard-renamed"
BEFORE_INDEX_MESSAGE = "before-index-message"
BEFORE_INDEX_ROWS = "before-index-rows"
VLLM_MID_REQUEST = "vllm-mid-request"
POINTS = (SHARD_TMP_WRITTEN, SHARD_RENAMED, BEFORE_INDEX_MESSAGE, BEFORE_INDEX_ROWS, VLLM_MID_REQUEST)
# The variables of the first kill points (tests/test_features.py and test_capture.py set them).
LEGACY = {BEFORE_INDEX_ROWS: "BUDGETQ_FEATURES_CRASH_AFTER_SHARD",
          BEFORE_INDEX_MESSAGE: "BUDGETQ_FEATURES_WORKER_CRASH_AFTER_SHARD"}

_raised: dict[str, int] = {}   # point -> OSErrors raised there so far by this process


def _spec(point: str) -> str | None:
    """This point's entry in BUDGETQ_FAULT_POINT ("" for a kill, "ERRNO[:n]" for an error), None if absent."""
    found = None
    for entry in filter(None, (e.strip() for e in os.environ.get(ENV, "").split(","))):
        name, _, rest = entry.partition(":")
        if name not in POINTS:  # a misspelt point would make a test's kill silently never happen
            raise ValueError(f"{ENV}: {entry!r}: no such fault point (one of {', '.join(POINTS)})")
        if name == point:
            found = rest
    if found is not None:
        return found
    legacy = LEGACY.get(point)
    return "" if legacy and os.environ.get(legacy) else None


def reached(point: str) -> None:
    """Called at ``point``: nothing unless the environment names it (then SIGKILL, or the OSError it names)."""
    spec = _spec(point)
    if spec is None:
        return
    if not spec:
        # One line first (unbuffered, stderr): the test reads where the kill landed from the process itself.
        os.write(2, f"budgetq fault point {point}: SIGKILL (pid {os.getpid()})\n".encode())
        os.kill(os.getpid(), signal.SIGKILL)
        return
    name, _, times = spec.partition(":")
    code = getattr(errno, name.upper(), None)
    if not isinstance(code, int):
        raise ValueError(f"{ENV}: {point}:{spec}: {name!r} is not an errno name (ENOSPC, EIO, ESTALE ...)")
    done = _raised.get(point, 0)
    if done < (int(times) if times else 1):
        _raised[point] = done + 1
        raise OSError(code, f"{os.strerror(code)} (fault point {point})")
