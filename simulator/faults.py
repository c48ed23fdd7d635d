"""Fault injection: error statuses, latency spikes, dropped connections, a down switch; live-changeable."""

from __future__ import annotations

import random
from collections import Counter
from http import HTTPStatus

from pydantic import BaseModel, ConfigDict, Field, field_validator

# The error type SGLang-style bodies carry for each injected status.
ERROR_TYPES = {400: "BadRequestError", 429: "TooManyRequestsError", 500: "InternalServerError",
               502: "BadGatewayError", 503: "ServiceUnavailableError", 504: "GatewayTimeoutError"}
ERROR_MESSAGES = {429: "Too many requests (simulated)", 500: "Internal server error (simulated)",
                  502: "Bad gateway (simulated)", 503: "The server is overloaded (simulated)",
                  504: "Gateway timeout (simulated)"}


class Faults(BaseModel):
    """What POST /sim/faults accepts (any subset) and GET /sim/faults returns."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    error_rate: float = Field(default=0.0, ge=0.0, le=1.0)
    error_codes: list[int] = Field(default_factory=lambda: [503], min_length=1)
    spike_rate: float = Field(default=0.0, ge=0.0, le=1.0)
    spike_s: float = Field(default=5.0, ge=0.0)      # wall seconds, not scaled by the speed-up
    drop_rate: float = Field(default=0.0, ge=0.0, le=1.0)
    # A dropped request is cut after this many tokens instead of at a uniform point (for tests).
    drop_after_tokens: int | None = Field(default=None, ge=0)
    context_length: int = Field(default=32768, gt=1)
    down: bool = False
    # A reverse proxy (nginx) in front of a dead server: every route, /health too, answers this
    # status with an HTML page instead of JSON. None = off.
    proxy_error: int | None = Field(default=None, ge=400, le=599)

    @field_validator("error_codes")
    @classmethod
    def _codes(cls, codes: list[int]) -> list[int]:
        bad = [c for c in codes if not 400 <= c <= 599]
        if bad:
            raise ValueError(f"error codes must be HTTP 4xx/5xx statuses, got {bad}")
        return codes


def proxy_page(status: int) -> str:
    """The error page nginx shows for ``status`` (its default page layout)."""
    title = f"{status} {HTTPStatus(status).phrase}" if status in HTTPStatus._value2member_map_ else str(status)
    return (f"<html>\r\n<head><title>{title}</title></head>\r\n<body>\r\n<center><h1>{title}</h1></center>\r\n"
            "<hr><center>nginx</center>\r\n</body>\r\n</html>\r\n")


def parse_codes(text: str) -> list[int]:
    """``"503,500"`` -> [503, 500], with an error naming the bad item."""
    codes = []
    for item in text.split(","):
        item = item.strip()
        if not item.isdigit():
            raise ValueError(f"--error-codes: {item!r} is not an HTTP status")
        codes.append(int(item))
    return codes


class FaultInjector:
    """Rolls the dice for each request (a seeded stream) and counts what it injected."""

    def __init__(self, faults: Faults, seed: int) -> None:
        self.faults = faults
        self._rng = random.Random(seed ^ 0x5EED)
        self.counts: Counter[str] = Counter()

    def update(self, changes: dict) -> Faults:
        """Apply a partial update; all-or-nothing (validation errors leave the faults unchanged)."""
        self.faults = self.faults.model_validate({**self.faults.model_dump(), **changes})
        return self.faults

    def error_status(self) -> int | None:
        f = self.faults
        if f.error_rate and self._rng.random() < f.error_rate:
            code = self._rng.choice(f.error_codes)
            self.counts[str(code)] += 1
            return code
        return None

    def spike_s(self) -> float:
        f = self.faults
        if f.spike_rate and self._rng.random() < f.spike_rate:
            self.counts["spike"] += 1
            return f.spike_s
        return 0.0

    def drop_at(self, target: int) -> int | None:
        """Tokens after which to drop the connection (uniform over the generation), or None."""
        f = self.faults
        if f.drop_rate and self._rng.random() < f.drop_rate:
            self.counts["drop"] += 1
            if f.drop_after_tokens is not None:
                return min(f.drop_after_tokens, max(target, 0))
            return self._rng.randint(0, max(target, 0))
        return None

    def count(self, kind: str) -> None:
        self.counts[kind] += 1
