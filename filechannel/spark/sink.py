"""The Spark sink: DataFrame rows into a channel, one transaction per micro-batch, exactly once per batch id.

This module owns the write side of the ``filechannel`` Spark data source:

* :class:`FileChannelStreamWriter` (``df.writeStream.format("filechannel")``) and
  :class:`FileChannelBatchWriter` (``df.write.format("filechannel")``), which
  Spark constructs with the query's options and the DataFrame's schema;
* the staging area ``DIR/spark-sink/staging/``: each Spark task writes its rows
  to one staged file there (atomic and durable before the task returns), and
  reports the file in its commit message;
* the per-query state ``DIR/spark-sink/queries/<query>.state`` (the last batch
  id committed, and the intent of the batch being committed), and the commit
  protocol that puts a batch's staged rows in one channel transaction exactly
  once per (query, batch id), across crashes at any point (:class:`SinkCommitter`).

It must not hold the channel open across tasks or batches (a channel has one
owning process, ``flock``): executors only write staged files; the commit opens
the channel, commits and closes it. Every durability call goes through the
``_fs`` seam, so the commit protocol is crash-tested on a simulated file system
without Spark. See docs/spark.md ("Sink") for the options and the argument for
exactly once.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql.types import StructType

try:
    from pyspark.sql.datasource import DataSourceArrowWriter, DataSourceStreamArrowWriter, WriterCommitMessage
except ImportError:  # pragma: no cover - depends on the installation
    # Staging and the commit protocol (SinkCommitter) need neither PySpark nor pyarrow;
    # without PySpark no Spark query can run, so the writers' bases are plain classes.
    class WriterCommitMessage:  # type: ignore[no-redef]
        """Stand-in for PySpark's base class of commit messages (PySpark is not installed)."""

    class DataSourceArrowWriter:  # type: ignore[no-redef]
        """Stand-in for PySpark's batch writer base class (PySpark is not installed)."""

    class DataSourceStreamArrowWriter:  # type: ignore[no-redef]
        """Stand-in for PySpark's streaming writer base class (PySpark is not installed)."""


from filechannel._fs import DEFAULT_FS, FS, read_file, replace_durably
from filechannel.channel import FileChannel, open_channel
from filechannel.config import ChannelConfig
from filechannel.consumers import ConsumerStore
from filechannel.crypto import Encryption
from filechannel.directory import CHANNEL_FILE, decode_meta, encode_meta
from filechannel.errors import (
    ChannelError,
    ChannelLockedError,
    ConfigError,
    CorruptLogError,
    FormatError,
    InvalidEventError,
    TransactionCapacityError,
)
from filechannel.permissions import fs_for
from filechannel.reader import ChannelReader
from filechannel.staged import (  # the staged-file format, shared with the agent
    CHUNK_BODIES,
    CHUNK_PAYLOADS,
    DEFAULT_STALE_STAGING,
    HEADER_BATCH,
    HEADER_QUERY,
    SINK_DIR,
    STAGE_SUFFIX,
    STAGING_DIR,
    TMP_PREFIX,
    StagedChunk,
    created_ns,
    ensure_dir,
    headers_overhead,
    job_prefix,
    put_chunks,
    read_staged,
    read_staged_chunks,
    sink_headers,
    slug,
    stage_chunks,
    stage_events,
    stream_prefix,
)

from .agent_sink import AGENT_OPTIONS, AgentSinkOptions, AgentSinkTarget

__all__ = [
    "HEADER_BATCH",
    "HEADER_QUERY",
    "BatchOutcome",
    "FileChannelBatchWriter",
    "FileChannelStreamWriter",
    "Pending",
    "QueryState",
    "SinkCommitter",
    "SinkLockedError",
    "SinkOptions",
    "StagedFiles",
    "TaskInfo",
    "read_staged",
    "stage_events",
]

logger = logging.getLogger(__name__)

QUERIES_DIR = "queries"

DEFAULT_LOCK_TIMEOUT = 30.0
_SINK_OPTIONS = ("path", "checkpointlocation", "locktimeout", "stalestagingseconds", "keystore")
_CHANNEL_PREFIX = "channel."
_GUARD_PREFIX = "spark-sink."
# Spark's local properties on a streaming query's tasks (StreamExecution.QUERY_ID_KEY,
# MicroBatchExecution.BATCH_ID_KEY): the query id is the one in the checkpoint's metadata file.
_QUERY_ID_PROPERTY = "sql.streaming.queryId"
_BATCH_ID_PROPERTY = "streaming.sql.batchId"


class SinkLockedError(ChannelLockedError):
    """The sink could not open its channel: another process kept it open for the whole ``lockTimeout``."""

    def __init__(self, path: str, waited: float, what: str) -> None:
        super().__init__(path)
        self.waited = waited
        self.args = (
            f"channel directory {path} stayed open by another process for {waited:.1f} s while the Spark sink "
            f"tried to commit {what}: a channel has one owning process at a time. Close the other owner (a "
            "reader in another process can use filechannel.ChannelReader, which takes no lock), or raise the "
            "sink's lockTimeout option. Nothing of this batch was written; a restarted query commits it again.",
        )


# --------------------------------------------------------------------------
# options


