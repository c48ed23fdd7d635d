"""``budgetq plan`` and the run-level ``budgetq budget`` commands (deadline, total, weight, show).

The settings live in Redis (shared/run_plan.py): a running producer applies a change within
``run.control_interval_s``; a restarted one keeps it.
"""

from __future__ import annotations

import argparse
import json

from budgetq.cli.common import load, open_redis, with_config
from budgetq.shared.config_fields import parse_total
from budgetq.shared.errors import BudgetqError
from budgetq.shared.tokens import format_tokens


def _positive(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be > 0 (got {text!r})")
    return v


def cmd_plan(args: argparse.Namespace) -> int:
    from budgetq.producer.ops.plan import format_plan, make_plan

    cfg = load(args)
    if not cfg.datasets:
        raise BudgetqError("plan needs the datasets of a config (-c CONFIG)")
    what_if = args.deadline is not None or args.total_budget is not None
    p = make_plan(cfg, args.tok_s, args.timeout_s, from_config=what_if)
    if args.json:
        from dataclasses import asdict

        print(json.dumps({**asdict(p), "rows": [{**asdict(r), "runs_out": r.runs_out} for r in p.rows]}, indent=2))
    else:
        print(format_plan(p))
    return 0


def _conn(args: argparse.Namespace):
    cfg = load(args)
    return cfg, open_redis(cfg, "budget")


def cmd_deadline(args: argparse.Namespace) -> int:
    import time

    from budgetq.shared import run_plan

    try:
        when = run_plan.parse_deadline(args.when, time.time())
    except run_plan.PlanError as exc:
        raise BudgetqError(str(exc)) from None
    _cfg, conn = _conn(args)
    old = run_plan.set_deadline(conn, when)
    print(f"deadline {run_plan.format_when(old)} -> {run_plan.format_when(when)}")
    return 0


def cmd_total(args: argparse.Namespace) -> int:
    from budgetq.shared import run_plan

    total = None
    if args.tokens.strip().lower() not in ("none", "null", "off"):
        try:
            total = parse_total(args.tokens)
        except ValueError as exc:
            raise BudgetqError(str(exc)) from None
    _cfg, conn = _conn(args)
    old = run_plan.set_total(conn, total)
    print(f"total budget {format_tokens(old) if old is not None else 'none'} -> "
          f"{format_tokens(total) if total is not None else 'none'}")
    return 0


def cmd_weight(args: argparse.Namespace) -> int:
    from budgetq.shared import run_plan
    from budgetq.shared.redis_conn import dataset_names

    try:
        weight = run_plan.parse_weight(args.weight)
    except run_plan.PlanError as exc:
        raise BudgetqError(f"{args.dataset}: {exc}") from None
    _cfg, conn = _conn(args)
    known = dataset_names(conn)
    if args.dataset not in known:
        raise BudgetqError(f"dataset {args.dataset!r} is not registered in this Redis "
                           f"(registered: {', '.join(known) or 'none'})")
    old = run_plan.set_weight(conn, args.dataset, weight)
    print(f"{args.dataset}: weight {old:g} -> {weight:g}")
    return 0


def _budgets(conn, s, state: dict) -> list[dict]:
    """Per registered dataset: its budget (the limit workers obey, the split's when a deadline or a
    total is set), used, mode, count, paused or held, weight, and the projected finish."""
    from budgetq.shared.budget import dataset_state
    from budgetq.shared.redis_conn import dataset_names

    out = []
    for name in dataset_names(conn):
        st = dataset_state(conn, name)
        fin = (state.get("datasets") or {}).get(name, {}).get("projected_finish")
        out.append({"dataset": name, "budget": st.limit, "used": st.used, "mode": st.mode, "count": st.count,
                    "paused": st.operator_paused, "held": bool(st.hold), "exhausted": st.exhausted,
                    "weight": s.weight(name), "finish_in_s": None if fin is None else max(0.0, fin - state["at"])})
    return out


def _budgets_table(rows: list[dict], managed: bool) -> list[str]:
    """One line per dataset; weight and projected finish only with a deadline or a total."""
    from budgetq.shared.status import format_duration

    cols = ("dataset", "budget", "used", "used %", "mode", "count", "state", "weight", "finish in")
    table: list[tuple[str, ...]] = [cols if managed else cols[:7]]
    for r in rows:
        state = "held" if r["held"] else "paused" if r["paused"] else "reached" if r["exhausted"] else "open"
        pct = f"{100 * r['used'] / r['budget']:.1f}%" if r["budget"] else "-"
        row = (r["dataset"], format_tokens(r["budget"]), format_tokens(r["used"]), pct, r["mode"], r["count"], state,
               f"{r['weight']:g}", format_duration(r["finish_in_s"]))
        table.append(row if managed else row[:7])
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    right = {1, 2, 3, 7}
    return ["  ".join(c.rjust(w) if i in right else c.ljust(w)
                      for i, (c, w) in enumerate(zip(row, widths, strict=True))).rstrip() for row in table]


def cmd_show(args: argparse.Namespace) -> int:
    """The run-wide settings, then every registered dataset's budget (docs/budget.md "Live")."""
    from budgetq.shared import run_plan

    _cfg, conn = _conn(args)
    s = run_plan.read_settings(conn)
    state = run_plan.read_state(conn) or {}
    rows = _budgets(conn, s, state if s.managed else {})  # a plan's state outlives the run that wrote it
    if args.json:
        print(json.dumps({"deadline": s.deadline, "total_budget": s.total_budget, "weights": s.weights,
                          "state": state, "datasets": rows}, indent=2))
        return 0
    print(f"deadline {run_plan.format_when(s.deadline)}; total budget "
          f"{format_tokens(s.total_budget) if s.total_budget is not None else 'none'}"
          + ("" if s.managed else "; per-dataset budgets"))
    if state and s.managed:
        rate = f"{state['tok_s']:,.0f} tok/s" if state.get("tok_s") else "not measured yet"
        print(f"phase {state.get('phase')}; fleet {rate}; last responses take {state.get('tail_s', 0):.1f} s "
              f"(p{100 * state.get('tail_quantile', 0):.0f})")
    print("\n".join(_budgets_table(rows, s.managed)) if rows else "no dataset registered in this Redis")
    return 0


def plan_text(plan: dict, now: float):
    """`budgetq status`'s line for a deadline or a total: countdown, phase, rate, finish per dataset."""
    import time

    from rich.text import Text

    from budgetq.shared.status import format_duration

    bits = []
    if plan.get("deadline") is not None:
        left = plan["deadline"] - now
        bits.append(f"deadline in {format_duration(left)}" if left > 0 else "deadline passed")
        bits.append(f"({plan.get('phase') or '-'})")
    if plan.get("total_budget") is not None:
        bits.append(f"total {format_tokens(plan['total_budget'])}")
    bits.append(f"fleet {plan['tok_s']:,.0f} tok/s" if plan.get("tok_s") else "fleet rate not measured yet")
    finishes = []
    for name, d in sorted((plan.get("datasets") or {}).items()):
        fin = d.get("projected_finish")
        finishes.append(f"{name} {time.strftime('%H:%M:%S', time.localtime(fin)) if fin else '-'}")
    if finishes:
        bits.append("finish: " + ", ".join(finishes))
    return Text("  ".join(bits), style="bold cyan")


def register(sub: argparse._SubParsersAction) -> None:
    sp = with_config(sub.add_parser("plan", help="per dataset: weight, effective budget, prompts needed vs "
                                                 "available, projected finish (reads, never writes)"))
    sp.add_argument("--tok-s", type=_positive, help="the fleet's rate (default: the rate the live run measured)")
    run_flags(sp, "instead of the live run's (or the config's)")
    sp.add_argument("--timeout-s", type=_positive, default=3.0, help="for Redis (default 3)")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(func=cmd_plan)


def run_flags(sp: argparse.ArgumentParser, whose: str, deadline_note: str = "", total_note: str = "") -> None:
    """--deadline and --total-budget: the config's run.deadline and run.total_budget, by the same names;
    each note says what that flag alone does over a restart."""
    sp.add_argument("--deadline", help=f"run.deadline: 12h, 90m or an ISO time ({whose}{deadline_note})")
    sp.add_argument("--total-budget", help=f"run.total_budget: tokens over all datasets, split by weight, e.g. 50M "
                                           f"({whose}{total_note})")


def register_budget(bp: argparse._SubParsersAction) -> None:
    """``budget deadline|total|weight|show``, beside ``budget set``."""
    sp = with_config(bp.add_parser("deadline", help="set the run's deadline live (12h, 2026-12-05T08:00:00Z, none)"))
    sp.add_argument("when")
    sp.set_defaults(func=cmd_deadline)
    sp = with_config(bp.add_parser("total", help="set the run's total budget live (50M, none)"))
    sp.add_argument("tokens")
    sp.set_defaults(func=cmd_total)
    sp = with_config(bp.add_parser("weight", help="set a dataset's weight live"))
    sp.add_argument("dataset")
    sp.add_argument("weight")
    sp.set_defaults(func=cmd_weight)
    sp = with_config(bp.add_parser("show", help="the deadline and total, then every dataset's budget, used, mode, "
                                                "state and weight (and what the producer measures)"))
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(func=cmd_show)
