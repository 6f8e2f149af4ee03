"""The agent's HTTP port (``filechannel serve --http HOST:PORT``): the HTTP source, ``/metrics`` and health.

This module owns the HTTP side of an agent, served by aiohttp on an event
loop in a thread of its own:

- ``POST /v1/channels/<name>/events``: Flume's JSON handler body
  (``[{"headers": {...}, "body": "text"}]``, or ``"body_base64"`` for binary
  bodies) or ``application/octet-stream`` (one event). One request is one
  channel transaction, answered ``200`` only after its durable commit. An
  ``Idempotency-Key`` header makes retries exactly-once: the key commits in
  the same transaction as the events, as a mark in a ring of
  ``idempotency_keys`` slots per channel (``idempotency.py``; ``http:<slot>`` = ``"<seq> <body
  hash> <key>"``, then the certificate name that owns the key; marks cannot be
  deleted, so the ring bounds them); a retry whose key is among the ring's
  keys is answered ``200`` again, nothing put; another certificate's request
  under that key is refused (403), so no writer can suppress another's.
- ``POST /v1/logs``: OTLP/HTTP logs (decoded by ``otlp.py``; ``docs/otlp.md``),
  one transaction per request, the channel from ``X-Filechannel-Channel``.
- ``GET /v1/channels``: the served channels by name.
- ``GET /metrics``: Prometheus text (``metrics.py``).
- ``GET /healthz`` (the process answers) and ``GET /readyz`` (every channel
  open, not full, its disks above ``minimum_required_space``; a JSON body
  says why not).

Requests are checked before any work: the bearer token (as for Flight; the
health checks need none), the content type, the ``Content-Length`` against
``max_body`` (and a body read in chunks of 64 KiB, never whole, under a read
deadline), each event against ``max_event_size`` and the event count
against ``transaction_capacity``. Commits run in a thread pool, so
concurrent requests share fsyncs (the channel's group commit). A put's error
becomes its HTTP answer through one funnel, :func:`refusal`, and one table,
:data:`STATUS`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import functools
import hashlib
import json
import logging
import os
import re
import ssl
import threading
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ParamSpec, Protocol

from aiohttp import web

from filechannel._fs import DEFAULT_FS, replace_durably
from filechannel.channel import FileChannel
from filechannel.errors import (
    ChannelClosedError,
    ChannelError,
    ChannelFullError,
    ConfigError,
    DiskSpaceError,
    EventTooLargeError,
    InvalidEventError,
    TransactionCapacityError,
)
from filechannel.format import encoded_event_size

from . import otlp
from .auth import (
    allowed,
    bearer_problem,
    certificate_name,
    is_loopback,
    may_write,
    read_token,
)
from .idempotency import KeyConflictError, KeyOwnerError, KeyRing
from .metrics import CONTENT_TYPE, AgentMetrics, ChannelSample, sample_from_stats
from .sources import CHANNEL_HEADER
from .sources import server_ssl_context as _ssl_context

if TYPE_CHECKING:
    import threading

    from filechannel.channel import FileChannel
    from filechannel.reader import ChannelReader


class _Served(Protocol):
    """What the HTTP side uses of one channel the agent serves (``served.ServedChannel``)."""

    cid: str
    name: str
    directory: str
    channel: FileChannel | None
    view: ChannelReader
    lock: threading.Lock | threading.RLock

    def describe(self) -> dict[str, Any]: ...


class Agent(Protocol):
    """What the HTTP side uses of the agent (``server.Agent``): its channels and its configuration."""

    @property
    def channels(self) -> Mapping[str, Any]: ...

    @property
    def config(self) -> Any: ...

    @property
    def connections(self) -> Any: ...  # a server.ConnectionTracker: seen(protocol, peer)


__all__ = ["HttpServer", "HttpSettings", "channel_samples", "parse_http_address", "readiness"]

logger = logging.getLogger("filechannel.agent.http")
_P = ParamSpec("_P")

NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,100}$")
KEY_RE = re.compile(r"^[A-Za-z0-9._:-]{1,100}$")
MARK_PREFIX = "http:"
MAX_IDEMPOTENCY_KEYS = 2048  # the channel keeps at most 4096 mark keys; the rest is for producers and tails
CHUNK = 65536
JSON_TYPES = ("application/json",)
BINARY_TYPES = ("application/octet-stream",)
RETRY_AFTER_FULL = "1"
RETRY_AFTER_DISK = "30"


@dataclass(frozen=True)
class HttpSettings:
    """The HTTP port's options (``filechannel serve --http ...``).

    Attributes:
        address: ``HOST:PORT`` (``[::1]:PORT`` for IPv6); port 0 picks a free one. Plain HTTP on a
            loopback address only; elsewhere the agent's ``tls_cert``/``tls_key`` are required.
        port_file: Write the bound port here (atomically) once listening.
        read_timeout: Seconds a client has to send its headers, and again its body; an idle
            keep-alive connection is closed after it too.
        max_body: The largest request body taken (bytes).
        idempotency_keys: Idempotency keys remembered per channel (the newest; 1 to 2048).
        workers: Threads that run commits (concurrent requests share fsyncs).
    """

    address: str
    port_file: str | None = None
    read_timeout: float = 30.0
    max_body: int = 64 << 20
    idempotency_keys: int = 1024
    workers: int = 8

    def check(self, tls: bool) -> tuple[str, int]:
        """The host and port, the options checked (``tls``: whether the agent has a certificate and key).

        Raises:
            ConfigError: A bad address or option, or plain HTTP (no ``tls``) off loopback.
        """
        host, port = parse_http_address(self.address)
        if not tls and not is_loopback(host):
            raise ConfigError(
                "http",
                f"{self.address}: plain HTTP is for a loopback address only (127.0.0.1, ::1, localhost); "
                "give --tls-cert and --tls-key for HTTPS",
            )
        if not (isinstance(self.read_timeout, (int, float)) and self.read_timeout > 0):
            raise ConfigError("http_read_timeout", f"must be a positive number of seconds, not {self.read_timeout!r}")
        if not (isinstance(self.max_body, int) and self.max_body > 0):
            raise ConfigError("http_max_body", f"must be a positive number of bytes, not {self.max_body!r}")
        if not (isinstance(self.idempotency_keys, int) and 1 <= self.idempotency_keys <= MAX_IDEMPOTENCY_KEYS):
            raise ConfigError(
                "http_idempotency_keys", f"must be 1 to {MAX_IDEMPOTENCY_KEYS}, not {self.idempotency_keys!r}"
            )
        if not (isinstance(self.workers, int) and self.workers > 0):
            raise ConfigError("http_workers", f"must be a positive int, not {self.workers!r}")
        return host, port


def parse_http_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (or ``[V6]:PORT``) as ``(host, port)``.

    Raises:
        ConfigError: No host or no port, or a port out of range.
    """
    host, sep, port_s = address.rpartition(":") if isinstance(address, str) else ("", "", "")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port_s.isdigit() or int(port_s) > 65535:
        raise ConfigError("http", f"{address!r}: give HOST:PORT, e.g. 127.0.0.1:8080 (port 0 picks a free port)")
    return host, int(port_s)


