"""Where ``filechannel top`` reads its samples: a channel directory (read-only, no lock) or an agent.

This module owns the I/O of ``top``: :class:`DirSource` follows a local channel
with a :class:`~filechannel.reader.ChannelReader` view (it takes no lock and
writes nothing, so the owner keeps running), :class:`AgentSource` asks an
agent's ``status`` action over Arrow Flight (every call with a deadline).
Each ``sample()`` returns a :class:`~filechannel.top.Sample`; a target that
cannot be read gives a sample with its ``error`` (``top`` shows the row as
unreachable and tries again at the next refresh).
"""

from __future__ import annotations

import math
import os
import time
from typing import Any, Protocol

from ._fs import DEFAULT_FS
from .consumers import ConsumerStore
from .crypto import Encryption
from .errors import ChannelError, CorruptLogError
from .reader import ChannelReader
from .top import ChannelReading, ConsumerReading, Sample

__all__ = [
    "AGENT_SCHEMES",
    "METRICS_SCHEMES",
    "AgentSource",
    "DirSource",
    "MetricsSource",
    "Source",
    "is_agent_uri",
    "open_agent",
]

AGENT_SCHEMES = ("grpc://", "grpc+tls://", "grpc+unix://", "grpc+tcp://")
METRICS_SCHEMES = ("http://", "https://")


def is_agent_uri(target: str) -> bool:
    """Whether ``target`` names an agent (a Flight URI or its HTTP ``/metrics``) rather than a channel directory."""
    return target.startswith(AGENT_SCHEMES + METRICS_SCHEMES)


class Source(Protocol):
    """One target of ``top``."""

    target: str
    kind: str

    def sample(self) -> Sample:
        """What the target says now (never raises for a target that cannot be read: the sample's ``error``)."""

    def check(self) -> None:
        """Read the target once; raise ``ChannelError`` (or ``OSError``) when it cannot be read."""

    def close(self) -> None:
        """Let go of files and connections."""


def disk_free(path: str) -> int | None:
    """Bytes an unprivileged writer may still use on the file system of ``path`` (None if it cannot be told)."""
    try:
        return DEFAULT_FS.free_space(path)
    except OSError:
        return None


class DirSource:
    """A local channel directory, followed read-only (a ``ChannelReader`` view: no lock, nothing written)."""

    kind = "dir"

    def __init__(self, path: str, encryption: Encryption | None = None) -> None:
        self.target = path
        self.name = os.path.basename(os.path.normpath(path))
        self._reader = ChannelReader(path, encryption=encryption)

    def read(self) -> ChannelReading:
        """The channel now (raises ``ChannelError`` or ``OSError`` when it cannot be read)."""
        start, end = self._reader.available()
        try:
            registry = ConsumerStore(DEFAULT_FS, self.target).list()
        except CorruptLogError:
            registry = {}
        names = sorted(registry)
        lows = [start, *(max(start, registry[n].acked) for n in names)]
        sizes = self._reader.record_bytes(lows, end)
        consumers = tuple(
            ConsumerReading(n, registry[n].acked, max(0, end - lo), b)
            for n, lo, b in zip(names, lows[1:], sizes[1:], strict=True)
        )
        return ChannelReading(self.name, start, end, sizes[0], disk_free(self.target), (), consumers)

    def sample(self) -> Sample:
        """The channel now, or why it cannot be read."""
        t = time.monotonic()
        try:
            return Sample(self.target, self.kind, t, (self.read(),))
        except (ChannelError, OSError) as exc:
            return Sample(self.target, self.kind, t, error=str(exc))

    def check(self) -> None:
        """Read once; raise when the target cannot be read."""
        self.read()

    def close(self) -> None:
        """Close the view."""
        self._reader.close()


def _buckets(raw: Any) -> tuple[tuple[float, float], ...]:
    """``[["0.001", 3], ..., ["+Inf", 9]]`` (the stats' form) as ``((0.001, 3.0), ..., (inf, 9.0))``."""
    out = []
    for bound, count in raw or ():
        out.append((math.inf if bound == "+Inf" else float(bound), float(count)))
    return tuple(out)


def readings_from_status(status: dict[str, Any]) -> tuple[ChannelReading, ...]:
    """The channels of an agent's ``status`` answer (the keys an older agent lacks stay unknown)."""
    out = []
    for ch in status.get("channels", ()):
        consumers = tuple(
            ConsumerReading(name, int(c["acked"]), int(c["lag"]), c.get("lag_bytes"))
            for name, c in sorted(ch.get("consumers", {}).items())
        )
        out.append(
            ChannelReading(
                str(ch["name"]),
                int(ch["start"]),
                int(ch["end"]),
                ch.get("bytes"),
                ch.get("disk_free"),
                _buckets(ch.get("fsync_seconds_buckets")),
                consumers,
            )
        )
    return tuple(out)


class _AgentReadings:
    """What the two ways of asking an agent share: ``sample`` and ``check`` around the subclass's ``read``."""

    kind = "agent"
    target: str

    def read(self) -> Sample:
        """The agent now (raises ``ChannelError`` when it cannot be reached or answers nonsense)."""
        raise NotImplementedError

    def sample(self) -> Sample:
        """The agent now, or why it cannot be reached."""
        try:
            return self.read()
        except (ChannelError, OSError) as exc:
            return Sample(self.target, self.kind, time.monotonic(), error=str(exc))

    def check(self) -> None:
        """Read once; raise when the target cannot be read."""
        self.read()