@dataclass(frozen=True)
class SinkOptions:
    """The sink's options, parsed from Spark's (case-insensitive, string-valued) options.

    Attributes:
        path: The channel directory (option ``path``, or ``save(path)`` / ``start(path)``).
        channel: Channel options from ``channel.<name>`` options, converted to
            their types and validated by :class:`~filechannel.ChannelConfig`.
        lock_timeout: Seconds a commit retries while another process holds the channel.
        stale_staging: Seconds after which a staged file nobody committed is swept.
        checkpoint_location: The query's ``checkpointLocation`` option, if given (used
            only when a task could not tell the query id).
        keystore: The ``keystore`` option: the path of the keystore of an encrypted
            channel (never key bytes: the path is what travels to executors). Its
            last key encrypts new data files and the staged rows.
        agent: With ``.option("agent", URI)``: rows are staged at, and committed by, the
            agent that owns the channel (:mod:`filechannel.spark.agent_sink`); ``path``
            is then empty.
    """

    path: str
    channel: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT
    stale_staging: float = DEFAULT_STALE_STAGING
    checkpoint_location: str | None = None
    keystore: str | None = None
    agent: AgentSinkOptions | None = None

    @classmethod
    def from_spark(cls, options: Mapping[str, str]) -> SinkOptions:
        """Parse and validate Spark options.

        Raises:
            ConfigError: ``path`` is missing, an option is unknown, or a value is invalid
                (``.option`` names the Spark option, e.g. ``channel.capacity``).
        """
        opts = {str(k).lower(): v for k, v in options.items()}
        if "agent" in opts:
            return cls._through_agent(opts)
        channel: dict[str, Any] = {}
        for key, value in opts.items():
            if key.startswith(_CHANNEL_PREFIX):
                channel[key[len(_CHANNEL_PREFIX) :]] = value
            elif key in AGENT_OPTIONS:
                raise ConfigError(key, "is an option of the sink through an agent: give .option('agent', URI) too")
            elif key not in _SINK_OPTIONS:
                raise ConfigError(
                    key,
                    "unknown option of the filechannel sink (known: path, checkpointLocation, lockTimeout, "
                    "staleStagingSeconds, keystore, and channel.<name> for any channel option such as "
                    "channel.capacity)",
                )
        path = opts.get("path")
        if not path:
            raise ConfigError("path", "the filechannel sink needs the channel directory: .option('path', DIR)")
        if "encryption" in channel:
            raise ConfigError("channel.encryption", "give the keystore path with .option('keystore', PATH)")
        converted = _channel_options(channel)
        keystore = opts.get("keystore") or None
        if keystore is not None:
            keystore = os.path.abspath(str(keystore))
            Encryption(keys=keystore)  # fail at once on a missing, exposed or malformed keystore
        return cls(
            path=os.path.abspath(str(path)),
            channel=converted,
            lock_timeout=_seconds(opts, "locktimeout", "lockTimeout", DEFAULT_LOCK_TIMEOUT),
            stale_staging=_seconds(opts, "stalestagingseconds", "staleStagingSeconds", DEFAULT_STALE_STAGING),
            checkpoint_location=opts.get("checkpointlocation") or None,
            keystore=keystore,
        )

    @classmethod
    def _through_agent(cls, opts: Mapping[str, Any]) -> SinkOptions:
        """The options of the sink through an agent (the agent owns the channel and its options)."""
        for key in opts:
            if key.startswith(_CHANNEL_PREFIX) or key in ("path", "keystore", "locktimeout"):
                why = {
                    "path": "the agent's channel is named with .option('channel', ID or NAME), not a path",
                    "keystore": "the agent encrypts with its own --keystore (staged rows too)",
                    "locktimeout": "the agent owns the channel: there is no lock to wait for",
                }.get(key, "the agent's channel options are set where it runs: filechannel serve --capacity ...")
                raise ConfigError(key, f"not an option of the sink through an agent: {why}")
            if key not in AGENT_OPTIONS and key not in ("checkpointlocation", "stalestagingseconds"):
                raise ConfigError(
                    key,
                    "unknown option of the filechannel sink through an agent (known: agent, channel, tlsCa, tlsCert, "
                    "tlsKey, tokenFile, agentTimeoutMs, agentRetryMs, agentFullWaitMs, staleStagingSeconds, "
                    "checkpointLocation)",
                )
        if not str(opts["agent"]).strip():
            raise ConfigError("agent", "give the agent's URI, e.g. grpc+tls://host:8815")
        return cls(
            path="",
            stale_staging=_seconds(opts, "stalestagingseconds", "staleStagingSeconds", DEFAULT_STALE_STAGING),
            checkpoint_location=opts.get("checkpointlocation") or None,
            agent=AgentSinkOptions.from_spark(opts),
        )

    def encryption(self) -> Encryption | None:
        """The keystore, loaded (each call reads it: a rotation needs no restart of the query), or None."""
        return None if self.keystore is None else Encryption(keys=self.keystore)

    def config(self) -> ChannelConfig:
        """Return the channel configuration these options give (see :func:`_config`)."""
        return _config(self.channel)

    @property
    def sink_dir(self) -> str:
        """``DIR/spark-sink``."""
        return os.path.join(self.path, SINK_DIR)

    @property
    def staging_dir(self) -> str:
        """``DIR/spark-sink/staging``: one file per successful task attempt until its batch commits."""
        return os.path.join(self.path, SINK_DIR, STAGING_DIR)

    @property
    def queries_dir(self) -> str:
        """``DIR/spark-sink/queries``: one state file per streaming query."""
        return os.path.join(self.path, SINK_DIR, QUERIES_DIR)


def _seconds(opts: Mapping[str, Any], key: str, name: str, default: float) -> float:
    raw = opts.get(key)
    if raw is None:
        return default
    try:
        v = float(raw)
    except (TypeError, ValueError):
        raise ConfigError(name, f"must be a number of seconds, got {raw!r}") from None
    if not v >= 0 or v == float("inf"):
        raise ConfigError(name, f"must be a finite number of seconds >= 0, got {raw!r}")
    return v


