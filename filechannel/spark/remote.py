"""The Spark source's agent side: channels of other hosts, read through ``filechannel serve`` over Arrow Flight.

This module owns what ``.option("agents", "grpc+tls://h1:8815,...")`` adds to
:mod:`filechannel.spark.source`: discovery of the channels each agent serves,
consumer registration and acknowledgements over the agent's calls, the
agent-down policy (``onAgentUnavailable``), and the executors' reads
(:func:`agent_batches`). Offsets are the source's own (keyed by channel id),
so a checkpoint survives a channel moving host, and ``path`` channels and
agent channels mix in one query.

The rules (docs/spark.md, "Channels on other hosts"):

- **Partitions are a pure function of the logged offsets**: each channel's
  ``[start, end)`` split every ``maxEventsPerPartition`` events into
  :class:`AgentPartition` s that carry the channel id, the range and every
  agent's :class:`~filechannel.agent.AgentSettings` (a URI and file paths,
  never a secret's contents). No agent is asked, so a replay after a restart
  plans the same tasks while an agent is down; the executor finds the agent
  serving the channel itself (and remembers it for the life of its Python worker).
- A channel joins a query (a new channel, an agent that was down when the query
  started) at its consumer's acknowledged position, with nothing of it in that
  micro-batch: a channel absent from a batch's start offset contributes nothing.
- An agent that cannot be reached holds its channels' positions while the other
  channels proceed; after ``agentHoldMs`` (or at once with
  ``onAgentUnavailable=fail``) the query fails naming the agent, channel ids
  and positions. An acknowledgement that cannot be delivered is deferred:
  acknowledgements are cumulative, the next one covers it.
- One channel id served twice (two agents, or an agent and a ``path``) is
  refused. A checkpointed channel that no agent (nor path) serves while every
  agent answers fails the query, unless named in ``retireChannels``.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pyspark.sql.datasource import InputPartition
from pyspark.sql.streaming.datasource import ReadLimit

from filechannel.agent.client import AgentClient, AgentSettings, ClientCache
from filechannel.errors import (
    AgentUnavailableError,
    ChannelError,
    ConfigError,
    ConsumerIdentityError,
    DataLossError,
    UnknownChannelError,
)
from filechannel.reader import ChannelReader

from .offsets import (
    AHEAD_HINT,
    CheckpointMismatchError,
    bind_query,
    check_position_keys,
    identity_guard,
    lost,
    make_offset,
    parse_offset,
    resolve_position,
)
from .source import (
    IDENTITY_PREFIX,
    FileChannelStreamReader,
    SourceOptions,
    shaped,
)

if TYPE_CHECKING:
    from pyspark.sql.types import StructType

__all__ = ["AgentPartition", "AgentStreamReader", "agent_batches", "agent_settings", "snapshot_partitions"]

logger = logging.getLogger(__name__)


def agent_settings(options: SourceOptions) -> tuple[AgentSettings, ...]:
    """The picklable settings of each agent of ``options`` (TLS files go to ``grpc+tls`` agents only)."""
    out = []
    for uri in options.agents:
        tls = uri.lower().startswith("grpc+tls://")
        out.append(
            AgentSettings(
                uri,
                tls_ca=options.tls_ca if tls else None,
                tls_cert=options.tls_cert if tls else None,
                tls_key=options.tls_key if tls else None,
                token_file=options.token_file,
                timeout=options.agent_timeout,
            )
        )
    return tuple(out)


class AgentPartition(InputPartition):
    """One Spark task: positions ``[start, end)`` of channel ``channel`` (hex), read from whichever agent serves it.

    Picklable: the agents' settings are URIs and file paths; ``keystore`` is a path.
    ``label`` is the value of the ``channel`` column (the channel id).
    """

    def __init__(
        self, channel: str, start: int, end: int, agents: tuple[AgentSettings, ...], keystore: str | None
    ) -> None:
        super().__init__((channel, start, end))
        self.channel = channel
        self.start = start
        self.end = end
        self.agents = agents
        self.keystore = keystore

    def __repr__(self) -> str:
        return f"AgentPartition(channel={self.channel}, [{self.start}, {self.end}))"

    def batches(self, schema: StructType) -> Iterator[Any]:
        """Read this partition as Arrow record batches of ``schema`` (the source's ``read`` calls it)."""
        return agent_batches(self, schema)


def split(
    channel: str, start: int, end: int, every: int, agents: tuple[AgentSettings, ...], keystore: str | None
) -> list[AgentPartition]:
    """``[start, end)`` of ``channel`` in partitions of at most ``every`` positions (a pure function)."""
    return [AgentPartition(channel, a, min(a + every, end), agents, keystore) for a in range(start, end, every)]


# -- executors ---------------------------------------------------------------------------------

_CLIENTS = ClientCache()  # per Python worker: one connection per agent
_client = _CLIENTS.get
_forget = _CLIENTS.forget  # a connection that failed
_WHERE: dict[str, AgentSettings] = {}  # channel id -> the agent that served it


def _locate(channel: str, agents: Sequence[AgentSettings]) -> AgentSettings:
    """The agent that serves ``channel`` (asked once per worker, then remembered).

    Raises:
        AgentUnavailableError: No reachable agent serves it and some agent cannot be reached.
        UnknownChannelError: Every agent answered and none serves it.
    """
    known = _WHERE.get(channel)
    if known is not None and known in agents:
        return known
    down: list[str] = []
    served: list[str] = []
    for s in agents:
        try:
            chans = _client(s).channels()
        except AgentUnavailableError as exc:
            down.append(f"{s.uri} ({exc.reason})")
            _forget(s)
            continue
        for cid in chans:
            _WHERE.setdefault(cid, s)
        served.extend(chans)
        if channel in chans:
            _WHERE[channel] = s
            return s
    uris = ", ".join(s.uri for s in agents)
    if down:
        raise AgentUnavailableError(
            uris,
            f"channel {channel} is not served by a reachable agent, and these cannot be reached: {'; '.join(down)}",
        )
    raise UnknownChannelError(uris, channel, sorted(served))


def agent_batches(partition: AgentPartition, schema: StructType) -> Iterator[Any]:
    """Read one :class:`AgentPartition` as Arrow record batches of ``schema`` (on an executor).

    The agent sends the segments' raw bytes; they are checked (checksum, and the
    tag of a sealed record) and decoded here straight into Arrow buffers, by the
    code that reads a local segment (``AgentClient.read_arrow``: no Python object
    per event). A read that fails fails the task (Spark retries it; the range is the same).
    """
    settings = _locate(partition.channel, partition.agents)
    try:
        batch = _client(settings).read_arrow(
            partition.channel, partition.start, partition.end, encryption=partition.keystore
        )
    except AgentUnavailableError:
        _WHERE.pop(partition.channel, None)  # the retry asks again: the channel may have moved
        _forget(settings)
        raise
    except DataLossError as exc:
        raise DataLossError(
            exc.start, exc.end, f"channel {partition.channel} at agent {settings.uri}: {exc.reason}"
        ) from exc
    yield from shaped(batch, schema, partition.channel)


# -- the batch source ----------------------------------------------------------------------------


def snapshot_partitions(options: SourceOptions, taken: Mapping[str, str]) -> list[InputPartition]:
    """The partitions of a snapshot of every channel the agents serve (acknowledges nothing).

    ``taken`` maps the ``path`` channels' ids to their directories (one channel id served twice is refused).

    Raises:
        AgentUnavailableError: An agent cannot be reached (a snapshot does not skip a host).
        ConfigError: One channel id served twice.
    """
    agents = agent_settings(options)
    served: dict[str, str] = {}
    channels = {s.uri: _client(s).channels() for s in agents}
    for uri, chans in channels.items():
        for cid in sorted(chans):
            _refuse_twice(cid, uri, served, taken)
            served[cid] = uri
    read = {**taken, **{cid: f"agent {uri}" for cid, uri in served.items()}}
    check_position_keys(options.starting, "startingPosition", read)
    check_position_keys(options.ending, "endingPosition", read)
    out: list[InputPartition] = []
    for uri, chans in channels.items():
        for cid, info in sorted(chans.items()):
            where = f"{cid} (agent {uri})"
            a = resolve_position(options.starting, "startingPosition", cid, where, info.start, info.end, "earliest")
            b = resolve_position(options.ending, "endingPosition", cid, where, info.start, info.end, "latest")
            if b < a:
                raise ConfigError("endingPosition", f"{b} is before startingPosition {a} (channel {where})")
            out.extend(split(cid, a, b, options.partition_events, agents, options.keystore))
    return out


def _refuse_twice(cid: str, uri: str, served: Mapping[str, str], paths: Mapping[str, str]) -> None:
    if cid in served:
        raise ConfigError(
            "agents",
            f"channel {cid} is served by {served[cid]} and by {uri}: one channel id served twice (a copied "
            "directory?); serve each channel from one agent, or list one of them only",
        )
    if cid in paths:
        raise ConfigError(
            "agents",
            f"channel {cid} is the local directory {paths[cid]} and is served by {uri}: one channel id read "
            "twice (a copy?); read it through the agent or the path, not both",
        )


# -- the stream source ---------------------------------------------------------------------------


class AgentStreamReader(FileChannelStreamReader):
    """The exactly-once stream reader when ``agents`` is given (``path`` channels may be mixed in).

    Runs in the same processes as :class:`FileChannelStreamReader`; the ``path``
    channels are handled by the base class's code, the agents' here.
    """

    def __init__(self, options: SourceOptions, schema: StructType) -> None:
        super().__init__(options, schema)
        self._agents = agent_settings(options)
        self._by_uri = {s.uri: s for s in self._agents}
        self._where: dict[str, str] = {}  # channel id -> agent URI (last seen)
        self._down: dict[str, float] = {}  # agent URI -> when it was first seen down (monotonic)
        self._registered: set[str] = set()
        self._pending: dict[str, int] = {}  # deferred acknowledgements by channel id
        self._clients: dict[str, AgentClient] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_clients"] = {}
        return state

    # -- plumbing ----------------------------------------------------------------------------

    def _client(self, uri: str) -> AgentClient:
        c = self._clients.get(uri)
        if c is None:
            c = self._clients[uri] = self._by_uri[uri].connect()
        return c

    def _forget(self, uri: str) -> None:
        """Drop the connection to an agent that could not be reached: the next call connects afresh.

        (A gRPC channel that failed waits out an exponential reconnect backoff, up to
        minutes; a new client sees an agent that is back at once.)
        """
        c = self._clients.pop(uri, None)
        if c is not None:
            with contextlib.suppress(Exception):
                c.close()

    def _paths(self) -> dict[str, str]:
        return self.channels() if self.options.paths else {}

    def _label(self, cid: str) -> str:
        return f"{cid} (agent {self._where.get(cid, '?')})"

    def _discover(self) -> tuple[dict[str, str], dict[str, AgentUnavailableError]]:
        """Ask every agent what it serves: ``(channel id -> URI, URI -> why it cannot be reached)``.

        Raises:
            ConfigError: One channel id served twice.
        """
        served: dict[str, str] = {}
        down: dict[str, AgentUnavailableError] = {}
        paths = self._paths()
        now = time.monotonic()
        for s in self._agents:
            try:
                chans = self._client(s.uri).channels()
            except AgentUnavailableError as exc:
                down[s.uri] = exc
                self._forget(s.uri)
                continue
            for cid in sorted(chans):
                _refuse_twice(cid, s.uri, served, paths)
                served[cid] = s.uri
        for uri in self._by_uri:
            if uri in down:
                if uri not in self._down:
                    logger.warning("filechannel source: agent %s cannot be reached; holding its channels", uri)
                self._down.setdefault(uri, now)
            elif self._down.pop(uri, None) is not None:
                logger.warning("filechannel source: agent %s is back", uri)
        self._where.update(served)
        return served, down

    def _register(self, cid: str, query: str) -> int:
        uri = self._where[cid]
        with identity_guard(self.consumer, self._label(cid)):
            acked = self._client(uri).register(
                cid, self.consumer, IDENTITY_PREFIX + query, reset=self.options.reset and cid not in self._registered
            )
        self._registered.add(cid)
        return acked

    def _start_at(self, cid: str, query: str) -> int:
        """Register a new consumer of ``cid`` and move it to ``startingPosition`` (what it skips is done for it)."""
        head = self._register(cid, query)
        if self.options.starting is None:
            return head
        uri = self._where[cid]
        acked, end = self._available(cid, query)
        where = f"{cid} (agent {uri})"
        at = resolve_position(self.options.starting, "startingPosition", cid, where, acked, end, "earliest")
        if at > acked:
            with identity_guard(self.consumer, self._label(cid)):
                at = self._client(uri).ack(cid, self.consumer, at, IDENTITY_PREFIX + query)
        return at

    def _available(self, cid: str, query: str) -> tuple[int, int]:
        if cid not in self._registered:
            self._register(cid, query)
        with identity_guard(self.consumer, self._label(cid)):
            return self._client(self._where[cid]).available(cid, self.consumer, IDENTITY_PREFIX + query)

    def _hold(self, down: Mapping[str, AgentUnavailableError], held: Mapping[str, int]) -> None:
        """Hold the channels of unreachable agents, or fail (policy ``fail``, or held past ``agentHoldMs``)."""
        now = time.monotonic()
        for uri, exc in down.items():
            mine = {cid: p for cid, p in held.items() if self._where.get(cid, uri) == uri}
            what = (
                ", ".join(f"channel {cid} at position {p}" for cid, p in sorted(mine.items()))
                or "no channel of this query's checkpoint"
            )
            waited = now - self._down.get(uri, now)
            if self.options.on_unavailable == "fail" or waited > self.options.hold_seconds:
                why = (
                    "onAgentUnavailable=fail"
                    if self.options.on_unavailable == "fail"
                    else f"held for {waited:.0f} s, past agentHoldMs={self.options.hold_seconds * 1000:.0f}"
                )
                raise AgentUnavailableError(
                    uri,
                    f"{exc.reason}; the query stops ({why}) with {what} (nothing after those positions was "
                    "delivered or acknowledged): restart the query once the agent is back; if the channel is "
                    "gone for good, name it in option('retireChannels', ID)",
                ) from exc

    # -- Spark's calls (source runner) ---------------------------------------------------------

    def initialOffset(self) -> dict[str, Any]:
        """Start a new query at each channel's acknowledged position (the head for a new consumer)."""
        query = self.new_query or self.query or uuid.uuid4().hex[:16]
        self.new_query = query
        positions: dict[str, int] = {}
        served, down = self._discover()
        self._hold(down, {})
        if not down:  # an unreachable agent's channels are unknown: a key may name one of them
            read = {**self._paths(), **{cid: f"agent {uri}" for cid, uri in served.items()}}
            check_position_keys(self.options.starting, "startingPosition", read)
        if self.options.paths:
            positions.update(parse_offset(super().initialOffset())[0])
        for uri in sorted(set(served.values())):
            status = self._client(uri).status()
            consumers = {c["channel"]: c.get("consumers", {}) for c in status.get("channels", [])}
            for cid in sorted(c for c, u in served.items() if u == uri):
                cur = consumers.get(cid, {}).get(self.consumer)
                if cur is not None:  # see FileChannelStreamReader.initialOffset
                    positions[cid] = int(cur["acked"])
                else:
                    self.query = bind_query(self.query, query)
                    positions[cid] = self._start_at(cid, query)
        if not positions:
            raise AgentUnavailableError(
                ",".join(self.options.agents),
                "no channel to read: the agents serve none" + (" (some cannot be reached)" if down else ""),
            )
        return make_offset(positions, query)

    def prepareForTriggerAvailableNow(self) -> None:
        """Record each channel's committed end now (an unreachable agent's channels wait for the next run)."""
        target: dict[str, int] = {}
        paths = self._paths()
        for cid, path in paths.items():
            with ChannelReader(path, encryption=self.options.keystore) as view:
                target[cid] = view.available()[1]
        served, down = self._discover()
        for cid, uri in served.items():
            try:
                target[cid] = self._client(uri).available(cid)[1]
            except AgentUnavailableError:
                continue
        for uri in down:
            logger.warning("filechannel source: availableNow: agent %s cannot be reached; its channels wait", uri)
        self.pacing.target = target

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        """The end of the next micro-batch: the agents' channels that answer proceed, the others hold.

        Raises:
            DataLossError: ``start`` is beyond what a channel holds (restored from an older copy) or below its
                acknowledged position.
            AgentUnavailableError: An agent is unreachable (``onAgentUnavailable=fail``, or past ``agentHoldMs``).
            CheckpointMismatchError: A checkpointed channel that nothing serves, not named in ``retireChannels``.
            ConfigError: One channel id served twice.
        """
        positions, query = parse_offset(start)
        self.query = bind_query(self.query, query)
        paths = self._paths()
        served, down = self._discover()
        self._flush_acks(query)
        avail: dict[str, int] = {}
        ends: dict[str, int] = {}
        held: dict[str, int] = {}
        for cid, s in sorted(positions.items()):
            if cid in paths:
                avail[cid] = self.path_available(cid, paths[cid], s, query)
            elif cid in served:
                try:
                    acked, end = self._available(cid, query)
                except AgentUnavailableError as exc:
                    down[served[cid]] = exc
                    self._forget(served[cid])
                    self._down.setdefault(served[cid], time.monotonic())
                    held[cid] = s
                    continue
                avail[cid] = self.pacing.available_from(f"{cid} at agent {self._where[cid]}", cid, s, acked, end)
            elif down:
                held[cid] = s
            elif cid in self.options.retire:
                logger.warning("filechannel source: channel %s (position %d) retired (retireChannels)", cid, s)
            else:
                raise CheckpointMismatchError(
                    f"filechannel source: channel {cid} (at position {s} in this query's checkpoint) is served by "
                    f"none of the agents ({', '.join(self.options.agents)})"
                    + (f" nor the paths ({', '.join(self.options.paths)})" if self.options.paths else "")
                    + ", and every agent answers. If it moved, add its agent to option('agents'); if it is gone "
                    f"for good, name it in option('retireChannels', '{cid}') (its events from position {s} on "
                    "are then never delivered)"
                )
        self._hold(down, held)
        take = self.admit(avail, limit)  # minEventsPerTrigger: every channel waits (joins still register)
        for cid, s in positions.items():
            if cid in take:
                ends[cid] = s + take[cid]
            elif cid in held:
                ends[cid] = s
        for cid in sorted((set(served) | set(paths)) - set(positions)):  # a channel joins: nothing of it now
            if cid in paths:
                ends[cid] = self.reader(cid, query).available()[0]
            else:
                try:
                    ends[cid] = self._register(cid, query)
                except AgentUnavailableError:
                    continue
                logger.info("filechannel source: channel %s (agent %s) joins at %d", cid, served[cid], ends[cid])
        return make_offset(ends, query)

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        """Split ``[start, end)``: a pure function of the two offsets (no agent is asked).

        A channel absent from ``start`` joined in this batch (nothing of it is read);
        one absent from ``end`` was retired.
        """
        first, _ = parse_offset(start)
        last, query = parse_offset(end)
        paths = self._paths()
        out: list[InputPartition] = []
        for cid in sorted(last):
            if cid not in first:
                continue
            s, e = first[cid], last[cid]
            if e < s:
                raise CheckpointMismatchError(
                    f"filechannel source: the micro-batch end {end} is below its start {start}"
                )
            if e == s:
                continue
            if cid in paths:
                out.extend(self.path_partitions(paths[cid], cid, s, e, query))
            else:
                out.extend(split(cid, s, e, self.options.partition_events, self._agents, self.options.keystore))
        return out

    def commit(self, end: dict[str, Any]) -> None:
        """Acknowledge every position below ``end``; an agent that cannot be reached gets it later (cumulative).

        Raises:
            DataLossError: ``end`` is beyond what a channel holds.
            CheckpointMismatchError: Another query took the consumer name over.
        """
        positions, query = parse_offset(end)
        self.query = bind_query(self.query, query)
        paths = self._paths()
        for cid, p in sorted(positions.items()):
            if cid in paths:
                self._path_ack(cid, paths[cid], p, query)
            else:
                self._pending[cid] = max(p, self._pending.get(cid, 0))
        self._flush_acks(query)

    def _path_ack(self, cid: str, path: str, p: int, query: str) -> None:
        r = self.reader(cid, query)
        with identity_guard(self.consumer, path):
            try:
                r.ack(p)
            except ConsumerIdentityError:
                raise
            except ChannelError as exc:
                visible = r.available()[1]
                if p <= visible:
                    raise
                loss = DataLossError(visible, p, f"the channel holds positions below {visible} only")
                raise lost(path, loss, AHEAD_HINT) from exc

    def _flush_acks(self, query: str) -> None:
        for cid, p in sorted(self._pending.items()):
            uri = self._where.get(cid)
            if uri is None:
                try:
                    self._discover()
                except ChannelError:
                    return
                uri = self._where.get(cid)
                if uri is None:
                    continue  # no agent serves it now: kept until one does
            try:
                if cid not in self._registered:
                    self._register(cid, query)
                with identity_guard(self.consumer, self._label(cid)):
                    try:
                        self._client(uri).ack(cid, self.consumer, p, IDENTITY_PREFIX + query)
                    except ConsumerIdentityError:
                        raise
                    except DataLossError as exc:
                        raise lost(f"{cid} at agent {uri}", exc, AHEAD_HINT) from exc
            except AgentUnavailableError as exc:
                logger.warning(
                    "filechannel source: acknowledgement of channel %s up to %d deferred: %s", cid, p, exc.reason
                )
                self._forget(uri)
                continue
            del self._pending[cid]

    def stop(self) -> None:
        """Close the connections and readers (Spark rarely calls this; nothing depends on it)."""
        super().stop()
        for c in self._clients.values():
            c.close()
        self._clients.clear()
