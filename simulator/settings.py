"""The simulator's settings: the capacity model, responses, faults and SGLang's timings (cli/sim.py fills it)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SimSettings:
    max_running_requests: int = 256
    # Requests allowed to wait for a slot; past that SGLang answers 503. None: unbounded.
    max_queued_requests: int | None = None
    # Aggregate decode speed at full batch, tokens/s (before speed-up), and the batch size
    # at which half of it is reached: tok/s(B) = peak * B / (B + half_batch).
    peak_tok_s: float = 20_000.0
    half_batch: float = 32.0
    prefill_tok_s: float = 50_000.0
    length_mean: float = 1500.0
    length_sigma: float = 0.8
    # rid prefix -> mean response length, so one simulator can mimic several datasets.
    length_means: dict[str, float] = field(default_factory=dict)
    speedup: float = 1.0
    # Respond as fast as possible: lengths are still drawn, but no capacity model and no sleeping.
    instant: bool = False
    # Fault injection (also changeable live through POST /sim/faults).
    error_rate: float = 0.0
    error_codes: list[int] = field(default_factory=lambda: [503])
    spike_rate: float = 0.0
    spike_s: float = 5.0
    drop_rate: float = 0.0
    drop_after_tokens: int | None = None   # a drop cuts after this many tokens (else uniform)
    context_length: int = 32768
    # Reasoning: this fraction of each response is "thinking"; a parser name separates it.
    reasoning_tokens_frac: float = 0.0
    reasoning_parser: str | None = None
    api_key: str | None = None
    seed: int = 0
    model: str = "sim-model"
    # Streaming responses emit a chunk at most this often (wall seconds): what reaches a client that reads
    # as fast as the tokens come, SGLang's tokenizer manager coalescing what piled up meanwhile.
    stream_interval_s: float = 0.05
    # SGLang's --stream-interval: a running request's output goes out every this many tokens (and at its end).
    stream_interval: int = 1
    # SGLang's --incremental-streaming-output: a streamed /generate sends each chunk's new text and
    # output_ids only (default: everything so far, in every chunk). Chat streams deltas either way.
    incremental_streaming_output: bool = False
    # Degenerate answers (simulator/texts.py Shape), each a fraction of the requests, by (seed, rid):
    # a loop (an exact cycle of loop_period tokens from a random onset to max_tokens), an empty answer,
    # a reasoning that never closes.
    loop_fraction: float = 0.0
    loop_period: int = 8
    empty_fraction: float = 0.0
    unclosed_fraction: float = 0.0
    # /sim/requests keeps the newest this many records.
    keep_records: int = 200_000
    # SGLang notices a dropped non-streaming client only at its next state-wait poll
    # (SGLANG_REQUEST_STATE_WAIT_TIMEOUT, 4 s), a streaming one ~2 s after the disconnect
    # (create_abort_task). Simulated seconds, so they shrink with the speed-up; 0 = at once.
    disconnect_poll_s: float = 4.0
    stream_abort_s: float = 2.0
    # SGLang's KV pool size in tokens (/server_info, /v1/loads); None: max_running_requests x 4096.
    max_total_num_tokens: int | None = None
    # A model's generation_config.json sampling defaults, filled into unset chat fields
    # (SGLang's --sampling-defaults model). Keys: temperature, top_p, top_k, min_p, repetition_penalty.
    generation_config: dict[str, float] = field(default_factory=dict)
    # SGLang's radix (prefix) cache: cached prompt tokens skip prefill and are reported as
    # cached_tokens (simulator/model.py PrefixCache). Off by default so timings of older runs hold.
    radix_cache: bool = False
    # --enable-cache-report: chat/completions usage gets prompt_tokens_details.cached_tokens.
    enable_cache_report: bool = False
    # Hidden states (simulator/hidden.py): the server's ceiling, as --return-hidden-states-mode
    # (None: off, requests asking for them get SGLang's 400), and the model's hidden size.
    return_hidden_states_mode: str | None = None
    hidden_size: int = 64
    # --enable-return-aux-hidden-states: this many layers (EAGLE-3: 3) concatenated in place of the last.
    aux_layers: int = 0
