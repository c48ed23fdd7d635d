"""Every Redis key budgetq uses, in one place.

Per-dataset keys carry a ``{dataset}`` hash tag so that one dataset's keys sit in one
Redis Cluster slot and the multi-key Lua scripts stay legal there.
"""

PREFIX = "bq"
DATASETS = f"{PREFIX}:datasets"
QUEUE_PREFIX = "bq-"


def _ds(ds: str, what: str) -> str:
    return f"{PREFIX}:{{{ds}}}:{what}"


def conf_key(ds: str) -> str:
    """Hash: limit, mode, paused, prior_mean, max_tokens."""
    return _ds(ds, "conf")


def used_key(ds: str) -> str:
    """String counter: tokens counted toward the budget."""
    return _ds(ds, "used")


def resv_key(ds: str) -> str:
    """Hash: job id -> tokens reserved by a request in flight."""
    return _ds(ds, "resv")


def reserved_key(ds: str) -> str:
    """String counter: sum of ``resv_key`` values (kept so reserve is O(1))."""
    return _ds(ds, "reserved")


def done_key(ds: str) -> str:
    """Set: prompt ids whose result has been committed."""
    return _ds(ds, "done")


def stats_key(ds: str) -> str:
    """Hash: committed, skipped, failed, invalid, duplicate, sum_tokens, requests."""
    return _ds(ds, "stats")


def results_key(ds: str) -> str:
    """Stream: committed results waiting for the producer's collector."""
    return _ds(ds, "results")


def cursor_key(ds: str) -> str:
    """String: id of the last results-stream entry the collector wrote to disk."""
    return _ds(ds, "cursor")


# Stats fields that mark a job as finished one way or another (the producer waits on them).
TERMINAL_STATS = ("committed", "skipped", "failed", "duplicate", "paused", "already_done")


def queue_name(ds: str) -> str:
    """RQ queue name of a dataset."""
    return f"{QUEUE_PREFIX}{ds}"


def budget_keys(ds: str) -> list[str]:
    """KEYS of every budget script, in the order the scripts' headers document."""
    return [
        conf_key(ds),
        used_key(ds),
        resv_key(ds),
        reserved_key(ds),
        done_key(ds),
        stats_key(ds),
        results_key(ds),
    ]
