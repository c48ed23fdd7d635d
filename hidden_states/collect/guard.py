"""The features pass's disk guard: admissions stop before the hidden states would fill the disk.

Its free-space rule (``min_free_mb`` kept free on output_dir's volume) is generation's too
(producer/run/disk_guard.py); this adds the estimate of what is coming, learnt from results.
"""

from __future__ import annotations

from budgetq.hidden_states.store.shards import features_root
from budgetq.producer.run.disk_guard import MB, free_bytes
from budgetq.shared.config import Config


class DiskGuard:
    """Stops admissions before the features would pass features.max_bytes or fill the volume.

    Bytes per token are learnt from the first results (no admission past features.concurrency
    samples before one has arrived); a sample is admitted only if everything admitted and not yet
    on disk, plus it, fits under both limits.
    """

    def __init__(self, cfg: Config) -> None:
        self.max_bytes = cfg.features.max_bytes
        self.min_free = int(cfg.min_free_mb * MB)
        self.first = cfg.features.concurrency
        self.out_dir = features_root(cfg)  # features.store, when set, is the volume that fills
        self.seen_bytes = 0
        self.seen_tokens = 0
        self.reason: str | None = None
        self.disk_bytes_per_token: float | None = None

    def learn(self, tokens: int, nbytes: int) -> None:
        self.seen_tokens += tokens
        self.seen_bytes += nbytes

    @property
    def bytes_per_token(self) -> float | None:
        """The larger of what results weighed in the stream and what shards weigh on disk (with
        token ids, masks and headers), so the estimate errs toward stopping early."""
        seen = self.seen_bytes / self.seen_tokens if self.seen_tokens else None
        if seen is None or self.disk_bytes_per_token is None:
            return seen
        return max(seen, self.disk_bytes_per_token)

    def admit(self, tokens: int, outstanding_tokens: int, outstanding_jobs: int, on_disk: int, buffered: int) -> bool:
        if self.reason is not None:
            return False
        bpt = self.bytes_per_token
        if bpt is None:
            return outstanding_jobs < self.first
        coming = buffered + (outstanding_tokens + tokens) * bpt
        if self.max_bytes is not None and on_disk + coming > self.max_bytes:
            self.reason = (f"features.max_bytes {self.max_bytes} would be passed: {on_disk} bytes on disk, "
                           f"~{coming:.0f} more coming at {bpt:.0f} bytes/token; raise features.max_bytes to go on")
            return False
        free = free_bytes(self.out_dir)
        if coming > free - self.min_free:
            self.reason = (f"the output volume of {self.out_dir} would fill: {free / MB:.0f} MB free, "
                           f"~{coming / MB:.0f} MB more coming at {bpt:.0f} bytes/token, "
                           f"{self.min_free / MB:.0f} MB kept free (min_free_mb); free space and run "
                           "`budgetq features` again to go on")
            return False
        return True
