"""The agent: an Arrow Flight server for the channels of one host (``filechannel serve``).

This module owns the server side of the wire format in ``protocol.py``. It is
a thin shell over :class:`filechannel.ChannelReader`: every channel is read
through a lock-free view (so the owner may have it open or not), every
consumer through a reader of its own name and identity; acknowledgements go
through ``ChannelReader.ack`` (durable, cumulative, idempotent). A read of
``[start, end)`` asks the view for its segments (which checks the range
against what the channel holds) and sends each segment's bytes as they are on
disk, read with one ``pread``: no per-event Python here, and every record is
checked again by the client (``reader.decode_segment``). Clients name channel
ids and positions, never paths.

Writes (``writable``, opt-in): the agent opens each channel as its owner
(``filechannel.open``, taking the lock; readers keep working) and ``DoPut``
turns one stream into one channel transaction that also records the
producer's sequence number in a mark (``producer:<id>``, with the certificate
name that owns the id: another certificate's put under it is refused),
acknowledged only after the durable commit. A (producer, sequence) at or
below the committed one is acknowledged again without a put: a retry after a
timeout, a lost answer or an agent crash is never put twice, because the mark
and the events commit together (the crash-point harness checks marks at every
persistence point).

HTTP (``web.py``, opt-in with ``http``): the HTTP source, ``/metrics`` and
health checks on a port of their own; Flight calls count into its metrics.

Security (``auth.py``): TLS off loopback, mutual TLS with a client CA, an
optional certificate-name allow-list per channel, an optional bearer token
checked by middleware before any handler runs; an address other hosts reach
needs client authentication (or ``insecure_allow_anyone``); a unix socket is
mode 0600. :func:`check` is ``serve --check``: the start's checks, as a dry run.

Its rooms: each served channel (view, readers, owned channel, producers'
puts) is ``served.ServedChannel``; the Arrow side of the streams (put and
stage streams read and checked, a segment as the batch DoGet sends) is
``streams.py``'s; the Spark sink's staging area is ``staging.py``'s.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pyarrow as pa
import pyarrow.flight as fl

from filechannel._fs import DEFAULT_FS, is_locked, replace_durably
from filechannel._version import __version__
from filechannel.channel import channel_config, open_channel
from filechannel.consumers import validate_name
from filechannel.crypto import Encryption, as_encryption
from filechannel.directory import CHANNEL_FILE, LOCK_FILE, decode_channel_file, lock_holder
from filechannel.errors import (
    ChannelError,
    ChannelLockedError,
    ConfigError,
    ConsumerIdentityError,
    DataLossError,
)
from filechannel.reader import channel_id_of
from filechannel.sources.tail import TailSource, make_tails
from filechannel.staged import DEFAULT_STALE_STAGING

from . import protocol as proto
from .auth import (
    Listen,
    allowed,
    check_reachable,
    consumer_allowed,
    make_token_middleware,
    may_write,
    parse_uri,
    read_public_file,
    read_secret_file,
    read_token,
)
from .errors import AgentError, AgentProtocolError, UnknownChannelError
from .idempotency import KeyOwnerError
from .served import ServedChannel
from .staging import StageRequest
from .streams import read_put_stream, segment_batch, stream_events
from .syslog_source import SyslogSources, resolve, start_syslog

__all__ = ["Agent", "AgentConfig", "check", "serve"]

logger = logging.getLogger("filechannel.agent")


@dataclass(frozen=True)
class AgentConfig:
    """What an agent serves and how (file paths only: secrets are read when the agent starts).

    Attributes:
        directories: The channel directories served (each channel id once).
        listen: ``grpc+tls://HOST:PORT``, ``grpc://127.0.0.1:PORT`` (loopback only) or ``grpc+unix:///PATH``.
        tls_cert, tls_key: The agent's certificate chain and private key (PEM), for ``grpc+tls``.
        client_ca: Require client certificates signed by this CA (mutual TLS).
        token_file: Require ``authorization: Bearer <token>`` with the token in this file (mode 0600).
        allow: Certificate names allowed per channel id (``"*"``: every channel); needs ``client_ca``.
            Empty: every certificate the CA signed is let in.
        consumers: The consumer names a certificate name may act as (register, read under,
            acknowledge for), by certificate name; a name not listed may use only consumers no listed
            name owns. Needs ``client_ca``.
        writers: The certificate names that may write (``DoPut`` puts, the Spark sink's stage
            and commit, HTTP posts); empty: every name let in may. Needs ``client_ca``.
        keystore: The keystore of encrypted channels (the agent's readers check batches with it;
            records still travel sealed and clients decrypt them).
        port_file: Write the bound port here (atomically) once listening.
        on_corruption: The readers' policy, ``"fail"`` (default) or ``"skip"``.
        writable: Open every channel as its owner and accept puts (``DoPut``); off by default.
        channel_options: Options of ``filechannel.open`` for the owned channels (``capacity``, ...).
        names: A channel's name by its directory as given (default: the directory's base name);
            the HTTP port's URLs use it.
        http: Also serve HTTP (the HTTP source, ``/metrics``, health checks; ``web.py``) with these
            settings (an ``HttpSettings``); TLS, the token and the allow-list apply there too.
        insecure_allow_anyone: Listen on an address other hosts reach without authenticating clients
            (neither ``client_ca`` nor ``token_file``); refused unless this is set.
        tail: Follow files into the channels (``--tail GLOB`` / ``NAME=GLOB``; ``sources/tail.py``); needs ``writable``.
        tail_options: Options of the tail sources (``TailSource``'s keyword arguments, e.g. ``follow_symlinks``).
        forward: Take Fluent's forward protocol (``--forward``; ``forward.py``, needs msgpack) with these
            settings (a ``ForwardSettings``); needs ``writable``.
        syslog: The syslog and RELP sources (``--syslog``, ``--relp``): a ``syslog_source.SyslogSettings``;
            needs ``writable``.
    """

    directories: tuple[str, ...]
    listen: str
    tls_cert: str | None = None
    tls_key: str | None = None
    client_ca: str | None = None
    token_file: str | None = None
    allow: Mapping[str, Collection[str]] = field(default_factory=dict)
    consumers: Mapping[str, Collection[str]] = field(default_factory=dict)
    writers: Collection[str] = frozenset()
    keystore: str | None = None
    port_file: str | None = None
    on_corruption: str = "fail"
    writable: bool = False
    channel_options: Mapping[str, Any] = field(default_factory=dict)
    names: Mapping[str, str] = field(default_factory=dict)
    http: Any = None
    insecure_allow_anyone: bool = False
    tail: tuple[str, ...] = ()
    tail_options: Mapping[str, Any] = field(default_factory=dict)
    forward: Any = None
    syslog: Any = None

    def parsed_listen(self) -> Listen:
        """The listen URI, checked together with the TLS options.

        Raises:
            ConfigError: A bad URI, TLS options missing for ``grpc+tls`` or given without it,
                an allow-list without ``client_ca``, bad HTTP settings, or an address other hosts
                reach without client authentication (and not ``insecure_allow_anyone``).
        """
        listen = parse_uri(self.listen, "listen")
        if listen.tls and not (self.tls_cert and self.tls_key):
            raise ConfigError("tls_cert", f"{self.listen}: grpc+tls needs --tls-cert FILE and --tls-key FILE")
        if not listen.tls and self.http is None:  # the HTTP port uses the TLS options on its own
            for option, value in (
                ("tls_cert", self.tls_cert),
                ("tls_key", self.tls_key),
                ("client_ca", self.client_ca),
            ):
                if value:
                    raise ConfigError(option, f"applies to grpc+tls:// only, and the agent listens on {self.listen}")
        if self.allow and not self.client_ca:
            raise ConfigError("allow", "certificate names come from client certificates: give --client-ca FILE too")
        if self.writers and not self.client_ca:
            raise ConfigError("writers", "certificate names come from client certificates: give --client-ca FILE too")
        if self.consumers and not self.client_ca:
            raise ConfigError("consumers", "certificate names come from client certificates: give --client-ca FILE too")
        for names in self.consumers.values():
            for consumer in names:
                try:
                    validate_name(consumer)
                except ConfigError as exc:
                    raise ConfigError("consumers", f"{consumer!r}: {exc.reason}") from None
        if self.port_file and listen.scheme == "grpc+unix":
            raise ConfigError("port_file", "a grpc+unix agent has no port")
        if not self.directories:
            raise ConfigError("directories", "give at least one channel directory")
        hosts = {"listen": listen.host} if listen.scheme != "grpc+unix" else {}
        if self.http is not None:
            hosts["http"] = self.http.check(bool(self.tls_cert and self.tls_key))[0]
        check_reachable(hosts, self.client_ca, self.token_file, self.insecure_allow_anyone)
        return listen


def _load(config: AgentConfig, d: str, encryption: Encryption | None) -> ServedChannel:
    """Channel directory ``d`` of ``config``, read only: its id, channel file and name (the view not loaded)."""
    directory = os.path.abspath(d)
    cid = channel_id_of(directory).hex()
    _, crc_kind, _ = decode_channel_file(_read(os.path.join(directory, CHANNEL_FILE)))
    ch = ServedChannel(directory, cid, crc_kind, encryption, config.on_corruption)
    ch.name = config.names.get(d, ch.name)
    return ch


def _owner_options(config: AgentConfig, encryption: Encryption | None) -> dict[str, Any]:
    """The options of ``filechannel.open`` for the channels a writable agent owns."""
    opts = {"on_corruption": config.on_corruption, **config.channel_options}
    if encryption is not None:
        opts["encryption"] = encryption
    return opts


def _same_channel(served: Mapping[str, ServedChannel], ch: ServedChannel) -> None:
    if ch.cid in served:
        raise ConfigError(
            "directories",
            f"{served[ch.cid].directory} and {ch.directory} are the same channel (id {ch.cid}): serve one",
        )


def _open_channels(config: AgentConfig) -> dict[str, ServedChannel]:
    encryption = as_encryption(config.keystore) if config.keystore else None
    served: dict[str, ServedChannel] = {}
    for d in config.directories:
        ch = _load(config, d, encryption)
        _same_channel(served, ch)
        if config.writable:
            try:
                ch.channel = open_channel(ch.directory, **_owner_options(config, encryption))
            except BaseException:
                for other in served.values():
                    if other.channel is not None:
                        other.channel.close()
                raise
        ch.view.available()  # load now: a missing key or damage fails the start, not the first call
        served[ch.cid] = ch
    return served


def _read(path: str) -> bytes:
    from filechannel._fs import read_file

    return read_file(DEFAULT_FS, path)


def _https(config: AgentConfig) -> None:
    """Check the HTTP port's TLS context (when it has one)."""
    if config.http is not None and config.tls_cert and config.tls_key:
        _http_module().ssl_context(config)


def _token(config: AgentConfig) -> bytes | None:
    return read_token(config.token_file, "token_file") if config.token_file else None


def _start_checks(config: AgentConfig) -> tuple[Listen, list[Any], bytes | None, bytes | None]:
    """What a start checks before it opens a channel: the options, the TLS files, the token (:func:`check` too).

    Returns ``(listen, certificate pairs, client CA, token)``.
    """
    listen = config.parsed_listen()
    certs, client_ca = _tls_material(config)
    _https(config)
    return listen, certs, client_ca, _token(config)


def _http_module() -> Any:
    try:
        from . import web
    except ImportError as exc:
        raise ConfigError(
            "http",
            f"the HTTP port needs aiohttp and prometheus_client ({exc}): pip install '.[agent]' in filechannel's clone",
        ) from None
    return web


def check(config: AgentConfig) -> tuple[dict[str, Any], list[Exception]]:
    """What an agent with ``config`` would serve, and every problem its start would meet (``serve --check``).

    A dry run: the same checks as a start (:func:`_start_checks`, the channels'
    ids, channel files, keys and data as their views load them, the HTTP names,
    the tail sources as :func:`make_tails` makes them), except that it opens no
    channel as owner; for a writable agent it checks the
    channel options and that no other process holds a channel's lock instead. It
    writes nothing, binds nothing, takes no lock and applies no consumer's
    acknowledgement. Returns ``(summary, problems)``: each problem is the
    exception the start would raise (``ConfigError``, ``ChannelError``, ``OSError``).
    """
    problems: list[Exception] = []

    def attempt(fn: Any) -> Any:
        try:
            return fn()
        except (ChannelError, OSError) as exc:
            problems.append(exc)
            return None

    listen = attempt(config.parsed_listen)  # the steps of _start_checks, each on its own
    if attempt(lambda: _tls_material(config)) is not None:
        attempt(lambda: _https(config))
    attempt(lambda: _token(config))
    encryption = attempt(lambda: as_encryption(config.keystore)) if config.keystore else None
    key_ok = not config.keystore or encryption is not None
    options = attempt(lambda: channel_config(_owner_options(config, encryption))) if config.writable else None
    served: dict[str, ServedChannel] = {}
    channels: list[dict[str, Any]] = []

    def one(d: str) -> None:
        ch = _load(config, d, encryption)
        _same_channel(served, ch)
        served[ch.cid] = ch
        lock = os.path.join(ch.directory, LOCK_FILE)
        if config.writable and is_locked(lock):
            raise ChannelLockedError(ch.directory, lock_holder(DEFAULT_FS, lock))
        try:
            ch.view.available()
            channels.append(ch.describe() | {"directory": ch.directory})
        finally:
            ch.view.close()

    for d in config.directories:
        if key_ok:
            attempt(lambda d=d: one(d))
    if config.http is not None:
        attempt(lambda: _http_module().check_names((ch.name, ch.directory) for ch in served.values()))
    if (config.tail or config.syslog is not None) and len(served) == len(config.directories):
        # The tail sources are made (not started) as a start makes them, each over a stand-in of the
        # channel it would own: its options, nothing opened; the syslog listeners checked on them too.
        stand_ins = [
            SimpleNamespace(name=ch.name, channel=SimpleNamespace(config=options) if options is not None else None)
            for ch in served.values()
        ]
        if config.tail and (not config.writable or options is not None):
            attempt(lambda: make_tails(stand_ins, config.tail, **config.tail_options))
        if config.syslog is not None and (not config.writable or options is not None):
            attempt(lambda: resolve(config.syslog, config, stand_ins))
    if config.forward is not None and len(served) == len(config.directories):
        attempt(lambda: _forward_module().check_forward(config, [ch.name for ch in served.values()], config.forward))
    summary = {
        "listen": listen.location() if listen is not None else config.listen,
        "tls": bool(listen is not None and listen.tls),
        "mutual_tls": bool(config.client_ca),
        "token": bool(config.token_file),
        "allow": {k: sorted(v) for k, v in config.allow.items()},
        "consumers": {k: sorted(v) for k, v in config.consumers.items()},
        "writers": sorted(config.writers),
        "channels": channels,
    }
    return summary, problems


def _forward_module() -> Any:
    """``forward.py`` (it needs msgpack, imported only for ``--forward``)."""
    try:
        from . import forward
    except ImportError as exc:
        raise ConfigError(
            "forward", f"needs msgpack ({exc}): pip install '.[sources]' in filechannel's clone"
        ) from None
    return forward


def _tls_material(config: AgentConfig) -> tuple[list[Any], bytes | None]:
    if not config.tls_cert or not config.tls_key:
        return [], None
    cert = read_public_file(config.tls_cert, "tls_cert")
    key = read_secret_file(config.tls_key, "tls_key")
    ca = read_public_file(config.client_ca, "client_ca") if config.client_ca else None
    return [fl.CertKeyPair(cert, key)], ca


def _bind_unix(make: Callable[[str], Any], path: str) -> tuple[Any, tuple[str, int]]:
    """A server made by ``make(uri)`` on the unix socket ``path``, mode 0600 whatever the umask.

    gRPC creates the socket with the process's umask (0777 under umask 000), so
    it binds inside a fresh directory of mode 0700 next to ``path`` (no other
    user can reach the socket there), sets the socket's mode to 0600 and renames
    it into place. Returns the server and the socket's ``(path, inode)``.
    """
    parent = os.path.dirname(path) or "."
    try:
        private = tempfile.mkdtemp(prefix=".fc", dir=parent)  # mode 0700
    except OSError as exc:
        raise OSError(exc.errno, f"cannot make a private directory in {parent}: {exc.strerror}") from None
    inner = os.path.join(private, "s")
    try:
        server = make(f"grpc+unix://{inner}")
        try:
            DEFAULT_FS.chmod(inner, 0o600)
            DEFAULT_FS.replace(inner, path)
            ino = os.lstat(path).st_ino
        except BaseException:
            server.shutdown()
            raise
    finally:
        try:
            os.rmdir(private)
        except OSError:
            pass
    return server, (path, ino)


def _flight_error(exc: ChannelError) -> fl.FlightServerError:
    msg = exc.reason if isinstance(exc, AgentError) else str(exc)
    return fl.FlightServerError(msg, extra_info=proto.encode_error(exc))


class _FlightServer(fl.FlightServerBase):  # type: ignore[misc]
    """The Flight service; every handler is short and maps channel errors to Flight errors."""

    def __init__(self, agent: Agent, location: str, **kwargs: Any) -> None:
        self._agent = agent
        super().__init__(location, **kwargs)

    # -- helpers ---------------------------------------------------------------------------

    def _peer(self, context: Any) -> str | None:
        ident = context.peer_identity()
        if not ident:
            return None
        return ident.decode("utf-8", "replace") if isinstance(ident, bytes) else str(ident)

    def _visible(self, context: Any) -> list[ServedChannel]:
        peer = self._peer(context)
        return [ch for cid, ch in self._agent.channels.items() if allowed(self._agent.config.allow, cid, peer)]

    def _channel(self, context: Any, cid: object) -> ServedChannel:
        if not isinstance(cid, str):
            raise AgentProtocolError("", "the request names no channel")
        ch = self._agent.channels.get(cid.lower())
        if ch is None:
            raise UnknownChannelError("", cid, sorted(c.cid for c in self._visible(context)))
        peer = self._peer(context)
        if not allowed(self._agent.config.allow, ch.cid, peer):
            logger.warning("refused certificate name %r for channel %s (%s)", peer, ch.cid, context.peer())
            raise fl.FlightUnauthorizedError(
                f"certificate name {peer!r} is not allowed to use channel {ch.cid} (the agent's --allow list)"
            )
        return ch

    def _writable(self, context: Any, cid: object) -> ServedChannel:
        """:meth:`_channel`, for a call that writes: refused to a certificate name not in ``writers``."""
        ch = self._channel(context, cid)
        peer = self._peer(context)
        if not may_write(self._agent.config.writers, peer):
            logger.warning("refused certificate name %r a write to channel %s (%s)", peer, ch.cid, context.peer())
            raise fl.FlightUnauthorizedError(
                f"certificate name {peer!r} may not write to channel {ch.cid} (the agent's --allow-writer list)"
            )
        return ch

    def _run(self, what: str, context: Any, fn: Any) -> Any:
        metrics = self._agent.metrics
        self._agent.connections.seen("flight", context.peer())
        try:
            result = fn()
        except fl.FlightError:
            if metrics is not None:
                metrics.flight_call(what, "denied")
            raise
        except KeyOwnerError as exc:  # a key (producer id, sink query id) of another certificate
            if metrics is not None:
                metrics.flight_call(what, "denied")
            raise fl.FlightUnauthorizedError(str(exc)) from None
        except ChannelError as exc:
            if metrics is not None:
                metrics.flight_call(what, "refused")
            logger.info(
                "%s from %s refused: %s", what, context.peer(), exc.reason if isinstance(exc, AgentError) else exc
            )
            raise _flight_error(exc) from None
        except OSError as exc:
            if metrics is not None:
                metrics.flight_call(what, "error")
            logger.error("%s from %s failed: %s", what, context.peer(), exc)
            raise fl.FlightInternalError(f"{what}: {exc.strerror or type(exc).__name__} on the agent") from None
        if metrics is not None:
            metrics.flight_call(what, "ok")
        return result

    # -- discovery -------------------------------------------------------------------------

    def _info(self, ch: ServedChannel) -> Any:
        with ch.lock:
            start, end = ch.view.available()
        meta = {"v": proto.WIRE_VERSION, "channel": ch.cid, "name": ch.name, "start": start, "end": end}
        meta["agent"] = __version__
        return fl.FlightInfo(
            proto.batch_schema(ch.cid, ch.crc_kind),
            fl.FlightDescriptor.for_path(ch.cid),
            [],
            end - start,
            -1,
            app_metadata=json.dumps(meta, sort_keys=True).encode(),
        )

    def list_flights(self, context: Any, criteria: bytes) -> Iterator[Any]:
        infos = self._run("list_flights", context, lambda: [self._info(ch) for ch in self._visible(context)])
        yield from infos

    def get_flight_info(self, context: Any, descriptor: Any) -> Any:
        def go() -> Any:
            path = descriptor.path or []
            if len(path) != 1:
                raise AgentProtocolError("", "a descriptor is the path [channel id]")
            cid = path[0].decode() if isinstance(path[0], bytes) else str(path[0])
            return self._info(self._channel(context, cid))

        return self._run("get_flight_info", context, go)

    # -- reads -----------------------------------------------------------------------------

    def do_get(self, context: Any, ticket: Any) -> Any:
        def go() -> Any:
            cid, start, end, max_bytes = proto.decode_ticket(ticket.ticket)
            ch = self._channel(context, cid)
            with ch.lock:
                segments = ch.view.segments(start, end, max_bytes) if end > start else []
            schema = proto.batch_schema(ch.cid, ch.crc_kind)
            batches = [segment_batch(schema, s) for s in segments]
            logger.debug("do_get %s [%d, %d): %d segments to %s", cid, start, end, len(segments), context.peer())
            return fl.RecordBatchStream(pa.Table.from_batches(batches, schema=schema))

        return self._run("do_get", context, go)

    # -- writes ----------------------------------------------------------------------------

    def do_put(self, context: Any, descriptor: Any, reader: Any, writer: Any) -> None:
        def go() -> dict[str, Any]:
            if proto.command_op(descriptor.command or b"") == "stage":
                return self._sink_stage(context, descriptor.command, reader)
            cid, producer, sequence = proto.decode_put_command(descriptor.command or b"")
            ch = self._writable(context, cid)
            if ch.channel is None:
                raise AgentError("", f"channel {ch.cid} is served read-only: start the agent with --writable to put")
            bodies, headers = read_put_stream(reader, ch.channel.config)
            t0 = time.monotonic()
            result: dict[str, Any] = ch.put(producer, sequence, bodies, headers, owner=self._peer(context))
            if self._agent.metrics is not None and not result["duplicate"]:
                self._agent.metrics.put_committed(ch.name, "flight", time.monotonic() - t0)
            logger.debug("do_put %s producer %r sequence %d: %s", cid, producer, sequence, result)
            return result

        result = self._run("do_put", context, go)
        writer.write(pa.py_buffer(json.dumps(result, sort_keys=True).encode()))

    # -- actions ---------------------------------------------------------------------------

    def list_actions(self, context: Any) -> list[tuple[str, str]]:
        return [*proto.ACTIONS.items(), *proto.SINK_ACTIONS.items()]

    def do_action(self, context: Any, action: Any) -> Iterator[bytes]:
        kind = action.type

        def go() -> dict[str, Any]:
            body = action.body.to_pybytes() if action.body is not None else b""
            req = proto.decode_json(body or b"{}", f"the {kind!r} request")
            if kind == "status":
                chans = self._visible(context)
                out = []
                for ch in chans:
                    with ch.lock:
                        out.append(ch.status())
                return {
                    "agent": self._agent.location,
                    "version": __version__,
                    "channels": out,
                    "connections": self._agent.connections.counts(),
                }
            if kind in proto.SINK_ACTIONS:
                return self._sink_action(context, kind, req)
            if kind not in proto.ACTIONS:
                raise AgentProtocolError("", f"no action {kind!r} (there are: {', '.join(proto.ACTIONS)})")
            ch = self._channel(context, req.get("channel"))
            consumer = proto.str_field(req, "consumer", required=kind != "available")
            identity = proto.str_field(req, "identity", required=False)
            with ch.lock:
                if kind == "available" and consumer is None:
                    start, end = ch.view.available()
                    return {"start": start, "end": end}
                assert consumer is not None
                validate_name(consumer)
                peer = self._peer(context)
                if not consumer_allowed(self._agent.config.consumers, peer, consumer):
                    logger.warning("refused certificate name %r as consumer %r (%s)", peer, consumer, context.peer())
                    raise fl.FlightUnauthorizedError(
                        f"certificate name {peer!r} may not act as consumer {consumer!r} "
                        "(the agent's --allow-consumer list)"
                    )
                if kind == "register":
                    reset = req.get("reset", False)
                    if not isinstance(reset, bool):
                        raise AgentProtocolError("", f"reset must be true or false, got {reset!r}")
                    r = ch.reader(consumer, identity, reset=reset)
                    start, end = r.available()
                    logger.info(
                        "consumer %r of channel %s registered (identity %r) by %s",
                        consumer,
                        ch.cid,
                        identity,
                        context.peer(),
                    )
                    return {"acked": r.acked, "start": start, "end": end}
                r = ch.reader(consumer, identity)
                if kind == "available":
                    start, end = r.available()
                    return {"start": start, "end": end}
                end = proto.int_field(req, "end")
                try:
                    acked = r.ack(end)
                except ConsumerIdentityError:
                    ch.readers.pop((consumer, identity), None)
                    raise
                except ChannelError as exc:
                    visible = r.available()[1]
                    if end <= visible:
                        raise
                    raise DataLossError(
                        visible, end, f"cannot acknowledge: the channel holds positions below {visible} only"
                    ) from exc
                return {"acked": acked}

        result = self._run(kind, context, go)
        return iter([json.dumps(result, sort_keys=True).encode()])

    # -- the Spark sink (staging.py) ------------------------------------------------------

    def _sink_stage(self, context: Any, command: bytes, reader: Any) -> dict[str, Any]:
        cmd = proto.decode_stage_command(command)
        store = self._writable(context, cmd.pop("channel")).sink_store()
        req = StageRequest(**cmd)
        name, rows, size = store.stage(req, stream_events(reader))
        logger.debug("sink stage %s: %d rows from %s", name, rows, context.peer())
        return {"v": proto.WIRE_VERSION, "staged": name, "rows": rows, "bytes": size}

    def _sink_action(self, context: Any, kind: str, req: dict[str, Any]) -> dict[str, Any]:
        store = self._writable(context, req.get("channel")).sink_store()
        files = req.get("files", [])
        if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
            raise AgentProtocolError("", "files must be a list of staged file names")
        stale = req.get("stale_staging", DEFAULT_STALE_STAGING)
        if not isinstance(stale, (int, float)) or isinstance(stale, bool) or not 0 <= stale < float("inf"):
            raise AgentProtocolError("", f"stale_staging must be a number of seconds >= 0, got {stale!r}")
        job = proto.str_field(req, "job", required=False)
        query = proto.str_field(req, "query", required=False)
        if kind == "sink_abort":
            batch = req.get("batch")
            prefix = None
            if job is not None:
                prefix = StageRequest(0, 0, job=job).prefix
            elif query is not None and batch is not None:
                prefix = StageRequest(0, 0, query=query, batch_id=proto.int_field(req, "batch")).prefix
            deleted = store.discard(prefix, files)
            store.sweep(float(stale))
            logger.info("sink abort from %s: %d staged file(s) deleted", context.peer(), deleted)
            return {"deleted": deleted}
        rows = req.get("rows")
        if rows is not None:
            rows = proto.int_field(req, "rows")
        owner = self._peer(context)
        if job is not None:
            return store.commit_job(job, files, rows, float(stale), owner=owner)
        if query is None:
            raise AgentProtocolError("", "a sink commit names a query and batch, or a job")
        return store.commit_batch(query, proto.int_field(req, "batch"), files, rows, float(stale), owner=owner)


class ConnectionTracker:
    """The client connections (peer address and port) that made a call lately, by protocol: thread-safe.

    A connection counts for ``window`` seconds after its last call, so a client
    that keeps its connection and calls now and then counts once. ``status``
    answers these counts as ``connections`` (``filechannel top`` shows them).
    """

    def __init__(self, window: float = 60.0) -> None:
        self.window = window
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, str], float] = {}

    def seen(self, protocol: str, peer: str) -> None:
        """Note a call from ``peer`` (as the transport names it, e.g. ``ipv4:10.0.0.5:53122``)."""
        with self._lock:
            self._seen[(protocol, peer)] = time.monotonic()

    def counts(self) -> dict[str, int]:
        """Connections per protocol with a call in the last ``window`` seconds (older ones are forgotten)."""
        cutoff = time.monotonic() - self.window
        out: dict[str, int] = {}
        with self._lock:
            for key, t in list(self._seen.items()):
                if t < cutoff:
                    del self._seen[key]
                else:
                    out[key[0]] = out.get(key[0], 0) + 1
        return out


