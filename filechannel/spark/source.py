"""The ``filechannel`` Spark data source: batch and exactly-once streaming reads of channel directories.

This module owns the mapping between Spark's Python Data Source API
(PySpark 4.2+) and :class:`filechannel.ChannelReader`; the sink lives in
:mod:`filechannel.spark.sink`. :func:`register` makes the short name
``"filechannel"`` available in a session::

    spark.readStream.format("filechannel").option("consumer", "q1").load(DIR)   # a stream
    spark.read.format("filechannel").load(DIR)                                  # a snapshot

Rows: ``position long, body binary, headers map<string,string>`` (plus
``channel string``, the directory, when several directories are read as one).

Options (case-insensitive):

``path``
    The channel directory (what ``load(DIR)`` sets), or several separated by
    commas, read as one stream with one position per channel.
``consumer`` (streaming; required)
    The consumer name this query reads and acknowledges under
    (``DIR/consumers/<name>.ack``). PySpark does not tell a Python source its
    checkpoint location or query id, so the name cannot be derived from them.
``maxEventsPerTrigger`` (streaming)
    No micro-batch holds more events (``ReadMaxRows``). Default: no limit.
``minEventsPerTrigger``, ``maxTriggerDelay`` (streaming)
    A micro-batch waits for at least this many events (the default read limit
    ``ReadMinRows``), no longer than the delay; not above ``maxEventsPerTrigger``.
    Ignored under ``trigger(once=True)`` (Spark passes ``ReadAllAvailable``) and ``availableNow``.
``startingPosition``, ``endingPosition``
    ``earliest``, ``latest``, a position, or per channel (JSON keyed by channel id
    or directory; a key naming no channel read is refused).
``failOnDataLoss``
    ``true`` only (what the source always does: a loss fails the query); ``false`` is refused.
``minPartitions``
    About how many partitions (Spark tasks) a micro-batch, or a snapshot, is
    cut into, of about equal bytes, so each core gets about one task per
    micro-batch. Default: the session's ``defaultParallelism`` when the source
    was registered with :func:`filechannel.spark.register`, else 2. A range
    under ``minPartitions`` times 4 MiB is cut into fewer (a task's fixed cost
    outweighs splitting it; as Spark's ``openCostInBytes``).
``maxPartitionBytes``
    A partition covers consecutive events of one data file spanning at most
    this many bytes (default 16 MiB): a large micro-batch gets more partitions
    than ``minPartitions``.
``resetConsumer`` (streaming; ``true``/``false``)
    Take over a consumer name registered by another query, e.g. after the
    Spark checkpoint was lost: reading resumes at the consumer's acknowledged
    position.
``agents``, ``tlsCa``, ``tlsCert``, ``tlsKey``, ``tokenFile``, ``agentTimeoutMs``,
``maxEventsPerPartition``, ``onAgentUnavailable``, ``agentHoldMs``, ``retireChannels``
    Channels on other hosts, read through ``filechannel serve`` agents (file
    paths only, never a secret's contents): see :mod:`filechannel.spark.remote`.
    ``path`` and ``agents`` mix; the rows then carry ``channel``.

Offsets are ``{"positions": {"<channel id>": N, ...}, "query": "<token>"}``:
every position below N was delivered, for each channel (keyed by the
channel's id, in sorted order, so a checkpoint is refused on another channel);
the token names the query (made when its checkpoint is new, then carried by
every offset in that checkpoint) and is the consumer's recorded identity, so a
second query or a lost checkpoint cannot silently share a consumer. Spark
compares offsets as JSON strings: they are always built by :func:`make_offset`.
(One consequence: a query killed while starting, after it registered its
consumer but before Spark logged its first offsets, has no token in its
checkpoint; its restart is refused like a lost checkpoint, and
``resetConsumer`` lets it continue.)

Which process runs what (see docs): ``initialOffset``, ``latestOffset``,
``partitions``, ``commit`` run in one long-lived source-runner process per
query, which holds the :class:`ChannelReader` s (no lock: readers are
lock-free); ``__init__`` also runs in a planner process whose instance is
pickled to the executors, so it only parses options. Executors read each
partition with :func:`filechannel.read_segment` (one ``pread``, every record
checked), never replaying the log, and hand Spark Arrow record batches. ``commit(end)`` acknowledges ``end``
(cumulative, idempotent); Spark calls it one micro-batch late, so after a stop
the consumer's acknowledgement trails the query's checkpoint by at most one
micro-batch, which the restarted query acknowledges first.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pyspark.sql.datasource import DataSourceReader, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    ReadMinRows,
    SupportsTriggerAvailableNow,
)

from filechannel._fs import DEFAULT_FS, read_file
from filechannel.consumers import ConsumerStore, validate_name
from filechannel.crypto import Encryption
from filechannel.directory import CHANNEL_FILE, decode_channel_file
from filechannel.errors import (
    ChannelError,
    ConfigError,
    ConsumerIdentityError,
    CorruptLogError,
    DataLossError,
    FormatError,
    NotAChannelError,
)
from filechannel.reader import ChannelReader, Segment

from .offsets import (
    AHEAD_HINT,
    BEHIND_HINT,
    CheckpointMismatchError,
    Pacing,
    bind_query,
    check_position_keys,
    identity_guard,
    lost,
    make_offset,
    parse_offset,
    position_option,
    resolve_position,
    share_partitions,
)

if TYPE_CHECKING:
    from pyspark.sql.types import StructType

__all__ = [
    "SCHEMA",
    "CheckpointMismatchError",
    "FileChannelBatchReader",
    "FileChannelStreamReader",
    "FilesNotVisibleError",
    "SourceOptions",
]

logger = logging.getLogger(__name__)

SCHEMA = "position long, body binary, headers map<string,string>"
MULTI_SCHEMA = SCHEMA + ", channel string"
DEFAULT_PARTITION_BYTES = 16 << 20
DEFAULT_MIN_PARTITIONS = 2  # when the session's defaultParallelism is not known (see FileChannelDataSource)
# No partition of fewer event bytes just to reach minPartitions: each task has a fixed cost (a Python
# worker, the Arrow stream to the JVM) that a small one does not repay (as Spark's openCostInBytes).
MIN_SPLIT_BYTES = 4 << 20
ROWS_PER_BATCH = 10_000
IDENTITY_PREFIX = "spark-query:"

_STREAM_ONLY = (
    "consumer",
    "maxeventspertrigger",
    "resetconsumer",
    "onagentunavailable",
    "agentholdms",
    "retirechannels",
    "mineventspertrigger",
    "maxtriggerdelay",
    "failondataloss",
)
_AGENT = ("agents", "tlsca", "tlscert", "tlskey", "tokenfile", "agenttimeoutms", "maxeventsperpartition")
_KNOWN = {
    "path",
    "paths",
    "maxpartitionbytes",
    "minpartitions",
    "keystore",
    "startingposition",
    "endingposition",
    *_STREAM_ONLY,
    *_AGENT,
}
DEFAULT_MAX_TRIGGER_DELAY = 15 * 60.0  # seconds; as the Kafka source's maxTriggerDelay
DEFAULT_PARTITION_EVENTS = 20_000
DEFAULT_AGENT_TIMEOUT_MS = 10_000
DEFAULT_AGENT_HOLD_MS = 300_000


class FilesNotVisibleError(ChannelError):
    """An executor cannot see a channel's files (another host, a container): read it through an agent."""


