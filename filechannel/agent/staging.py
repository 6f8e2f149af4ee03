"""The agent's side of the Spark sink: a staging area per owned channel, and commits exactly once per batch.

This module owns what a writable agent (``filechannel serve --writable``) does
for ``writeStream.format("filechannel").option("agent", URI)``:

* **Stage.** An executor's task streams its partition's rows to the agent
  (``DoPut`` with ``op: "stage"``); :meth:`AgentSink.stage` writes them to one
  staged file ``DIR/spark-sink/staging/q.<query>.b<batch>.p<partition>.a<attempt>.<pid>.<ns>.stage``
  (``j.<job>.…`` for a batch job), in the sink's staged-file format
  (``filechannel.staged.stage_events``: checksummed, sealed under the
  channel's last key when the channel is encrypted), durable (fsync, rename,
  fsync of the directory) before the answer names the file.
* **Commit.** The driver names the staged files of the task attempts Spark
  committed (``DoAction("sink_commit")``); :meth:`AgentSink.commit_batch` puts
  all their rows in **one** channel transaction together with the mark
  ``spark-sink:<query>`` = batch id (``Transaction.mark``), syncs, and answers.
  The mark and the rows commit atomically (``idempotency.commit_once``, the
  agent's one exactly-once protocol), so a batch id at or below the mark is a
  no-op: a commit retried after a crash of the driver or of the agent, or a
  batch Spark replays, is never put twice. The mark also records the
  certificate name that first committed under the query id; another name's
  commit under it is refused. A batch job's commit records its job id in the
  mark ``spark-sink:jobs`` (the last 16 job ids; ``spark-sink:jobs:<name>``
  per certificate name), so a retried job commit is a no-op too.
* **Room.** Staged files live on the channel directory's file system, beside
  the channel's data: a stage keeps the channel's free-space floor
  (``minimum_required_space``) free for the records of takes, acknowledgements
  and retirements, through which space comes back. Before it reads the first
  row, and again every :data:`STAGE_CHECK_BYTES` of rows, it waits up to the
  channel's ``keep_alive`` for the floor plus what it is about to write (and
  what the staged file may still hold unwritten), then refuses with
  :class:`~filechannel.errors.DiskSpaceError`; a write that runs out of space
  anyway (ENOSPC, EDQUOT) is :class:`~filechannel.errors.DiskFullError`. Both
  are the channel's full error (``ChannelFullError``, which Flight's error
  carries to the client); the partial file is removed and the channel is
  untouched, and the sink's task sends its rows again when there is room
  (``filechannel.spark.agent_sink``).
* **Abort and cleanup.** ``sink_abort`` deletes a batch's staged files; every
  commit deletes its query's staged files of batches up to its own (every
  attempt), and any staged or temporary file older than ``staleStagingSeconds``.

Plain Python (no pyarrow): the server feeds it decoded rows, and tests drive it
directly on a simulated file system. Every persistence call goes through the
``_fs`` seam. One lock per channel orders the sink's commits (other producers'
puts commit beside them).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from filechannel._fs import DEFAULT_FS, FS
from filechannel.channel import FileChannel
from filechannel.errors import (
    ChannelError,
    DiskFullError,
    DiskSpaceError,
    InvalidEventError,
    TransactionCapacityError,
)
from filechannel.permissions import fs_for
from filechannel.space import ENOSPC_ERRNOS, POLL_S
from filechannel.staged import (
    DEFAULT_STALE_STAGING,
    SINK_DIR,
    STAGE_SUFFIX,
    STAGING_DIR,
    TMP_PREFIX,
    created_ns,
    headers_overhead,
    job_prefix,
    payload_chunk,
    put_chunks,
    read_staged,
    sink_headers,
    slug,
    stage_events,
    stream_prefix,
)

__all__ = ["JOBS_MARK", "MARK_PREFIX", "STAGE_CHECK_BYTES", "AgentSink", "StageRequest", "batch_mark"]

from .idempotency import Claim, commit_once, decode_claim

logger = logging.getLogger("filechannel.agent")

MARK_PREFIX = "spark-sink:"
"""Prefix of the mark holding a streaming query's last committed batch id (``spark-sink:<query>``)."""
JOBS_MARK = "spark-sink:jobs"
"""The mark holding the ids of the last batch jobs committed (space-separated)."""
RECENT_JOBS = 16
_JOB_RE = re.compile(r"[A-Za-z0-9]{1,40}")
_MAX_ID = (1 << 63) - 1
STAGE_CHECK_BYTES = 256 * 1024
"""Bytes of rows a stage takes between two looks at the free space."""
_UNWRITTEN = 1 << 20  # a staged file being written holds up to about this much not yet written (staged.py)


