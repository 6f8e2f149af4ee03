"""What the agent's push sources share: addresses, TLS, metrics, bounded gunzip, and the TCP/TLS listener.

This module owns the pieces every network source of ``filechannel serve`` uses
(``--syslog``, ``--relp``, ``--forward``; OTLP shares the metrics), so each
protocol module holds only its own parser and answers:

- :func:`parse_source_address`: ``tcp://HOST:PORT[=CHANNEL]`` / ``tls://...``
  checked (plain TCP on a loopback address only, as for HTTP), the channel
  name resolved against the served channels (default: the only one).
- :func:`server_ssl_context`: the agent's certificate, key and client CA as an
  ``ssl.SSLContext`` (mutual TLS when a client CA is given); :func:`peer_name`
  the client certificate's name for the allow-lists (the same rule as Flight's).
- :func:`gunzip_bounded`: gzip members decompressed up to a limit, so a small
  compressed body never becomes an unbounded one.
- :func:`source_metrics`: the agent's ``AgentMetrics`` (made when the agent
  has no HTTP port), where every source counts into the one
  ``filechannel_source_*`` family with its ``source`` label.
- :class:`StreamListener`: one TCP or TLS listening socket and a thread per
  connection: at most ``max_connections`` open at once (a
  :class:`ConnectionSlots` may be shared by several listeners), the TLS
  handshake and every read and write under ``read_timeout``, each client
  certificate's name checked against the agent's ``--allow`` and
  ``--allow-writer`` lists, and each connection's outcome counted. The
  protocol's handler reads through :class:`Connection` (at most ``READ_SIZE``
  bytes a read, so a connection's memory is that plus what its parser holds).
"""

from __future__ import annotations

import logging
import re
import socket
import ssl
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from filechannel.errors import ChannelError, ConfigError

from .auth import (
    INSECURE_FLAG,
    allowed,
    certificate_name,
    is_loopback,
    may_write,
    read_public_file,
    read_secret_file,
)

__all__ = [
    "CHANNEL_HEADER",
    "READ_SIZE",
    "Connection",
    "ConnectionSlots",
    "SourceAddress",
    "StreamListener",
    "TooLargeError",
    "gunzip_bounded",
    "parse_source_address",
    "peer_name",
    "server_ssl_context",
    "source_metrics",
]

logger = logging.getLogger("filechannel.agent.sources")

CHANNEL_HEADER = "X-Filechannel-Channel"  # the HTTP header naming a channel (OTLP)
READ_SIZE = 65536  # the most one read of a connection takes
ACCEPT_POLL = 0.25  # seconds between looks at the stop flag while accepting
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


def peer_name(sock: socket.socket) -> str | None:
    """The name of a TLS socket's client certificate, by the agent's one rule (``auth.certificate_name``)."""
    return certificate_name(sock.getpeercert()) if isinstance(sock, ssl.SSLSocket) else None


def source_metrics(agent: Any) -> Any:
    """The agent's ``AgentMetrics`` (``metrics.py``), made now when it has none (no ``--http``: counted, not served)."""
    metrics = getattr(agent, "metrics", None)
    if metrics is None:
        from .metrics import AgentMetrics

        metrics = agent.metrics = AgentMetrics(lambda: [])
    return metrics


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
    """One client connection of a :class:`StreamListener`: blocking reads and writes under its deadline.

    Attributes:
        peer: The client's address.
        name: Its certificate's name (None without TLS or a client certificate).
        listener: The listener that accepted it (its ``stopping`` event, its ``count``).
    """

    def __init__(self, sock: socket.socket, peer: Any, name: str | None, listener: StreamListener) -> None:
        self.sock = sock
        self.peer = peer
        self.name = name
        self.listener = listener

    def read(self, n: int = READ_SIZE) -> bytes:
        """Up to ``n`` bytes (b"" at the end of the stream).

        Raises:
            TimeoutError: Nothing arrived within the listener's ``read_timeout``.
        """
        return self.sock.recv(min(n, READ_SIZE))

    def write(self, data: bytes) -> None:
        """Send ``data`` (TimeoutError when the client reads none of it within ``read_timeout``)."""
        self.sock.sendall(data)


Handler = Callable[[Connection], None]