def _config(channel: Mapping[str, Any]) -> ChannelConfig:
    """The channel configuration of ``channel.<name>`` options.

    ``transaction_capacity`` defaults to ``capacity`` here: the sink's own open
    raises it to ``capacity`` anyway (a batch is one transaction), so a small
    ``channel.capacity`` alone is valid.
    """
    opts = dict(channel)
    if "transaction_capacity" not in opts:
        opts["transaction_capacity"] = min(
            ChannelConfig.transaction_capacity, opts.get("capacity", ChannelConfig.capacity)
        )
    return ChannelConfig.from_options(opts)


def _channel_options(raw: Mapping[str, Any]) -> dict[str, Any]:
    """Convert ``channel.<name>`` string values to the types ChannelConfig expects, and validate them."""
    known = {f.name: f for f in dataclasses.fields(ChannelConfig)}
    out: dict[str, Any] = {}
    for name, value in raw.items():
        f = known.get(name)
        if f is None:
            raise ConfigError(_CHANNEL_PREFIX + name, f"unknown channel option (known: {', '.join(sorted(known))})")
        if not isinstance(value, str):
            out[name] = value
            continue
        text = value.strip()
        default = f.default
        try:
            if name == "data_dirs":
                out[name] = tuple(p.strip() for p in text.split(",") if p.strip())
            elif name == "max_event_size" or (isinstance(default, int) and not isinstance(default, bool)):
                out[name] = int(text)
            elif isinstance(default, float):
                out[name] = float(text)
            else:
                out[name] = text
        except ValueError:
            kind = "a float" if isinstance(default, float) else "an int"
            raise ConfigError(_CHANNEL_PREFIX + name, f"must be {kind}, got {value!r}") from None
    try:
        _config(out)
    except ConfigError as exc:
        raise ConfigError(_CHANNEL_PREFIX + exc.option, exc.reason) from exc
    return out


# --------------------------------------------------------------------------
# the input schema


@dataclass(frozen=True)
class _Columns:
    """Which input columns hold the body and the headers."""

    body: str
    body_is_text: bool
    headers: str | None


def _check_schema(schema: StructType) -> _Columns:
    """Return the body/headers columns of ``schema``.

    Raises:
        ConfigError: A column other than ``body``/``headers``, no ``body``, or a wrong type.
    """
    from pyspark.sql.types import BinaryType, MapType, StringType  # a schema comes from PySpark

    names = [f.name for f in schema.fields]
    extra = [n for n in names if n not in ("body", "headers")]
    if extra:
        raise ConfigError(
            "schema",
            f"unexpected column(s) {', '.join(repr(n) for n in extra)}: the filechannel sink writes a `body` "
            "column (binary or string) and an optional `headers` column (map<string,string>); select them, "
            "e.g. df.select(col('value').alias('body'))",
        )
    if "body" not in names:
        raise ConfigError("schema", "no `body` column: the filechannel sink needs `body` (binary or string)")
    body = schema["body"].dataType
    if not isinstance(body, (BinaryType, StringType)):
        raise ConfigError("schema", f"column `body` must be binary or string, got {body.simpleString()}")
    headers: str | None = None
    if "headers" in names:
        h = schema["headers"].dataType
        if not (isinstance(h, MapType) and isinstance(h.keyType, StringType) and isinstance(h.valueType, StringType)):
            raise ConfigError("schema", f"column `headers` must be map<string,string>, got {h.simpleString()}")
        headers = "headers"
    return _Columns("body", isinstance(body, StringType), headers)


# --------------------------------------------------------------------------
# staged files


def _staged_name(prefix: str, partition: int, attempt: int) -> str:
    return f"{prefix}p{partition}.a{attempt}.{os.getpid()}.{time.time_ns()}{STAGE_SUFFIX}"


def _write_atomic(fs: FS, directory: str, name: str, data: bytes) -> None:
    """Write ``directory/name`` atomically and durably: temporary file, fsync, rename, fsync of the directory."""
    tmp = os.path.join(directory, f"{TMP_PREFIX}{name}.{os.getpid()}.{time.time_ns()}")
    replace_durably(fs, tmp, os.path.join(directory, name), data)


# --------------------------------------------------------------------------
# commit messages and task identity


@dataclass(frozen=True)
class StagedFiles(WriterCommitMessage):
    """A task's commit message: the files it staged (names in the staging directory) and what they hold.

    Attributes:
        files: Staged file names (none for an empty partition).
        rows: Rows in them.
        nbytes: Bytes in them.
        query: The streaming query's id as the task saw it (None in a batch job).
        batch_id: The micro-batch id as the task saw it (None in a batch job).
        job: A batch job's id (None when streaming).
    """

    files: tuple[str, ...]
    rows: int
    nbytes: int
    query: str | None = None
    batch_id: int | None = None
    job: str | None = None


@dataclass(frozen=True)
class TaskInfo:
    """What a Spark task knows about itself (from ``TaskContext``)."""

    partition: int = 0
    attempt: int = 0
    query: str | None = None
    batch_id: int | None = None


def task_info() -> TaskInfo:
    """Return the running Spark task's partition, attempt, query id and batch id (defaults outside a task)."""
    from pyspark import TaskContext

    tc = TaskContext.get()
    if tc is None:
        return TaskInfo()
    query = tc.getLocalProperty(_QUERY_ID_PROPERTY) or None
    batch = tc.getLocalProperty(_BATCH_ID_PROPERTY)
    return TaskInfo(tc.partitionId(), tc.attemptNumber(), query, int(batch) if batch and batch.isdigit() else None)


# --------------------------------------------------------------------------
# the per-query state


@dataclass(frozen=True)
class Pending:
    """The intent of a batch being committed: where its events go.

    Attributes:
        batch_id: The micro-batch id.
        first: The channel's next position when the batch's transaction began
            (its first event's position, if it commits).
        count: Events in the batch.
    """

    batch_id: int
    first: int
    count: int


