"""The Spark sink: DataFrame rows into a channel, one transaction per micro-batch, exactly once per batch id.

This module owns the Spark-facing side of the ``filechannel`` sink:

* :class:`FileChannelStreamWriter` (``df.writeStream.format("filechannel")``) and
  :class:`FileChannelBatchWriter` (``df.write.format("filechannel")``), which
  Spark constructs with the query's options and the DataFrame's schema;
* the input schema (a ``body`` column, optionally ``headers``) and the rows'
  way into the staging area ``DIR/spark-sink/staging/``: each Spark task turns
  its Arrow batches into staged column chunks (one C call per chunk) and writes
  them to one staged file there (atomic and durable before the task returns),
  named by its partition and attempt, and reports the file in its commit message;
* what a task knows about itself (:func:`task_info`).

Its rooms: the options are :mod:`filechannel.spark.sink_options`'s; the commit
protocol (the per-query state and :class:`SinkCommitter`, which puts a batch's
staged rows in one channel transaction exactly once per (query, batch id)) is
:mod:`filechannel.spark.sink_commit`'s; the staged-file format is
:mod:`filechannel.staged`'s. Executors only write staged files: no task holds
the channel open (a channel has one owning process, ``flock``). See
docs/spark.md ("Sink") for the options and the argument for exactly once.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql.types import StructType

try:
    from pyspark.sql.datasource import DataSourceArrowWriter, DataSourceStreamArrowWriter
except ImportError:  # pragma: no cover - depends on the installation
    # Staging and the commit protocol (SinkCommitter) need neither PySpark nor pyarrow;
    # without PySpark no Spark query can run, so the writers' bases are plain classes.
    class DataSourceArrowWriter:  # type: ignore[no-redef]
        """Stand-in for PySpark's batch writer base class (PySpark is not installed)."""

    class DataSourceStreamArrowWriter:  # type: ignore[no-redef]
        """Stand-in for PySpark's streaming writer base class (PySpark is not installed)."""


from filechannel._fs import DEFAULT_FS
from filechannel.errors import (
    ChannelError,
    ConfigError,
    InvalidEventError,
)
from filechannel.permissions import fs_for
from filechannel.staged import (  # the staged-file format, shared with the agent
    CHUNK_BODIES,
    CHUNK_PAYLOADS,
    HEADER_BATCH,
    HEADER_QUERY,
    STAGE_SUFFIX,
    StagedChunk,
    headers_overhead,
    job_prefix,
    read_staged,
    sink_headers,
    stage_chunks,
    stage_events,
    stream_prefix,
)

from .agent_sink import AgentSinkTarget
from .sink_commit import (
    BatchOutcome,
    Pending,
    QueryState,
    SinkCommitter,
    SinkLockedError,
    StagedFiles,
    StateStore,
    WriterCommitMessage,
)
from .sink_options import SinkOptions

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
    "StateStore",
    "TaskInfo",
    "read_staged",
    "stage_events",
]

logger = logging.getLogger(__name__)

# Spark's local properties on a streaming query's tasks (StreamExecution.QUERY_ID_KEY,
# MicroBatchExecution.BATCH_ID_KEY): the query id is the one in the checkpoint's metadata file.
_QUERY_ID_PROPERTY = "sql.streaming.queryId"
_BATCH_ID_PROPERTY = "streaming.sql.batchId"


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
# staged file names and task identity


def _staged_name(prefix: str, partition: int, attempt: int) -> str:
    return f"{prefix}p{partition}.a{attempt}.{os.getpid()}.{time.time_ns()}{STAGE_SUFFIX}"


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
