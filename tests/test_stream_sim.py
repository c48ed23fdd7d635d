"""The worker's one client streams from ``budgetq sim`` as from SGLang: both routes, cumulative and
incremental /generate output, stream intervals, exact counts, the guard's cut at the engine, and the
simulator's degenerate answers (loop, empty, unclosed reasoning). Real HTTP, in-process simulator.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import aiohttp
import pytest

from budgetq.shared.config import ServerConfig
from budgetq.shared.schema import JobPayload, Message, SamplingParams
from budgetq.simulator.model import SimSettings
from budgetq.simulator.server import start_sim
from budgetq.worker.sglang_client import SGLangClient
from budgetq.worker.sglang_stream import WATCH, Watch
from tests.test_simulator import CHAT, MSGS, get, run_sim, sse


def payload(pid: str, max_tokens: int = 400, **extra: Any) -> JobPayload:
    return JobPayload(id=pid, dataset="D", messages=[Message(role="user", content=f"question {pid}")],
                      sampling=SamplingParams(max_tokens=max_tokens), **extra)


async def with_client(settings: SimSettings, body, **server: Any) -> Any:
    runner = await start_sim(settings, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        async with aiohttp.ClientSession() as session:
            client = SGLangClient(session, ServerConfig(urls=[url], max_attempts=2, backoff_base_s=0.01,
                                                        backoff_max_s=0.02, **server))
            try:
                return await asyncio.wait_for(body(client, session, url), 60)
            finally:
                await client.close()
    finally:
        await runner.cleanup()


def run(settings: dict, body, **server: Any) -> Any:
    return asyncio.run(with_client(SimSettings(**settings), body, **server))


# Tokens past onset + min_span_tokens that the guard may need beyond the chunk's end: its check runs every 32
# characters (~8 tokens of the simulator's words), it reads the span's tokens off its marks (one check), and the
# comparison starts a period after the onset.
CHECK_SLACK_TOKENS = 32
FAST = {"speedup": 5.0, "length_mean": 300, "length_sigma": 0.5, "stream_interval_s": 0.002}


@pytest.mark.parametrize("api", ["generate", "chat"])
@pytest.mark.parametrize("incremental", [False, True])
@pytest.mark.parametrize("interval", [1, 16])
def test_streamed_answers_equal_the_unstreamed_ones_token_for_token(api, incremental, interval):
    """The same prompts (the simulator's answer is a function of the rid without its nonce) streamed and not:
    the same text, the same exact counts, on every route and output mode; progress climbs to the count."""
    ids = [f"p{i}" for i in range(6)]

    async def body(client: SGLangClient, _s, _u) -> list:
        out = []
        for stream in (True, False):
            client.server.stream = stream   # per server; the same client, the same endpoint
            for pid in ids:
                progress: list[int] = []
                token = WATCH.set(Watch(on_progress=progress.append))
                try:
                    got = await client.complete(payload(pid, input_ids=[1, 2, 3] if api == "generate" else None),
                                                f"D-{pid}")
                finally:
                    WATCH.reset(token)
                out.append((stream, pid, got, progress))
        return out

    server = {"api": api}
    if api == "generate":
        server["tokenizer"] = "tok"
    results = run({**FAST, "incremental_streaming_output": incremental, "stream_interval": interval,
                   "reasoning_tokens_frac": 0.3, "reasoning_parser": "qwen3"}, body, **server)
    streamed = {pid: (got, progress) for stream, pid, got, progress in results if stream}
    plain = {pid: got for stream, pid, got, _p in results if not stream}
    for pid in ids:
        got, progress = streamed[pid]
        want = plain[pid]
        assert (got.text, got.reasoning, got.completion_tokens, got.prompt_tokens, got.finish_reason) == \
               (want.text, want.reasoning, want.completion_tokens, want.prompt_tokens, want.finish_reason), pid
        assert progress and progress == sorted(progress) and progress[-1] == got.completion_tokens
    # Progress comes chunk by chunk. A client that falls behind gets chunks merged, as from SGLang (its
    # tokenizer manager hands a late reader the latest state), so on a loaded machine one answer may come
    # whole; not all six.
    assert sum(len(p) for _g, p in streamed.values()) > 2 * len(ids), {k: len(p) for k, (_g, p) in streamed.items()}


@dataclasses.dataclass(frozen=True)
class Verdict:   # worker/degeneration.py's Verdict, as the interface names its fields
    reason: str
    period: int
    repeats: int
    onset_tokens: int
    cut_tokens: int


class CycleGuard:
    """A stand-in for worker/degeneration.py's LoopGuard: the same ``feed``; a verdict when the last
    ``period`` x ``repeats`` words are one cycle."""

    def __init__(self, period: int, repeats: int = 6) -> None:
        self.period, self.repeats = period, repeats
        self.words: list[str] = []
        self.fed = 0

    def feed(self, delta_text: str, tokens_so_far: int, in_reasoning: bool):
        self.fed += 1
        self.words += delta_text.split()
        n = self.period * self.repeats
        tail = self.words[-n:]
        if len(tail) == n and all(tail[i] == tail[i % self.period] for i in range(n)):
            return Verdict("loop", self.period, self.repeats, tokens_so_far - n, tokens_so_far)
        return None


@pytest.mark.parametrize("api", ["generate", "chat"])
def test_a_guard_verdict_aborts_the_request_at_the_engine_and_returns_the_answer_so_far(api):
    """Every answer loops (period 4) from a random onset to max_tokens 20,000: each is cut soon after its
    onset, the simulator's record says it was aborted (not run to max_tokens), and the Completion is
    marked discard with finish_reason abort and the tokens made so far."""
    async def body(client: SGLangClient, session: aiohttp.ClientSession, url: str) -> list:
        outs = []
        for i in range(3):
            token = WATCH.set(Watch(guard=lambda: CycleGuard(4)))
            try:
                outs.append(await client.complete(payload(f"L{i}", max_tokens=20_000,
                                                          input_ids=[1, 2] if api == "generate" else None), f"D-L{i}"))
            finally:
                WATCH.reset(token)

        async def all_ended() -> list[dict]:
            for _ in range(500):
                _, recs = await get(session, url + "/sim/requests")
                if len(recs) == 3 and all(r["finished"] is not None for r in recs):
                    return recs
                await asyncio.sleep(0.02)
            raise AssertionError(f"the engine still runs them: {recs}")

        return [outs, await all_ended(), client.aborts_sent]

    server: dict = {"api": api}
    if api == "generate":
        server["tokenizer"] = "tok"
    outs, records, aborts = run({"speedup": 5.0, "length_mean": 400, "length_sigma": 0.3, "loop_fraction": 1.0,
                                 "loop_period": 4, "stream_interval_s": 0.002, "context_length": 40_000,
                                 "stream_abort_s": 1000.0}, body, **server)
    assert aborts == 3   # /abort_request for each (the sim's disconnect handling would take 1000 s here)
    by_rid = {r["rid"].split(".")[0]: r for r in records}
    for i, out in enumerate(outs):
        rec = by_rid[f"D-L{i}"]
        assert out.discard is not None and out.discard[0] == "loop" and out.finish_reason == "abort"
        assert out.discard[1]["period"] == 4 and out.discard[1]["cut_tokens"] == out.completion_tokens
        assert rec["shape"] == "loop" and rec["finish"] == "abort"
        # Cut soon after the onset, far below max_tokens, and the engine stopped soon after the cut. "Soon" in
        # tokens is the engine's rate times the client's lag: a client that falls behind gets chunks merged (as
        # from SGLang), so the guard sees the cycle a chunk later; on a loaded machine a cut landed 358 tokens
        # past its onset. The bound that matters is max_tokens: each stopped before a tenth of it.
        assert rec["loop_onset"] < out.completion_tokens <= rec["loop_onset"] + 2000, (out.completion_tokens, rec)
        assert out.completion_tokens <= rec["completion_tokens"] < out.completion_tokens + 2000 < 20_000 // 10 + 2000


def test_sim_records_a_streams_largest_chunk_as_the_client_saw_it():
    """``max_chunk_tokens`` (what the loop-cut tests bound the guard's cut by) is the largest step between two
    chunks the client got, before the final one: here the first token, then every 7 tokens (stream_interval),
    merged into larger steps whenever the server's tick found more made."""
    async def scenario(c, u):
        body = {"text": "x", "stream": True, "rid": "M1", "sampling_params": {"max_new_tokens": 400,
                                                                             "stream_interval": 7}}
        events = await sse(c, u + "/generate", body)
        _, recs = await get(c, u + "/sim/requests")
        return events, recs

    events, recs = run_sim(scenario, speedup=5.0, length_mean=1e6, stream_interval_s=0.002)
    counts = [e["meta_info"]["completion_tokens"] for e in events if e != "[DONE]"]
    assert counts[-1] == 400 and len(counts) > 5, counts
    assert all((k - 1) % 7 == 0 for k in counts[:-1]), counts   # SGLang's: token 1, then every 7 (sent_at)
    steps = [b - a for a, b in zip([0, *counts[:-2]], counts[:-1], strict=True)]
    assert recs[0]["max_chunk_tokens"] == max(steps), (steps, recs[0])


def test_sim_generate_streams_cumulative_by_default_and_deltas_with_incremental_output():
    async def scenario(c, u):
        body = {"text": "x", "stream": True, "rid": "G1", "sampling_params": {"max_new_tokens": 40}}
        return await sse(c, u + "/generate", body)

    for incremental in (False, True):
        events = run_sim(scenario, speedup=1, length_mean=10**6, length_sigma=0.0, stream_interval_s=0.001,
                         incremental_streaming_output=incremental)
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        counts = [e["meta_info"]["completion_tokens"] for e in chunks]
        assert counts[-1] == 40 and counts == sorted(counts) and len(chunks) > 2
        if incremental:
            # Each chunk's output_ids are the tokens since the one before; joined they are the answer.
            assert [len(e["output_ids"]) for e in chunks] == [b - a for a, b in zip([0, *counts], counts, strict=False)]
            assert len("".join(e["text"] for e in chunks).split()) == 40
        else:
            assert all(len(e["output_ids"]) == k for e, k in zip(chunks, counts, strict=True))
            assert all(b["text"].startswith(a["text"]) for a, b in zip(chunks, chunks[1:], strict=False))
        assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 40}
        assert all(e["meta_info"]["finish_reason"] is None for e in chunks[:-1])


def test_sim_stream_interval_sends_at_token_1_then_every_interval_and_a_request_may_set_its_own():
    async def scenario(c, u):
        server = await sse(c, u + "/generate", {"text": "x", "stream": True, "sampling_params": {"max_new_tokens": 50}})
        own = await sse(c, u + "/generate", {"text": "x", "stream": True,
                                             "sampling_params": {"max_new_tokens": 50, "stream_interval": 7}})
        return server, own

    server, own = run_sim(scenario, speedup=20, length_mean=10**6, length_sigma=0.0, stream_interval_s=0.001,
                          stream_interval=10)
    for events, interval in ((server, 10), (own, 7)):
        counts = [e["meta_info"]["completion_tokens"] for e in events[:-1]]
        # scheduler: a running request's output goes out when len(output_ids) % interval == 1; the last at its end.
        assert all(k % interval == 1 for k in counts[:-1]) and counts[-1] == 50, counts


def test_sim_chat_continuous_usage_stats_and_the_final_usage_chunk():
    async def scenario(c, u):
        return await sse(c, u + CHAT, {"messages": MSGS, "max_tokens": 30, "stream": True,
                                       "stream_options": {"include_usage": True, "continuous_usage_stats": True}})

    events = run_sim(scenario, speedup=1, length_mean=10**6, length_sigma=0.0, stream_interval_s=0.001)
    assert events[-1] == "[DONE]"
    *deltas, last = events[:-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 30
    counts = [e["usage"]["completion_tokens"] for e in deltas[1:-1]]   # not the role and finish chunks
    assert counts == sorted(counts) and counts[-1] == 30
    text = "".join((e["choices"][0]["delta"].get("content") or "") for e in deltas)
    assert len(text.split()) == 30


def test_sim_abort_mid_stream_ends_the_stream_with_finish_reason_abort():
    async def scenario(c, u):
        async def stream():
            return await sse(c, u + "/generate", {"text": "x", "stream": True, "rid": "AB",
                                                  "sampling_params": {"max_new_tokens": 10**5}})
        task = asyncio.create_task(stream())
        for _ in range(500):
            _, recs = await get(c, u + "/sim/requests")
            if recs and recs[0]["first_token"] is not None:
                break
            await asyncio.sleep(0.01)
        async with c.post(u + "/abort_request", json={"rid": "AB"}) as r:
            assert r.status == 200
        return await task

    events = run_sim(scenario, speedup=5, length_mean=10**6, length_sigma=0.0, stream_interval_s=0.001,
                     context_length=10**6)
    assert events[-1] == "[DONE]"
    fr = events[-2]["meta_info"]["finish_reason"]
    assert fr["type"] == "abort" and events[-2]["meta_info"]["completion_tokens"] < 10**5


@pytest.mark.parametrize("shape", ["loop", "empty", "unclosed"])
def test_sim_degenerate_answers(shape):
    """--loop-fraction / --empty-fraction / --unclosed-fraction 1.0: every answer has that shape."""
    async def scenario(c, u):
        outs = []
        for i in range(5):
            async with c.post(u + "/generate", json={"text": "x", "rid": f"S{i}",
                                                     "sampling_params": {"max_new_tokens": 3000}}) as r:
                outs.append(await r.json())
        _, recs = await get(c, u + "/sim/requests")
        return outs, recs

    period = 5
    outs, recs = run_sim(scenario, instant=True, length_mean=800, length_sigma=0.3, reasoning_tokens_frac=0.25,
                         loop_period=period, **{f"{shape}_fraction": 1.0})
    assert {r["shape"] for r in recs} == {shape}
    for out, rec in zip(outs, recs, strict=True):
        text, meta = out["text"], out["meta_info"]
        if shape == "loop":
            onset = rec["loop_onset"]
            ids = out["output_ids"]
            assert meta["completion_tokens"] == 3000 and meta["finish_reason"]["type"] == "length"
            assert all(ids[i] == ids[i - period] for i in range(onset + period, 3000))
            assert len(set(ids[:onset])) > onset * 0.8   # before the onset: ordinary, non-repeating words
        elif shape == "empty":
            assert text.endswith("</think>") and meta["finish_reason"]["type"] == "stop"
        else:
            assert text.startswith("<think>") and "</think>" not in text and meta["finish_reason"]["type"] == "stop"


# --- the whole path: producer, a streaming worker with the real guard and gates, the simulator -------


def test_a_run_cuts_every_loop_at_the_engine_and_keeps_only_whole_answers(tmp_path, redis_url, conn, sim_factory):
    """A fifth of the answers loop (period 6, from a random onset, max_tokens 16,000), a tenth are empty: the
    worker streams, its guard cuts each loop within a few hundred tokens of its onset (the simulator's
    record says aborted, far below max_tokens), the gates discard the empty ones, and the rows kept are
    exactly the ordinary answers, their tokens what the budget counted."""
    from budgetq.shared import keys
    from budgetq.shared.identity import job_id
    from tests.helpers import live_run, rows, sim_get, write_config, write_dataset

    sim = sim_factory("--speedup", "4", "--seed", "5", "--length-mean", "300", "--length-sigma", "0.4",
                      "--loop-fraction", "0.2", "--loop-period", "6", "--empty-fraction", "0.1",
                      "--stream-interval-s", "0.005")
    ids = write_dataset(tmp_path / "D.jsonl", 60)
    cfg = write_config(tmp_path, redis_url, sim, [{"name": "D", "path": str(tmp_path / "D.jsonl"), "budget": "10M",
                                                   "id_field": "id", "sampling": {"max_tokens": 16_000}}],
                       worker={"concurrency": 16})
    run = live_run(cfg, tmp_path, producer_args=["--log-level", "WARNING"], timeout_s=240)
    assert run.producer.returncode == 0, run.producer.stderr
    records = sim_get(sim, "/sim/requests")
    pid_of = {job_id("D", pid): pid for pid in ids}
    by_pid: dict[str, list[dict]] = {}
    for r in records:
        by_pid.setdefault(pid_of[r["rid"].split(".")[0]], []).append(r)
    discarded = {d["id"]: d for d in rows(run.out / "D.discarded.jsonl")}
    loops = [r for r in records if r["shape"] == "loop"]
    assert len(loops) >= 5, [r["shape"] for r in records]
    for r in loops:
        cut = discarded[pid_of[r["rid"].split(".")[0]]]["discard"]
        # The guard's defaults cut a cycle once it spans 384 tokens. A chat stream gives the guard every chunk,
        # and the client sees the answer only at chunk ends: the cut lands in the first chunk that ends past
        # onset + 384 (a check every 32 characters, its token count read off marks: ~8 tokens more). How far
        # that is in tokens depends on the chunks: on a loaded machine the simulator's grow (a cut once landed
        # 1,145 tokens past its onset, a chunk of 700), so the bound is the stream's own largest chunk ...
        slack = CHECK_SLACK_TOKENS + r["max_chunk_tokens"]
        assert 0 < r["max_chunk_tokens"] and r["loop_onset"] + 384 <= cut["details"]["cut_tokens"], (r, cut)
        assert cut["details"]["cut_tokens"] <= r["loop_onset"] + 384 + slack, (r, cut)
        assert cut["completion_tokens"] == cut["details"]["cut_tokens"]
        # ... and the engine stopped there (/abort_request), far below max_tokens: what it made after the cut
        # is what it decodes while the abort travels (the bound is wide for a loaded machine; not max_tokens).
        assert r["finish"] == "abort" and r["completion_tokens"] <= cut["completion_tokens"] + 4000 < 8_000, (r, cut)
    kept = rows(run.out / "D.jsonl")
    shapes = {pid: rs[-1]["shape"] for pid, rs in by_pid.items()}
    assert {shapes[row["id"]] for row in kept} == {"normal"}
    assert len(kept) == sum(1 for s in shapes.values() if s == "normal") and len(shapes) == len(ids)
    assert int(conn.get(keys.used_key("D"))) == sum(row["completion_tokens"] for row in kept)
    reasons = {pid: d["discard"]["reason"] for pid, d in discarded.items()}
    assert reasons == {pid: {"loop": "loop", "empty": "empty"}[s] for pid, s in shapes.items() if s != "normal"}


# --- OpenAI-style servers that are not SGLang (vLLM, llama.cpp): mock servers over real HTTP --------------


def _oai_server(chunks_for, seen: list[dict], ended: list[str] | None = None):
    """An OpenAI-style server (no /server_info: not SGLang) streaming ``chunks_for(body)``, or one JSON answer
    when the request does not ask to stream; ``ended`` gets "whole" or "dropped" per stream."""
    from aiohttp import web

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append(body)
        if not body.get("stream"):
            return web.json_response({"choices": [{"index": 0, "finish_reason": "stop", "message": {
                "role": "assistant", "content": "a b c"}}], "usage": {"prompt_tokens": 3, "completion_tokens": 3}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for chunk in chunks_for(body):
                await resp.write(chunk)
                await asyncio.sleep(0)
            await resp.write_eof()
        except ConnectionResetError:
            if ended is not None:
                ended.append("dropped")
            return resp
        except asyncio.CancelledError:
            if ended is not None:
                ended.append("dropped")
            raise
        if ended is not None:
            ended.append("whole")
        return resp

    async def models(_r: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m"}]})

    return [web.post("/v1/chat/completions", chat), web.get("/v1/models", models)]


def _oai_chunk(delta: dict, finish: str | None = None, usage: dict | None = None) -> bytes:
    import json
    return b"data: " + json.dumps({"id": "c", "object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": delta, "finish_reason": finish}], "usage": usage}).encode() + b"\n\n"


def test_a_server_whose_streams_carry_no_counts_is_asked_unstreamed_from_then_on(caplog):
    """llama-cpp-python's server ignores stream_options: its streams end without a usage chunk. The answer
    is asked again unstreamed (exact counts), that endpoint is not streamed again, and it is said once."""
    from tests.helpers import serve_routes

    seen: list[dict] = []

    def chunks(_body):
        yield _oai_chunk({"role": "assistant", "content": "a "})
        yield _oai_chunk({"content": "b c"}, "stop")
        yield b"data: [DONE]\n\n"

    async def body(url: str) -> None:
        async with aiohttp.ClientSession() as session:
            client = SGLangClient(session, ServerConfig(urls=[url], max_attempts=2, backoff_base_s=0.01))
            try:
                for i in range(3):
                    out = await client.complete(payload(f"q{i}"), f"D-q{i}")
                    assert (out.text, out.completion_tokens, out.prompt_tokens) == ("a b c", 3, 3)
            finally:
                await client.close()

    with caplog.at_level("WARNING", logger="budgetq.worker"):
        asyncio.run(serve_routes(_oai_server(chunks, seen), body))
    assert [b["stream"] for b in seen] == [True, False, False, False]
    assert seen[0]["stream_options"] == {"include_usage": True}   # not SGLang or vLLM: no continuous usage
    assert sum("no longer streamed" in r.getMessage() for r in caplog.records) == 1


def test_vllm_style_reasoning_and_a_guard_cut_drops_the_connection():
    """vLLM names the reasoning delta ``reasoning``; a guard's verdict on a server without /abort_request
    closes the connection (vLLM and llama.cpp abort a request whose client left) and sends no abort."""
    from tests.helpers import serve_routes

    seen: list[dict] = []
    ended: list[str] = []
    sent = [0]

    def chunks(_body):
        yield _oai_chunk({"role": "assistant", "content": ""})
        yield _oai_chunk({"reasoning": "think "}, usage={"prompt_tokens": 3, "completion_tokens": 1,
                                                         "total_tokens": 4})
        while sent[0] < 100_000:
            sent[0] += 1
            yield _oai_chunk({"content": "the "})

    got: list = []

    async def body(url: str) -> None:
        async with aiohttp.ClientSession() as session:
            client = SGLangClient(session, ServerConfig(urls=[url], max_attempts=1))
            token = WATCH.set(Watch(guard=lambda: CycleGuard(1, 50)))
            try:
                out = await client.complete(payload("v1"), "D-v1")
            finally:
                WATCH.reset(token)
                await client.close()
            for _ in range(500):
                if ended:
                    break
                await asyncio.sleep(0.01)
            got.extend([out, client.aborts_sent])

    asyncio.run(serve_routes(_oai_server(chunks, seen, ended), body))
    out, aborts = got
    assert out.discard is not None and out.discard[0] == "loop" and out.reasoning == "think "
    assert out.text == "the " * 50 and out.finish_reason == "abort"
    assert ended == ["dropped"] and aborts == 0 and sent[0] < 1000