@dataclass(frozen=True)
class QueryState:
    """What the sink recorded for one streaming query.

    Attributes:
        query: The query id.
        last_batch: The highest batch id known committed (-1: none).
        pending: A batch whose commit began and whose outcome is not yet recorded.
    """

    query: str
    last_batch: int = -1
    pending: Pending | None = None


class _StateStore:
    """``DIR/spark-sink/queries/<slug>.state``: checksummed one-line JSON, replaced atomically."""

    def __init__(self, fs: FS, options: SinkOptions) -> None:
        self.fs = fs
        self.dir = options.queries_dir

    def path(self, query: str) -> str:
        return os.path.join(self.dir, slug(query) + ".state")

    def load(self, query: str) -> QueryState:
        path = self.path(query)
        try:
            buf = read_file(self.fs, path)
        except FileNotFoundError:
            return QueryState(query)
        hint = (
            "the Spark sink's state file of this query is damaged; it cannot tell which batches were "
            "committed. Inspect the channel (events carry spark.query and spark.batch_id headers) before "
            "deleting the file"
        )
        try:
            obj = decode_meta(buf, f"sink state {path}")
            if obj.get("version") != 1 or obj.get("query") != query:
                raise FormatError(0, "unexpected version or query")
            last = obj["last_batch"]
            p = obj.get("pending")
            pending = None if p is None else Pending(int(p["batch_id"]), int(p["first"]), int(p["count"]))
            return QueryState(query, int(last), pending)
        except FormatError as exc:
            raise CorruptLogError(path, exc.offset, exc.reason, hint) from exc
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptLogError(path, 0, f"malformed state: {exc}", hint) from exc

    def save(self, state: QueryState) -> None:
        ensure_dir(self.fs, self.dir)
        # A crash between create and rename leaves a temporary file; this query's commits
        # run one at a time (under the channel's lock), so any left now is no write in progress.
        leftover = f"{TMP_PREFIX}{slug(state.query)}.state."
        for name in self.fs.listdir(self.dir):
            if name.startswith(leftover):
                try:
                    self.fs.unlink(os.path.join(self.dir, name))
                except FileNotFoundError:
                    pass
        obj: dict[str, Any] = {
            "version": 1,
            "query": state.query,
            "last_batch": state.last_batch,
            "pending": None if state.pending is None else dataclasses.asdict(state.pending),
            "updated_ns": time.time_ns(),
        }
        _write_atomic(self.fs, self.dir, os.path.basename(self.path(state.query)), encode_meta(obj))


def _guard_name(query: str) -> str:
    return _GUARD_PREFIX + slug(query)


# --------------------------------------------------------------------------
# the commit protocol


@dataclass(frozen=True)
class BatchOutcome:
    """What :meth:`SinkCommitter.commit_batch` did.

    Attributes:
        committed: Whether this call put the batch's events in the channel.
        rows: Events put by this call (0 when skipped).
        first_position: The first event's position, when committed.
        reason: ``"committed"``, ``"already committed"`` or ``"empty"``.
    """

    committed: bool
    rows: int
    first_position: int | None
    reason: str


