"""``budgetq check``'s lines on what the workers will discard and what the budget counts
(docs/datasets.md "Guard and gates"), and on how many answers per prompt ("Samples per prompt")."""

from __future__ import annotations

import math

from budgetq.shared.config import DatasetConfig
from budgetq.shared.config_quality import validator_module_missing


def quality_line(ds: DatasetConfig) -> str:
    """What the worker will discard, and what the budget counts (docs/datasets.md "Guard and gates").
    A validator whose module is not importable here is said so: the workers, where it runs, need it."""
    g = ds.guard
    guard = (f"loops of 1-{g.max_period_tokens} tokens cut once they span {g.min_span_tokens} tokens and "
             f"{g.min_repeats} repeats" if g.enabled else "off")
    gates = [n for n in ("empty", "unclosed_reasoning", "think_tags") if getattr(ds.gates, n)]
    if ds.gates.validator:
        missing = validator_module_missing(ds.gates.validator)
        gates.append(f"validator {ds.gates.validator}" + (f" ({missing} is not importable here: the workers need it)"
                                                          if missing else ""))
    return (f"guard: {guard}; gates: {', '.join(gates) or 'none'}; retry_discarded {ds.retry_discarded}; "
            f"budget counts {ds.budget_counts} tokens")


def samples_lines(auto: bool, samples: int, unique: int, responses_needed: int, runs_out: bool) -> list[str]:
    """``samples: auto``: the answers per prompt the budget needs and whether ``max_samples`` binds;
    ``samples: N``: the answers the prompts give."""
    if auto:
        per = responses_needed / unique if unique else 0.0
        return [f"  samples: auto (max_samples {samples}): the budget needs ~{per:,.2f} answers per prompt "
                f"at prior_mean_tokens ({math.ceil(per) if per else 0} rounds over {unique:,} prompts)"
                + (f"; the cap binds: {samples} answers a prompt end it short of its budget" if runs_out else "")]
    if samples > 1:
        return [f"  samples: {samples} answers per prompt: {unique * samples:,} answers from "
                f"{unique:,} prompts (ids <id>, <id>#2 ... <id>#{samples})"]
    return []
