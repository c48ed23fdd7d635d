"""Every Redis key budgetq uses, in one place.

Per-dataset keys carry a ``{dataset}`` hash tag, so one dataset's keys share a hash slot
and the per-dataset budget scripts (reserve, commit, adjust, adopt, withdraw, and release
without its optional RQ registry key) touch one slot only. The claim, requeue and finish
scripts (and release with the registry) also touch RQ's own keys (``rq:queue:bq-<ds>``,
``rq:wip:bq-<ds>``, ``rq:job:<id>``, named here too because those scripts move jobs
atomically within RQ's layout, checked by tests against RQ's own API); those keys carry no
hash tag, so those scripts are not Redis Cluster-legal. budgetq needs a single Redis
(optionally with replicas), not a Cluster: see docs/resilience.md.
"""
from __future__ import annotations

from budgetq.shared import identity

PREFIX = "bq"
DATASETS = f"{PREFIX}:datasets"
QUEUE_PREFIX = "bq-"
# Set of live worker names; each has a hash worker_key(name) with a TTL (see worker_key).
WORKERS = f"{PREFIX}:workers"
# Stream of operator actions (budget set, pause, resume, abort, retry-failed, reconcile):
# fields ts, who, action, dataset, old, new.
CONTROL_LOG = f"{PREFIX}:control"
CONTROL_LOG_MAXLEN = 1000
# Stream of the producer's automatic budget moves (deadline pacing, the total's split, the abort at
# a deadline), same fields; apart from CONTROL_LOG so its hundreds of pace steps never push a
# person's action out of the log or off `budgetq status`.
CONTROL_AUTO_LOG = f"{PREFIX}:control:auto"
# A run's deadline, total budget and weights (hash; shared/run_plan.py), and what the producer's
# budget loop measured and projects from them (JSON string): docs/budget.md "Deadline and total".
PLAN = f"{PREFIX}:plan"
PLAN_STATE = f"{PREFIX}:plan:state"
# The running producer (JSON host, pid, started_at) with a TTL it refreshes: gone, its unfinished
# datasets are "interrupted" in status (shared/presence.py).
PRODUCER = f"{PREFIX}:producer"
# Lock held by whichever process runs the maintenance pass (requeue abandoned jobs).
MAINTENANCE_LOCK = f"{PREFIX}:maintenance:lock"
# Width of the buckets of rate_key, in seconds, and how long commit.lua keeps them.
RATE_BUCKET_S = 5
RATE_KEEP_S = 3600
# Bins of hist_key: bin width = max_tokens // HIST_BINS; a response cut at max_tokens lands
# in bin HIST_BINS (the cap's point mass). Passed to commit.lua, read by worker/estimator.py.
HIST_BINS = 64


def _ds(ds: str, what: str) -> str:
    return f"{PREFIX}:{{{ds}}}:{what}"


def conf_key(ds: str) -> str:
    """Hash of a dataset's settings; its fields are ``shared.stats.Conf``."""
    return _ds(ds, "conf")


def used_key(ds: str) -> str:
    """String counter: tokens counted toward the budget."""
    return _ds(ds, "used")


def resv_key(ds: str) -> str:
    """Hash: job id -> tokens reserved by a request in flight (its admission ticket)."""
    return _ds(ds, "resv")


def reserved_key(ds: str) -> str:
    """String counter: sum of ``resv_key`` values (kept so reserve is O(1))."""
    return _ds(ds, "reserved")


def done_key(ds: str) -> str:
    """Set: job ids whose result has been committed (counted, or kept aside as truncated)."""
    return _ds(ds, "done")


def stats_key(ds: str) -> str:
    """Hash of counters; its fields are ``shared.stats.Stat`` (who writes each is noted there)."""
    return _ds(ds, "stats")


def hist_key(ds: str) -> str:
    """Hash: bucket index -> count of committed responses whose counted length falls in
    [i * width, (i + 1) * width), width = conf.max_tokens // HIST_BINS (at least 1). Workers read it
    to estimate how long the requests still in flight will run."""
    return _ds(ds, "hist")


def rate_key(ds: str) -> str:
    """Hash: bucket start (unix seconds, multiple of RATE_BUCKET_S) -> tokens counted in it."""
    return _ds(ds, "rate")


def results_key(ds: str) -> str:
    """Stream: committed results waiting for the producer's collector (fields id, kind, row)."""
    return _ds(ds, "results")


def discards_key(ds: str) -> str:
    """Hash of discarded answers by reason (commit.lua): ``<reason>`` -> answers, ``<reason>:tokens`` ->
    their completion tokens; the reason's kind only ("validator", not the validator's text)."""
    return _ds(ds, "discards")


def retried_key(ds: str) -> str:
    """Set of job ids whose discarded answer was already sent again once (commit.lua, retry_discarded):
    a prompt is retried at most once, whichever worker or run commits its attempts."""
    return _ds(ds, "retried")


def cursor_key(ds: str) -> str:
    """String: id of the last results-stream entry the collector wrote to disk."""
    return _ds(ds, "cursor")