# -- options --------------------------------------------------------------------------------


@dataclass(frozen=True)
class SourceOptions:
    """The parsed read options (picklable; see the module docstring for their meaning)."""

    paths: tuple[str, ...]
    consumer: str | None = None
    max_events: int | None = None
    partition_bytes: int = DEFAULT_PARTITION_BYTES
    min_partitions: int = DEFAULT_MIN_PARTITIONS
    reset: bool = False
    keystore: str | None = None  # an encrypted channel's keystore path (never key bytes)
    # Agents (filechannel.spark.remote): URIs and file paths only, never a secret's contents.
    agents: tuple[str, ...] = ()
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    token_file: str | None = None
    agent_timeout: float = DEFAULT_AGENT_TIMEOUT_MS / 1000
    partition_events: int = DEFAULT_PARTITION_EVENTS
    on_unavailable: str = "hold"
    hold_seconds: float = DEFAULT_AGENT_HOLD_MS / 1000
    retire: tuple[str, ...] = ()
    # Kafka-style positions: "earliest", "latest", a position, or per channel (JSON: id or path -> one of them).
    starting: str | None = None
    ending: str | None = None  # batch reads only
    min_events: int | None = None
    max_trigger_delay: float = DEFAULT_MAX_TRIGGER_DELAY

    @classmethod
    def parse(
        cls, options: Mapping[str, str], *, streaming: bool, default_partitions: int | None = None
    ) -> SourceOptions:
        """Check ``options`` (as Spark passes them) and return them parsed.

        ``default_partitions`` is ``minPartitions`` when the option is not set
        (the session's ``defaultParallelism``, if the data source knows it).

        Raises:
            ConfigError: An option is unknown, missing or invalid; the message names it.
        """
        opts = {str(k).lower(): str(v) for k, v in options.items()}
        unknown = sorted(set(opts) - _KNOWN)
        if unknown:
            raise ConfigError(
                unknown[0],
                "the filechannel source has no such option (it knows path, agents, consumer, maxEventsPerTrigger, "
                "maxPartitionBytes, minPartitions, maxEventsPerPartition, resetConsumer, keystore, tlsCa, tlsCert, "
                "tlsKey, tokenFile, agentTimeoutMs, onAgentUnavailable, agentHoldMs, retireChannels, "
                "startingPosition, endingPosition, minEventsPerTrigger, maxTriggerDelay, failOnDataLoss)",
            )
        _fail_on_data_loss(opts)
        raw: list[str] = []
        if "paths" in opts:  # DataFrameReader.load([a, b]) passes a JSON list
            try:
                listed = json.loads(opts["paths"])
            except ValueError:
                listed = [opts["paths"]]
            raw.extend(str(p) for p in (listed if isinstance(listed, list) else [listed]))
        if "path" in opts:
            raw.append(opts["path"])
        paths = [p.strip() for r in raw for p in r.split(",") if p.strip()]
        agents = [a.strip() for a in opts.get("agents", "").split(",") if a.strip()]
        if not paths and not agents:
            raise ConfigError(
                "path",
                "no channel directory and no agent: use .load(DIR), .option('path', DIR) or "
                ".option('agents', 'grpc+tls://HOST:PORT,...')",
            )
        paths = [os.path.abspath(p) for p in paths]
        if len(set(paths)) != len(paths):
            raise ConfigError("path", f"a directory is listed twice in {paths}")
        keystore = opts.get("keystore") or None
        if keystore is not None:
            keystore = os.path.abspath(keystore)
            Encryption(keys=keystore)  # fail at once on a missing, exposed or malformed keystore
        remote = _agent_options(opts, agents)
        starting = position_option(opts, "startingPosition")
        ending = position_option(opts, "endingPosition")
        min_partitions = _positive(opts, "minPartitions", default_partitions or DEFAULT_MIN_PARTITIONS)
        if not streaming:
            return cls(
                tuple(paths),
                partition_bytes=_positive(opts, "maxPartitionBytes", DEFAULT_PARTITION_BYTES),
                min_partitions=min_partitions,
                keystore=keystore,
                starting=starting,
                ending=ending,
                **remote,
            )
        if ending is not None:
            raise ConfigError("endingPosition", "applies to batch reads only (a stream has no end)")
        if "consumer" not in opts:
            raise ConfigError(
                "consumer",
                "a streaming read needs .option('consumer', NAME): the name this query acknowledges under "
                "(one per query; PySpark does not tell a Python source its checkpoint location to derive it)",
            )
        reset = opts.get("resetconsumer", "false").lower()
        if reset not in ("true", "false"):
            raise ConfigError("resetConsumer", f"must be true or false, got {opts['resetconsumer']!r}")
        max_events = _positive(opts, "maxEventsPerTrigger", None)
        min_events = _positive(opts, "minEventsPerTrigger", None)
        if min_events is not None and max_events is not None and min_events > max_events:
            raise ConfigError(
                "minEventsPerTrigger",
                f"{min_events} is above maxEventsPerTrigger {max_events}: no micro-batch could reach the minimum, "
                "so each would wait the full maxTriggerDelay; lower minEventsPerTrigger or raise maxEventsPerTrigger",
            )
        return cls(
            tuple(paths),
            consumer=validate_name(opts["consumer"]),
            max_events=max_events,
            partition_bytes=_positive(opts, "maxPartitionBytes", DEFAULT_PARTITION_BYTES),
            min_partitions=min_partitions,
            reset=reset == "true",
            keystore=keystore,
            starting=starting,
            min_events=min_events,
            max_trigger_delay=_duration(opts, "maxTriggerDelay", DEFAULT_MAX_TRIGGER_DELAY),
            **remote,
            **_stream_agent_options(opts),
        )

    @property
    def multi(self) -> bool:
        """Whether the rows carry a ``channel`` column: several directories, or any agent."""
        return len(self.paths) > 1 or bool(self.agents)


