"""Prometheus metrics of channels and of the agent (``GET /metrics``, ``filechannel stat --prometheus``).

This module owns the metric names, their help texts and how each is derived
from what a channel reports (``FileChannel.stats()``, a ``ChannelReader`` view,
or the read-only state ``filechannel stat`` loads), in the Prometheus text
format of the official ``prometheus_client`` library (the ``agent`` extra).
Channel values are read when a scrape asks for them (a custom collector);
the agent's own counters (HTTP requests, Flight calls, put commit latency)
are ``prometheus_client`` counters and histograms in a registry per agent,
never the library's global one. ``docs/agents.md`` lists every metric.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from filechannel._version import __version__

__all__ = [
    "CHANNEL_METRICS",
    "CONSUMER_METRICS",
    "CONTENT_TYPE",
    "AgentMetrics",
    "ChannelSample",
    "render_samples",
    "sample_from_stats",
]

CONTENT_TYPE = CONTENT_TYPE_LATEST
PREFIX = "filechannel_"

# (metric name without prefix and without _total, kind, help, the stats() key it comes from, Flume's counter)
CHANNEL_METRICS: tuple[tuple[str, str, str, str, str], ...] = (
    ("channel_size", "gauge", "Events queued in the channel (committed, not taken)", "queue_size", "ChannelSize"),
    ("channel_capacity", "gauge", "The channel's capacity (events)", "capacity", "ChannelCapacity"),
    ("channel_fill_ratio", "gauge", "channel_size / channel_capacity (0 to 1)", "", "ChannelFillPercentage / 100"),
    ("event_put_attempts", "counter", "Events offered to put", "puts_attempted", "EventPutAttemptCount"),
    ("event_put_success", "counter", "Events put and committed", "puts_committed", "EventPutSuccessCount"),
    ("event_take_attempts", "counter", "Take calls", "takes_attempted", "EventTakeAttemptCount"),
    ("event_take_success", "counter", "Events taken and committed", "takes_committed", "EventTakeSuccessCount"),
    ("transactions_committed", "counter", "Transactions committed", "transactions_committed", ""),
    ("transactions_rolled_back", "counter", "Transactions rolled back", "rollbacks", "RollbackCounter"),
    ("commit_failures", "counter", "Commits that failed (the channel failed)", "commit_failures", "EventPutErrorCount"),
    ("channel_full", "counter", "Puts refused because the channel was full", "channel_full", "ChannelFullCount"),
    ("fsyncs", "counter", "fsync calls on data files", "fsyncs", ""),
    ("bytes_written", "counter", "Bytes written to data files", "bytes_written", ""),
    ("checkpoints_written", "counter", "Checkpoints written", "checkpoints_written", ""),
    (
        "checkpoint_failures",
        "counter",
        "Checkpoint writes that failed",
        "checkpoint_failures",
        "CheckpointWriteErrorCount",
    ),
    ("last_checkpoint_duration_seconds", "gauge", "Duration of the last checkpoint", "last_checkpoint_seconds", ""),
    ("last_checkpoint_bytes", "gauge", "Size of the last checkpoint", "last_checkpoint_bytes", ""),
    ("last_checkpoint_timestamp_seconds", "gauge", "Unix time of the last checkpoint", "last_checkpoint_time", ""),
    ("disk_bytes", "gauge", "Bytes of the channel's data files on disk", "disk_bytes", ""),
    ("data_bytes", "gauge", "Bytes the live data files hold, as max_bytes counts them", "data_bytes", ""),
    ("max_bytes", "gauge", "The channel's byte limit (absent: none)", "max_bytes", ""),
    ("min_free_bytes", "gauge", "The free-space floor (minimum_required_space)", "minimum_required_space", ""),
    (
        "space_refusals",
        "counter",
        "Puts refused for max_bytes, the free-space floor or a full disk",
        "space_refusals",
        "",
    ),
    ("data_files", "gauge", "Data files of the channel", "files", ""),
    ("data_files_created", "counter", "Data files created", "files_created", ""),
    ("data_files_retired", "counter", "Data files retired (deleted once drained)", "files_retired", ""),
    ("next_position", "gauge", "The position the next put gets", "next_position", ""),
    ("open_transactions", "gauge", "Transactions open now", "open_transactions", ""),
    ("replay_seconds", "gauge", "Duration of the replay when the channel opened", "replay_seconds", ""),
    ("failed", "gauge", "1 if the channel has failed and refuses work (reopen it)", "failed", "Unhealthy"),
    ("torn_tails_truncated", "counter", "Torn data file tails cut at open", "torn_tails_truncated", ""),
    ("corruptions_skipped", "counter", "Damaged records skipped (on_corruption=skip)", "corruptions_skipped", ""),
    ("damaged_events_dropped", "counter", "Events dropped as damaged", "damaged_events_dropped", ""),
    ("lost_positions", "gauge", "Positions reported lost to damage", "lost_positions", ""),
    ("channel_bytes", "gauge", "Record bytes of the queued events (an agent's channels)", "", ""),
    # Read afresh at each scrape by the agent (stats()["disk_free"] is the same reading, of every data directory).
    ("disk_free_bytes", "gauge", "Bytes unprivileged writers may still use on the channel's file system", "", ""),
)

# (metric name, help, key of a consumer row) -- labels channel and consumer
CONSUMER_METRICS: tuple[tuple[str, str, str], ...] = (
    ("consumer_acked_position", "The consumer's acknowledged mark (every position below it is done)", "acked"),
    ("consumer_lag_events", "Queued events at or after the consumer's mark", "lag_events"),
    ("consumer_lag_bytes", "Bytes of the records of those events", "lag_bytes"),
)

# Seconds from a put's first event to its durable commit, as the agent sees it.
COMMIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class ChannelSample:
    """One channel's values at one scrape: metric name (see :data:`CHANNEL_METRICS`) -> number.

    ``consumers`` maps a consumer name to its ``acked``, ``lag_events`` and ``lag_bytes``.
    """

    channel: str
    values: dict[str, float] = field(default_factory=dict)
    consumers: dict[str, dict[str, float]] = field(default_factory=dict)
    # The commits' fdatasync durations: cumulative [(upper bound, count)] and their sum (stats()).
    fsync_buckets: list[tuple[str, float]] = field(default_factory=list)
    fsync_sum: float = 0.0


def sample_from_stats(channel: str, stats: Mapping[str, Any]) -> ChannelSample:
    """The sample of an open channel from its ``FileChannel.stats()`` (consumer ``lag_bytes`` not included)."""
    out = ChannelSample(channel)
    for name, _kind, _help, key, _flume in CHANNEL_METRICS:
        if not key or key not in stats:
            continue
        v = stats[key]
        if key == "lost_positions":
            v = sum(hi - lo for lo, hi in v)
        if v is None:
            continue
        out.values[name] = float(v)
    size, cap = stats.get("queue_size"), stats.get("capacity")
    if isinstance(size, int) and isinstance(cap, int) and cap > 0:
        out.values["channel_fill_ratio"] = size / cap
    for cname, c in (stats.get("consumers") or {}).items():
        out.consumers[cname] = {"acked": float(c["acked"]), "lag_events": float(c["lag_events"])}
    for le, n in stats.get("fsync_seconds_buckets") or ():
        out.fsync_buckets.append((str(le), float(n)))
    out.fsync_sum = float(stats.get("fsync_seconds") or 0.0)
    return out


def channel_families(samples: Iterable[ChannelSample]) -> Iterator[Metric]:
    """The metric families of ``samples`` (one family per metric, one sample per channel that has it)."""
    samples = list(samples)
    for name, kind, text, _key, _flume in CHANNEL_METRICS:
        fam: Metric
        if kind == "counter":
            fam = CounterMetricFamily(PREFIX + name, text, labels=["channel"])
        else:
            fam = GaugeMetricFamily(PREFIX + name, text, labels=["channel"])
        for s in samples:
            if name in s.values:
                fam.add_metric([s.channel], s.values[name])
        if fam.samples:
            yield fam
    h = HistogramMetricFamily(
        PREFIX + "fsync_seconds",
        "How long each commit's fdatasync took (the durable part of a commit)",
        labels=["channel"],
    )
    for s in samples:
        if s.fsync_buckets:
            h.add_metric([s.channel], s.fsync_buckets, s.fsync_sum)
    if h.samples:
        yield h
    for name, text, key in CONSUMER_METRICS:
        g = GaugeMetricFamily(PREFIX + name, text, labels=["channel", "consumer"])
        for s in samples:
            for cname, row in sorted(s.consumers.items()):
                if key in row:
                    g.add_metric([s.channel, cname], row[key])
        if g.samples:
            yield g


class _ChannelCollector:
    """A collector reading the channels' samples at each scrape."""

    def __init__(self, samples: Callable[[], list[ChannelSample]]) -> None:
        self._samples = samples

    def collect(self) -> Iterator[Metric]:
        return channel_families(self._samples())

    def describe(self) -> list[Metric]:
        return []  # values are read at scrape time only