class _BadRequest(Exception):
    def __init__(self, status: int, reason: str, headers: dict[str, str] | None = None, close: bool = False) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.headers = headers or {}
        self.close = close


@dataclass(frozen=True)
class Refusal:
    """How the HTTP side answers one kind of error of a put: a status, an optional ``Retry-After``, the reason.

    ``say(exc, channel name)`` is the one-line reason of the answer; ``log``: the error is
    the agent's (logged as an error), not the request's.
    """

    status: int
    say: Callable[[BaseException, str], str] = lambda exc, _: str(exc)
    retry_after: str | None = None
    log: bool = False


STATUS: dict[type[BaseException], Refusal] = {
    KeyConflictError: Refusal(
        422,
        lambda exc, _: f"Idempotency-Key {getattr(exc, 'key', '')!r} was committed with another body; use a new key",
    ),
    KeyOwnerError: Refusal(
        403,
        lambda *_: (
            "this Idempotency-Key was committed by another client certificate: use keys of your own (nothing was put)"
        ),
    ),
    ChannelFullError: Refusal(
        503, lambda exc, name: f"channel {name}: {_full(exc)}; retry later (nothing was put)", RETRY_AFTER_FULL
    ),
    DiskSpaceError: Refusal(  # a full channel of the disk kind (min_free, disk_full)
        503, lambda exc, _: f"{exc} (nothing was put)", RETRY_AFTER_DISK
    ),
    EventTooLargeError: Refusal(413),
    TransactionCapacityError: Refusal(413),
    InvalidEventError: Refusal(400),
    ChannelClosedError: Refusal(503, lambda exc, name: f"channel {name} has failed: {exc}", log=True),
    ChannelError: Refusal(500, lambda exc, _: f"the put failed: {exc}", log=True),
    OSError: Refusal(
        500,
        lambda exc, _: f"the put failed: {getattr(exc, 'strerror', None) or type(exc).__name__} on the agent",
        log=True,
    ),
}
"""The HTTP answer of each error a put can raise; the most specific class of an error's MRO wins."""