def _fail_on_data_loss(opts: Mapping[str, str]) -> None:
    """``failOnDataLoss``: accepted as ``true`` (what the source always does), refused as ``false``."""
    raw = opts.get("failondataloss")
    if raw is None or raw.strip().lower() == "true":
        return
    if raw.strip().lower() == "false":
        raise ConfigError(
            "failOnDataLoss",
            "false is not supported: the filechannel source never skips events it cannot deliver (a checkpoint "
            "ahead of the channel, or behind its consumer's acknowledgement, fails with DataLossError naming the "
            "positions); to accept such a loss, start the query on a new checkpoint, or take a lost checkpoint's "
            "consumer over with option('resetConsumer', 'true')",
        )
    raise ConfigError("failOnDataLoss", f"must be true (false is not supported), got {raw!r}")


def _duration(opts: Mapping[str, str], name: str, default: float) -> float:
    """A duration option: seconds, or with a unit (``500ms``, ``30s``, ``5m``, ``1h``)."""
    raw = opts.get(name.lower())
    if raw is None:
        return default
    units = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    text = raw.strip().lower()
    unit = next((u for u in ("ms", "s", "m", "h") if text.endswith(u)), "s")
    try:
        value = float(text[: len(text) - len(unit)] if text.endswith(unit) else text) * units[unit]
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigError(name, f"must be a positive duration (e.g. 30s, 5m, 500ms), got {raw!r}")
    return value


