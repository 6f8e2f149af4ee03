"""The syslog and RELP sources of a writable agent (``filechannel serve --syslog ... --relp ...``).

This module owns the listeners: threads that accept connections (TCP, TLS
with the agent's certificates, or UDP datagrams), read bytes under a deadline
and hand them to the sans-I/O parsers of ``syslog_wire.py``, then put what
came out into the channel, one transaction per read burst (the frames of one
``recv``). What it promises:

- syslog over TCP/TLS: nothing is acknowledged on the wire, so a burst that
  cannot be committed (a full channel, too little disk) is retried, holding
  the connection's reads meanwhile (TCP pushes back on the sender); a frame
  over ``max_event_size`` is skipped and counted, the connection goes on.
- syslog over UDP: lossy by nature; a datagram that cannot be committed at
  once is dropped and counted.
- RELP: each ``syslog`` command is answered ``rsp 200 OK`` only after the
  transaction holding its event committed durably (the channel's fsync
  returned), or ``rsp 500`` with a reason when it cannot be (full, too
  large, the channel failed). ``open`` is answered with the offers,
  ``close`` with an empty ``rsp`` (then the connection closes), and the agent
  sends ``serverclose`` to its sessions when it stops.

The TCP and TLS listeners are ``sources.StreamListener`` (shared with the
forward source): every connection has a read deadline (``read_timeout``: an
idle connection is closed after it), bounded memory (one read of 64 KiB plus
one frame of at most ``max_event_size``), each listener a bound on open
connections, and TLS listeners check client certificates against the agent's
CA, allow-list and writers list, as the HTTP source does. The counters are the
agent's ``filechannel_source_*`` family with ``source="syslog"`` or
``source="relp"``.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from filechannel.channel import FileChannel
from filechannel.errors import (
    ChannelClosedError,
    ChannelError,
    ChannelFullError,
    ConfigError,
    DiskSpaceError,
    EventTooLargeError,
)

from .auth import INSECURE_FLAG, host_port, is_loopback
from .sources import Connection, ConnectionSlots, StreamListener, server_ssl_context, source_metrics
from .syslog_wire import (
    INVALID,
    STATUS_HEADER,
    Frame,
    RelpFrame,
    RelpParser,
    RelpProtocolError,
    SyslogFramer,
    TooLarge,
    parse_syslog,
    relp_frame,
)

__all__ = [
    "ListenSpec",
    "SyslogSettings",
    "SyslogSources",
    "check_listener",
    "parse_listen_spec",
    "resolve",
    "start_syslog",
]

logger = logging.getLogger("filechannel.agent.syslog")

UDP_MAX = 65535
UDP_BURST = 256  # datagrams committed together at most
FULL_RETRY = 0.5  # seconds between commits of a burst the channel refused (syslog over TCP/TLS)
RELP_OFFERS = b"200 OK\nrelp_version=0\nrelp_software=filechannel\ncommands=syslog"


@dataclass(frozen=True)
class ListenSpec:
    """One ``--syslog`` or ``--relp`` value: ``SCHEME://HOST:PORT[=CHANNEL]``."""

    kind: str  # "syslog" or "relp"
    scheme: str  # tcp, tls, udp
    host: str
    port: int
    channel: str | None
    text: str


@dataclass(frozen=True)
class SyslogSettings:
    """The syslog and RELP listeners of an agent and their options (``AgentConfig.syslog``).

    Attributes:
        syslog: ``--syslog`` values: ``tcp://HOST:PORT[=CHANNEL]``, ``tls://...``, ``udp://...``.
        relp: ``--relp`` values: ``tcp://HOST:PORT[=CHANNEL]``, ``tls://...``.
        read_timeout: Seconds a connection may stay silent (and a TLS handshake may take)
            before it is closed.
        max_connections: Connections open at once per listener; more are closed at once.
        relp_full_wait: Seconds RELP holds the answers of messages a full channel (or low disk)
            refused, committing them again every 0.5 s, before it answers ``rsp 500``. rsyslog's
            ``omrelp`` takes a 500 as an error of the action, so waiting (its window then stops
            it sending) is the back-pressure it expects.
    """

    syslog: tuple[str, ...] = ()
    relp: tuple[str, ...] = ()
    read_timeout: float = 300.0
    max_connections: int = 256
    relp_full_wait: float = 60.0

    def specs(self) -> list[ListenSpec]:
        """The listeners, parsed, the options checked.

        Raises:
            ConfigError: A bad listener or option.
        """
        self.check()
        return [parse_listen_spec("syslog", x) for x in self.syslog] + [parse_listen_spec("relp", x) for x in self.relp]

    def check(self) -> None:
        """Raises ConfigError for a bad option."""
        if not isinstance(self.read_timeout, (int, float)) or not self.read_timeout > 0:
            raise ConfigError("syslog_read_timeout", f"must be a positive number of seconds, not {self.read_timeout!r}")
        if not isinstance(self.relp_full_wait, (int, float)) or not self.relp_full_wait >= 0:
            raise ConfigError("relp_full_wait", f"must be a number of seconds >= 0, not {self.relp_full_wait!r}")
        if type(self.max_connections) is not int or self.max_connections < 1:
            raise ConfigError("syslog_max_connections", f"must be a positive int, not {self.max_connections!r}")