class AgentSource(_AgentReadings):
    """An agent, asked over Arrow Flight (its ``status`` action; the deadline is ``timeout``)."""

    def __init__(self, uri: str, **settings: Any) -> None:
        from .agent.client import AgentSettings  # the agent extra: only when an agent is watched

        self.target = uri
        self._client = AgentSettings(uri, **settings).connect()

    def read(self) -> Sample:
        """The agent now (raises ``ChannelError`` when it cannot be reached or answers nonsense)."""
        t = time.monotonic()
        st = self._client.status()
        try:
            channels = readings_from_status(st)
        except (KeyError, TypeError, ValueError) as exc:
            raise ChannelError(f"{self.target}: the status answer does not decode ({exc!r})") from None
        conns = st.get("connections")
        return Sample(self.target, self.kind, t, channels, dict(conns) if isinstance(conns, dict) else None)

    def close(self) -> None:
        """Close the connection."""
        self._client.close()


def _int_or_none(v: float | None) -> int | None:
    return None if v is None else int(v)


def readings_from_metrics(text: str) -> tuple[tuple[ChannelReading, ...], dict[str, int] | None]:
    """The channels and connections of an agent's ``/metrics`` text (docs/agents.md names the metrics)."""
    from prometheus_client.parser import text_string_to_metric_families  # the agent extra

    values: dict[str, dict[str, float]] = {}
    buckets: dict[str, list[tuple[float, float]]] = {}
    consumers: dict[str, dict[str, dict[str, float]]] = {}
    conns: dict[str, int] | None = None
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            name, labels = smp.name.removeprefix("filechannel_"), smp.labels
            if name == "agent_connections":
                conns = conns or {}
                conns[labels["protocol"]] = int(smp.value)
            elif "channel" not in labels:
                continue
            elif name == "fsync_seconds_bucket":
                buckets.setdefault(labels["channel"], []).append((float(labels["le"]), smp.value))
            elif name.startswith("consumer_") and "consumer" in labels:
                row = consumers.setdefault(labels["channel"], {}).setdefault(labels["consumer"], {})
                row[name.removeprefix("consumer_")] = smp.value
            else:
                values.setdefault(labels["channel"], {})[name] = smp.value
    out = []
    for ch, v in sorted(values.items()):
        if "next_position" not in v or "channel_size" not in v:
            continue
        end = int(v["next_position"])
        rows = tuple(
            ConsumerReading(n, int(c["acked_position"]), int(c["lag_events"]), _int_or_none(c.get("lag_bytes")))
            for n, c in sorted(consumers.get(ch, {}).items())
            if "acked_position" in c and "lag_events" in c
        )
        size, free = v.get("channel_bytes"), v.get("disk_free_bytes")
        out.append(
            ChannelReading(
                ch,
                end - int(v["channel_size"]),
                end,
                _int_or_none(size),
                _int_or_none(free),
                tuple(sorted(buckets.get(ch, ()))),
                rows,
            )
        )
    return tuple(out), conns


class MetricsSource(_AgentReadings):
    """An agent's HTTP ``/metrics`` (``http://HOST:PORT``; the path defaults to ``/metrics``), with a deadline."""

    def __init__(
        self,
        url: str,
        *,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        token_file: str | None = None,
        timeout: float = 5.0,
    ) -> None:
        import ssl
        import urllib.parse

        from .agent.auth import read_token

        self.target = url
        parts = urllib.parse.urlsplit(url)
        self._url = url if parts.path not in ("", "/") else urllib.parse.urlunsplit(parts._replace(path="/metrics"))
        self._timeout = timeout
        self._headers = {"Authorization": f"Bearer {read_token(token_file).decode()}"} if token_file else {}
        self._context: ssl.SSLContext | None = None
        if parts.scheme == "https":
            self._context = ssl.create_default_context(cafile=tls_ca)
            if tls_cert:
                self._context.load_cert_chain(tls_cert, tls_key)

    def read(self) -> Sample:
        """The agent now (raises ``ChannelError`` when it cannot be reached or answers nonsense)."""
        import urllib.error
        import urllib.request

        t = time.monotonic()
        req = urllib.request.Request(self._url, headers=self._headers)
        try:
            with urllib.request.urlopen(req, timeout=self._timeout, context=self._context) as resp:
                text = resp.read(64 << 20).decode("utf-8", "replace")
        except urllib.error.HTTPError as exc:
            raise ChannelError(f"{self._url}: HTTP {exc.code} {exc.reason}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            raise ChannelError(f"{self._url}: cannot reach the agent ({reason})") from None
        try:
            channels, conns = readings_from_metrics(text)
        except (KeyError, TypeError, ValueError) as exc:
            raise ChannelError(f"{self._url}: the metrics do not parse ({exc})") from None
        return Sample(self.target, self.kind, t, channels, conns)

    def close(self) -> None:
        """Nothing to close: each sample is one request."""


def open_agent(uri: str, **settings: Any) -> AgentSource | MetricsSource:
    """The source of an agent URI: Flight (``grpc...://``) or its HTTP ``/metrics`` (``http(s)://``)."""
    if uri.startswith(METRICS_SCHEMES):
        return MetricsSource(uri, **settings)
    return AgentSource(uri, **settings)
