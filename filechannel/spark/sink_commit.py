"""The Spark sink's commit protocol: staged rows into one channel transaction, exactly once per batch id.

This module owns the driver side of the sink (:class:`SinkCommitter`): the
commit messages the tasks send (:class:`StagedFiles`, the files each staged),
the per-query state ``DIR/spark-sink/queries/<query>.state`` (the last batch
id committed and the intent of the batch being committed: :class:`StateStore`),
and the protocol that puts a batch's staged rows in one channel transaction
exactly once per (query, batch id), across crashes at any point, with the
sweep of staged files nobody will commit. It needs neither PySpark nor
pyarrow. It must not hold the channel open across batches (a channel has one
owning process, ``flock``): each commit opens the channel, commits and closes
it. Every durability call goes through the ``_fs`` seam, so the protocol is
crash-tested on a simulated file system without Spark.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

try:
    from pyspark.sql.datasource import WriterCommitMessage
except ImportError:  # pragma: no cover - depends on the installation
    # The commit protocol needs no PySpark; without it no Spark query runs, so the
    # commit message's base is a plain class.
    class WriterCommitMessage:  # type: ignore[no-redef]
        """Stand-in for PySpark's base class of commit messages (PySpark is not installed)."""


from filechannel._fs import DEFAULT_FS, FS, read_file, replace_durably
from filechannel.channel import FileChannel, open_channel
from filechannel.consumers import ConsumerStore
from filechannel.directory import CHANNEL_FILE, decode_meta, encode_meta
from filechannel.errors import (
    ChannelError,
    ChannelLockedError,
    CorruptLogError,
    FormatError,
    TransactionCapacityError,
)
from filechannel.permissions import fs_for
from filechannel.reader import ChannelReader
from filechannel.staged import (  # the staged-file format, shared with the agent
    HEADER_BATCH,
    HEADER_QUERY,
    STAGE_SUFFIX,
    TMP_PREFIX,
    StagedChunk,
    created_ns,
    ensure_dir,
    job_prefix,
    put_chunks,
    read_staged_chunks,
    sink_headers,
    slug,
)

from .sink_options import SinkOptions

__all__ = [
    "BatchOutcome",
    "Pending",
    "QueryState",
    "SinkCommitter",
    "SinkLockedError",
    "StagedFiles",
    "StateStore",
    "WriterCommitMessage",
]

logger = logging.getLogger(__name__)

_GUARD_PREFIX = "spark-sink."


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


def _write_atomic(fs: FS, directory: str, name: str, data: bytes) -> None:
    """Write ``directory/name`` atomically and durably: temporary file, fsync, rename, fsync of the directory."""
    tmp = os.path.join(directory, f"{TMP_PREFIX}{name}.{os.getpid()}.{time.time_ns()}")
    replace_durably(fs, tmp, os.path.join(directory, name), data)


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


class StateStore:
    """``DIR/spark-sink/queries/<slug>.state``: checksummed one-line JSON, replaced atomically."""

    def __init__(self, fs: FS, options: SinkOptions) -> None:
        self.fs = fs
        self.dir = options.queries_dir

    def path(self, query: str) -> str:
        """The state file of ``query``."""
        return os.path.join(self.dir, slug(query) + ".state")

    def load(self, query: str) -> QueryState:
        """What the sink recorded for ``query`` (a new query's state when there is no file).

        Raises:
            CorruptLogError: The state file is damaged or malformed.
        """
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
        """Replace the query's state file with ``state``, atomically and durably."""
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
            store = StateStore(self.fs, self.options)
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
        store: StateStore,
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

    def _settle(self, ch: FileChannel, store: StateStore, state: QueryState) -> QueryState:
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