def parse_listen_spec(kind: str, text: str) -> ListenSpec:
    """``tcp://HOST:PORT[=CHANNEL]`` (also ``tls://``, and ``udp://`` for syslog) as a :class:`ListenSpec`.

    Raises:
        ConfigError: Another scheme, no host or port, or a bad channel name.
    """
    schemes = ("tcp", "tls", "udp") if kind == "syslog" else ("tcp", "tls")
    example = f"--{kind} tcp://127.0.0.1:6514[=CHANNEL]"
    uri, sep, channel = text.rpartition("=") if "=" in text else (text, "", "")
    if sep and not channel:
        raise ConfigError(kind, f"{text!r}: give a channel name after '=', e.g. {example}")
    scheme = uri.split("://", 1)[0].lower() if "://" in uri else ""
    if scheme not in schemes:
        raise ConfigError(kind, f"{text!r}: the scheme is one of {', '.join(s + '://' for s in schemes)} ({example})")
    hp = host_port(uri)
    if hp is None:
        raise ConfigError(kind, f"{text!r}: give HOST:PORT, e.g. {example} (port 0 picks a free port)")
    return ListenSpec(kind, scheme, *hp, channel or None, text)


def check_listener(spec: ListenSpec, config: Any) -> None:
    """The agent's rules for a listener: plain only on loopback; a token or lists need client certificates.

    Raises:
        ConfigError: A listener the agent's ``config`` (an ``AgentConfig``) does not allow.
    """
    flag = spec.text
    insecure = bool(getattr(config, "insecure_allow_anyone", False))
    if spec.scheme == "tls" and not (config.tls_cert and config.tls_key):
        raise ConfigError(spec.kind, f"{flag}: tls:// needs the agent's --tls-cert FILE and --tls-key FILE")
    checks_certs = spec.scheme == "tls" and bool(config.client_ca)
    if checks_certs or insecure:
        return
    if not is_loopback(spec.host):
        raise ConfigError(
            spec.kind,
            f"{flag}: {spec.host} is reachable from other hosts and {spec.kind} clients are not authenticated: "
            f"use tls:// with --client-ca (or, to take {spec.kind} from anyone on purpose, {INSECURE_FLAG})",
        )
    if config.token_file or config.client_ca:
        raise ConfigError(
            spec.kind,
            f"{flag}: the agent authenticates its clients (--token-file, --client-ca), and {spec.kind} carries "
            f"no token: use tls:// with --client-ca so clients are checked by certificate (or {INSECURE_FLAG})",
        )
    if config.allow or config.writers:
        raise ConfigError(
            spec.kind,
            f"{flag}: the agent's --allow/--allow-writer lists name client certificates: use tls:// (with --client-ca)",
        )


@dataclass
class _Outcome:
    """What became of each event of a burst: None committed, else the reason (too_large, full, disk, failed)."""

    results: list[str | None]
    seconds: float = 0.0