class ConnectionSlots:
    """A bound on the connections open at once, shared by the listeners that take from it."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._open = 0
        self._lock = threading.Lock()

    def take(self) -> bool:
        """Take a slot; False when ``limit`` connections are open."""
        with self._lock:
            if self._open >= self.limit:
                return False
            self._open += 1
            return True

    def give(self) -> None:
        """Give a slot back (the connection closed)."""
        with self._lock:
            self._open -= 1


class StreamListener:
    """One TCP/TLS listening socket of a source and a thread per connection; listening when made.

    Each accepted connection takes a slot of ``slots`` (over the limit: closed
    at once, counted ``over_limit``), gets ``read_timeout`` on its handshake
    and on every read and write, and with TLS has its certificate's name
    checked by the agent's rules for ``cid`` (``allowed`` and ``may_write``:
    refused ones are closed, counted ``refused_certificate``); then
    ``handler`` serves it. The outcomes go to
    ``filechannel_source_connection_outcomes_total{source, transport, outcome}``
    and the open connections to ``filechannel_source_connections{source}``.

    Attributes:
        port: The bound port.
        stopping: Set by :meth:`stop` (a handler seeing its stream end then knows why).
    """

    def __init__(
        self,
        source: str,
        text: str,
        host: str,
        port: int,
        handler: Handler,
        *,
        ssl_ctx: ssl.SSLContext | None,
        read_timeout: float,
        slots: ConnectionSlots,
        config: Any,
        cid: str,
        metrics: Any,
    ) -> None:
        self.source = source
        self.text = text
        self.transport = "tls" if ssl_ctx is not None else "tcp"
        self._handler = handler
        self._ssl_ctx = ssl_ctx
        self._read_timeout = read_timeout
        self._slots = slots
        self._config = config
        self._cid = cid
        self._metrics = metrics
        self.stopping = threading.Event()
        self._conns: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind((host, port))
            self.sock.listen(128)
        except OSError as exc:
            self.sock.close()
            raise ChannelError(f"cannot listen for {source} on {text}: {exc.strerror or exc}") from None
        self.sock.settimeout(ACCEPT_POLL)
        self.port = int(self.sock.getsockname()[1])
        self._thread = threading.Thread(target=self._accept_loop, name=f"filechannel-{source}-{self.port}", daemon=True)
        self._thread.start()

    def count(self, outcome: str) -> None:
        """Count one connection's ``outcome`` (accepted, over_limit, tls_failed, refused_certificate, ...)."""
        self._metrics.source_connection_outcomes.labels(self.source, self.transport, outcome).inc()

    def _accept_loop(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, addr = self.sock.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self.stopping.is_set():
                    return
                logger.warning("--%s %s: accept failed: %s", self.source, self.text, exc)
                time.sleep(0.1)
                continue
            if not self._slots.take():
                self.count("over_limit")
                logger.warning(
                    "--%s %s: refused %s: %d connections open (the limit)",
                    self.source,
                    self.text,
                    addr,
                    self._slots.limit,
                )
                conn.close()
                continue
            th = threading.Thread(target=self._connection, args=(conn, addr), daemon=True)
            with self._lock:
                self._conns.add(conn)
                self._threads.add(th)
            th.start()

    def _connection(self, conn: socket.socket, addr: Any) -> None:
        sock: socket.socket = conn
        gauge = self._metrics.source_connections.labels(self.source)
        gauge.inc()
        try:
            conn.settimeout(self._read_timeout)
            # Answers (acks, rsp frames) are small and awaited by the client: send each at once (no Nagle delay).
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._ssl_ctx is not None:
                try:
                    sock = self._ssl_ctx.wrap_socket(conn, server_side=True)
                except (ssl.SSLError, OSError) as exc:
                    self.count("tls_failed")
                    logger.warning("--%s %s: TLS handshake with %s failed: %s", self.source, self.text, addr, exc)
                    return
                with self._lock:
                    self._conns.discard(conn)
                    self._conns.add(sock)
            name = peer_name(sock)
            if not allowed(self._config.allow, self._cid, name) or not may_write(self._config.writers, name):
                self.count("refused_certificate")
                logger.warning(
                    "--%s %s: refused certificate name %r for channel %s (--allow / --allow-writer)",
                    self.source,
                    self.text,
                    name,
                    self._cid,
                )
                return
            self.count("accepted")
            self._handler(Connection(sock, addr, name, self))
        except TimeoutError:
            self.count("timeout")
            logger.info("--%s %s: %s silent for %g s: closed", self.source, self.text, addr, self._read_timeout)
        except (OSError, ssl.SSLError) as exc:
            if not self.stopping.is_set():
                logger.info("--%s %s: connection from %s ended: %s", self.source, self.text, addr, exc)
        except Exception:
            logger.exception("--%s %s: connection from %s failed", self.source, self.text, addr)
        finally:
            gauge.dec()
            self._slots.give()
            with self._lock:
                self._conns.discard(sock)
                self._conns.discard(conn)
                self._threads.discard(threading.current_thread())
            try:
                sock.close()
            except OSError:
                pass

    def stop(self) -> None:
        """Stop accepting; end every connection (its reads see the end of the stream); wait for them (idempotent)."""
        self.stopping.set()
        self.sock.close()
        self._thread.join(10)
        with self._lock:
            conns = list(self._conns)
            threads = list(self._threads)
        for c in conns:
            try:  # wake the reader: it sees the end of its stream (commits in flight finish first)
                socket.socket.shutdown(c, socket.SHUT_RD)
            except OSError:
                pass
        for th in threads:
            th.join(10)