def batch_mark(query: str) -> str:
    """The mark key of ``query``'s last committed batch id (a query id that is not a UUID is hashed)."""
    return MARK_PREFIX + slug(query)


def jobs_mark(owner: str | None) -> str:
    """The mark key of the batch jobs committed by certificate name ``owner`` (:data:`JOBS_MARK` without one)."""
    return JOBS_MARK if owner is None else f"{JOBS_MARK}:{slug(owner)}"


@dataclass(frozen=True)
class StageRequest:
    """What one stage call is for: a streaming task (``query``, ``batch_id``) or a batch job's (``job``).

    Raises (at construction):
        InvalidEventError: A field is missing or out of range (a ``ValueError``).
    """

    partition: int
    attempt: int
    query: str | None = None
    batch_id: int | None = None
    job: str | None = None

    def __post_init__(self) -> None:
        for name in ("partition", "attempt"):
            _check_int(getattr(self, name), name)
        if self.job is not None:
            if self.query is not None or self.batch_id is not None:
                raise InvalidEventError("a stage request names a job or a (query, batch id), not both")
            check_job(self.job)
        else:
            if not isinstance(self.query, str) or not self.query:
                raise InvalidEventError("a stage request names a query id (or a job)")
            _check_int(self.batch_id, "batch_id")

    @property
    def prefix(self) -> str:
        """The staged file names' prefix of this request's batch (or job)."""
        return job_prefix(self.job) if self.job is not None else stream_prefix(self.query, self.batch_id)


def check_job(job: object) -> str:
    """A batch job's id: 1 to 40 characters of ``A-Z a-z 0-9``.

    Raises:
        InvalidEventError: Anything else.
    """
    if not isinstance(job, str) or not _JOB_RE.fullmatch(job):
        raise InvalidEventError(f"a job id is 1 to 40 characters of A-Z a-z 0-9, got {job!r}")
    return job