class Agent:
    """A running agent (made by :func:`serve`): listening as soon as it exists.

    Attributes:
        config: Its :class:`AgentConfig`.
        port: The bound port (0 for ``grpc+unix``).
        location: The URI a client on this host connects to.
        channels: The served channels, by channel id (hex).
    """

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        listen, certs, client_ca, token = _start_checks(config)
        middleware: dict[str, Any] = {}
        if token is not None:
            middleware["token"] = make_token_middleware(token)
        self.channels = _open_channels(config)
        kwargs: dict[str, Any] = {"middleware": middleware}
        if certs:
            kwargs["tls_certificates"] = certs
        if client_ca is not None:
            kwargs["verify_client"] = True
            kwargs["root_certificates"] = client_ca
        self._stopped = False
        self.location = listen.location()
        self.http: Any = None  # the HttpServer (web.py) when config.http is set
        self.metrics: Any = None  # its AgentMetrics
        self.connections = ConnectionTracker()  # client connections seen lately (status, filechannel top)
        self.tails: list[TailSource] = []  # the tail sources (sources/tail.py) of config.tail
        self.forward: Any = None  # the ForwardSource (forward.py) when config.forward is set
        self.syslog: SyslogSources | None = None  # the syslog and RELP listeners (syslog_source.py)
        self._server: Any = None
        self._socket: tuple[str, int] | None = None  # a grpc+unix socket's path and inode, removed at stop
        # Every part starts (Flight, HTTP, the syslog listeners, the tail sources) before anything is
        # announced (the port files, the "serving" line): an agent that cannot start every part stops
        # them all and raises.
        try:
            if config.tail:
                self.tails = make_tails(self.channels.values(), config.tail, **config.tail_options)
            try:
                if listen.scheme == "grpc+unix":
                    make = lambda uri: _FlightServer(self, uri, **kwargs)  # noqa: E731
                    self._server, self._socket = _bind_unix(make, listen.path)
                else:
                    self._server = _FlightServer(self, listen.location(), **kwargs)
            except (fl.FlightError, pa.ArrowException, OSError) as exc:
                raise ChannelError(f"cannot listen on {config.listen}: {str(exc).splitlines()[0]}") from None
            self.port = int(self._server.port) if listen.scheme != "grpc+unix" else 0
            self.location = listen.location(self.port if listen.scheme != "grpc+unix" else None)
            if config.http is not None:
                self._start_http()
            if config.forward is not None:
                self._start_forward()
            if config.syslog is not None:
                self.syslog = start_syslog(self, settings=config.syslog)
            for src in self.tails:
                src.start()
                logger.info("tailing %s into %s", ", ".join(src.patterns), src.channel.directory)
        except BaseException:
            self._shut_down()
            raise
        if self.http is not None:
            self.http.announce()
        if config.port_file:
            path = os.path.abspath(config.port_file)
            replace_durably(DEFAULT_FS, f"{path}.tmp-{os.getpid()}", path, b"%d\n" % self.port)
        security = "mutual TLS" if client_ca is not None else "TLS" if certs else "no TLS"
        logger.info(
            "serving %d channel(s) on %s (%s%s%s): %s",
            len(self.channels),
            self.location,
            security,
            ", bearer token" if config.token_file else "",
            ", certificate allow-list" if config.allow else "",
            ", ".join(f"{c.cid} ({c.name})" for c in self.channels.values()),
        )

    def _start_forward(self) -> None:
        self.forward = _forward_module().ForwardSource(self, self.config.forward)

    def _start_http(self) -> None:
        self.http = _http_module().HttpServer(self, self.config.http)
        self.metrics = self.http.metrics

    def _close_channels(self) -> None:
        for ch in self.channels.values():
            ch.view.close()
            for r in ch.readers.values():
                r.close()
            if ch.channel is not None:
                ch.channel.close()

    def stop(self) -> None:
        """Stop the tail sources and listening, wait for the calls in flight (idempotent); remove the port file."""
        if self._stopped:
            return
        self._shut_down()
        if self.config.port_file:
            try:
                DEFAULT_FS.unlink(os.path.abspath(self.config.port_file))
            except FileNotFoundError:
                pass
        logger.info("stopped serving on %s", self.location)

    def _shut_down(self) -> None:
        """Stop every part started (the tail sources first: they put), then close the channels."""
        self._stopped = True
        try:
            if self.syslog is not None:
                self.syslog.stop()
            for src in self.tails:
                src.stop()
            if self.forward is not None:
                self.forward.stop()
            if self.http is not None:
                self.http.stop()
            if self._server is not None:
                self._server.shutdown()
            if self._socket is not None:
                path, ino = self._socket
                try:
                    if os.lstat(path).st_ino == ino:  # ours still, not a successor's
                        DEFAULT_FS.unlink(path)
                except FileNotFoundError:
                    pass
        finally:
            self._close_channels()

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<Agent {self.location} channels={sorted(self.channels)}>"