def _agent_options(opts: Mapping[str, str], agents: list[str]) -> dict[str, Any]:
    """The agent options, checked (URIs parsed, files made absolute; the files are read by the client)."""
    from filechannel.agent.auth import parse_uri

    files = {}
    for name, key in (("tlsCa", "tls_ca"), ("tlsCert", "tls_cert"), ("tlsKey", "tls_key"), ("tokenFile", "token_file")):
        value = opts.get(name.lower()) or None
        if value is not None and not agents:
            raise ConfigError(name, "applies to agents only: give .option('agents', URI,...) too")
        files[key] = os.path.abspath(value) if value is not None else None
    if bool(files["tls_cert"]) != bool(files["tls_key"]):
        raise ConfigError("tlsCert", "give tlsCert and tlsKey together (a client certificate and its key)")
    for uri in agents:
        listen = parse_uri(uri, "agents")
        if not listen.tls:
            for name, key in (("tlsCa", "tls_ca"), ("tlsCert", "tls_cert")):
                if files[key]:
                    raise ConfigError(name, f"applies to grpc+tls:// agents only, and {uri} is not one")
    if len(set(agents)) != len(agents):
        raise ConfigError("agents", f"an agent is listed twice in {agents}")
    return {
        "agents": tuple(agents),
        **files,
        "agent_timeout": _positive(opts, "agentTimeoutMs", DEFAULT_AGENT_TIMEOUT_MS) / 1000,
        "partition_events": _positive(opts, "maxEventsPerPartition", DEFAULT_PARTITION_EVENTS),
    }


def _stream_agent_options(opts: Mapping[str, str]) -> dict[str, Any]:
    """``onAgentUnavailable``, ``agentHoldMs`` and ``retireChannels`` (streaming only)."""
    policy = opts.get("onagentunavailable", "hold").lower()
    if policy not in ("hold", "fail"):
        raise ConfigError("onAgentUnavailable", f"must be hold or fail, got {opts['onagentunavailable']!r}")
    retire = []
    for cid in opts.get("retirechannels", "").split(","):
        cid = cid.strip().lower()
        if not cid:
            continue
        try:
            bytes.fromhex(cid)
        except ValueError:
            raise ConfigError("retireChannels", f"{cid!r} is not a channel id (hex)") from None
        retire.append(cid)
    return {
        "on_unavailable": policy,
        "hold_seconds": _positive(opts, "agentHoldMs", DEFAULT_AGENT_HOLD_MS) / 1000,
        "retire": tuple(retire),
    }


