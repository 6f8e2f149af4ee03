"""What the agent's push sources share: their addresses, TLS, bounded gunzip, and a TCP/TLS listener.

This module owns the pieces every stream source of ``filechannel serve`` uses
(``--forward`` here; syslog and RELP can reuse them), so each protocol module
holds only its own parser and answers:

- :func:`parse_source_address`: ``tcp://HOST:PORT[=CHANNEL]`` / ``tls://...``
  checked (plain TCP on a loopback address only, as for HTTP), the channel
  name resolved against the served channels (default: the only one).
- :func:`server_ssl_context`: the agent's certificate, key and client CA as an
  ``ssl.SSLContext`` (mutual TLS when a client CA is given); :func:`peer_name`
  the client certificate's name for the allow-lists (the same rule as Flight's).
- :func:`gunzip_bounded`: gzip members decompressed up to a limit, so a small
  compressed body never becomes an unbounded one.
- :class:`StreamListener`: asyncio TCP/TLS servers on an event loop thread of
  their own, at most ``max_connections`` connections, each served by a
  coroutine that reads through :class:`Connection` (every read under a
  deadline).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import re
import ssl
import threading
import zlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from filechannel.errors import ChannelError, ConfigError

from .auth import INSECURE_FLAG, certificate_name, is_loopback, read_public_file, read_secret_file

__all__ = [
    "CHANNEL_HEADER",
    "Connection",
    "SourceAddress",
    "StreamListener",
    "TooLargeError",
    "gunzip_bounded",
    "parse_source_address",
    "peer_name",
    "server_ssl_context",
]

logger = logging.getLogger("filechannel.agent.sources")

CHANNEL_HEADER = "X-Filechannel-Channel"  # the HTTP header naming a channel (OTLP)
_ADDRESS_RE = re.compile(r"^(?P<scheme>[a-z]+)://(?P<host>\[[^\]]+\]|[^:/\[\]]+):(?P<port>\d{1,5})(?:=(?P<name>.+))?$")


class TooLargeError(ChannelError, ValueError):
    """Input over a configured size limit (a decompressed body, a message)."""


@dataclass(frozen=True)
class SourceAddress:
    """A source's listening address: ``scheme`` (``tcp`` or ``tls``), host, port and the channel's name."""

    scheme: str
    host: str
    port: int
    channel: str

    @property
    def tls(self) -> bool:
        """Whether connections use TLS."""
        return self.scheme == "tls"


def parse_source_address(
    option: str,
    spec: str,
    names: Sequence[str],
    *,
    schemes: Sequence[str] = ("tcp", "tls"),
    has_tls: bool = False,
    insecure: bool = False,
) -> SourceAddress:
    """``SCHEME://HOST:PORT[=CHANNEL]`` checked against the served channel ``names``.

    Args:
        option: The flag, for messages (``forward``).
        spec: The address as given.
        names: The names of the channels served (``=CHANNEL`` picks one; without it, the only one).
        schemes: The schemes this source takes.
        has_tls: Whether the agent has a certificate and key (``tls://`` needs them).
        insecure: The agent runs open on purpose (``--insecure-allow-anyone``): plain TCP off loopback too.

    Raises:
        ConfigError: A bad address, an unknown channel, plain TCP off loopback, or TLS without certificates.
    """
    m = _ADDRESS_RE.match(spec) if isinstance(spec, str) else None
    example = f"{schemes[0]}://127.0.0.1:24224[=CHANNEL]"
    if m is None or int(m["port"]) > 65535:
        raise ConfigError(option, f"{spec!r}: give {'|'.join(schemes)}://HOST:PORT[=CHANNEL], e.g. {example}")
    scheme, host, port = m["scheme"], m["host"].strip("[]"), int(m["port"])
    if scheme not in schemes:
        raise ConfigError(option, f"{spec}: the scheme is one of {', '.join(schemes)}, not {scheme}")
    name = m["name"]
    if name is None:
        if len(names) != 1:
            raise ConfigError(option, f"{spec}: several channels are served ({', '.join(names)}): add =CHANNEL")
        name = names[0]
    elif name not in names:
        raise ConfigError(option, f"{spec}: no channel named {name!r} is served (served: {', '.join(names)})")
    if scheme == "tls" and not has_tls:
        raise ConfigError(option, f"{spec}: tls:// needs the agent's --tls-cert FILE and --tls-key FILE")
    if scheme == "tcp" and not is_loopback(host) and not insecure:
        raise ConfigError(
            option,
            f"{spec}: plain tcp:// is for a loopback address only (127.0.0.1, ::1, localhost); "
            f"off loopback use tls:// with --tls-cert and --tls-key (or, to run open on purpose, {INSECURE_FLAG})",
        )
    return SourceAddress(scheme, host, port, name)


def server_ssl_context(tls_cert: str, tls_key: str, client_ca: str | None) -> ssl.SSLContext:
    """The agent's TLS server context (mutual TLS with ``client_ca``).

    Raises:
        ConfigError: Unreadable or unsafe files, or files that are not PEM.
    """
    read_public_file(tls_cert, "tls_cert")
    read_secret_file(tls_key, "tls_key")  # the mode and owner checks; ssl reads the file itself
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(tls_cert, tls_key)
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(
            "tls_cert",
            f"{tls_cert} and {tls_key} are not a PEM certificate chain and its key ({exc.__class__.__name__})",
        ) from None
    if client_ca:
        read_public_file(client_ca, "client_ca")
        try:
            ctx.load_verify_locations(cafile=client_ca)
        except (ssl.SSLError, OSError):
            raise ConfigError("client_ca", f"{client_ca} is not a PEM CA certificate") from None
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def peer_name(transport: Any) -> str | None:
    """The name of a TLS transport's client certificate, by the agent's one rule (``auth.certificate_name``)."""
    return certificate_name(transport.get_extra_info("peercert") if transport is not None else None)


def gunzip_bounded(data: bytes, limit: int) -> bytes:
    """``data`` (one or more gzip members) decompressed, at most ``limit`` bytes.

    Raises:
        TooLargeError: The output would pass ``limit``.
        ValueError: Not gzip, or a truncated member.
    """
    out = bytearray()
    rest = data
    while rest:
        d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        try:
            chunk = d.decompress(rest, limit - len(out) + 1)
        except zlib.error as exc:
            raise ValueError(f"not gzip data: {exc}") from None
        out += chunk
        if len(out) > limit:
            raise TooLargeError(f"the data decompresses to more than {limit} bytes")
        if not d.eof:
            raise ValueError("a gzip member is truncated")
        rest = d.unused_data
    return bytes(out)


class Connection:
    """One client connection of a :class:`StreamListener`: reads under a deadline, writes, the peer's name."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, read_timeout: float) -> None:
        self.reader = reader
        self.writer = writer
        self.read_timeout = read_timeout
        self.peer = writer.get_extra_info("peername")
        self.name = peer_name(writer.transport)

    async def read(self, n: int) -> bytes:
        """Up to ``n`` bytes (b"" at the end of the stream).

        Raises:
            TimeoutError: Nothing arrived within ``read_timeout`` seconds.
        """
        try:
            return await asyncio.wait_for(self.reader.read(n), self.read_timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"nothing arrived within {self.read_timeout:g} s") from None

    async def write(self, data: bytes) -> None:
        """Send ``data`` (waiting, under the same deadline, while the client does not read)."""
        self.writer.write(data)
        try:
            await asyncio.wait_for(self.writer.drain(), self.read_timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"the client did not read an answer within {self.read_timeout:g} s") from None


Handler = Callable[[Connection], Awaitable[None]]


class StreamListener:
    """TCP/TLS servers on an event loop thread of their own; listening when made, stopped by :meth:`stop`.

    Attributes:
        ports: The bound port of each address, in order.
        pool: Threads for blocking work (commits); ``run`` hands a call to it.
    """

    def __init__(
        self,
        what: str,
        addresses: Sequence[tuple[str, int, ssl.SSLContext | None, Handler]],
        *,
        read_timeout: float,
        max_connections: int,
        workers: int = 8,
    ) -> None:
        self.what = what
        self._read_timeout = read_timeout
        self._slots = max_connections
        self._active = 0
        self.pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix=f"filechannel-{what}")
        self._loop = asyncio.new_event_loop()
        self._servers: list[asyncio.Server] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self.ports: list[int] = []
        failure: list[BaseException] = []
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            try:
                self._loop.run_until_complete(self._start(addresses))
            except OSError as exc:
                failure.append(exc)
            started.set()
            if failure:
                self._loop.close()
                return
            try:
                self._loop.run_forever()
            finally:
                self._loop.close()

        self._thread = threading.Thread(target=run, name=f"filechannel-{what}", daemon=True)
        self._thread.start()
        started.wait()
        if failure:
            self.pool.shutdown()
            raise ChannelError(f"cannot listen for {what}: {failure[0]}")

    async def _start(self, addresses: Sequence[tuple[str, int, ssl.SSLContext | None, Handler]]) -> None:
        try:
            for host, port, ctx, handler in addresses:
                srv = await asyncio.start_server(
                    self._wrap(handler),
                    host,
                    port,
                    ssl=ctx,
                    reuse_address=True,
                    ssl_handshake_timeout=self._read_timeout if ctx is not None else None,
                )
                self._servers.append(srv)
                self.ports.append(int(srv.sockets[0].getsockname()[1]))
        except BaseException:
            for srv in self._servers:
                srv.close()
            raise

    def _wrap(self, handler: Handler) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            if self._active >= self._slots:
                logger.warning(
                    "%s: refused a connection from %s: %d connections open (the limit)",
                    self.what,
                    writer.get_extra_info("peername"),
                    self._slots,
                )
                writer.close()
                return
            self._active += 1
            if task is not None:
                self._tasks.add(task)  # type: ignore[arg-type]
            try:
                await handler(Connection(reader, writer, self._read_timeout))
            except (ConnectionError, TimeoutError, ssl.SSLError) as exc:
                logger.info("%s: connection from %s closed: %s", self.what, writer.get_extra_info("peername"), exc)
            except Exception:
                logger.exception("%s: connection from %s failed", self.what, writer.get_extra_info("peername"))
            finally:
                self._active -= 1
                if task is not None:
                    self._tasks.discard(task)  # type: ignore[arg-type]
                writer.close()

        return serve

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in the pool (for blocking work such as a commit), awaited."""
        return await self._loop.run_in_executor(self.pool, fn, *args)

    async def _stop(self) -> None:
        for srv in self._servers:
            srv.close()
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=10)
        for srv in self._servers:
            await srv.wait_closed()

    def stop(self) -> None:
        """Stop listening and close the connections (idempotent); commits in flight finish."""
        if self._loop.is_closed():
            return
        fut = asyncio.run_coroutine_threadsafe(self._stop(), self._loop)
        try:
            fut.result(30)
        except (concurrent.futures.TimeoutError, RuntimeError) as exc:
            logger.warning("%s shutdown: %s", self.what, exc)
        self.pool.shutdown(wait=True)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
