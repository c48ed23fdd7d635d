"""The web monitor: one live page, a JSON API and Prometheus ``/metrics``, all from one snapshot.

Routes: ``/`` (the page, producer/ops/static/monitor.html, plain JS polling the API),
``/api/status`` (shared.status.snapshot as JSON), ``/metrics`` (Prometheus text),
``/report`` (the run report, producer/ops/report.py, drawn when asked from the config's
output_dir and this Redis; the page links to it), ``/healthz`` (200 "ok", no auth, reveals
nothing: for container healthchecks).

Run it on its own (``budgetq monitor``) or inside the producer: ``MonitorThread(cfg).start()``
for a synchronous caller, or ``await start_monitor(cfg)`` inside an asyncio loop.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import ipaddress
import logging
import signal
import threading
import time
from importlib import resources
from typing import Any

import redis
from aiohttp import web

from budgetq.producer.ops import metrics
from budgetq.shared.config import Config, MonitorConfig
from budgetq.shared.errors import ConfigError
from budgetq.shared.logs import register_config_secrets
from budgetq.shared.redis_conn import connect, explain
from budgetq.shared.status import configured_server_urls, snapshot

log = logging.getLogger("budgetq.monitor")
# Snapshots are shared by all viewers and scrapes within this window (one Redis read per window).
CACHE_S = 0.5
# The run report reads every row on disk: drawn at most this often, however many ask.
REPORT_CACHE_S = 30.0
_PUBLIC = {"/healthz"}


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve anywhere


def check_bind(mon: MonitorConfig, host: str, allow_unauthenticated: bool = False) -> None:
    """Refuse a monitor reachable from other machines without basic auth (clear error)."""
    if bool(mon.username) != bool(mon.password):
        raise ConfigError("monitor: set both monitor.username and monitor.password (BUDGETQ_MONITOR_USERNAME, "
                          "BUDGETQ_MONITOR_PASSWORD) or neither")
    if mon.username or is_loopback(host) or allow_unauthenticated:
        return
    raise ConfigError(
        f"monitor: refusing to serve on {host!r} (not a loopback address) without HTTP basic auth: set "
        "monitor.username and monitor.password (or BUDGETQ_MONITOR_USERNAME / BUDGETQ_MONITOR_PASSWORD), or bind "
        "to 127.0.0.1. Pass --allow-unauthenticated only when something else limits who can connect "
        "(e.g. compose publishes the port on 127.0.0.1 only).")


def _page() -> bytes:
    return resources.files("budgetq.producer.ops").joinpath("static", "monitor.html").read_bytes()


class Monitor:
    """The aiohttp application and its snapshot cache."""

    def __init__(self, cfg: Config, conn: redis.Redis | None = None) -> None:
        self.cfg = cfg
        # connect(): socket timeouts, so a Redis that never answers costs each request 10 s, not forever
        self.conn = conn if conn is not None else connect(cfg.redis_url)
        self._failing = False
        self._servers = configured_server_urls(cfg)
        self._cached: tuple[float, dict[str, Any]] | None = None
        self._lock = asyncio.Lock()
        self._page = _page()
        self._report_lock = asyncio.Lock()
        self._report: tuple[float, bytes] | None = None

    async def snapshot(self) -> dict[str, Any]:
        async with self._lock:
            if self._cached is None or time.monotonic() - self._cached[0] > CACHE_S:
                snap = await asyncio.to_thread(snapshot, self.conn, self.cfg.redis_url, self._servers)
                self._cached = (time.monotonic(), snap)
                if self._failing:
                    log.warning("monitor: Redis answers again")
                    self._failing = False
            return self._cached[1]

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        mon = self.cfg.monitor
        if mon.username and mon.password and request.path not in _PUBLIC:
            if not _credentials_ok(request.headers.get("Authorization", ""), mon.username, mon.password):
                return web.Response(status=401, text="authentication required\n",
                                    headers={"WWW-Authenticate": 'Basic realm="budgetq monitor", charset="UTF-8"'})
        return await handler(request)

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except redis.RedisError as exc:
            message = explain(exc, self.cfg.redis_url)
            if not self._failing:  # once per outage, not once per request; every request retries
                log.warning("monitor: %s; answering 503 until it is back", message)
                self._failing = True
            return web.json_response({"error": f"redis: {message}"}, status=503)

    async def index(self, _request: web.Request) -> web.Response:
        return web.Response(body=self._page, content_type="text/html", charset="utf-8",
                            headers={"Cache-Control": "no-store"})

    async def api_status(self, _request: web.Request) -> web.Response:
        return web.json_response(await self.snapshot(), headers={"Cache-Control": "no-store"})

    async def metrics(self, _request: web.Request) -> web.Response:
        body = metrics.render(await self.snapshot())
        return web.Response(body=body, headers={"Content-Type": metrics.CONTENT_TYPE})

    def _draw_report(self) -> bytes:
        from budgetq.producer.ops.report import render
        from budgetq.producer.ops.report_data import gather

        return render(gather(self.cfg, self.conn, keep=True)).encode("utf-8")

    async def report(self, _request: web.Request) -> web.Response:
        """The run report as of now (a run still going says so on its first line); a directory this
        monitor cannot read (a monitor on another host than the producer's) is one line, 404."""
        from budgetq.shared.errors import BudgetqError

        async with self._report_lock:
            if self._report is None or time.monotonic() - self._report[0] > REPORT_CACHE_S:
                try:
                    self._report = (time.monotonic(), await asyncio.to_thread(self._draw_report))
                except (BudgetqError, OSError, ModuleNotFoundError) as exc:
                    return web.Response(status=404, text=f"no run report: {exc}\n",
                                        headers={"Cache-Control": "no-store"})
            return web.Response(body=self._report[1], content_type="text/html", charset="utf-8",
                                headers={"Cache-Control": "no-store"})

    async def healthz(self, _request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth, self._errors])
        app.add_routes([web.get("/", self.index), web.get("/api/status", self.api_status),
                        web.get("/metrics", self.metrics), web.get("/report", self.report),
                        web.get("/healthz", self.healthz)])
        return app