class _ConnectionsCollector:
    """The agent's client connections with a call lately, by protocol, read at each scrape."""

    def __init__(self, counts: Callable[[], dict[str, int]]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[Metric]:
        g = GaugeMetricFamily(
            PREFIX + "agent_connections",
            "Client connections (address and port) with a call in the last minute, by protocol",
            labels=["protocol"],
        )
        counts = {"flight": 0, "http": 0, **self._counts()}
        for protocol, n in sorted(counts.items()):
            g.add_metric([protocol], n)
        yield g

    def describe(self) -> list[Metric]:
        return []


def render_samples(samples: list[ChannelSample]) -> bytes:
    """The Prometheus text of ``samples`` alone (``filechannel stat --prometheus``)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_ChannelCollector(lambda: samples))  # type: ignore[arg-type]
    data: bytes = generate_latest(registry)
    return data


class AgentMetrics:
    """The metrics of one agent: its channels (read at scrape time) and its own counters.

    Thread-safe (``prometheus_client`` metrics are); the HTTP server and the
    Flight handlers count into it.
    """

    def __init__(
        self, samples: Callable[[], list[ChannelSample]], connections: Callable[[], dict[str, int]] | None = None
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._lock = threading.Lock()
        self.registry.register(_ChannelCollector(samples))  # type: ignore[arg-type]
        if connections is not None:
            self.registry.register(_ConnectionsCollector(connections))  # type: ignore[arg-type]
        info = Gauge(PREFIX + "agent_info", "The agent's version (always 1)", ["version"], registry=self.registry)
        info.labels(__version__).set(1)
        self.http_requests = Counter(
            PREFIX + "http_requests",
            "HTTP requests answered, by endpoint, channel (empty if none) and status code",
            ["endpoint", "channel", "status"],
            registry=self.registry,
        )
        self.http_events = Counter(
            PREFIX + "http_events",
            "Events committed from HTTP requests",
            ["channel"],
            registry=self.registry,
        )
        self.http_duplicates = Counter(
            PREFIX + "http_duplicate_requests",
            "HTTP requests answered from a committed Idempotency-Key (nothing put)",
            ["channel"],
            registry=self.registry,
        )
        # The push sources other than the HTTP one (syslog, relp, forward, otlp): label source names which.
        self.source_events = Counter(
            PREFIX + "source_events",
            "Events committed from a push source (syslog, relp, forward, otlp), by source and channel",
            ["source", "channel"],
            registry=self.registry,
        )
        self.source_invalid = Counter(
            PREFIX + "source_invalid_events",
            "Events committed as they came, marked invalid (syslog.status=invalid; also in source_events)",
            ["source", "channel"],
            registry=self.registry,
        )
        self.source_refused = Counter(
            PREFIX + "source_refused",
            "Events or messages a push source refused or left out, by source, channel and reason",
            ["source", "channel", "reason"],
            registry=self.registry,
        )
        self.source_duplicates = Counter(
            PREFIX + "source_duplicates",
            "Retried chunks answered from a committed key (nothing put), by source and channel",
            ["source", "channel"],
            registry=self.registry,
        )
        self.source_responses = Counter(
            PREFIX + "source_responses",
            "Answers a source sent for messages, by source, channel and code (relp: 200 after a durable commit, 500)",
            ["source", "channel", "code"],
            registry=self.registry,
        )
        self.source_connections = Gauge(
            PREFIX + "source_connections",
            "Connections open to a stream source now, by source",
            ["source"],
            registry=self.registry,
        )
        self.source_connection_outcomes = Counter(
            PREFIX + "source_connection_outcomes",
            "Connections to a stream source by transport (tcp, tls) and outcome (accepted, over_limit, tls_failed, "
            "refused_certificate, timeout, protocol_error)",
            ["source", "transport", "outcome"],
            registry=self.registry,
        )
        self.flight_calls = Counter(
            PREFIX + "flight_calls",
            "Flight calls by kind and outcome (ok, refused: a channel error sent to the client, error: I/O)",
            ["call", "outcome"],
            registry=self.registry,
        )
        self.put_commit_seconds = Histogram(
            PREFIX + "put_commit_seconds",
            "Seconds from a put's first event to its durable commit (fsync included), by channel and source",
            ["channel", "source"],
            buckets=COMMIT_BUCKETS,
            registry=self.registry,
        )

    def http_request(self, endpoint: str, channel: str, status: int) -> None:
        """Count one HTTP answer."""
        self.http_requests.labels(endpoint, channel, str(status)).inc()

    def flight_call(self, call: str, outcome: str) -> None:
        """Count one Flight call."""
        self.flight_calls.labels(call, outcome).inc()

    def put_committed(self, channel: str, source: str, seconds: float) -> None:
        """Record the commit latency of one put transaction."""
        self.put_commit_seconds.labels(channel, source).observe(seconds)

    def render(self, channels: Collection[str] | None = None) -> bytes:
        """The Prometheus text of every metric now; ``channels``: only these channels' series (and no channel's)."""
        if channels is None:
            data: bytes = generate_latest(self.registry)
            return data
        return generate_latest(_OnlyChannels(self.registry, channels))  # type: ignore[arg-type]


class _OnlyChannels:
    """A registry's metrics without the series of channels not in ``channels`` (a series without one stays)."""

    def __init__(self, registry: CollectorRegistry, channels: Collection[str]) -> None:
        self._registry = registry
        self._channels = frozenset(channels)

    def collect(self) -> Iterator[Metric]:
        for m in self._registry.collect():
            kept = Metric(m.name, m.documentation, m.type, m.unit)
            kept.samples = [s for s in m.samples if s.labels.get("channel", "") in self._channels or not _named(s)]
            if kept.samples or not m.samples:
                yield kept


def _named(sample: Any) -> bool:
    """Whether a sample belongs to a served channel (``""``: none; ``"?"``: an unknown name, shared)."""
    return sample.labels.get("channel", "") not in ("", "?")