def worker_key(name: str) -> str:
    """Hash of one live worker: host, pid, started_at, concurrency, in_flight, processed,
    endpoints (JSON: url -> {healthy, in_flight, failures}). Expires unless refreshed."""
    return f"{PREFIX}:worker:{name}"


def server_faults_key(name: str) -> str:
    """String (JSON): url -> that worker's fault counts by reason for the endpoint, its health and the
    times of its last fault and last success (shared/server_faults.py). Same TTL as worker_key."""
    return f"{PREFIX}:faults:{name}"


def queue_name(ds: str) -> str:
    """RQ queue name of a dataset."""
    return f"{QUEUE_PREFIX}{ds}"


def dataset_of_queue(queue: str) -> str:
    return queue.removeprefix(QUEUE_PREFIX)


def rq_queue_key(ds: str) -> str:
    """RQ's list of queued job ids of a dataset."""
    return f"rq:queue:{queue_name(ds)}"


def rq_wip_key(ds: str) -> str:
    """RQ's StartedJobRegistry of a dataset (members ``<job id>:<execution id>``, score = lease end)."""
    return f"rq:wip:{queue_name(ds)}"


def rq_intermediate_key(ds: str) -> str:
    """Where a stock ``rq worker`` parks a job between popping and starting it."""
    return f"{rq_queue_key(ds)}:intermediate"


RQ_JOB_PREFIX = "rq:job:"  # claim.lua gets it in ARGV: it builds job keys from the ids it pops


def rq_job_key(job_id: str) -> str:
    return f"{RQ_JOB_PREFIX}{job_id}"


def rq_registry_key(ds: str, status: str) -> str:
    """RQ's registry of a dataset's jobs with this status (finished, failed, canceled):
    ``rq:<status>:<queue>``, RQ's own naming (what shared.jobs.registry(...).key gives)."""
    return f"rq:{status}:{queue_name(ds)}"


RQ_RESULTS_PREFIX = "rq:results:"  # finish.lua gets it in ARGV: one call records several jobs


def rq_results_key(job_id: str) -> str:
    """RQ's stream of a job's results (rq.results.Result)."""
    return f"{RQ_RESULTS_PREFIX}{job_id}"


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
        hist_key(ds),
        rate_key(ds),
    ]


def capacity_key(url: str) -> str:
    """Hash: worker name -> "<unix s> <its requests in flight there>", written each time it sizes
    its requests for the server at ``url`` (worker.concurrency: auto, worker/capacity.py): the
    live workers sharing that server."""
    return f"{PREFIX}:capacity:{url}"


# ---------------------------------------------------------------------------------------------
# Hidden states (the `features` pass). A dataset's features jobs live in their own RQ
# queue, bq-<ds>-features, written through the same claim/finish/requeue scripts as generation
# jobs: those scripts take a "dataset" and derive RQ's keys from it, so the features pass hands
# them features_name(ds). Per-dataset keys keep the {ds} hash tag of the dataset itself.
# ---------------------------------------------------------------------------------------------
# Set of dataset names whose features queue a features worker polls.
FEATURES_DATASETS = f"{PREFIX}:features:datasets"
# Set of the run's dataset names that share features.max_bytes (hidden_states/collect/byte_budget.py): a
# pass over some of them counts what the others wrote and holds their shares.
FEATURES_BUDGET_DATASETS = f"{PREFIX}:features:budget_datasets"


def features_name(ds: str) -> str:
    """The name the job scripts get for a dataset's features jobs: its queue is bq-<ds>-features."""
    return f"{ds}{identity.FEATURES_SUFFIX}"


def features_queue_name(ds: str) -> str:
    """RQ queue of a dataset's features jobs."""
    return queue_name(features_name(ds))


def features_done_key(ds: str) -> str:
    """Set: prompt ids whose hidden states are on disk (in a shard and the index)."""
    return _ds(ds, "features:done")


def features_results_key(ds: str) -> str:
    """Stream of decoded hidden states waiting for the features collector (fields id, meta, data:
    raw little-endian tensor bytes). Entries are deleted once their shard is on disk."""
    return _ds(ds, "features:results")


def features_pending_key(ds: str) -> str:
    """String counter: bytes of ``features_results_key`` entries not yet on disk; workers stop
    claiming the dataset's features jobs while it is over features.redis_max_mb."""
    return _ds(ds, "features:pending_bytes")


def features_lock_key(ds: str) -> str:
    """String with a TTL: who runs the dataset's features collector (one at a time writes its shards)."""
    return _ds(ds, "features:lock")


def features_bytes_key(ds: str) -> str:
    """Hash: the dataset's hidden states against its disk budget (docs/hidden_states.md "Disk as a budget"):
    ``written``/``tokens`` (bytes and tokens indexed on disk, counted once per sample by features_mark.lua),
    ``share`` (its part of features.max_bytes, "" = none), ``stop`` (the one-line reason capture stopped)."""
    return _ds(ds, "features:bytes")
