"""Retiring data files: which ones may go, and how they go (the RETIRE record first, then the unlink).

This module owns a data file's end. :class:`FileRefs` is the channel's
per-file bookkeeping (how many queued events each file holds, and which takes
each file records of events in other files); :class:`Retirer` decides which
files nothing needs any more (no queued event, no open transaction, no
consumer), writes again what a leaving file alone records (takes of events in
files that stay, the newest copy of a mark), and runs that work on its own
thread after the take commits that free a file. :func:`retire_files` is how
they go: each leaves its writer's live list, a RETIRE record naming it is made
durable in the active file of its data directory, and only then is it
unlinked and its directory entry synced. Recovery never mistakes a retired
file for a missing one, nor replays one whose unlink did not persist.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

from . import format as fmt
from .logstate import LogState
from .writer import CommitResult, Item, Writer

logger = logging.getLogger(__name__)


def retire_files(st: LogState, writers: Sequence[Writer], file_ids: Sequence[int]) -> None:
    """Remove live data files that no longer hold anything the channel needs (not a writer's active file).

    Raises:
        OSError: Writing the RETIRE record or syncing failed (the log fails too).
        ChannelClosedError: The log has failed or is closed.
    """
    by_dir: dict[int, list[int]] = {}
    for fid in file_ids:
        if fid in st.files:
            by_dir.setdefault(st.files[fid][0], []).append(fid)
    for index, fids in by_dir.items():
        w = writers[index]
        fids = [f for f in fids if f != w.file_id]
        if not fids:
            continue
        # Leave the live list first: a file the writer starts from now on (even one a
        # concurrent commit rolls to before the RETIRE is written) must not list these
        # in its header, or, once they are unlinked, the newest header names files
        # that are gone and the next open fails. A header that omits a file whose
        # RETIRE did not persist is safe: such a file holds nothing the channel needs,
        # and recovery deletes it.
        for fid in fids:
            if fid in w.live:
                w.live.remove(fid)
        w.submit(Item(fmt.RETIRE, 0, retire=fids))
        if st.config.fsync == "interval":
            # Every writer, not just this directory's: the takes re-logged before a
            # retirement may sit in another data directory, and must be durable
            # before the file they make unnecessary is unlinked.
            for other in writers:
                other.sync_now()
            st.check_writable()
        for fid in fids:
            path = st.forget_file(fid)
            try:
                st.fs.unlink(path)
            except FileNotFoundError:
                pass
            st.files_retired += 1
            logger.debug("retired data file %s", path)
        st.fs.fsync_dir(w.path)


def add_run(taken_from: dict[int, list[tuple[int, int]]], file_id: int, first: int, count: int) -> None:
    """Record that positions ``first .. first + count - 1`` (in ``file_id``) were taken, coalescing runs."""
    lst = taken_from.get(file_id)
    if lst is None:
        taken_from[file_id] = [(first, count)]
        return
    a, c = lst[-1]
    if a + c == first:
        lst[-1] = (a, c + count)
    else:
        lst.append((first, count))


class FileRefs:
    """What each data file holds that the channel still needs; read and changed under the channel's lock.

    ``refs``: queued or in-flight events per file; ``take_targets``: for each
    file, the files whose events its TAKE records took; ``taken_from``: for each
    file, the runs of its positions that were taken (what a checkpoint records
    and what a retirement writes again); ``unreplayed``: the files the checkpoint
    recovery started from lists, whose records up to it were not replayed, so
    which files their TAKE records took from is unknown (a retirement of one
    writes again the taken runs of every file that stays).
    """

    __slots__ = ("refs", "take_targets", "taken_from", "unreplayed")

    def __init__(
        self,
        refs: dict[int, int],
        take_targets: dict[int, set[int]],
        taken_from: dict[int, list[tuple[int, int]]],
        unreplayed: set[int] | None = None,
    ) -> None:
        self.refs = refs
        self.take_targets = take_targets
        self.taken_from = taken_from
        self.unreplayed = unreplayed if unreplayed is not None else set()

    def committed(self, file_id: int, n_puts: int, runs: Sequence[tuple[int, int, int]]) -> bool:
        """Count a commit written to ``file_id``: ``n_puts`` events, takes as ``(file, first, count)`` runs.

        Returns whether a data file lost its last reference (so retirement may have work).
        """
        refs = self.refs
        if n_puts:
            refs[file_id] = refs.get(file_id, 0) + n_puts
        if not runs:
            return False
        freed = False
        tset = self.take_targets.setdefault(file_id, set())
        tfrom = self.taken_from
        for f, first_taken, k in runs:  # one update per run, not per event
            c = refs[f] - k
            if c:
                refs[f] = c
            else:
                del refs[f]
                freed = True
            tset.add(f)
            add_run(tfrom, f, first_taken, k)
        return freed

    def forget(self, gone: set[int]) -> None:
        """Drop retired files from the bookkeeping."""
        self.unreplayed -= gone
        for f in gone:
            self.take_targets.pop(f, None)
            self.taken_from.pop(f, None)
            self.refs.pop(f, None)
        for tset in self.take_targets.values():
            tset -= gone


class RetiringLog(Protocol):
    """What :class:`Retirer` uses of the log (``filechannel.log.Log``, which imports this module)."""

    @property
    def failed(self) -> BaseException | None: ...  # noqa: D102

    def newest_file_ids(self) -> set[int]: ...  # noqa: D102

    def active_file_ids(self) -> set[int]: ...  # noqa: D102

    def file_ids(self) -> list[int]: ...  # noqa: D102

    def new_txn_id(self) -> int: ...  # noqa: D102

    def commit(  # noqa: D102
        self,
        txn_id: int,
        payloads: Sequence[bytes],
        takes: Sequence[tuple[int, int]] = (),
        on_written: Callable[[CommitResult], None] | None = None,
        prefix: bytes = b"",
        marks: Sequence[bytes] = (),
    ) -> CommitResult: ...

    def retire(self, file_ids: Sequence[int]) -> None: ...  # noqa: D102


class Retirer:
    """Retires the channel's data files that nothing needs any more, inline or on its own thread.

    Args:
        log: The channel's log.
        lock: The channel's lock (``refs`` and ``marks`` are read and changed under it).
        refs: The channel's per-file bookkeeping.
        marks: The channel's committed marks: key -> (value, woid, file holding its newest copy).
        closed: Whether the channel is closed.
        background: Retire on a thread of its own (else inline, in :meth:`want`).
    """

    def __init__(
        self,
        log: RetiringLog,
        lock: threading.Lock,
        refs: FileRefs,
        marks: dict[str, tuple[bytes, int, int]],
        closed: Callable[[], bool],
        background: bool,
    ) -> None:
        self._log = log
        self._lock = lock
        self.refs = refs
        self._marks = marks
        self._closed = closed
        self._background = background
        self._wanted = threading.Event()
        self._busy = threading.Lock()
        self._start_lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def retire_files(self) -> int:
        """Delete data files that no queued or in-flight event needs; return how many (see FileChannel)."""
        log = self._log
        refs = self.refs
        with self._busy:
            with self._lock:
                if self._closed() or log.failed is not None:
                    return 0
                keep = log.newest_file_ids() | log.active_file_ids()
                live = set(log.file_ids())
                cand = {f for f in live if not refs.refs.get(f) and f not in keep}
                stay = live - cand
                relog_files = set()
                for f in cand:
                    # A file whose TAKE records were not replayed (before the checkpoint this open
                    # started from) may have taken from any file: every staying file's runs go again.
                    relog_files |= stay if f in refs.unreplayed else refs.take_targets.get(f, set()) & stay
                relog = sorted(r for g in relog_files for r in refs.taken_from.get(g, ()))
                # Marks whose newest copy is in a file that goes: written again first.
                moving = [fmt.Mark(k, v, w) for k, (v, w, f) in self._marks.items() if f in cand]
            if not cand:
                return 0
            if relog:
                self.relog_takes(relog, relog_files)
            if moving:
                self.relog_marks(moving)
            log.retire(sorted(cand))
            with self._lock:
                refs.forget(cand)
            return len(cand)

    def relog_takes(self, ranges: list[tuple[int, int]], files: set[int]) -> None:
        """Write a take-only commit that repeats already committed takes (replay is idempotent)."""
        merged: list[tuple[int, int]] = []
        for a, c in ranges:
            if merged and merged[-1][0] + merged[-1][1] >= a:
                pa, pc = merged[-1]
                merged[-1] = (pa, max(pa + pc, a + c) - pa)
            else:
                merged.append((a, c))

        def note(res: CommitResult) -> None:
            with self._lock:
                self.refs.take_targets.setdefault(res.file_id, set()).update(files)

        self._log.commit(self._log.new_txn_id(), [], merged, note)

    def relog_marks(self, marks: list[fmt.Mark]) -> None:
        """Commit a transaction of MARK records repeating ``marks`` with their woids (replay keeps the newest)."""

        def note(res: CommitResult) -> None:
            with self._lock:
                for m in marks:
                    cur = self._marks.get(m.key)
                    if cur is not None and cur[1] == m.woid:
                        self._marks[m.key] = (cur[0], cur[1], res.file_id)

        step = fmt.MAX_MARKS_PER_RECORD
        payloads = [fmt.encode_marks(marks[i : i + step]) for i in range(0, len(marks), step)]
        self._log.commit(self._log.new_txn_id(), [], (), note, b"", payloads)

    def want(self) -> None:
        """A file lost its last reference: retire now (inline) or wake the retiring thread."""
        if not self._background:
            try:
                self.retire_files()
            except OSError:
                logger.exception("retiring data files failed")
            return
        self._wanted.set()
        if self._thread is None:
            with self._start_lock:
                if self._thread is None:
                    t = threading.Thread(target=self._loop, name="filechannel-retire", daemon=True)
                    self._thread = t
                    t.start()

    def stop(self) -> None:
        """Wake the retiring thread to see the channel closed, and wait for it."""
        self._wanted.set()
        if self._thread is not None:
            self._thread.join()

    def _loop(self) -> None:
        while True:
            self._wanted.wait()
            self._wanted.clear()
            if self._closed():
                return
            try:
                self.retire_files()
            except Exception:  # a failed retirement must not kill the thread
                logger.exception("retiring data files failed")
