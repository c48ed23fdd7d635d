"""Measure the simulator itself: requests/s in --instant mode, and its CPU while holding long requests.

    python bench/loadtest.py instant --clients 64 --seconds 10 [--client-procs 2]
    python bench/loadtest.py hold --requests 256 --seconds 10 [--stream] [--chat]
    python bench/loadtest.py loop --clients 256 --seconds 10 --speedup 25

Each mode starts its own `budgetq sim` subprocess on a free port and reads that process's CPU
time from /proc (Linux), so the numbers are the server's, not the load generator's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import sys
import time

import aiohttp
from _common import Sim, cpu_s


async def _get(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(url) as r:
        return await r.json()


# --- instant: requests/s ----------------------------------------------------------------------------

async def _hammer(url: str, clients: int, seconds: float) -> int:
    """Keep-alive HTTP/1.1 clients on raw asyncio streams: far lighter than aiohttp's client, so the
    count measures the server rather than the load generator."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"text": "a short prompt", "sampling_params": {"max_new_tokens": 16}}).encode()
    head = (f"POST /generate HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    done = 0
    deadline = time.monotonic() + seconds

    async def client() -> None:
        nonlocal done
        reader, writer = await asyncio.open_connection(host, int(port))
        while time.monotonic() < deadline:
            writer.write(head + body)
            headers = await reader.readuntil(b"\r\n\r\n")
            length = int(headers.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            done += headers.startswith(b"HTTP/1.1 200")
        writer.close()

    await asyncio.gather(*[client() for _ in range(clients)])
    return done


def _hammer_proc(args: tuple[str, int, float]) -> int:
    return asyncio.run(_hammer(*args))


def instant(clients: int, seconds: float, client_procs: int) -> dict:
    sim = Sim("--instant", "--length-mean", "16", "--keep-records", "1000")
    try:
        c0, t0 = cpu_s(sim.pid), time.monotonic()
        per = [clients // client_procs + (i < clients % client_procs) for i in range(client_procs)]
        with multiprocessing.Pool(client_procs) as pool:
            counts = pool.map(_hammer_proc, [(sim.url, n, seconds) for n in per])
        wall = time.monotonic() - t0
        return {"mode": "instant", "clients": clients, "client_procs": client_procs, "requests": sum(counts),
                "req_per_s": round(sum(counts) / wall), "server_cpu_pct": round(100 * (cpu_s(sim.pid) - c0) / wall)}
    finally:
        sim.close()


# --- hold: CPU while N long requests decode ----------------------------------------------------------

async def _hold(url: str, n: int, seconds: float, stream: bool, pid: int, chat: bool) -> dict:
    if chat:
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": stream}
    else:
        path, body = "/generate", {"text": "x", "stream": stream, "sampling_params": {"max_new_tokens": 10**7}}

    async def one(session: aiohttp.ClientSession) -> None:
        async with session.post(url + path, json=body) as r:
            async for _ in r.content.iter_any():
                pass

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks = [asyncio.create_task(one(session)) for _ in range(n)]
        while (await _get(session, url + "/sim/stats"))["running"] < n:
            await asyncio.sleep(0.05)
        g0, c0, t0 = (await _get(session, url + "/sim/stats"))["generated_tokens"], cpu_s(pid), time.monotonic()
        await asyncio.sleep(seconds)
        stats = await _get(session, url + "/sim/stats")
        wall, cpu = time.monotonic() - t0, cpu_s(pid) - c0
        async with session.post(url + "/abort_request", json={"abort_all": True}) as r:
            await r.read()
        await asyncio.gather(*tasks, return_exceptions=True)
    return {"mode": "hold", "requests": n, "stream": stream, "endpoint": path, "seconds": round(wall, 1),
            "server_cpu_pct": round(100 * cpu / wall, 1), "tok_per_s": round((stats["generated_tokens"] - g0) / wall)}


def hold(n: int, seconds: float, stream: bool, chat: bool) -> dict:
    sim = Sim("--max-running-requests", str(max(n, 1)), "--length-mean", "1e7", "--length-sigma", "0",
                          "--context-length", str(10**8))
    try:
        return asyncio.run(_hold(sim.url, n, seconds, stream, sim.pid, chat))
    finally:
        sim.close()


# --- loop: closed-loop clients, real lengths ---------------------------------------------------------

async def _loop(url: str, clients: int, seconds: float, pid: int) -> dict:
    body = {"text": "x" * 400, "sampling_params": {"max_new_tokens": 8000}}

    async def client(session: aiohttp.ClientSession, i: int) -> None:
        k = 0
        while True:
            async with session.post(url + "/generate", json={**body, "rid": f"c{i}-{k}"}) as r:
                await r.read()
            k += 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        s0, c0, t0 = await _get(session, url + "/sim/stats"), cpu_s(pid), time.monotonic()
        tasks = [asyncio.create_task(client(session, i)) for i in range(clients)]
        await asyncio.sleep(seconds)
        s1, wall, cpu = await _get(session, url + "/sim/stats"), time.monotonic() - t0, cpu_s(pid) - c0
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return {"mode": "loop", "clients": clients, "completed": s1["completed"] - s0["completed"],
            "req_per_s": round((s1["completed"] - s0["completed"]) / wall, 1),
            "tok_per_s": round((s1["generated_tokens"] - s0["generated_tokens"]) / wall),
            "server_cpu_pct": round(100 * cpu / wall, 1)}


def loop(clients: int, seconds: float, speedup: float) -> dict:
    sim = Sim("--max-running-requests", "256", "--speedup", str(speedup))
    try:
        return asyncio.run(_loop(sim.url, clients, seconds, sim.pid))
    finally:
        sim.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/loadtest.py", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="mode", required=True)
    sp = sub.add_parser("instant", help="requests/s with --instant")
    sp.add_argument("--clients", type=int, default=64)
    sp.add_argument("--client-procs", type=int, default=1)
    sp.add_argument("--seconds", type=float, default=10)
    sp = sub.add_parser("hold", help="server CPU while N long requests decode")
    sp.add_argument("--requests", type=int, default=256)
    sp.add_argument("--seconds", type=float, default=10)
    sp.add_argument("--stream", action="store_true")
    sp.add_argument("--chat", action="store_true", help="/v1/chat/completions instead of /generate")
    sp = sub.add_parser("loop", help="closed-loop clients with drawn lengths")
    sp.add_argument("--clients", type=int, default=256)
    sp.add_argument("--seconds", type=float, default=10)
    sp.add_argument("--speedup", type=float, default=1)
    a = p.parse_args(argv)
    if a.mode == "instant":
        out = instant(a.clients, a.seconds, a.client_procs)
    elif a.mode == "hold":
        out = hold(a.requests, a.seconds, a.stream, a.chat)
    else:
        out = loop(a.clients, a.seconds, a.speedup)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
