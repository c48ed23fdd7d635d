"""A TCP relay that holds every chunk it forwards for a fixed delay: a link's latency, for tests
and benchmarks on a kernel without ``sch_netem`` (``tc qdisc ... netem`` refused).

    python -m budgetq.simulator.relay --listen 127.0.0.1:7000 --to 127.0.0.1:6379 --rtt-ms 20

Each direction of each connection waits ``rtt / 2`` per chunk, measured from when the chunk was
read: chunks in flight overlap (a pipelined client pays one RTT per round trip, not one per
command), and order is kept. It emulates propagation delay on a TCP stream only: no loss, no
reordering, no bandwidth limit, and the TCP handshake itself is not delayed (the first request
on a connection is).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time

_CHUNK = 65536


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def send() -> None:
        while True:
            due, data = await queue.get()
            if not data:
                break
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()

    sender = asyncio.create_task(send())
    try:
        while data := await reader.read(_CHUNK):
            queue.put_nowait((time.monotonic() + delay_s, data))
        queue.put_nowait((0.0, b""))
        await sender
    except (ConnectionError, OSError):
        pass
    finally:
        sender.cancel()
        with contextlib.suppress(ConnectionError, OSError, RuntimeError):
            if writer.can_write_eof():
                writer.write_eof()
        writer.close()


async def serve(listen: tuple[str, int], to: tuple[str, int], rtt_s: float) -> asyncio.Server:
    """Start the relay; the returned server runs until closed."""
    half = rtt_s / 2

    async def handle(c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        try:
            s_reader, s_writer = await asyncio.open_connection(*to)
        except OSError:
            c_writer.close()
            return
        await asyncio.gather(_pipe(c_reader, s_writer, half), _pipe(s_reader, c_writer, half))

    return await asyncio.start_server(handle, *listen)


def _addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main() -> None:
    ap = argparse.ArgumentParser(description="a TCP relay that adds a round-trip time")
    ap.add_argument("--listen", type=_addr, required=True, help="HOST:PORT")
    ap.add_argument("--to", type=_addr, required=True, help="HOST:PORT")
    ap.add_argument("--rtt-ms", type=float, required=True)
    args = ap.parse_args()

    async def run() -> None:
        server = await serve(args.listen, args.to, args.rtt_ms / 1000)
        print(f"relay {args.listen[0]}:{args.listen[1]} -> {args.to[0]}:{args.to[1]}, rtt {args.rtt_ms:g} ms",
              flush=True)
        async with server:
            await server.serve_forever()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())


if __name__ == "__main__":
    main()