def _full(exc: BaseException) -> str:
    """What a full channel reached (``ChannelFullError.reason``), in words."""
    return "its max_bytes is reached" if getattr(exc, "reason", None) == "max_bytes" else "it is full"


def refusal(exc: BaseException, channel: str) -> _BadRequest:
    """The one funnel from a put's error to its HTTP answer (:data:`STATUS`); an error it does not know is a 500."""
    rule = next((STATUS[c] for c in type(exc).__mro__ if c in STATUS), Refusal(500, log=True))
    if rule.log:
        logger.error("a put to channel %s failed: %s", channel, exc)
    headers = {"Retry-After": rule.retry_after} if rule.retry_after is not None else None
    return _BadRequest(rule.status, rule.say(exc, channel), headers)


def _answer(status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        status=status,
        text=json.dumps(body, sort_keys=True) + "\n",
        content_type="application/json",
        headers=headers,
    )


def parse_json_events(data: bytes) -> tuple[list[bytes], list[dict[str, str] | None]]:
    """Flume's JSON handler body: a list of ``{"headers": {str: str}, "body": str | "body_base64": str}``.

    Raises:
        _BadRequest: 400 with a one-line reason.
    """
    try:
        doc = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise _BadRequest(400, "the body is not UTF-8 JSON") from None
    except json.JSONDecodeError as exc:
        raise _BadRequest(400, f"malformed JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise _BadRequest(400, "the JSON is nested too deeply: the body is a list of flat event objects") from None
    if not isinstance(doc, list):
        raise _BadRequest(400, f"the body is a JSON list of events, not {type(doc).__name__}")
    bodies: list[bytes] = []
    headers: list[dict[str, str] | None] = []
    for i, ev in enumerate(doc):
        if not isinstance(ev, dict):
            raise _BadRequest(400, f"event {i} is not a JSON object")
        extra = set(ev) - {"headers", "body", "body_base64"}
        if extra:
            raise _BadRequest(400, f"event {i} has unknown fields {sorted(extra)} (headers, body, body_base64)")
        if ("body" in ev) == ("body_base64" in ev):
            raise _BadRequest(400, f"event {i} needs exactly one of body (text) and body_base64")
        if "body" in ev:
            if not isinstance(ev["body"], str):
                raise _BadRequest(400, f"event {i}: body is a string (use body_base64 for binary bodies)")
            try:
                bodies.append(ev["body"].encode("utf-8"))
            except UnicodeEncodeError:
                raise _BadRequest(400, f"event {i}: body holds a lone surrogate (not UTF-8 text)") from None
        else:
            b64 = ev["body_base64"]
            if not isinstance(b64, str):
                raise _BadRequest(400, f"event {i}: body_base64 is a string")
            try:
                bodies.append(base64.b64decode(b64, validate=True))
            except (binascii.Error, ValueError):
                raise _BadRequest(400, f"event {i}: body_base64 is not valid base64") from None
        h = ev.get("headers")
        if h is None:
            headers.append(None)
        elif isinstance(h, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in h.items()):
            headers.append(h or None)
        else:
            raise _BadRequest(400, f"event {i}: headers is an object of string values")
    return bodies, headers


def _data_dirs(ch: _Served) -> list[str]:
    dirs = ch.channel.data_dirs if ch.channel is not None else None
    return dirs or [ch.directory]


def readiness(agent: Agent) -> tuple[bool, dict[str, Any]]:
    """Whether every channel is open, not full and has its minimum disk space; and why not, per channel."""
    out: dict[str, Any] = {}
    ready = True
    for ch in agent.channels.values():
        problems: list[str] = []
        try:
            if ch.channel is not None:
                c = ch.channel
                if c.closed:
                    problems.append("the channel is closed")
                else:
                    st = c.stats()
                    if st["failed"]:
                        problems.append("the channel has failed (see the agent's log); restart the agent")
                    if st["queue_size"] >= st["capacity"]:
                        problems.append(f"the channel is full ({st['queue_size']} of {st['capacity']} events)")
                    if st["max_bytes"] is not None and st["data_bytes"] >= st["max_bytes"]:
                        problems.append(f"the channel is full ({st['data_bytes']} bytes, max_bytes={st['max_bytes']})")
                    need = c.config.minimum_required_space
                    for d in _data_dirs(ch):
                        free = DEFAULT_FS.free_space(d)
                        if free < need:
                            problems.append(f"only {free} bytes free on {d} (minimum_required_space={need})")
            else:
                with ch.lock:
                    ch.view.available()
        except (ChannelError, OSError) as exc:
            problems.append(f"cannot read the channel: {exc}")
        ready = ready and not problems
        out[ch.name] = {"channel": ch.cid, "ready": not problems, "problems": problems}
    return ready, {"ready": ready, "channels": out}


def channel_samples(agent: Agent) -> list[ChannelSample]:
    """Every served channel's metric values now (owned channels from ``stats()``; others from the view)."""
    samples: list[ChannelSample] = []
    for ch in agent.channels.values():
        try:
            if ch.channel is not None and not ch.channel.closed:
                s = sample_from_stats(ch.name, ch.channel.stats())
            else:
                s = ChannelSample(ch.name)
                with ch.lock:
                    start, end = ch.view.available()
                    info = ch.describe()
                s.values["channel_size"] = float(end - start)
                s.values["next_position"] = float(end)
                for cname, c in info["consumers"].items():
                    s.consumers[cname] = {"acked": float(c["acked"]), "lag_events": float(c["lag"])}
            try:
                s.values["disk_free_bytes"] = float(DEFAULT_FS.free_space(ch.directory))
            except OSError:
                pass
            with ch.lock:
                start, end = ch.view.available()
                rows = list(s.consumers.values())
                sizes = ch.view.record_bytes([start, *(max(int(r["acked"]), start) for r in rows)], end)
            s.values["channel_bytes"] = float(sizes[0])
            for row, b in zip(rows, sizes[1:], strict=True):
                row["lag_bytes"] = float(b)
        except (ChannelError, OSError) as exc:
            logger.warning("metrics of channel %s (%s): %s", ch.name, ch.cid, exc)
            continue
        samples.append(s)
    return samples


def check_names(channels: Iterable[tuple[str, str]]) -> None:
    """Check the served channels' names, ``(name, directory)`` each: the HTTP URLs use them.

    Raises:
        ConfigError: A name that is not 1 to 100 of ``A-Z a-z 0-9 . _ -``, or one name twice.
    """
    seen: dict[str, str] = {}
    for name, directory in channels:
        if not NAME_RE.match(name):
            raise ConfigError(
                "directories", f"{directory}: the name {name!r} is not 1-100 of A-Z a-z 0-9 . _ -: give DIR=NAME"
            )
        if name in seen:
            raise ConfigError("directories", f"{seen[name]} and {directory} are both named {name!r}: give DIR=NAME")
        seen[name] = directory


def ssl_context(config: Any) -> ssl.SSLContext:
    """The HTTPS context of an agent's ``config`` (its ``tls_cert``, ``tls_key`` and ``client_ca``), checked.

    Raises:
        ConfigError: A file missing, unsafe, or not PEM of the right kind.
    """
    return _ssl_context(config.tls_cert, config.tls_key, config.client_ca)


def _peer_name(request: web.Request) -> str | None:
    transport = request.transport
    return certificate_name(transport.get_extra_info("peercert") if transport is not None else None)


class HttpServer:
    """The HTTP port of an agent; listening when made, stopped by :meth:`stop`.

    Attributes:
        port: The bound port.
        url: ``http(s)://HOST:PORT`` to reach it on this host.
        metrics: The agent's :class:`AgentMetrics` (Flight calls count into it too).
    """

    def __init__(self, agent: Agent, settings: HttpSettings) -> None:
        config = agent.config
        tls = bool(config.tls_cert and config.tls_key)
        host, port = settings.check(tls)
        self._agent = agent
        self._settings = settings
        self._ssl = ssl_context(config) if tls else None
        self._token = read_token(config.token_file, "token_file") if config.token_file else None
        check_names((ch.name, ch.directory) for ch in agent.channels.values())
        self._by_name: dict[str, _Served] = {ch.name: ch for ch in agent.channels.values()}
        self._rings = {
            ch.cid: KeyRing(ch.channel, settings.idempotency_keys, MARK_PREFIX)
            for ch in agent.channels.values()
            if ch.channel is not None
        }
        self.metrics = AgentMetrics(lambda: channel_samples(agent), agent.connections.counts)
        self._pool = concurrent.futures.ThreadPoolExecutor(settings.workers, thread_name_prefix="filechannel-http")
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._started = threading.Event()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(host, port), name="filechannel-http", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._failure is not None:
            self._pool.shutdown()
            raise ChannelError(f"cannot listen for HTTP on {settings.address}: {self._failure}") from None
        scheme = "https" if self._ssl else "http"
        shown = f"[{host}]" if ":" in host else host
        self.url = f"{scheme}://{shown}:{self.port}"
        self._announced = False

    def announce(self) -> None:
        """Write the port file and log the URL (the agent calls it once every part has started)."""
        self._announced = True
        if self._settings.port_file:
            path = os.path.abspath(self._settings.port_file)
            replace_durably(DEFAULT_FS, f"{path}.tmp-{os.getpid()}", path, b"%d\n" % self.port)
        logger.info("HTTP source, /metrics and health checks on %s", self.url)

    # -- the event loop thread -------------------------------------------------------------

    def _run(self, host: str, port: int) -> None:
        asyncio.set_event_loop(self._loop)
        ok = False
        try:
            self._loop.run_until_complete(self._start(host, port))
            ok = True
        except OSError as exc:  # reported by __init__
            self._failure = exc
        finally:
            if not ok:
                self._failure = self._failure or RuntimeError("the HTTP server did not start")
                self._started.set()
                self._loop.close()
        if not ok:
            return
        self._started.set()
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    async def _start(self, host: str, port: int) -> None:
        app = web.Application(middlewares=[self._middleware], client_max_size=self._settings.max_body)
        app.router.add_get("/v1/channels", self._list, name="channels")
        app.router.add_post("/v1/channels/{name}/events", self._events, name="events")
        app.router.add_post("/v1/logs", self._otlp_logs, name="otlp")
        app.router.add_get("/metrics", self._metrics, name="metrics")
        app.router.add_get("/healthz", self._healthz, name="healthz")
        app.router.add_get("/readyz", self._readyz, name="readyz")
        runner = web.AppRunner(
            app,
            access_log=None,
            handle_signals=False,
            shutdown_timeout=10.0,
            keepalive_timeout=self._settings.read_timeout,
            # After a refused body (413, 408) the rest of it is read and dropped for at most 1 s (so
            # the client sees the answer rather than a reset), then the connection is closed.
            lingering_time=min(1.0, self._settings.read_timeout),
        )
        await runner.setup()
        site = web.TCPSite(runner, host, port, ssl_context=self._ssl, reuse_address=True)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self.port = int(runner.addresses[0][1])

    def stop(self) -> None:
        """Stop listening; requests in flight finish (up to 10 s); remove the port file."""
        if self._runner is not None and not self._loop.is_closed():
            fut = asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop)
            try:
                fut.result(30)
            except (concurrent.futures.TimeoutError, RuntimeError) as exc:
                logger.warning("HTTP shutdown: %s", exc)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._runner = None
        self._thread.join(30)
        self._pool.shutdown(wait=True)
        if self._settings.port_file and self._announced:
            try:
                DEFAULT_FS.unlink(os.path.abspath(self._settings.port_file))
            except FileNotFoundError:
                pass

    # -- middleware: the token, errors as JSON, counting -----------------------------------

    @web.middleware
    async def _middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        route = request.match_info.route
        endpoint = route.name if route.name else "other"
        peer = request.transport.get_extra_info("peername") if request.transport is not None else None
        if isinstance(peer, tuple) and len(peer) >= 2:
            self._agent.connections.seen("http", f"{peer[0]}:{peer[1]}")
        channel = request.match_info.get("name", "") if endpoint == "events" else ""
        if channel not in self._by_name:
            channel = "" if endpoint != "events" else "?"  # unknown names share one label value
        try:
            if self._token is not None and endpoint not in ("healthz", "readyz"):
                problem = bearer_problem(self._token, request.headers.getall("Authorization", []))
                if problem == "missing":
                    raise _BadRequest(
                        401,
                        "this agent requires a bearer token: send Authorization: Bearer <token>",
                        {"WWW-Authenticate": "Bearer"},
                    )
                if problem is not None:
                    raise _BadRequest(
                        401, "the bearer token is wrong", {"WWW-Authenticate": 'Bearer error="invalid_token"'}
                    )
            resp = await handler(request)
        except _BadRequest as exc:
            resp = _answer(exc.status, {"error": exc.reason}, exc.headers)
            if exc.close:
                resp.force_close()
        except web.HTTPException as exc:  # no such route, a method not allowed, ...
            resp = _answer(exc.status, {"error": exc.reason}, {k: v for k, v in exc.headers.items() if k == "Allow"})
        self.metrics.http_request(endpoint, channel, resp.status)
        return resp

    # -- handlers --------------------------------------------------------------------------

    async def _healthz(self, request: web.Request) -> web.StreamResponse:
        return _answer(200, {"status": "ok"})

    def _visible(self, request: web.Request) -> set[str] | None:
        """The channel names this request's certificate may use (None: every one; no ``--allow``)."""
        allow = self._agent.config.allow
        if not allow:
            return None
        peer = _peer_name(request)
        return {name for name, ch in self._by_name.items() if allowed(allow, ch.cid, peer)}

    async def _readyz(self, request: web.Request) -> web.StreamResponse:
        ready, body = await self._loop.run_in_executor(self._pool, readiness, self._agent)
        visible = self._visible(request)
        if visible is not None:  # the verdict is the agent's; the details only of the caller's channels
            body["channels"] = {n: v for n, v in body["channels"].items() if n in visible}
        return _answer(200 if ready else 503, body)

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        data = await self._loop.run_in_executor(self._pool, self.metrics.render, self._visible(request))
        return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE})

    async def _list(self, request: web.Request) -> web.StreamResponse:
        visible = self._visible(request)

        def go() -> list[dict[str, Any]]:
            out = []
            for name, ch in sorted(self._by_name.items()):
                if visible is not None and name not in visible:
                    continue
                with ch.lock:
                    start, end = ch.view.available()
                out.append(
                    {"name": name, "channel": ch.cid, "start": start, "end": end, "writable": ch.channel is not None}
                )
            return out

        return _answer(200, {"channels": await self._loop.run_in_executor(self._pool, go)})

    async def _events(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        ch = self._by_name.get(name)
        if ch is None:
            visible = self._visible(request)
            shown = sorted(n for n in self._by_name if visible is None or n in visible)
            raise _BadRequest(404, f"no channel named {name!r} here (served: {', '.join(shown) or 'none to you'})")
        channel = self._writable(request, ch)
        if "Content-Type" not in request.headers:
            raise _BadRequest(
                415, "give Content-Type: application/json (Flume's JSON events) or application/octet-stream"
            )
        ctype = request.content_type
        charset = request.charset
        if ctype in JSON_TYPES:
            if charset is not None and charset.lower().replace("_", "-") not in ("utf-8", "utf8"):
                raise _BadRequest(415, f"JSON events are UTF-8, not charset={charset}")
        elif ctype not in BINARY_TYPES:
            raise _BadRequest(
                415,
                f"Content-Type {ctype} is not taken: "
                "give application/json (Flume's JSON events) or application/octet-stream",
            )
        key = request.headers.get("Idempotency-Key")
        if key is not None and not KEY_RE.match(key):
            raise _BadRequest(400, "an Idempotency-Key is 1 to 100 characters of A-Z a-z 0-9 . _ : -")
        limit = self._settings.max_body
        max_event = channel.config.max_event_size
        if ctype in BINARY_TYPES:
            limit = min(limit, max_event)
        length = request.content_length
        if length is not None and length > limit:
            what = f"max_event_size={max_event}" if limit == max_event else f"the agent's --http-max-body={limit}"
            raise _BadRequest(413, f"a body of {length} bytes is over {what}", close=True)
        data = await self._read_body(request, limit, max_event)
        if ctype in JSON_TYPES:
            bodies, headers = parse_json_events(data)
        else:
            bodies, headers = [data], [None]
        cap = channel.config.transaction_capacity
        if len(bodies) > cap:
            raise _BadRequest(413, f"{len(bodies)} events in one request, over transaction_capacity={cap}: send fewer")
        fingerprint = hashlib.sha256(ctype.encode() + b"\0" + data).hexdigest()[:32]
        ring = self._rings[ch.cid]
        duplicate, took = await self._put(ch, ring.put, channel, key, fingerprint, bodies, headers, _peer_name(request))
        if duplicate:
            self.metrics.http_duplicates.labels(name).inc()
        else:
            self.metrics.http_events.labels(name).inc(len(bodies))
            self.metrics.put_committed(name, "http", took)
        return _answer(200, {"channel": name, "events": 0 if duplicate else len(bodies), "duplicate": duplicate})

    def _writable(self, request: web.Request, ch: _Served) -> FileChannel:
        """The channel to post to, once the client's certificate name may write to it.

        Raises:
            _BadRequest: 403 (not allowed, or the channel is read-only).
        """
        name = ch.name
        peer = _peer_name(request)
        if not allowed(self._agent.config.allow, ch.cid, peer):
            logger.warning("refused certificate name %r for channel %s over HTTP", peer, ch.cid)
            raise _BadRequest(403, f"certificate name {peer!r} is not allowed to use channel {name} (--allow)")
        if not may_write(self._agent.config.writers, peer):
            logger.warning("refused certificate name %r a post to channel %s over HTTP", peer, ch.cid)
            raise _BadRequest(403, f"certificate name {peer!r} may not write to channel {name} (--allow-writer)")
        channel = ch.channel
        if channel is None:
            raise _BadRequest(403, f"channel {name} is served read-only: start the agent with --writable to post")
        return channel

    async def _put(
        self, ch: _Served, put: Callable[_P, tuple[bool, float]], *args: _P.args, **kwargs: _P.kwargs
    ) -> tuple[bool, float]:
        """``put(*args)``, channel ``ch``'s :meth:`KeyRing.put`, in the pool: (duplicate, seconds).

        A channel's refusal comes out as its HTTP status.

        Raises:
            _BadRequest: The refusal's status (:data:`STATUS`): 422 (a key's other body), 403 (another
                certificate's key), 503 with Retry-After (full, no disk space, failed), 413 (too large),
                400 (an invalid event), 500 (I/O).
        """
        try:
            return await self._loop.run_in_executor(self._pool, functools.partial(put, *args, **kwargs))
        except (ChannelError, OSError) as exc:
            raise refusal(exc, ch.name) from None

    async def _otlp_logs(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/logs``: OTLP/HTTP logs (decoded by ``otlp.py``), one transaction per request.

        Answers in the request's encoding: an ``ExportLogsServiceResponse`` (with
        ``partial_success`` when records over ``max_event_size`` were left out), or
        a ``google.rpc.Status`` with the status (503 and ``Retry-After`` when full).
        """
        is_json = request.content_type in JSON_TYPES
        ctype = "application/json" if is_json else otlp.PROTOBUF_TYPE
        try:
            if request.content_type not in (otlp.PROTOBUF_TYPE, *JSON_TYPES):
                raise _BadRequest(415, f"give Content-Type: {otlp.PROTOBUF_TYPE} or application/json, not {ctype}")
            name = request.headers.get(CHANNEL_HEADER)
            visible = self._visible(request)
            shown = ", ".join(sorted(n for n in self._by_name if visible is None or n in visible)) or "none to you"
            if name is None:
                if len(self._by_name) != 1:
                    raise _BadRequest(400, f"several channels are served ({shown}): send {CHANNEL_HEADER}")
                name = next(iter(self._by_name))
            ch = self._by_name.get(name)
            if ch is None:
                raise _BadRequest(404, f"no channel named {name!r} here (served: {shown})")
            channel = self._writable(request, ch)
            max_event = channel.config.max_event_size
            if request.content_length is not None and request.content_length > self._settings.max_body:
                raise _BadRequest(413, f"a body of {request.content_length} bytes is over --http-max-body", close=True)
            data = await self._read_body(request, self._settings.max_body, max_event)
            try:
                events = (otlp.decode_logs_json if is_json else otlp.decode_logs_protobuf)(data)
            except otlp.OtlpDecodeError as exc:
                raise _BadRequest(400, f"not an OTLP ExportLogsServiceRequest: {exc}") from None
            bodies: list[bytes] = []
            headers: list[dict[str, str] | None] = []
            for body, hdrs in events:
                if encoded_event_size(body, hdrs) <= max_event:
                    bodies.append(body)
                    headers.append(hdrs)
            rejected = len(events) - len(bodies)
            cap = channel.config.transaction_capacity
            if len(bodies) > cap:
                raise _BadRequest(413, f"{len(bodies)} log records in one request, over transaction_capacity={cap}")
            ring = self._rings[ch.cid]
            took = (await self._put(ch, ring.put, channel, None, "", bodies, headers))[1] if bodies else 0.0
        except _BadRequest as exc:
            resp = web.Response(
                status=exc.status,
                body=otlp.encode_status(is_json, exc.status, exc.reason),
                content_type=ctype,
                headers=exc.headers,
            )
            if exc.close:
                resp.force_close()
            return resp
        self.metrics.source_events.labels("otlp", name).inc(len(bodies))
        if rejected:
            self.metrics.source_refused.labels("otlp", name, "too_large").inc(rejected)
        if bodies:
            self.metrics.put_committed(name, "otlp", took)
        message = f"{rejected} log record(s) over max_event_size={max_event} were left out" if rejected else ""
        return web.Response(body=otlp.encode_response(is_json, rejected, message), content_type=ctype)

    async def _read_body(self, request: web.Request, limit: int, max_event: int) -> bytes:
        """The body, read in chunks up to ``limit`` bytes within the read deadline."""
        buf = bytearray()

        async def read() -> None:
            while True:
                chunk = await request.content.read(CHUNK)
                if not chunk:
                    return
                if len(buf) + len(chunk) > limit:
                    what = (
                        f"max_event_size={max_event}" if limit == max_event else f"the agent's --http-max-body={limit}"
                    )
                    raise _BadRequest(413, f"the body is over {what}", close=True)
                buf.extend(chunk)

        try:
            await asyncio.wait_for(read(), self._settings.read_timeout)
        except asyncio.TimeoutError:
            raise _BadRequest(
                408, f"the body did not arrive within {self._settings.read_timeout:g} s", close=True
            ) from None
        return bytes(buf)