class SinkCommitter:
    """The driver side of the sink: puts staged rows into the channel, exactly once per (query, batch id).

    Plain Python, no Spark: the writers call it from Spark's commit worker, and
    tests call it directly (with a simulated file system through ``fs``).

    Args:
        options: The sink's options.
        fs: The I/O seam.
        sleep: Waits between attempts to open a locked channel (tests shorten it).
    """

    def __init__(self, options: SinkOptions, *, fs: FS | None = None, sleep: Callable[[float], None] = time.sleep):
        self.options = options
        self.fs = fs_for(fs or DEFAULT_FS, options.config().permissions)
        self.sleep = sleep

    # -- the channel ---------------------------------------------------------------------

    def open_channel(self, what: str) -> FileChannel:
        """Open the channel for the sink's own use, retrying while another process holds it.

        The sink's open raises ``transaction_capacity`` to ``capacity``, so that
        a batch is always one transaction.

        Raises:
            SinkLockedError: The channel stayed locked for ``lockTimeout`` seconds.
            ConfigError: A channel option is invalid.
            NotAChannelError: ``path`` is not a channel directory.
        """
        opts = dict(self.options.channel)
        cfg = self.options.config()
        opts["transaction_capacity"] = cfg.capacity
        enc = self.options.encryption()
        if enc is not None:
            opts["encryption"] = enc
        start = time.monotonic()
        delay = 0.02
        while True:
            try:
                return open_channel(self.options.path, fs=self.fs, background=False, **opts)
            except ChannelLockedError:
                waited = time.monotonic() - start
                if waited >= self.options.lock_timeout:
                    raise SinkLockedError(self.options.path, waited, what) from None
                logger.debug("channel %s is locked; the sink retries in %.2f s", self.options.path, delay)
                self.sleep(min(delay, max(0.0, self.options.lock_timeout - waited)))
                delay = min(delay * 2, 1.0)

    def ensure_channel(self) -> None:
        """Create the channel if its directory holds none yet (so staged files never precede it).

        Raises:
            ConfigError: A channel option is invalid.
            NotAChannelError: ``path`` exists and is not a channel directory.
            SinkLockedError: The channel is being created by another process for too long.
        """
        if self.fs.exists(os.path.join(self.options.path, CHANNEL_FILE)):
            return
        self.open_channel("the channel's creation").close()

    # -- streaming: one transaction per batch, exactly once --------------------------------

    def commit_batch(self, query: str, batch_id: int, files: Sequence[str], rows: int | None = None) -> BatchOutcome:
        """Put the staged rows of micro-batch ``batch_id`` of ``query`` in one transaction, unless done already.

        The protocol (see docs/spark.md): with the channel open, settle a pending
        intent left by an interrupted commit (from the channel itself: did the
        events at the recorded position land, with this batch's headers?); skip
        a batch id at or below the last committed one; otherwise pin the next
        position P (a guard consumer), record the intent (batch, P, count), put
        every row in one transaction (each event carries ``spark.query`` and
        ``spark.batch_id``), make it durable, record the batch as committed, drop
        the guard. Staged files of this query up to ``batch_id`` are deleted after.

        Args:
            query: The streaming query's id.
            batch_id: The micro-batch id.
            files: Staged file names of the batch's tasks.
            rows: The rows the tasks reported (checked against the files), if known.

        Returns:
            What was done.

        Raises:
            SinkLockedError: The channel stayed locked for ``lockTimeout`` seconds.
            CorruptLogError: A staged file or the query's state file is damaged.
            ChannelError: A staged file is missing, or the channel refused the events
                (``ChannelFullError``, ``EventTooLargeError``, ...); nothing of the batch is visible.
            OSError: A write or fsync failed; nothing of the batch is visible, or all of it
                (the next commit of this query finds out which).
        """
        if not files:
            self._cleanup(query, batch_id)
            return BatchOutcome(False, 0, None, "empty")
        what = f"batch {batch_id} of query {query}"
        ch = self.open_channel(what)
        try:
            store = _StateStore(self.fs, self.options)
            state = self._settle(ch, store, store.load(query))
            if batch_id <= state.last_batch:
                logger.info("%s: already committed (last committed batch %d); skipped", what, state.last_batch)
                outcome = BatchOutcome(False, 0, None, "already committed")
            else:
                outcome = self._put_batch(ch, store, state, batch_id, files, rows)
        finally:
            ch.close()
        self._cleanup(query, batch_id)
        return outcome

    def _put_batch(
        self,
        ch: FileChannel,
        store: _StateStore,
        state: QueryState,
        batch_id: int,
        files: Sequence[str],
        rows: int | None,
    ) -> BatchOutcome:
        query = state.query
        chunks = self._read_files(files, rows, f"batch {batch_id} of query {query}")
        count = sum(c[3] for c in chunks)
        if count == 0:
            return BatchOutcome(False, 0, None, "empty")
        self._check_size(count, f"batch {batch_id}")
        stats = ch.stats()
        first = int(stats["next_position"])
        head = stats["head_position"]
        guards = ConsumerStore(self.fs, self.options.path)
        # The guard is a consumer whose mark is the queue's head: the owner takes nothing at or
        # above the lowest mark, so until the outcome is recorded every queued event, and the one
        # at `first` in particular, stays readable and tells whether this transaction landed,
        # whatever other producers and readers do. (A mark at `first` would acknowledge, and so
        # let the owner take, every event below it.)
        guards.register(
            _guard_name(query), f"spark sink: query {query} batch {batch_id}", first if head is None else int(head)
        )
        store.save(QueryState(query, state.last_batch, Pending(batch_id, first, count)))
        try:
            with ch.transaction() as tx:
                put_chunks(tx, chunks, sink_headers(query, batch_id))
        except ChannelError:
            # Refused before anything was written (full, an event too large, no disk space):
            # settle now, so that the guard does not pin the channel until the next commit.
            try:
                self._settle(ch, store, store.load(query))
            except (ChannelError, OSError) as exc:
                logger.warning(
                    "batch %d: could not settle after a failed commit (%s); the next commit does", batch_id, exc
                )
            raise
        ch.sync()  # durable before it is recorded, whatever the fsync mode
        end = int(ch.stats()["next_position"])
        if end != first + count:  # pragma: no cover - the sink holds the only open of the channel
            logger.warning(
                "batch %d: expected positions [%d, %d), the channel is at %d", batch_id, first, first + count, end
            )
        store.save(QueryState(query, batch_id, None))
        guards.remove(_guard_name(query))
        logger.info(
            "committed batch %d of query %s: %d events at positions [%d, %d)", batch_id, query, count, first, end
        )
        return BatchOutcome(True, count, first, "committed")

    def _settle(self, ch: FileChannel, store: _StateStore, state: QueryState) -> QueryState:
        """Decide a pending intent from the channel's recovered state, record it, drop the guard."""
        guards = ConsumerStore(self.fs, self.options.path)
        guard = _guard_name(state.query)
        p = state.pending
        if p is None:
            if guards.get(guard) is not None:
                guards.remove(guard)  # a crash before the intent was recorded, or after the outcome was
            return state
        landed = self._landed(ch, state.query, p)
        settled = QueryState(state.query, max(state.last_batch, p.batch_id) if landed else state.last_batch, None)
        logger.warning(
            "query %s: the commit of batch %d was interrupted; the channel shows it %s",
            state.query,
            p.batch_id,
            "landed (it is not put again)" if landed else "did not land (it is committed again when replayed)",
        )
        store.save(settled)
        guards.remove(guard)
        return settled

    def _landed(self, ch: FileChannel, query: str, p: Pending) -> bool:
        next_position = int(ch.stats()["next_position"])
        if next_position < p.first + p.count:
            return False  # had it landed, the channel would be past its last event
        view = ChannelReader(
            self.options.path, fs=self.fs, on_corruption=ch.config.on_corruption, encryption=ch.config.encryption
        )
        try:
            head, visible = view.available()
            if visible <= p.first:
                return False  # nothing at the intended position in the files
            if p.first < head:
                # Taken already: only possible if the guard consumer was removed by hand.
                logger.warning(
                    "query %s batch %d: position %d was taken before the sink could check it (was its guard "
                    "consumer removed?); the channel is past the batch's positions, so it counts as committed",
                    query,
                    p.batch_id,
                    p.first,
                )
                return True
            events = view.read(p.first, p.first + 1)
        finally:
            view.close()
        if not events or events[0].position != p.first:
            return False  # a gap, or another writer's event, at the intended position
        h = events[0].headers
        return h.get(HEADER_QUERY) == query and h.get(HEADER_BATCH) == str(p.batch_id)

    # -- batch jobs: one transaction, no replay -------------------------------------------

    def commit_job(self, job: str, files: Sequence[str], rows: int | None = None) -> int:
        """Put a batch job's staged rows in one transaction; return how many.

        Raises:
            SinkLockedError: The channel stayed locked for ``lockTimeout`` seconds.
            CorruptLogError: A staged file is damaged.
            ChannelError: A staged file is missing, or the channel refused the events.
            OSError: A write or fsync failed.
        """
        what = f"batch job {job}"
        count = 0
        if files:
            chunks = self._read_files(files, rows, what)
            count = sum(c[3] for c in chunks)
            if count:
                self._check_size(count, what)
                ch = self.open_channel(what)
                try:
                    with ch.transaction() as tx:
                        put_chunks(tx, chunks, {})
                    ch.sync()
                finally:
                    ch.close()
                logger.info("committed %s: %d events", what, count)
        self.discard(job_prefix(job), files)
        self.sweep()
        return count

    # -- staged files ---------------------------------------------------------------------

    def _read_files(self, files: Sequence[str], rows: int | None, what: str) -> list[StagedChunk]:
        chunks: list[StagedChunk] = []
        for name in files:
            if os.path.basename(name) != name or not name.endswith(STAGE_SUFFIX):
                raise ChannelError(f"{what}: {name!r} is not a staged file name")
            path = os.path.join(self.options.staging_dir, name)
            try:
                chunks += read_staged_chunks(self.fs, path, self.options.encryption())
            except FileNotFoundError:
                raise ChannelError(
                    f"{what}: staged file {path} is missing (deleted by hand, or swept as older than "
                    "staleStagingSeconds); restart the query: it runs the batch's tasks again"
                ) from None
        held = sum(c[3] for c in chunks)
        if rows is not None and rows != held:
            raise ChannelError(f"{what}: the tasks reported {rows} rows, their staged files hold {held}")
        return chunks

    def _check_size(self, count: int, what: str) -> None:
        cap = self.options.config().capacity
        if count > cap:
            raise TransactionCapacityError(
                f"{what} has {count} rows, more than the channel's capacity={cap}: one batch is one transaction; "
                "make micro-batches smaller (e.g. maxEventsPerTrigger, maxFilesPerTrigger) or raise channel.capacity"
            )

    def discard(self, prefix: str | None, files: Iterable[str] = ()) -> int:
        """Delete staged files: those named, and every one whose name starts with ``prefix``.

        Returns:
            How many were deleted.
        """
        directory = self.options.staging_dir
        doomed = {f for f in files if os.path.basename(f) == f}
        if prefix is not None:
            for name in self._staged_names():
                bare = name[len(TMP_PREFIX) :] if name.startswith(TMP_PREFIX) else name
                if bare.startswith(prefix):
                    doomed.add(name)
        return self._unlink(directory, doomed)

    def sweep(self, now_ns: int | None = None) -> int:
        """Delete staged and temporary files older than ``staleStagingSeconds`` (a crashed task's, a failed job's).

        Returns:
            How many were deleted.
        """
        now = time.time_ns() if now_ns is None else now_ns
        limit = int(self.options.stale_staging * 1e9)
        doomed = set()
        for name in self._staged_names():
            created = created_ns(name)
            if created is not None and now - created >= limit:
                doomed.add(name)
        n = self._unlink(self.options.staging_dir, doomed)
        if n:
            logger.info("swept %d stale staged file(s) from %s", n, self.options.staging_dir)
        return n

    def _cleanup(self, query: str, batch_id: int) -> None:
        """After a batch of ``query``: its staged files up to ``batch_id`` (every attempt) go, then stale ones."""
        qprefix = f"q.{slug(query)}.b"
        doomed = set()
        for name in self._staged_names():
            bare = name[len(TMP_PREFIX) :] if name.startswith(TMP_PREFIX) else name
            if bare.startswith(qprefix):
                b = bare[len(qprefix) :].split(".", 1)[0]
                if b.isdigit() and int(b) <= batch_id:
                    doomed.add(name)
        self._unlink(self.options.staging_dir, doomed)
        self.sweep()

    def _staged_names(self) -> list[str]:
        try:
            return sorted(self.fs.listdir(self.options.staging_dir))
        except FileNotFoundError:
            return []

    def _unlink(self, directory: str, names: Iterable[str]) -> int:
        n = 0
        for name in sorted(names):
            try:
                self.fs.unlink(os.path.join(directory, name))
                n += 1
            except FileNotFoundError:
                pass
        # Not fsynced: a deletion a crash undoes is swept again; nothing reads a file of a finished batch.
        return n


