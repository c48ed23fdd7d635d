"""``budgetq sim``: flags of the SGLang simulator (docs/simulator.md explains the model)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging

from budgetq.shared.errors import BudgetqError


def _mean_for(items: list[str] | None) -> dict[str, float]:
    means = {}
    for item in items or []:
        prefix, sep, mean = item.partition("=")
        try:
            value = float(mean)
        except ValueError:
            value = -1.0
        if not sep or not prefix or value <= 0:
            raise BudgetqError(f"--length-mean-for {item!r}: expected RID_PREFIX=MEAN with MEAN > 0")
        means[prefix] = value
    return means


def _generation_config(path: str | None) -> dict[str, float]:
    """The sampling defaults of a generation_config.json (the keys SGLang's chat route fills)."""
    if not path:
        return {}
    from budgetq.simulator.sampling import CHAT_DEFAULTED

    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise BudgetqError(f"--generation-config {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise BudgetqError(f"--generation-config {path}: expected a JSON object, got {type(data).__name__}")
    out = {}
    for key in CHAT_DEFAULTED:
        value = data.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise BudgetqError(f"--generation-config {path}: {key} must be a number, got {value!r}")
        out[key] = value
    return out


def settings_from_args(args: argparse.Namespace):
    from budgetq.simulator.faults import parse_codes
    from budgetq.simulator.model import SimSettings

    for name in ("error_rate", "spike_rate", "drop_rate", "reasoning_tokens_frac", "loop_fraction",
                 "empty_fraction", "unclosed_fraction"):
        value = getattr(args, name)
        if not 0.0 <= value <= 1.0:
            raise BudgetqError(f"--{name.replace('_', '-')} {value}: must be between 0 and 1")
    if args.loop_fraction + args.empty_fraction + args.unclosed_fraction > 1.0:
        raise BudgetqError("--loop-fraction + --empty-fraction + --unclosed-fraction: must be at most 1")
    for name in ("peak_tok_s", "prefill_tok_s", "length_mean", "speedup"):
        if getattr(args, name) <= 0:
            raise BudgetqError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be > 0")
    for name, low in (("max_running_requests", 1), ("max_queued_requests", 0), ("context_length", 2),
                      ("keep_records", 0), ("stream_interval", 1), ("loop_period", 1)):
        value = getattr(args, name)
        if value is not None and value < low:
            raise BudgetqError(f"--{name.replace('_', '-')} {value}: must be >= {low}")
    for name in ("disconnect_poll_s", "stream_abort_s"):
        if getattr(args, name) < 0:
            raise BudgetqError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 0")
    if args.max_total_num_tokens is not None and args.max_total_num_tokens < 1:
        raise BudgetqError(f"--max-total-num-tokens {args.max_total_num_tokens}: must be >= 1")
    if args.spike_s < 0 or args.half_batch < 0 or args.length_sigma < 0 or args.stream_interval_s <= 0:
        raise BudgetqError("--spike-s, --half-batch and --length-sigma must be >= 0, --stream-interval-s > 0")
    try:
        codes = parse_codes(args.error_codes)
    except ValueError as exc:
        raise BudgetqError(str(exc)) from exc
    bad = [c for c in codes if not 400 <= c <= 599]
    if bad:
        raise BudgetqError(f"--error-codes: {bad} are not HTTP 4xx/5xx statuses")
    return SimSettings(
        max_running_requests=args.max_running_requests, max_queued_requests=args.max_queued_requests,
        peak_tok_s=args.peak_tok_s, half_batch=args.half_batch, prefill_tok_s=args.prefill_tok_s,
        length_mean=args.length_mean, length_sigma=args.length_sigma, length_means=_mean_for(args.length_mean_for),
        speedup=args.speedup, instant=args.instant, error_rate=args.error_rate, error_codes=codes,
        spike_rate=args.spike_rate, spike_s=args.spike_s, drop_rate=args.drop_rate,
        context_length=args.context_length, reasoning_tokens_frac=args.reasoning_tokens_frac,
        reasoning_parser=args.reasoning_parser, api_key=args.api_key, seed=args.seed, model=args.model,
        stream_interval_s=args.stream_interval_s, keep_records=args.keep_records,
        disconnect_poll_s=args.disconnect_poll_s, stream_abort_s=args.stream_abort_s,
        max_total_num_tokens=args.max_total_num_tokens, generation_config=_generation_config(args.generation_config),
        radix_cache=args.radix_cache, enable_cache_report=args.enable_cache_report,
        return_hidden_states_mode=_hidden_mode(args), hidden_size=args.hidden_size,
        aux_layers=3 if args.enable_return_aux_hidden_states else 0, stream_interval=args.stream_interval,
        incremental_streaming_output=args.incremental_streaming_output, loop_fraction=args.loop_fraction,
        loop_period=args.loop_period, empty_fraction=args.empty_fraction, unclosed_fraction=args.unclosed_fraction)


def _hidden_mode(args: argparse.Namespace) -> str | None:
    """SGLang: --return-hidden-states-mode wins; the legacy flag means full (forward_batch_info.py)."""
    if args.hidden_size < 1:
        raise BudgetqError(f"--hidden-size {args.hidden_size}: must be >= 1")
    # --enable-return-aux-hidden-states sets the mode to full when unset (arg_groups/fields/exec_.py).
    legacy = args.enable_return_hidden_states or args.enable_return_aux_hidden_states
    return args.return_hidden_states_mode or ("full" if legacy else None)


def cmd_sim(args: argparse.Namespace) -> int:
    from budgetq.simulator.server import start_sim

    settings = settings_from_args(args)

    async def main() -> None:
        runner = await start_sim(settings, args.host, args.port)
        logging.getLogger("budgetq.sim").info("simulator on http://%s:%d (speed-up %gx%s)", args.host, args.port,
                                              args.speedup, ", instant" if args.instant else "")
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    sp = sub.add_parser("sim", help="run the SGLang simulator")
    sp.add_argument("--host", default="127.0.0.1")
    sp.add_argument("--port", type=int, default=30000)
    g = sp.add_argument_group("capacity model")
    g.add_argument("--max-running-requests", type=int, default=256, help="requests decoding together")
    g.add_argument("--max-queued-requests", type=int, default=None, help="waiting requests past which -> 503")
    g.add_argument("--peak-tok-s", type=float, default=20_000.0, help="aggregate decode tok/s as the batch grows")
    g.add_argument("--half-batch", type=float, default=32.0, help="batch size reaching half of --peak-tok-s")
    g.add_argument("--prefill-tok-s", type=float, default=50_000.0, help="prompt tokens prefilled per second")
    g.add_argument("--speedup", type=float, default=1.0, help="simulated seconds per wall second")
    g.add_argument("--instant", action="store_true", help="answer at once (no capacity model); lengths still drawn")
    g.add_argument("--max-total-num-tokens", type=int, default=None,
                   help="KV pool size reported by /server_info and /v1/loads (default: max-running x 4096)")
    g.add_argument("--radix-cache", action="store_true",
                   help="model SGLang's prefix cache: cached prompt tokens skip prefill, reported as cached_tokens")
    g.add_argument("--enable-cache-report", action="store_true",
                   help="chat/completions usage carries prompt_tokens_details.cached_tokens (SGLang's flag)")
    g.add_argument("--disconnect-poll-s", type=float, default=4.0,
                   help="simulated s: a dropped non-streaming client is noticed at the next poll (SGLang: 4)")
    g.add_argument("--stream-abort-s", type=float, default=2.0,
                   help="simulated s: a dropped streaming client is aborted this long after (SGLang: 2)")
    g = sp.add_argument_group("responses")
    g.add_argument("--length-mean", type=float, default=1500.0)
    g.add_argument("--length-mean-for", action="append", metavar="RID_PREFIX=MEAN")
    g.add_argument("--length-sigma", type=float, default=0.8, help="lognormal sigma of lengths")
    g.add_argument("--seed", type=int, default=0, help="lengths are a function of (seed, rid)")
    g.add_argument("--reasoning-tokens-frac", type=float, default=0.0, help="part of each response that thinks")
    g.add_argument("--reasoning-parser", default=None, help="e.g. qwen3: chat separates reasoning_content")
    g.add_argument("--context-length", type=int, default=32768)
    g.add_argument("--model", "--served-model-name", dest="model", default="sim-model")
    g.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY (not on /health*, /metrics)")
    g.add_argument("--stream-interval-s", type=float, default=0.05, help="at most one stream chunk per this (wall s)")
    g.add_argument("--stream-interval", type=int, default=1,
                   help="SGLang's: a streamed request sends its output every this many tokens (and at its end)")
    g.add_argument("--incremental-streaming-output", action="store_true",
                   help="SGLang's: a streamed /generate sends only each chunk's new text and output_ids")
    g = sp.add_argument_group("degenerate answers (by seed and rid: a prompt sent again with another seed redraws)")
    g.add_argument("--loop-fraction", type=float, default=0.0,
                   help="answers that fall into an exact cycle of --loop-period tokens, until max_tokens")
    g.add_argument("--loop-period", type=int, default=8, help="tokens in one cycle of a looping answer")
    g.add_argument("--empty-fraction", type=float, default=0.0, help="answers with no content")
    g.add_argument("--unclosed-fraction", type=float, default=0.0,
                   help="answers whose reasoning never closes (no final answer)")
    g.add_argument("--keep-records", type=int, default=200_000, help="records /sim/requests keeps")
    g.add_argument("--enable-return-hidden-states", action="store_true",
                   help="allow return_hidden_states on /generate (SGLang's legacy flag: mode full)")
    g.add_argument("--return-hidden-states-mode", choices=("last", "full"), default=None,
                   help="the server's hidden-state ceiling: last, or full (also return_hidden_states=true)")
    g.add_argument("--enable-return-aux-hidden-states", action="store_true",
                   help="return_hidden_states answers 3 layers side by side (EAGLE-3's aux capture): 3 x hidden wide")
    g.add_argument("--hidden-size", type=int, default=64, help="length of each simulated hidden-state vector")
    g.add_argument("--generation-config", default=None, metavar="JSON",
                   help="generation_config.json whose sampling defaults fill unset chat fields")
    g = sp.add_argument_group("faults (also live: POST /sim/faults)")
    g.add_argument("--error-rate", type=float, default=0.0, help="share of requests answered with an error")
    g.add_argument("--error-codes", default="503", help="statuses to pick from, e.g. 503,500,429,502")
    g.add_argument("--spike-rate", type=float, default=0.0, help="share of requests delayed by --spike-s")
    g.add_argument("--spike-s", type=float, default=5.0, help="latency spike, wall seconds (not sped up)")
    g.add_argument("--drop-rate", type=float, default=0.0, help="share of connections closed mid-generation")
    sp.set_defaults(func=cmd_sim)