def _credentials_ok(header: str, username: str, password: str) -> bool:
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "basic":
        return False
    try:
        user, _, pw = base64.b64decode(token.strip(), validate=True).decode("utf-8").partition(":")
    except (binascii.Error, UnicodeDecodeError):
        return False
    # Both compared in full, in constant time: no early exit that times the user name.
    ok_user = hmac.compare_digest(user.encode(), username.encode())
    ok_pw = hmac.compare_digest(pw.encode(), password.encode())
    return ok_user and ok_pw


async def start_monitor(cfg: Config, host: str | None = None, port: int | None = None,
                        allow_unauthenticated: bool = False) -> web.AppRunner:
    """Serve the monitor on the running loop; returns the runner (``await runner.cleanup()`` to stop).

    ``port=0`` picks a free port: read it back with ``bound_port(runner)``.
    """
    host = host or cfg.monitor.host
    port = cfg.monitor.port if port is None else port
    check_bind(cfg.monitor, host, allow_unauthenticated)
    register_config_secrets(cfg)
    runner = web.AppRunner(Monitor(cfg).app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise ConfigError(f"monitor: cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    log.info("monitor on http://%s:%d/ (JSON at /api/status, Prometheus at /metrics)", host, bound_port(runner))
    return runner


def bound_port(runner: web.AppRunner) -> int:
    for site in runner.sites:
        server = getattr(site, "_server", None)
        if server is not None and server.sockets:
            return server.sockets[0].getsockname()[1]
    raise RuntimeError("monitor is not listening")


class MonitorThread:
    """The monitor on its own event loop in a daemon thread, for the synchronous producer loop.

    ``start()`` returns once the port is bound (or raises the bind/config error here, in the
    caller's thread); ``stop()`` shuts it down.
    """

    def __init__(self, cfg: Config, host: str | None = None, port: int | None = None,
                 allow_unauthenticated: bool = False) -> None:
        self._args = (cfg, host, port, allow_unauthenticated)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="bq-monitor", daemon=True)
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    def start(self) -> int:
        self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(start_monitor(*self._args), self._loop)
        try:
            self._runner = fut.result(timeout=30)
        except BaseException:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
            raise
        self.port = bound_port(self._runner)
        return self.port

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=10)
            self._runner = None
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
        if not self._loop.is_running():
            self._loop.close()


async def serve_forever(cfg: Config, host: str | None = None, port: int | None = None,
                        allow_unauthenticated: bool = False) -> None:
    """``budgetq monitor``: serve until cancelled (Ctrl-C / SIGTERM)."""
    runner = await start_monitor(cfg, host, port, allow_unauthenticated)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # docker stop / Ctrl-C: close the port, exit 0
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        log.info("monitor stopped")