# --------------------------------------------------------------------------
# the Spark writers


def _arrow_events(
    batches: Iterable[pa.RecordBatch], columns: _Columns, row: int = 0
) -> Iterator[tuple[bytes, Mapping[str, str] | None]]:
    """Yield ``(body, headers)`` for each row of Arrow record batches (``row``: the first one's index in the task)."""
    for batch in batches:
        bodies = batch.column(batch.schema.get_field_index(columns.body)).to_pylist()
        maps = (
            batch.column(batch.schema.get_field_index(columns.headers)).to_pylist()
            if columns.headers is not None
            else None
        )
        for i, body in enumerate(bodies):
            if body is None:
                raise InvalidEventError(f"row {row + i} of the task has a null body; filter nulls out first")
            if isinstance(body, str):
                body = body.encode("utf-8")
            headers: dict[str, str] | None = None
            if maps is not None and maps[i]:
                headers = {}
                for k, v in maps[i]:
                    if v is None:
                        raise InvalidEventError(
                            f"row {row + i} of the task has a null value for header {k!r}; headers are strings"
                        )
                    headers[k] = v
            yield body, headers
        row += len(bodies)


def _arrow_chunks(batches: Iterable[pa.RecordBatch], columns: _Columns) -> Iterator[StagedChunk]:
    """The staged column chunks of Arrow record batches (``stage_chunks``).

    Each Arrow chunk becomes one staged chunk in one C call, with no Python object
    per row (``arrow.payload_columns``): rows without headers a
    :data:`~filechannel.staged.CHUNK_BODIES` chunk copied from its body buffers,
    rows with headers a :data:`~filechannel.staged.CHUNK_PAYLOADS` chunk of their
    whole PUT payloads.
    """
    import pyarrow as pa

    from filechannel.arrow import payload_columns

    row = 0
    for batch in batches:
        if not batch.num_rows:
            continue
        names = ["body"] if columns.headers is None else ["body", "headers"]
        picked = [batch.column(batch.schema.get_field_index(c)) for c in (columns.body, columns.headers) if c]
        try:
            got = payload_columns(pa.record_batch(picked, names=names))
        except InvalidEventError:
            for _ in _arrow_events([batch], columns, row):  # the sink's own message, naming the task's row
                pass
            raise
        for with_headers, cdata, coffs, k, longest in got:
            yield (CHUNK_PAYLOADS if with_headers else CHUNK_BODIES), cdata, coffs, k, longest
        row += batch.num_rows


