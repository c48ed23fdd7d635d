"""``budgetq check``'s line on what the workers will discard and what the budget counts
(docs/datasets.md "Guard and gates")."""

from __future__ import annotations

import importlib.util

from budgetq.shared.config import DatasetConfig


def quality_line(ds: DatasetConfig) -> str:
    """What the worker will discard, and what the budget counts (docs/datasets.md "Guard and gates").
    A validator whose module is not importable here is said so: the workers, where it runs, need it."""
    g = ds.guard
    guard = (f"loops of 1-{g.max_period_tokens} tokens cut once they span {g.min_span_tokens} tokens and "
             f"{g.min_repeats} repeats" if g.enabled else "off")
    gates = [n for n in ("empty", "unclosed_reasoning", "think_tags") if getattr(ds.gates, n)]
    if ds.gates.validator:
        module = ds.gates.validator.partition(":")[0]
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        gates.append(f"validator {ds.gates.validator}" + ("" if found else
                                                          f" ({module} is not importable here: the workers need it)"))
    return (f"guard: {guard}; gates: {', '.join(gates) or 'none'}; retry_discarded {ds.retry_discarded}; "
            f"budget counts {ds.budget_counts} tokens")