def _check_int(v: object, name: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= _MAX_ID:
        raise InvalidEventError(f"{name} must be an int in [0, 2**63), got {v!r}")
    return v


class AgentSink:
    """The staging area and sink commits of one channel the agent owns.

    Args:
        channel: The open channel (the agent is its owner).
        directory: The channel directory (the staging area is ``DIR/spark-sink/staging``).
        fs: The I/O seam (default: the real file system), set to the channel's permissions.
    """

    def __init__(self, channel: FileChannel, directory: str, fs: FS | None = None) -> None:
        self.channel = channel
        self.directory = directory
        self.staging_dir = os.path.join(directory, SINK_DIR, STAGING_DIR)
        self.fs = fs_for(fs or DEFAULT_FS, channel.config.permissions)
        self._lock = threading.Lock()  # orders the sink's commits (and the job mark's read-modify-write)
        self._names = threading.Lock()
        self._last_ns = 0
        self.refusals = 0  # stages refused for want of space (the floor, or a write that ran out)

    # -- staging --------------------------------------------------------------------------

    def _name(self, req: StageRequest) -> str:
        with self._names:  # unique within this process even within one clock tick
            ns = self._last_ns = max(time.time_ns(), self._last_ns + 1)
        return f"{req.prefix}p{req.partition}.a{req.attempt}.{os.getpid()}.{ns}{STAGE_SUFFIX}"

    def stage(
        self, req: StageRequest, events: Iterable[tuple[bytes, Mapping[str, str] | None]]
    ) -> tuple[str | None, int, int]:
        """Write a task's rows to one staged file, durable before it returns.

        Returns:
            ``(file name or None when there were no rows, rows, bytes)``.

        Raises:
            EventTooLargeError: A row (with the sink's headers) exceeds the channel's ``max_event_size``.
            InvalidEventError: A header is not valid text.
            DiskSpaceError: Too little free space (:meth:`room`), or a write ran out of it
                (``DiskFullError``): a full channel; nothing is left under the staged name.
            OSError: Writing failed (nothing is left under the staged name).
        """
        overhead = 0
        if req.job is None:
            assert req.query is not None
            assert req.batch_id is not None
            overhead = headers_overhead(sink_headers(req.query, req.batch_id))
        cfg = self.channel.config
        try:
            name, rows, size = stage_events(
                self.fs,
                self.staging_dir,
                self._name(req),
                self._with_room(events),
                cfg.max_event_size,
                overhead,
                cfg.encryption,
            )
        except DiskSpaceError:
            self.refusals += 1
            raise
        except OSError as exc:
            if exc.errno not in ENOSPC_ERRNOS:
                raise
            # The staged file is removed (stage_events); nothing of it is used, so nothing is trusted.
            self.refusals += 1
            raise DiskFullError(self.staging_dir, exc.errno, cfg.minimum_required_space) from exc
        logger.debug("staged %d rows (%d bytes) as %s", rows, size, name)
        return name, rows, size

    def _with_room(
        self, events: Iterable[tuple[bytes, Mapping[str, str] | None]]
    ) -> Iterator[tuple[bytes, Mapping[str, str] | None]]:
        """``events``, looking for room before the first row is read and every :data:`STAGE_CHECK_BYTES` after."""
        self.room(STAGE_CHECK_BYTES)
        handed = since = 0
        for body, headers in events:
            n = len(body) + (sum(len(k) + len(v) for k, v in headers.items()) if headers else 0)
            if since + n > STAGE_CHECK_BYTES:
                self.room(STAGE_CHECK_BYTES + n + min(handed, _UNWRITTEN))
                since = 0
            handed += n
            since += n
            yield body, headers

    def room(self, nbytes: int, wait: float | None = None) -> None:
        """Return once the staging area's file system has ``minimum_required_space`` + ``nbytes`` free.

        Waits up to ``wait`` seconds (default: the channel's ``keep_alive``), looking again
        every ``POLL_S``; a channel without a floor (0) never waits.

        Raises:
            DiskSpaceError: Still too little free space (``reason="min_free"``); nothing was written.
        """
        floor = self.channel.config.minimum_required_space
        if not floor:
            return
        need = floor + nbytes
        deadline = time.monotonic() + (self.channel.config.keep_alive if wait is None else wait)
        while True:
            free = self.fs.free_space(self.directory)
            if free >= need:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                err = DiskSpaceError(self.directory, free, floor, needed=need)
                err.args = (
                    f"no room to stage a Spark task's rows: only {free} bytes free on {self.directory}, under "
                    f"minimum_required_space={floor} plus the {nbytes} bytes about to be staged; consumers must "
                    "take (or acknowledge) events so that data files retire, or free disk space",
                )
                raise err
            time.sleep(min(left, POLL_S))

    # -- commits --------------------------------------------------------------------------

    def committed_batch(self, query: str) -> int:
        """The last batch id of ``query`` committed to the channel (-1: none)."""
        claim = self._claim(query)
        return -1 if claim is None else int(claim.state)

    def _claim(self, query: str) -> Claim | None:
        raw = self.channel.mark(batch_mark(query))
        return None if raw is None else decode_claim(raw, 1)

    def commit_batch(
        self,
        query: str,
        batch_id: int,
        files: Sequence[str],
        rows: int | None = None,
        stale_staging: float = DEFAULT_STALE_STAGING,
        owner: str | None = None,
    ) -> dict[str, Any]:
        """Put micro-batch ``batch_id`` of ``query`` in one transaction with its mark, unless committed before.

        The query id belongs to the certificate name (``owner``) that first
        committed under it (``idempotency.commit_once``): another name's commit
        under it is refused, so no writer can mark another's batches committed.

        Returns:
            ``{"committed": bool, "reason": "committed" | "already committed" | "empty",
            "rows": n, "last_batch": the query's last committed batch id}``.

        Raises:
            KeyOwnerError: Another certificate name owns ``query``.
            ChannelError: A staged file is missing or damaged, more rows than ``transaction_capacity``,
                or the channel refused the events (``ChannelFullError``, ...): nothing of the batch is put.
            OSError: A write or fsync failed: nothing or all of the batch is in the channel (with its
                mark); a retried commit finds out which.
        """
        if not isinstance(query, str) or not query:
            raise InvalidEventError("a sink commit names a query id")
        _check_int(batch_id, "batch_id")
        what = f"batch {batch_id} of query {query}"
        with self._lock:
            claim = self._claim(query)
            last = -1 if claim is None else int(claim.state)
            payloads = self._commit_staged(
                files,
                rows,
                what,
                committed_before=batch_id <= last,
                key=f"the sink's query id {query!r}",
                owner=owner,
                claim=claim if claim is not None else Claim("-1", None),
                headers=sink_headers(query, batch_id),
                mark=(batch_mark(query), str(batch_id)),
            )
            if payloads is not None:
                out = {"committed": True, "reason": "committed", "rows": len(payloads), "last_batch": batch_id}
            elif batch_id <= last:
                logger.info("%s: already committed (the channel's mark says %d); skipped", what, last)
                out = {"committed": False, "reason": "already committed", "rows": 0, "last_batch": last}
            else:
                out = {"committed": False, "reason": "empty", "rows": 0, "last_batch": last}
        self._cleanup(f"q.{slug(query)}.b", batch_id, stale_staging)
        return out

    def commit_job(
        self,
        job: str,
        files: Sequence[str],
        rows: int | None = None,
        stale_staging: float = DEFAULT_STALE_STAGING,
        owner: str | None = None,
    ) -> dict[str, Any]:
        """Put a batch job's staged rows in one transaction, recording the job id; a repeated job id is a no-op.

        The job ids are kept per certificate name (``owner``: :func:`jobs_mark`), so
        another writer's job id never makes this one's commit a no-op.

        Returns:
            ``{"committed": bool, "reason": ..., "rows": n}``.

        Raises:
            ChannelError, OSError: As :meth:`commit_batch`.
        """
        check_job(job)
        what = f"batch job {job}"
        mark = jobs_mark(owner)
        with self._lock:
            raw = self.channel.mark(mark)
            recent = raw.decode("ascii", "replace").split() if raw else []
            payloads = self._commit_staged(
                files,
                rows,
                what,
                committed_before=job in recent,
                key=f"batch job {job!r}",
                owner=None,  # bound by the mark's name
                claim=Claim(" ".join(recent), None),
                headers={},
                mark=(mark, " ".join([*recent, job][-RECENT_JOBS:])),
            )
            if payloads is not None:
                out = {"committed": True, "reason": "committed", "rows": len(payloads)}
            elif job in recent:
                out = {"committed": False, "reason": "already committed", "rows": 0}
            else:
                out = {"committed": False, "reason": "empty", "rows": 0}
        self.discard(job_prefix(job), files)
        self.sweep(stale_staging)
        return out

    def _commit_staged(
        self,
        files: Sequence[str],
        rows: int | None,
        what: str,
        *,
        committed_before: bool,
        key: str,
        owner: str | None,
        claim: Claim,
        headers: dict[str, str],
        mark: tuple[str, str],
    ) -> list[bytes] | None:
        """Put the staged rows with ``mark`` in one durable transaction (``commit_once`` on ``key``).

        Returns the rows committed; None when ``committed_before`` (nothing is read) or the
        files hold no rows. Raises as :meth:`commit_batch`.
        """
        payloads: list[bytes] = []

        def done(_: Claim) -> bool:
            if committed_before:
                return True
            payloads.extend(self._read(files, rows, what))
            self._check_size(len(payloads), what)
            return not payloads

        dup = commit_once(
            self.channel,
            what=key,
            owner=owner,
            claim=claim,
            done=done,
            put=lambda tx: put_chunks(tx, [payload_chunk(payloads)], headers),
            mark=lambda: mark,
            sync=True,  # durable before the writer hears of it, whatever the fsync mode
        )
        if dup is not None:
            return None
        logger.info("committed %s: %d events", what, len(payloads))
        return payloads

    def _read(self, files: Sequence[str], rows: int | None, what: str) -> list[bytes]:
        payloads: list[bytes] = []
        for name in files:
            if not isinstance(name, str) or os.path.basename(name) != name or not name.endswith(STAGE_SUFFIX):
                raise ChannelError(f"{what}: {name!r} is not a staged file name")
            path = os.path.join(self.staging_dir, name)
            try:
                payloads += read_staged(self.fs, path, self.channel.config.encryption)
            except FileNotFoundError:
                raise ChannelError(
                    f"{what}: staged file {name} is missing at the agent (deleted, or swept as older than "
                    "staleStagingSeconds); restart the query: it runs the batch's tasks again"
                ) from None
        if rows is not None and rows != len(payloads):
            raise ChannelError(f"{what}: the tasks reported {rows} rows, their staged files hold {len(payloads)}")
        return payloads

    def _check_size(self, count: int, what: str) -> None:
        cap = self.channel.config.transaction_capacity
        if count > cap:
            raise TransactionCapacityError(
                f"{what} has {count} rows, more than the agent channel's transaction_capacity={cap}: one batch is "
                "one transaction; make micro-batches smaller (e.g. maxEventsPerTrigger) or start the agent with "
                "a larger --transaction-capacity"
            )

    # -- abort and cleanup ----------------------------------------------------------------

    def discard(self, prefix: str | None, files: Iterable[str] = ()) -> int:
        """Delete the staged files named, and every one (or its temporary) whose name starts with ``prefix``."""
        doomed = {f for f in files if isinstance(f, str) and os.path.basename(f) == f and f.endswith(STAGE_SUFFIX)}
        if prefix is not None:
            for name in self._names_in_staging():
                if _bare(name).startswith(prefix):
                    doomed.add(name)
        return self._unlink(doomed)

    def sweep(self, stale_staging: float = DEFAULT_STALE_STAGING, now_ns: int | None = None) -> int:
        """Delete staged and temporary files older than ``stale_staging`` seconds (attempts nobody committed)."""
        now = time.time_ns() if now_ns is None else now_ns
        limit = int(stale_staging * 1e9)
        doomed = set()
        for name in self._names_in_staging():
            created = created_ns(name)
            if created is not None and now - created >= limit:
                doomed.add(name)
        n = self._unlink(doomed)
        if n:
            logger.info("swept %d stale staged file(s) from %s", n, self.staging_dir)
        return n

    def _cleanup(self, qprefix: str, batch_id: int, stale_staging: float) -> None:
        """After a batch: the query's staged files of batches up to ``batch_id`` (every attempt), then stale ones."""
        doomed = set()
        for name in self._names_in_staging():
            bare = _bare(name)
            if bare.startswith(qprefix):
                b = bare[len(qprefix) :].split(".", 1)[0]
                if b.isdigit() and int(b) <= batch_id:
                    doomed.add(name)
        self._unlink(doomed)
        self.sweep(stale_staging)

    def _names_in_staging(self) -> list[str]:
        try:
            return sorted(self.fs.listdir(self.staging_dir))
        except FileNotFoundError:
            return []

    def _unlink(self, names: Iterable[str]) -> int:
        n = 0
        for name in sorted(names):
            try:
                self.fs.unlink(os.path.join(self.staging_dir, name))
                n += 1
            except FileNotFoundError:
                pass
        # Not fsynced: a deletion a crash undoes is cleaned up again; nothing commits a finished batch's file twice.
        return n


def _bare(name: str) -> str:
    return name[len(TMP_PREFIX) :] if name.startswith(TMP_PREFIX) else name