def serve(
    directories: Sequence[str | os.PathLike[str]] | str | os.PathLike[str],
    listen: str,
    *,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    client_ca: str | None = None,
    token_file: str | None = None,
    allow: Mapping[str, Collection[str]] | None = None,
    consumers: Mapping[str, Collection[str]] | None = None,
    writers: Collection[str] | None = None,
    keystore: str | os.PathLike[str] | None = None,
    port_file: str | None = None,
    on_corruption: str = "fail",
    writable: bool = False,
    channel_options: Mapping[str, Any] | None = None,
    names: Mapping[str, str] | None = None,
    http: Any = None,
    insecure_allow_anyone: bool = False,
    tail: Sequence[str] = (),
    tail_options: Mapping[str, Any] | None = None,
    forward: Any = None,
    syslog: Any = None,
) -> Agent:
    """Start an agent serving ``directories`` on ``listen`` and return it (stop it with ``.stop()``).

    See :class:`AgentConfig` for the arguments (``http``: an ``HttpSettings`` of
    ``filechannel.agent.web``, or ``"HOST:PORT"``). The agent listens on return;
    with port 0 its ``.port`` (and ``port_file``) tells which port was bound, and
    ``.http.port`` the HTTP one. With ``tail``, its tail sources run (``.tails``) on return; with
    ``syslog`` (a ``SyslogSettings``), its syslog and RELP listeners (``.syslog``).
    ``forward`` (a ``ForwardSettings`` of ``filechannel.agent.forward``, or its addresses, e.g.
    ``["tcp://127.0.0.1:24224"]``) starts the forward source (``.forward``, its ``.ports``).
    Nothing is announced (the port files, the "serving" log line) until every part has started.

    Raises:
        ConfigError: A bad option, or a TLS key, CA or token file that is missing or unsafe.
        NotAChannelError, CorruptLogError, DecryptionError: A directory that cannot be served.
        ChannelError: The address cannot be bound.
    """
    dirs = (directories,) if isinstance(directories, (str, os.PathLike)) else tuple(directories)
    if isinstance(http, str):
        from .web import HttpSettings

        http = HttpSettings(http)
    if forward is not None and not hasattr(forward, "addresses"):  # addresses, not ForwardSettings
        from .forward import ForwardSettings

        forward = ForwardSettings((forward,) if isinstance(forward, str) else tuple(forward))
    config = AgentConfig(
        tuple(os.fspath(d) for d in dirs),
        listen,
        tls_cert=tls_cert,
        tls_key=tls_key,
        client_ca=client_ca,
        token_file=token_file,
        allow={k: frozenset(v) for k, v in (allow or {}).items()},
        consumers={k: frozenset(v) for k, v in (consumers or {}).items()},
        writers=frozenset(writers or ()),
        keystore=os.fspath(keystore) if keystore is not None else None,
        port_file=port_file,
        on_corruption=on_corruption,
        writable=writable,
        channel_options=dict(channel_options or {}),
        names=dict(names or {}),
        http=http,
        insecure_allow_anyone=insecure_allow_anyone,
        tail=tuple(tail),
        tail_options=dict(tail_options or {}),
        forward=forward,
        syslog=syslog,
    )
    return Agent(config)