class _WriterBase:
    """What both writers share: options, the input columns, staging a task's rows."""

    def __init__(self, options: Mapping[str, str], schema: StructType) -> None:
        self.options = SinkOptions.from_spark(options)
        self.columns = _check_schema(schema)
        self.max_event_size = self.options.config().max_event_size
        # Through an agent: the agent checks each row against its channel's max_event_size.
        self.target = AgentSinkTarget(self.options.agent) if self.options.agent is not None else None

    def _ensure_channel(self) -> None:
        if self.target is None:
            self._committer().ensure_channel()

    def _committer(self) -> SinkCommitter:
        return SinkCommitter(self.options)

    def _stage(
        self, batches: Iterable[pa.RecordBatch], prefix: str, info: TaskInfo, overhead: int
    ) -> tuple[tuple[str, ...], int, int]:
        name = _staged_name(prefix, info.partition, info.attempt)
        staged, rows, size = stage_chunks(
            fs_for(DEFAULT_FS, self.options.config().permissions),
            self.options.staging_dir,
            name,
            _arrow_chunks(batches, self.columns),
            self.max_event_size,
            overhead,
            self.options.encryption(),
        )
        return ((staged,) if staged else ()), rows, size


def _messages(messages: Sequence[WriterCommitMessage | None], what: str) -> list[StagedFiles]:
    out = []
    for i, m in enumerate(messages):
        if m is None:
            raise ChannelError(f"{what}: task {i} reported no commit message (it failed); the batch is not committed")
        if not isinstance(m, StagedFiles):
            raise ChannelError(f"{what}: task {i} sent a {type(m).__name__}, not StagedFiles")
        out.append(m)
    return out


