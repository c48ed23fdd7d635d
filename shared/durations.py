"""Durations and ETAs as status, progress and plan print them."""

from __future__ import annotations


def format_duration(s: float | None) -> str:
    """``42s``, ``3m05s``, ``2h07m``; ``-`` for unknown (an ETA with no rate yet)."""
    if s is None:
        return "-"
    s = int(round(s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


_ENDS_SAID = {"budget": "budget", "prompts": "out of prompts", "deadline": "deadline"}


def format_eta(s: float | None, by: str | None) -> str:
    """An ETA with the end it comes to: ``52s (out of prompts)``, ``3m05s (budget)``; ``-`` for none."""
    if s is None:
        return "-"
    return f"{format_duration(s)} ({_ENDS_SAID.get(by or '', by)})" if by else format_duration(s)