class _Listener:
    """One syslog or RELP listener: a ``StreamListener`` (TCP, TLS) or a UDP socket, and the channel it puts into."""

    def __init__(
        self,
        spec: ListenSpec,
        served: Any,
        agent_config: Any,
        settings: SyslogSettings,
        metrics: Any,
        ssl_ctx: Any,
    ) -> None:
        self.spec = spec
        self.channel: FileChannel = served.channel
        self.name: str = served.name
        self.settings = settings
        self.metrics = metrics
        self.max_frame = self.channel.config.max_event_size
        self._stop = threading.Event()
        self._stream: StreamListener | None = None
        if spec.scheme != "udp":
            self._stream = StreamListener(
                spec.kind,
                spec.text,
                spec.host,
                spec.port,
                self._relp_session if spec.kind == "relp" else self._syslog_stream,
                ssl_ctx=ssl_ctx,
                read_timeout=settings.read_timeout,
                slots=ConnectionSlots(settings.max_connections),
                config=agent_config,
                cid=served.cid,
                metrics=metrics,
            )
            self.port = self._stream.port
            return
        self.sock = socket.socket(socket.AF_INET6 if ":" in spec.host else socket.AF_INET, socket.SOCK_DGRAM)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind((spec.host, spec.port))
        except OSError as exc:
            self.sock.close()
            raise ChannelError(f"cannot listen for {spec.kind} on {spec.text}: {exc.strerror or exc}") from None
        self.sock.settimeout(0.25)
        self.port = int(self.sock.getsockname()[1])
        self._thread = threading.Thread(target=self._udp_loop, name=f"filechannel-{spec.kind}-{self.port}", daemon=True)
        self._thread.start()

    # -- committing ----------------------------------------------------------------------------

    def commit(self, events: Sequence[tuple[bytes, dict[str, str]] | None]) -> _Outcome:
        """Put ``events`` (None: refused already) in transactions of at most ``transaction_capacity``.

        Returns each event's outcome. A full channel, too little disk or a failed
        channel refuses the events of the transaction that did not commit and of
        every one after it, so what commits is always a prefix (the order is kept).
        """
        results: list[str | None] = ["too_large" if e is None else None for e in events]
        cap = self.channel.config.transaction_capacity
        idx = [i for i, e in enumerate(events) if e is not None]
        t0 = time.monotonic()
        for k in range(0, len(idx), cap):
            chunk = idx[k : k + cap]
            try:
                with self.channel.transaction() as tx:
                    for i in chunk:
                        ev = events[i]
                        assert ev is not None
                        try:
                            tx.put(ev[0], headers=ev[1])
                        except EventTooLargeError:  # the headers made it too large: skipped like a long frame
                            results[i] = "too_large"
            except DiskSpaceError:  # a ChannelFullError of the disk kind: caught first
                reason = "disk"
            except ChannelFullError:
                reason = "full"
            except (ChannelClosedError, ChannelError, OSError) as exc:
                logger.error(
                    "--%s %s: a commit to channel %s failed: %s", self.spec.kind, self.spec.text, self.name, exc
                )
                reason = "failed"
            else:
                continue
            # This transaction did not commit: neither do the ones after it (the order of the
            # frames is kept; a retry commits them all in order).
            for i in idx[k:]:
                if results[i] is None:
                    results[i] = reason
            break
        took = time.monotonic() - t0
        committed = sum(1 for r in results if r is None)
        if committed:
            self.metrics.source_events.labels(self.spec.kind, self.name).inc(committed)
            self.metrics.put_committed(self.name, self.spec.kind, took)
        return _Outcome(results, took)

    def _count_frames(
        self, events: Sequence[tuple[bytes, dict[str, str]] | None], out: _Outcome, retrying: bool = False
    ) -> None:
        """Count refused frames (those to be retried not yet, when ``retrying``) and invalid ones committed."""
        for e, r in zip(events, out.results, strict=True):
            if r is not None and retrying and r != "too_large":
                continue
            if r is not None:
                self.metrics.source_refused.labels(self.spec.kind, self.name, r).inc()
            elif e is not None and e[1].get(STATUS_HEADER) == INVALID:
                self.metrics.source_invalid.labels(self.spec.kind, self.name).inc()

    # -- syslog over TCP / TLS ------------------------------------------------------------------

    def _syslog_stream(self, conn: Connection) -> None:
        framer = SyslogFramer(self.max_frame)
        while True:
            data = conn.read()
            if not data and self._stop.is_set():
                return  # the agent stops: a frame cut by it was never whole (the sender knows it was not read)
            items = framer.feed(data) if data else framer.end()
            if items:
                self._put_frames(items)
            if not data:
                return

    def _put_frames(self, items: Iterable[Frame | TooLarge]) -> None:
        events: list[tuple[bytes, dict[str, str]] | None] = []
        for it in items:
            if isinstance(it, TooLarge):
                events.append(None)
                logger.warning(
                    "--%s %s: skipped a frame of %d bytes (over max_event_size=%d)",
                    self.spec.kind,
                    self.spec.text,
                    it.size,
                    self.max_frame,
                )
            elif it.broken:
                events.append((it.data, {STATUS_HEADER: INVALID}))
            else:
                events.append(parse_syslog(it.data))
        pending = events
        while True:
            out = self.commit(pending)
            self._count_frames(pending, out, retrying=True)
            retry: list[tuple[bytes, dict[str, str]] | None] = [
                e for e, r in zip(pending, out.results, strict=True) if r in ("full", "disk", "failed")
            ]
            if not retry:
                return
            reason = next(r for r in out.results if r in ("full", "disk", "failed"))
            if reason == "failed" or self._stop.is_set():
                self.metrics.source_refused.labels(self.spec.kind, self.name, reason).inc(len(retry))
                raise OSError(f"{len(retry)} frame(s) not committed: the channel {reason}")
            logger.warning(
                "--%s %s: channel %s is %s: holding %d frame(s), reads paused",
                self.spec.kind,
                self.spec.text,
                self.name,
                "full" if reason == "full" else "short of disk space",
                len(retry),
            )
            self._stop.wait(FULL_RETRY)
            pending = retry

    # -- syslog over UDP ------------------------------------------------------------------------

    def _udp_loop(self) -> None:
        while not self._stop.is_set():
            try:
                data, _ = self.sock.recvfrom(UDP_MAX)
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                continue
            batch = [data]
            self.sock.setblocking(False)
            try:
                while len(batch) < UDP_BURST:
                    batch.append(self.sock.recvfrom(UDP_MAX)[0])
            except (BlockingIOError, OSError):
                pass
            finally:
                self.sock.settimeout(0.25)
            events: list[tuple[bytes, dict[str, str]] | None] = []
            for d in batch:
                d = d[:-1] if d.endswith(b"\n") else d
                events.append(None if len(d) > self.max_frame else parse_syslog(d))
            out = self.commit(events)
            self._count_frames(events, out)

    # -- RELP -----------------------------------------------------------------------------------

    def _relp_session(self, conn: Connection) -> None:
        closed = False
        try:
            closed = self._relp_frames(conn)
        finally:
            if self._stop.is_set() and not closed:  # the agent stops: tell the client (best effort)
                try:
                    conn.sock.settimeout(1.0)
                    conn.write(relp_frame(0, "serverclose"))
                except OSError:
                    pass

    def _relp_frames(self, conn: Connection) -> bool:
        """Answer the frames of one session until it ends; True when closed by either side's words."""
        parser = RelpParser(self.max_frame)
        opened = False
        while True:
            data = conn.read()
            if not data:
                return False
            try:
                frames = parser.feed(data)
            except RelpProtocolError as exc:
                conn.listener.count("protocol_error")
                logger.warning("--relp %s: %s sent a bad frame (%s): closed", self.spec.text, conn.peer, exc)
                conn.write(relp_frame(0, "serverclose"))
                return True
            out: list[bytes] = []
            batch: list[RelpFrame] = []
            for f in frames:
                if f.command == "syslog":
                    if not opened:
                        out += self._flush(batch)
                        batch = []
                        out.append(relp_frame(f.txnr, "rsp", b"500 the session is not open (send open first)"))
                    else:
                        batch.append(f)
                    continue
                out += self._flush(batch)
                batch = []
                if f.command == "open":
                    offers = f.data or b""
                    if b"commands=" in offers and b"syslog" not in offers.split(b"commands=", 1)[1].split(b"\n")[0]:
                        out.append(relp_frame(f.txnr, "rsp", b"500 this server takes the syslog command only"))
                    else:
                        opened = True
                        out.append(relp_frame(f.txnr, "rsp", RELP_OFFERS))
                elif f.command == "close":
                    out.append(relp_frame(f.txnr, "rsp"))
                    conn.write(b"".join(out))
                    return True
                else:
                    out.append(relp_frame(f.txnr, "rsp", b"500 unknown command " + f.command.encode()))
            out += self._flush(batch)
            if out:
                conn.write(b"".join(out))

    def _flush(self, frames: list[RelpFrame]) -> list[bytes]:
        """Commit the events of ``frames`` (one transaction) and return their answers, in order."""
        if not frames:
            return []
        events = [None if f.data is None else parse_syslog(f.data) for f in frames]
        results: list[str | None] = [None] * len(events)
        pending = list(range(len(events)))
        deadline = time.monotonic() + self.settings.relp_full_wait
        while True:
            out = self.commit([events[i] for i in pending])
            for i, r in zip(pending, out.results, strict=True):
                results[i] = r
            pending = [i for i in pending if results[i] in ("full", "disk")]
            # Full or short of disk: hold the answers (the client's window stops it) and try again,
            # up to relp_full_wait; then answer 500.
            if not pending or time.monotonic() >= deadline or self._stop.is_set():
                break
            self._stop.wait(FULL_RETRY)
        out = _Outcome(results)
        self._count_frames(events, out)
        answers = []
        for f, r in zip(frames, out.results, strict=True):
            if r is None:
                answers.append(relp_frame(f.txnr, "rsp", b"200 OK"))
            else:
                why = {
                    "too_large": f"500 the message is over max_event_size={self.max_frame} (not taken)",
                    "full": f"500 channel {self.name} is full: retry later (not taken)",
                    "disk": f"500 channel {self.name} is short of disk space (not taken)",
                    "failed": f"500 channel {self.name} failed (not taken)",
                }[r]
                answers.append(relp_frame(f.txnr, "rsp", why.encode()))
            self.metrics.source_responses.labels("relp", self.name, "200" if r is None else "500").inc()
        return answers

    # -- stopping -------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop accepting; end every connection (RELP sessions get ``serverclose``); wait for them."""
        self._stop.set()
        if self._stream is not None:
            self._stream.stop()
            return
        self.sock.close()
        self._thread.join(10)


