"""``budgetq status``: what operators watch."""

from __future__ import annotations

import argparse
import json

from budgetq.cli_common import load, with_config
from shared.tokens import format_tokens


def cmd_status(args: argparse.Namespace) -> int:
    import redis

    from shared import keys
    from shared.budget import dataset_state

    cfg = load(args)
    conn = redis.Redis.from_url(cfg.redis_url)
    names = sorted(n.decode() for n in conn.smembers(keys.DATASETS))
    out = []
    for n in names:
        st = dataset_state(conn, n)
        out.append({"dataset": n, "budget": st.limit, "used": st.used, "reserved": st.reserved,
                    "in_flight": st.in_flight, "mode": st.mode, "paused": st.paused, "stats": st.stats})
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for r in out:
            pct = 100 * r["used"] / r["budget"] if r["budget"] else 0
            print(f"{r['dataset']:<16} {format_tokens(r['used']):>9} / {format_tokens(r['budget']):<9} "
                  f"{pct:6.2f}%  in flight {r['in_flight']:<4} {'PAUSED' if r['paused'] else ''}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    sp = with_config(sub.add_parser("status", help="per-dataset budget and progress"))
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(func=cmd_status)
