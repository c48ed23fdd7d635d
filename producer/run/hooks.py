"""The seam another room plugs into the producer's loop, so the producer never imports that room.

``capture: features`` (produce captures hidden states as rows commit) lives in hidden_states/, which imports
the producer (its tokenizer, its disk rule). The producer's loop only calls a ``CaptureHook``; whoever wires the
command line registers the real one (budgetq/cli/main.py registers hidden_states.collect.inline's ``Capture``)
before the producer starts. Without a registration the producer runs generation only, and refuses a config
with a capture: features dataset in one line rather than silently skipping its hidden states.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from budgetq.shared.config import Config
from budgetq.shared.errors import BudgetqError


class CaptureHook(Protocol):
    """What the producer's loop calls (producer/run/producer.py), and what produce's summary reads."""

    @property
    def active(self) -> bool: ...

    def tick(self) -> None:
        """Each round of the loop."""

    def done(self, drain: Callable[[], object]) -> bool:
        """Asked once generation is complete: True once the capture is complete too (``drain`` writes the last
        generation results first)."""
        ...

    def close(self) -> None:
        """After the loop (a stop too)."""

    def summary(self) -> dict[str, dict]: ...

    @property
    def problems(self) -> list[str]: ...


class NoCapture:
    """No dataset captures: every hook is a no-op."""

    active = False

    @property
    def problems(self) -> list[str]:
        return []

    def tick(self) -> None:
        return None

    def done(self, drain: Callable[[], object]) -> bool:
        return True

    def close(self) -> None:
        return None

    def summary(self) -> dict[str, dict]:
        return {}


_capture: Callable[[Config], CaptureHook] | None = None


def register_capture(factory: Callable[[Config], CaptureHook]) -> None:
    """Called at wiring time (the CLI) with the room that captures hidden states."""
    global _capture
    _capture = factory


def make_capture(cfg: Config) -> CaptureHook:
    wanted = [ds.name for ds in cfg.datasets if ds.capture == "features"]
    if not wanted:
        return NoCapture()
    if _capture is None:
        raise BudgetqError(f"dataset {wanted[0]}: capture: features, but no hidden-states capture is registered in "
                           "this process (run it through `budgetq produce`, which registers it)")
    return _capture(cfg)