class SyslogSources:
    """The syslog and RELP listeners of one agent (made by :func:`start_syslog`).

    Attributes:
        listeners: ``(spec, port)`` of each listener, in the order given.
    """

    def __init__(self, listeners: list[_Listener]) -> None:
        self._listeners = listeners

    @property
    def ports(self) -> list[int]:
        """The bound port of each listener, in the order given."""
        return [x.port for x in self._listeners]

    def stop(self) -> None:
        """Stop every listener (idempotent)."""
        for x in self._listeners:
            x.stop()

    close = stop


def resolve(settings: SyslogSettings, config: Any, channels: Iterable[Any]) -> list[tuple[ListenSpec, Any]]:
    """Each listener of ``settings`` with the served channel it puts into, every rule checked.

    ``channels``: the served channels (each with ``name`` and ``channel``, the owned
    ``FileChannel`` or None; ``server.check`` passes stand-ins with the options only).

    Raises:
        ConfigError: A bad spec or option, an unknown channel, an agent that is not writable, a
            listener the agent's authentication rules refuse, or RELP on a channel that does not
            fsync at commit.
    """
    by_name = {ch.name: ch for ch in channels}
    out = []
    for spec in settings.specs():
        flag = spec.text
        if spec.channel is None:
            if len(by_name) != 1:
                raise ConfigError(
                    spec.kind, f"{flag}: several channels are served ({', '.join(sorted(by_name))}): add =CHANNEL"
                )
            ch = next(iter(by_name.values()))
        else:
            found = by_name.get(spec.channel)
            if found is None:
                raise ConfigError(
                    spec.kind, f"{flag}: no channel named {spec.channel!r} (served: {', '.join(sorted(by_name))})"
                )
            ch = found
        if ch.channel is None:
            raise ConfigError(spec.kind, f"{flag}: the {spec.kind} source puts into the channel: add --writable")
        if spec.kind == "relp" and ch.channel.config.fsync != "commit":
            raise ConfigError(
                spec.kind,
                f"{flag}: RELP acknowledges durable commits only, and the channel's fsync is "
                f"{ch.channel.config.fsync!r}: use --fsync commit",
            )
        check_listener(spec, config)
        out.append((spec, ch))
    return out