def _positive(opts: Mapping[str, str], name: str, default: int | None) -> Any:
    value = opts.get(name.lower())
    if value is None:
        return default
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n <= 0:
        raise ConfigError(name, f"must be a positive integer, got {value!r}")
    return n


def _channel_id(path: str) -> str:
    """Return the id (hex) of the channel in ``path``, reading its ``CHANNEL`` file.

    Raises:
        NotAChannelError: ``path`` is missing or is not a channel directory.
        CorruptLogError: The ``CHANNEL`` file does not decode.
    """
    if not os.path.isdir(path):
        raise NotAChannelError(path, "no such directory" if not os.path.exists(path) else "not a directory")
    chan = os.path.join(path, CHANNEL_FILE)
    try:
        data = read_file(DEFAULT_FS, chan)
    except FileNotFoundError:
        raise NotAChannelError(path, "no CHANNEL file (create a channel with filechannel.open)") from None
    try:
        return decode_channel_file(data)[0].hex()
    except FormatError as exc:
        raise CorruptLogError(chan, exc.offset, exc.reason) from exc


# -- partitions and rows ----------------------------------------------------------------------


class SegmentPartition(InputPartition):
    """One Spark task: a :class:`Segment` of one channel (and its directory, for the ``channel`` column)."""

    def __init__(self, segment: Segment, channel: str | None, keystore: str | None = None) -> None:
        super().__init__((segment.path, segment.start, segment.end))
        self.segment = segment
        self.channel = channel
        self.keystore = keystore  # the path: an executor loads the keys itself


def _check_columns(schema: StructType, options: SourceOptions) -> StructType:
    """Return ``schema`` if every column is one the source makes (any subset, any order)."""
    allowed = ("position", "body", "headers", "channel") if options.multi else ("position", "body", "headers")
    for field in schema.fields:
        if field.name not in allowed:
            raise ConfigError("schema", f"the filechannel source has no column {field.name!r}; it has {allowed}")
    return schema


def _batches(partition: InputPartition, schema: StructType) -> Iterator[Any]:
    """Read one partition as Arrow record batches of exactly ``schema``.

    The segment is read straight into Arrow buffers (:func:`filechannel.arrow.read_segment_arrow`:
    every record checked, no Python object per event); the ``channel`` column is a constant.
    """
    from filechannel.arrow import read_segment_arrow

    if not isinstance(partition, SegmentPartition):  # Spark's placeholder for "no partitions"
        return
    batch = read_segment_arrow(partition.segment, encryption=partition.keystore)
    yield from shaped(batch, schema, partition.channel)


def shaped(batch: Any, schema: StructType, channel: str | None) -> Iterator[Any]:
    """``batch`` (the columns of ``arrow.read_segment_arrow``) as record batches of exactly ``schema``.

    At most ``ROWS_PER_BATCH`` rows each; the ``channel`` column is the constant ``channel``.
    Both readers (a local segment, an agent's range) hand Spark their batches through here.
    """
    import pyarrow as pa
    from pyspark.sql.pandas.types import to_arrow_schema

    arrow = to_arrow_schema(schema, timezone="UTC")
    for i in range(0, batch.num_rows, ROWS_PER_BATCH):
        chunk = batch.slice(i, ROWS_PER_BATCH)
        columns = []
        for field in arrow:
            if field.name == "channel":
                column = pa.repeat(pa.scalar(channel, type=field.type), chunk.num_rows)
            else:
                column = chunk.column(field.name)
                if column.type != field.type:
                    column = column.cast(field.type)
            columns.append(column)
        yield pa.RecordBatch.from_arrays(columns, schema=arrow)


def _read(partition: InputPartition, schema: StructType) -> Iterator[Any]:
    """Read one partition (on an executor): from an agent, or the channel's files on this host.

    A partition that reads itself (``filechannel.spark.remote.AgentPartition``: it has
    ``batches(schema)``) does; any other is a segment of a local channel.
    """
    own = getattr(partition, "batches", None)
    if callable(own):
        return own(schema)  # type: ignore[no-any-return]
    return _local_batches(partition, schema)


