"""The features pass's disk guard: admissions stop before the hidden states would fill the disk.

Its free-space rule (``min_free_mb`` kept free on output_dir's volume) is generation's too
(producer/run/disk_guard.py); this adds the estimate of what is coming, learnt from results. features.max_bytes is not a
limit here: it is split over the datasets as a budget (byte_budget.py).
"""

from __future__ import annotations

from budgetq.hidden_states.store.shards import features_root
from budgetq.producer.run.disk_guard import MB, free_bytes
from budgetq.shared.config import Config


class DiskGuard:
    """Stops admissions before the features would fill the volume (features.max_bytes is a budget split over
    the datasets: byte_budget.py).

    Bytes per token are learnt from the first results (no admission past features.concurrency
    samples before one has arrived); a sample is admitted only if everything admitted and not yet
    on disk, plus it, fits under both limits.
    """

    def __init__(self, cfg: Config) -> None:
        self.min_free = int(cfg.min_free_mb * MB)
        self.first = cfg.features.concurrency
        self.out_dir = features_root(cfg)  # features.store, when set, is the volume that fills
        self.seen_bytes = 0
        self.wire_ratio = 0.51 if cfg.features.dtype == "fp8" else 1.0
        self.seen_tokens = 0
        self.reason: str | None = None
        self.disk_bytes_per_token: float | None = None

    def learn(self, tokens: int, nbytes: int) -> None:
        self.seen_tokens += tokens
        self.seen_bytes += nbytes

    def learn_wire(self, tokens: int, tensor_bytes: int, other_bytes: int) -> None:
        """A result that came through the stream: its tensors are bf16 there, fp8 on disk (half, plus a float32
        scale per token and layer: ~0.5 for any real hidden size)."""
        self.learn(tokens, int(tensor_bytes * self.wire_ratio) + other_bytes)

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
        free = free_bytes(self.out_dir)
        if coming > free - self.min_free:
            self.reason = (f"the output volume of {self.out_dir} would fill: {free / MB:.0f} MB free, "
                           f"~{coming / MB:.0f} MB more coming at {bpt:.0f} bytes/token, "
                           f"{self.min_free / MB:.0f} MB kept free (min_free_mb); free space and run "
                           "`budgetq features` again to go on")
            return False
        return True
