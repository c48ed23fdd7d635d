"""GET /metrics: Prometheus text with SGLang's metric names (sglang:...{model_name=...})."""

from __future__ import annotations

import bisect

# SGLang's default buckets for these two histograms.
TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0, 200.0, 400.0)
E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0, 200.0, 400.0,
               600.0, 1200.0, 1800.0, 2400.0)


class Histogram:
    """A cumulative Prometheus histogram with fixed buckets (wall seconds)."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)   # last one: +Inf
        self.total = 0.0
        self.n = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1


def _fmt(value: float) -> str:
    return repr(float(value))


class MetricsText:
    """Builds one exposition: HELP/TYPE lines then samples, labelled with the model name."""

    def __init__(self, model: str) -> None:
        self._label = 'model_name="' + model.replace("\\", "\\\\").replace('"', '\\"') + '"'
        self._lines: list[str] = []

    def metric(self, name: str, kind: str, help_text: str, value: float) -> None:
        self._lines += [f"# HELP sglang:{name} {help_text}", f"# TYPE sglang:{name} {kind}",
                        f"sglang:{name}{{{self._label}}} {_fmt(value)}"]

    def histogram(self, name: str, help_text: str, h: Histogram) -> None:
        self._lines += [f"# HELP sglang:{name} {help_text}", f"# TYPE sglang:{name} histogram",
                        f"sglang:{name}_sum{{{self._label}}} {_fmt(h.total)}"]
        cumulative = 0
        for le, count in zip([*map(str, h.buckets), "+Inf"], h.counts, strict=True):
            cumulative += count
            self._lines.append(f'sglang:{name}_bucket{{le="{le}",{self._label}}} {_fmt(cumulative)}')
        self._lines.append(f"sglang:{name}_count{{{self._label}}} {_fmt(h.n)}")

    def text(self) -> str:
        return "\n".join(self._lines) + "\n"


def render(engine, model: str, max_running: int) -> str:
    """The exposition for ``engine`` (a simulator.model.Engine)."""
    m = MetricsText(model)
    m.metric("num_running_reqs", "gauge", "The number of running requests", engine.running)
    m.metric("num_queue_reqs", "gauge", "The number of requests in the waiting queue", engine.queued)
    m.metric("gen_throughput", "gauge", "The generate throughput (token/s)", engine.throughput())
    m.metric("max_running_requests", "gauge", "Maximum running requests", max_running)
    m.metric("prompt_tokens_total", "counter", "Number of prefill tokens processed.", engine.prompt_tokens)
    m.metric("generation_tokens_total", "counter", "Number of generation tokens processed.",
             engine.generated_tokens())
    m.metric("num_requests_total", "counter", "Number of requests processed.",
             engine.completed + engine.aborted + engine.dropped)
    m.metric("num_aborted_requests_total", "counter", "Number of requests aborted.", engine.aborted + engine.dropped)
    # Not an SGLang metric: the simulator's measure of wasted work (aborted or dropped requests).
    m.metric("sim_aborted_tokens_total", "counter", "Tokens generated for requests that were aborted or dropped.",
             engine.aborted_tokens)
    m.histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.", engine.ttft)
    m.histogram("e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds", engine.e2e)
    return m.text()