def start_syslog(
    agent: Any,
    syslog: Iterable[str] = (),
    relp: Iterable[str] = (),
    settings: SyslogSettings | None = None,
) -> SyslogSources:
    """Start the syslog and RELP listeners of a writable agent: those of ``settings`` and ``syslog``/``relp``.

    The agent starts its own (``AgentConfig.syslog``) before it announces itself;
    this starts more on a running one.

    Raises:
        ConfigError: As :func:`resolve`.
        ChannelError: An address that cannot be bound.
    """
    settings = settings or SyslogSettings()
    settings = dataclasses.replace(settings, syslog=(*settings.syslog, *syslog), relp=(*settings.relp, *relp))
    config = agent.config
    resolved = resolve(settings, config, agent.channels.values())
    if not resolved:
        return SyslogSources([])
    metrics = source_metrics(agent)
    ctx = (
        server_ssl_context(config.tls_cert, config.tls_key, config.client_ca)
        if any(s.scheme == "tls" for s, _ in resolved)
        else None
    )
    listeners: list[_Listener] = []
    try:
        for spec, ch in resolved:
            lst = _Listener(spec, ch, config, settings, metrics, ctx if spec.scheme == "tls" else None)
            listeners.append(lst)
            logger.info("%s source on %s://%s:%d into channel %s", spec.kind, spec.scheme, spec.host, lst.port, ch.name)
    except BaseException:
        for lst in listeners:
            lst.stop()
        raise
    return SyslogSources(listeners)