def _local_batches(partition: InputPartition, schema: StructType) -> Iterator[Any]:
    """:func:`_batches`, and a file this host cannot see named as such (not as a retired one)."""
    try:
        yield from _batches(partition, schema)
    except DataLossError as exc:
        if isinstance(partition, SegmentPartition):
            data_dir = os.path.dirname(partition.segment.path)
            if not os.path.isdir(data_dir):
                import socket

                raise FilesNotVisibleError(
                    f"filechannel source: this executor (host {socket.gethostname()}, pid {os.getpid()}) cannot "
                    f"see the channel's files: the directory {data_dir} does not exist here, so positions "
                    f"[{exc.start}, {exc.end}) cannot be read. The path option needs every executor to see the "
                    "channel directory (local mode, or the same host); on a cluster, run `filechannel serve` on "
                    "the channel's host and read it with .option('agents', URI) instead"
                ) from exc
        raise


def _plan(reader: ChannelReader, start: int, end: int, options: SourceOptions, parts: int) -> list[Segment]:
    """The segments of ``[start, end)``: about ``parts`` of equal bytes, each within ``maxPartitionBytes``.

    A pure function of the range, the options and where the events lie, so a replayed
    micro-batch gets the same tasks (and a different split would read the same events).
    """
    return reader.segments(start, end, options.partition_bytes, parts=parts, min_bytes=MIN_SPLIT_BYTES)


def _partitions(segments: Sequence[Segment], channel: str | None, keystore: str | None) -> list[InputPartition]:
    return [SegmentPartition(s, channel, keystore) for s in segments]


# -- the data source ------------------------------------------------------------------------


class FileChannelBatchReader(DataSourceReader):
    """A snapshot: the committed events the channel still holds, read through a view; acknowledges nothing."""

    def __init__(
        self,
        options: SourceOptions,
        schema: StructType,
        agent_partitions: Callable[..., list[InputPartition]] | None = None,
    ) -> None:
        self.options = options
        self.schema = _check_columns(schema, options)
        # The agents' channels (``filechannel.spark.remote.snapshot_partitions``): given by the data source.
        self.agent_partitions = agent_partitions

    def partitions(self) -> Sequence[InputPartition]:
        """Plan the snapshot: about ``minPartitions`` segments per channel (runs in the planner process)."""
        out: list[InputPartition] = []
        if not self.options.agents:  # with agents, snapshot_partitions checks against every channel read
            for name, option in (("startingPosition", self.options.starting), ("endingPosition", self.options.ending)):
                check_position_keys(option, name, self._path_ids())
        for path in self.options.paths:
            _channel_id(path)  # a clear error for a missing directory
            with ChannelReader(path, encryption=self.options.keystore) as view:
                start, end = view.available()
                cid = _channel_id(path)
                s = resolve_position(self.options.starting, "startingPosition", cid, path, start, end, "earliest")
                e = resolve_position(self.options.ending, "endingPosition", cid, path, start, end, "latest")
                if e < s:
                    raise ConfigError("endingPosition", f"{e} is before startingPosition {s} (channel {path})")
                segments = _plan(view, s, e, self.options, self.options.min_partitions) if e > s else []
            out.extend(_partitions(segments, path if self.options.multi else None, self.options.keystore))
        if self.options.agents:
            if self.agent_partitions is None:
                raise ConfigError("agents", "this reader was made without the agent transport (use the data source)")
            out.extend(self.agent_partitions(self.options, taken=self._path_ids()))
        return out

    def _path_ids(self) -> dict[str, str]:
        return {_channel_id(p): p for p in self.options.paths}

    def read(self, partition: InputPartition) -> Iterator[Any]:
        """Read one partition's events as Arrow record batches (runs on an executor)."""
        return _read(partition, self.schema)


class FileChannelStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """An exactly-once micro-batch reader of one or more channels under one consumer name.

    ``__init__`` only keeps the options: it runs in two processes and the
    planner's copy is pickled to the executors. Readers are opened lazily in the
    source-runner process, by the first driver-side call.
    """

    def __init__(self, options: SourceOptions, schema: StructType) -> None:
        assert options.consumer is not None
        self.options = options
        self.schema = _check_columns(schema, options)
        self.consumer: str = options.consumer
        self._ids: dict[str, str] | None = None  # channel id -> directory
        self._readers: dict[str, ChannelReader] = {}
        self.query: str | None = None  # the token this process reads under (see bind_query)
        self.new_query: str | None = None  # the token initialOffset made
        self.pacing = Pacing(self.consumer, options.max_trigger_delay)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_readers"] = {}
        return state

    # -- the runner's state, and what AgentStreamReader shares of it ----------------------------

    def channels(self) -> dict[str, str]:
        """The channel directories read (``path``), by channel id.

        Raises:
            ConfigError: Two paths are the same channel.
        """
        if self._ids is None:
            ids: dict[str, str] = {}
            for path in self.options.paths:
                cid = _channel_id(path)
                if cid in ids:
                    raise ConfigError("path", f"{ids[cid]} and {path} are the same channel (id {cid})")
                ids[cid] = path
            self._ids = ids
        return self._ids

    def _check(self, positions: Mapping[str, int]) -> dict[str, str]:
        ids = self.channels()
        if set(positions) != set(ids):
            theirs = ", ".join(sorted(positions)) or "none"
            ours = ", ".join(f"{cid} ({ids[cid]})" for cid in sorted(ids))
            raise CheckpointMismatchError(
                f"filechannel source: this query's Spark checkpoint belongs to channel(s) {theirs}, but it reads "
                f"{ours}: a checkpoint follows one set of channels; give this query its own checkpoint location"
            )
        return ids

    def reader(self, cid: str, query: str) -> ChannelReader:
        """The reader of the local channel ``cid`` under query token ``query``, opened (and registered) once.

        Raises:
            CheckpointMismatchError: ``query`` is not the token this process reads under, or the
                consumer belongs to another query.
        """
        self.query = bind_query(self.query, query)
        r = self._readers.get(cid)
        if r is None:
            path = self.channels()[cid]
            r = ChannelReader(
                path,
                self.consumer,
                identity=IDENTITY_PREFIX + query,
                reset=self.options.reset,
                encryption=self.options.keystore,
            )
            with identity_guard(self.consumer, path):
                r.acked  # noqa: B018  (registers the consumer, or checks its identity, now)
            self._readers[cid] = r
        return r

    # -- Spark's calls (source runner) ---------------------------------------------------------

    def initialOffset(self) -> dict[str, Any]:
        """Start a new query at each channel's acknowledged position (the head for a new consumer)."""
        query = self.new_query or self.query or uuid.uuid4().hex[:16]
        self.new_query = query
        if not self.options.agents:  # with agents, AgentStreamReader checks against every channel read
            check_position_keys(self.options.starting, "startingPosition", self.channels())
        positions: dict[str, int] = {}
        for cid, path in self.channels().items():
            r = self._readers.get(cid)
            if r is not None:
                positions[cid] = r.available()[0]
                continue
            cur = ConsumerStore(DEFAULT_FS, path).list().get(self.consumer)
            if cur is not None:
                # Registered already: by this query before a crash in its first micro-batch (Spark then
                # replays that batch with the logged end, whose token is the recorded one), or by
                # another query (refused as soon as this one reads).
                positions[cid] = cur.acked
            else:
                r = self.reader(cid, query)  # registers the consumer at the channel's head
                start, end = r.available()
                at = resolve_position(self.options.starting, "startingPosition", cid, path, start, end, "earliest")
                if at > start:
                    r.ack(at)  # a new consumer that starts later: what it skips is done for it
                positions[cid] = r.available()[0]
        return make_offset(positions, query)

    def getDefaultReadLimit(self) -> ReadLimit:
        """``ReadMinRows(minEventsPerTrigger)``, else ``ReadMaxRows(maxEventsPerTrigger)``, else ``ReadAllAvailable``.

        Spark passes this limit to :meth:`latestOffset`, except under ``trigger(once=True)``,
        where it passes ``ReadAllAvailable``: both options are then ignored, as by the
        Kafka source (a scheduled run delivers a remainder below the minimum). PySpark has
        no composite limit, so with both options set the limit says the minimum and the
        maximum comes from the options.
        """
        if self.options.min_events is not None:
            return ReadMinRows(self.options.min_events)
        if self.options.max_events is not None:
            return ReadMaxRows(self.options.max_events)
        return ReadAllAvailable()

    def admit(self, avail: Mapping[str, int], limit: ReadLimit) -> dict[str, int]:
        """How many events of each channel the next micro-batch takes, of ``avail``, under ``limit``.

        ``ReadMaxRows`` caps the total (shared fairly); ``ReadMinRows`` (see
        :meth:`getDefaultReadLimit`) caps it at ``maxEventsPerTrigger`` and takes nothing
        while fewer than the minimum are there (``Pacing.too_few``); ``ReadAllAvailable``
        (``trigger(once=True)``) takes everything.
        """
        cap = (
            limit.max_rows
            if isinstance(limit, ReadMaxRows)
            else self.options.max_events
            if isinstance(limit, ReadMinRows)
            else None
        )
        return self.pacing.admit(avail, cap, limit.min_rows if isinstance(limit, ReadMinRows) else None)

    def prepareForTriggerAvailableNow(self) -> None:
        """Record each channel's committed end now: an ``availableNow`` query stops there."""
        target: dict[str, int] = {}
        for cid, path in self.channels().items():
            with ChannelReader(path, encryption=self.options.keystore) as view:
                target[cid] = view.available()[1]
        self.pacing.target = target

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        """Return the end of the next micro-batch: what is committed, within ``limit`` and the availableNow end.

        Raises:
            DataLossError: ``start`` is beyond what a channel holds or below its acknowledged position.
        """
        positions, query = parse_offset(start)
        ids = self._check(positions)
        avail: dict[str, int] = {}
        for cid, s in positions.items():
            avail[cid] = self.path_available(cid, ids[cid], s, query)
        take = self.admit(avail, limit)
        return make_offset({cid: s + take[cid] for cid, s in positions.items()}, query)

    def path_available(self, cid: str, path: str, s: int, query: str) -> int:
        """Events of the local channel ``cid`` (at ``path``) from position ``s`` (see ``Pacing.available_from``)."""
        r = self.reader(cid, query)
        with identity_guard(self.consumer, path):
            acked, end = r.available()
        return self.pacing.available_from(path, cid, s, acked, end)

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        """Split ``[start, end)`` into about ``minPartitions`` segments (:func:`_plan`): the same for the same range.

        Raises:
            DataLossError: The range is no longer (or not) in the channel.
        """
        first, _ = parse_offset(start)
        last, query = parse_offset(end)  # the end's token is the recorded one (see initialOffset)
        ids = self._check(last)
        self._check(first)
        for cid in sorted(last):
            if last[cid] < first[cid]:
                raise CheckpointMismatchError(
                    f"filechannel source: the micro-batch end {end} is below its start {start}"
                )
        parts = share_partitions({cid: last[cid] - first[cid] for cid in last}, self.options.min_partitions)
        out: list[InputPartition] = []
        for cid in sorted(last):
            s, e = first[cid], last[cid]
            if e == s:
                continue
            out.extend(self.path_partitions(ids[cid], cid, s, e, query, parts[cid]))
        return out

    def path_partitions(
        self, path: str, cid: str, s: int, e: int, query: str, parts: int | None = None
    ) -> list[InputPartition]:
        """The partitions of ``[s, e)`` of the local channel ``path`` (id ``cid``): about ``parts`` of them."""
        r = self.reader(cid, query)
        try:
            with identity_guard(self.consumer, path):
                segments = _plan(r, s, e, self.options, self.options.min_partitions if parts is None else parts)
        except DataLossError as exc:
            acked, visible = r.available()
            hint = AHEAD_HINT if e > visible else BEHIND_HINT if s < acked else "a data file holding them is gone"
            raise lost(path, exc, hint) from exc
        return _partitions(segments, path if self.options.multi else None, self.options.keystore)

    def read(self, partition: InputPartition) -> Iterator[Any]:
        """Read one partition's events as Arrow record batches (on an executor, from the pickled planner copy)."""
        return _read(partition, self.schema)

    def commit(self, end: dict[str, Any]) -> None:
        """Acknowledge every position below ``end`` (cumulative and idempotent; Spark calls it a batch late).

        Raises:
            DataLossError: ``end`` is beyond what a channel holds.
            CheckpointMismatchError: Another query took the consumer name over.
        """
        positions, query = parse_offset(end)
        ids = self._check(positions)
        for cid, p in sorted(positions.items()):
            r = self.reader(cid, query)
            with identity_guard(self.consumer, ids[cid]):
                try:
                    r.ack(p)
                except ConsumerIdentityError:
                    raise
                except ChannelError as exc:
                    visible = r.available()[1]
                    if p <= visible:
                        raise
                    loss = DataLossError(visible, p, f"the channel holds positions below {visible} only")
                    raise lost(ids[cid], loss, AHEAD_HINT) from exc

    def stop(self) -> None:
        """Forget the readers (Spark rarely calls this; nothing depends on it)."""
        for r in self._readers.values():
            r.close()
        self._readers.clear()