class FileChannelStreamWriter(_WriterBase, DataSourceStreamArrowWriter):
    """The streaming sink: each micro-batch becomes one channel transaction, exactly once per batch id.

    ``write`` runs in each task on an executor and stages the task's rows in
    ``DIR/spark-sink/staging/`` (durable before it returns); ``commit`` runs on
    the driver and hands the staged files to :meth:`SinkCommitter.commit_batch`.

    Args:
        options: Spark's options (see :class:`SinkOptions`).
        schema: The DataFrame's schema: ``body`` (binary or string), optional ``headers``.

    Raises:
        ConfigError: A bad option or column (named in the message).
        NotAChannelError: ``path`` exists and is not a channel directory.
    """

    def __init__(self, options: Mapping[str, str], schema: StructType, overwrite: bool = False) -> None:
        if overwrite:
            raise ConfigError("outputMode", "the filechannel sink only appends: use outputMode('append')")
        super().__init__(options, schema)
        self._ensure_channel()

    def write(self, iterator: Iterator[pa.RecordBatch]) -> StagedFiles:
        """Stage this task's rows durably and return what was staged.

        Raises:
            EventTooLargeError: A row exceeds the channel's ``max_event_size``.
            InvalidEventError: A null body or header value.
            OSError: Writing the staged file failed.
        """
        info = task_info()
        if self.target is not None:
            if info.query is None or info.batch_id is None:
                raise ChannelError(
                    "a task of the sink through an agent could not tell its streaming query id and batch id "
                    f"(Spark's {_QUERY_ID_PROPERTY!r} and {_BATCH_ID_PROPERTY!r} properties)"
                )
            files, rows, size = self.target.stage(
                _arrow_events(iterator, self.columns),
                partition=info.partition,
                attempt=info.attempt,
                query=info.query,
                batch_id=info.batch_id,
            )
            return StagedFiles(files, rows, size, query=info.query, batch_id=info.batch_id)
        overhead = headers_overhead(
            sink_headers(info.query or "x" * 64, 10**12 if info.batch_id is None else info.batch_id)
        )
        files, rows, size = self._stage(iterator, stream_prefix(info.query, info.batch_id), info, overhead)
        return StagedFiles(files, rows, size, query=info.query, batch_id=info.batch_id)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Commit micro-batch ``batchId``: all of its rows in one transaction, or nothing if it was committed before.

        Raises:
            SinkLockedError: Another process kept the channel open for ``lockTimeout`` seconds.
            ChannelError: The batch cannot be committed (see :meth:`SinkCommitter.commit_batch`).
        """
        what = f"batch {batchId}"
        msgs = _messages(messages, what)
        files = [f for m in msgs for f in m.files]
        rows = sum(m.rows for m in msgs)
        query = self._query_of(msgs, batchId, required=bool(files))
        if query is None:
            return
        if self.target is not None:
            out = self.target.commit(
                files, rows, query=query, batch_id=batchId, stale_staging=self.options.stale_staging
            )
            logger.info("batch %d of query %s at %s: %s", batchId, query, self.target.options.uri, out.get("reason"))
            return
        self._committer().commit_batch(query, batchId, files, rows)

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Delete the staged files of micro-batch ``batchId`` (failed tasks' files are found by name)."""
        msgs = [m for m in messages if isinstance(m, StagedFiles)]
        files = [f for m in msgs for f in m.files]
        query = self._query_of(msgs, batchId, required=False)
        if self.target is not None:
            n = self.target.abort(files, query=query, batch_id=batchId, stale_staging=self.options.stale_staging)
            logger.info("aborted batch %d: %d staged file(s) deleted at the agent", batchId, n)
            return
        prefix = stream_prefix(query, batchId) if query is not None else None
        n = self._committer().discard(prefix, files)
        logger.info("aborted batch %d: %d staged file(s) deleted", batchId, n)

    def _query_of(self, msgs: list[StagedFiles], batch_id: int, required: bool) -> str | None:
        """The query's id: from the tasks (Spark's local property), else the checkpoint's metadata file."""
        ids = {m.query for m in msgs if m.query}
        if len(ids) > 1:
            raise ChannelError(f"batch {batch_id}: tasks report different query ids {sorted(ids)}")
        for m in msgs:
            if m.batch_id is not None and m.batch_id != batch_id:
                logger.warning("batch %d: a task reported batch id %d", batch_id, m.batch_id)
        if ids:
            return ids.pop()
        query = _checkpoint_query_id(self.options.checkpoint_location)
        if query is None and required:
            raise ChannelError(
                f"batch {batch_id}: cannot tell which streaming query this is (the tasks did not see Spark's "
                f"{_QUERY_ID_PROPERTY!r} property); set .option('checkpointLocation', DIR) on a local path"
            )
        return query


def _checkpoint_query_id(location: str | None) -> str | None:
    """The query id recorded in ``<checkpointLocation>/metadata`` (local paths only), or None."""
    if not location:
        return None
    path = location[len("file:") :] if location.startswith("file:") else location
    if "://" in path:
        return None
    try:
        with open(os.path.join(path, "metadata"), encoding="utf-8") as f:
            obj = json.loads(f.readline())
    except (OSError, ValueError):
        return None
    qid = obj.get("id") if isinstance(obj, dict) else None
    return qid if isinstance(qid, str) and qid else None


class FileChannelBatchWriter(_WriterBase, DataSourceArrowWriter):
    """The batch sink (``df.write``): the whole job becomes one channel transaction.

    A batch job has no batch id, so a job run twice puts its rows twice; within
    one run, the rows are all visible or none.

    Args:
        options: Spark's options (see :class:`SinkOptions`).
        schema: The DataFrame's schema: ``body`` (binary or string), optional ``headers``.
        overwrite: ``mode("overwrite")``; refused (a channel is appended to).

    Raises:
        ConfigError: A bad option or column (named in the message), or ``overwrite``.
        NotAChannelError: ``path`` exists and is not a channel directory.
    """

    def __init__(self, options: Mapping[str, str], schema: StructType, overwrite: bool = False) -> None:
        if overwrite:
            raise ConfigError("mode", "the filechannel sink only appends: use mode('append')")
        super().__init__(options, schema)
        self.job = uuid.uuid4().hex
        self._ensure_channel()

    def write(self, iterator: Iterator[pa.RecordBatch]) -> StagedFiles:
        """Stage this task's rows durably and return what was staged.

        Raises:
            EventTooLargeError: A row exceeds the channel's ``max_event_size``.
            InvalidEventError: A null body or header value.
            OSError: Writing the staged file failed.
        """
        info = task_info()
        if self.target is not None:
            files, rows, size = self.target.stage(
                _arrow_events(iterator, self.columns), partition=info.partition, attempt=info.attempt, job=self.job
            )
        else:
            files, rows, size = self._stage(iterator, job_prefix(self.job), info, 0)
        return StagedFiles(files, rows, size, job=self.job)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        """Put every task's rows in one transaction.

        Raises:
            SinkLockedError: Another process kept the channel open for ``lockTimeout`` seconds.
            ChannelError: The job cannot be committed (see :meth:`SinkCommitter.commit_job`).
        """
        msgs = _messages(messages, f"batch job {self.job}")
        files = [f for m in msgs for f in m.files]
        if self.target is not None:
            rows = sum(m.rows for m in msgs)
            self.target.commit(files, rows, job=self.job, stale_staging=self.options.stale_staging)
            return
        self._committer().commit_job(self.job, files, sum(m.rows for m in msgs))

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        """Delete the job's staged files."""
        files = [f for m in messages if isinstance(m, StagedFiles) for f in m.files]
        if self.target is not None:
            self.target.abort(files, job=self.job, stale_staging=self.options.stale_staging)
            return
        self._committer().discard(job_prefix(self.job), files)
