"""Room for new data: the byte limit (``max_bytes``) and the free-space floor (``minimum_required_space``).

This module owns one decision: may a put write now? A put is refused (after
waiting up to ``keep_alive``) when the channel's data files hold
``max_bytes`` or more, or when the data directory's file system has less free
space than the floor plus what the commit is about to write. Takes,
acknowledgements and retirements never ask: they are how room comes back.

Which ENOSPC is safe to live through (docs/design.md, "A full disk"):

* **caught before writing**: this module's check, against the file system's
  free space (read at most every second, minus what was written since). A
  refused put wrote nothing; its transaction stays open and may commit later.
* **a write that ran out of space** (``pwrite`` → ENOSPC or EDQUOT, maybe
  after part of the batch reached the file): the writer cuts the file back to
  where the batch began. Once that truncate succeeds the file is as it was
  and nothing of the batch was acknowledged, so the channel goes on and the
  commit raises :class:`~filechannel.errors.DiskFullError` (a
  ``ChannelFullError`` with ``reason="disk_full"``, and an ``OSError`` with
  that errno; the transaction is undone, never written again as if it were
  safe). A failed truncate fails the log.
* **a failed fsync**, whatever its errno (ENOSPC from NFS or thin
  provisioning included): the kernel may have dropped the dirty pages, so
  what the file holds is unknown. The log fails, as for any fsync error.

The writer zero-fills up to 1 MiB ahead of its last write (``writer.py``), so
on file systems that overwrite in place (ext4, XFS, tmpfs) the records of
takes and retirements usually land in space already allocated, even on a
full disk. Copy-on-write file systems (btrfs, ZFS) allocate on every write:
there the floor is what keeps room for them.

It does no I/O of its own but ``free_space`` and, at open, the sizes of the
live data files, both through ``_fs``.
"""

from __future__ import annotations

import errno
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from .errors import ChannelFullError, DiskFullError, DiskSpaceError

if TYPE_CHECKING:
    from .logstate import LogState

SPACE_REFRESH_S = 1.0
"""Longest a free-space reading is trusted (less what was written since) before it is read again."""
POLL_S = 0.25
"""A put waiting for free space looks again this often (space can come back from outside the channel)."""
ENOSPC_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class SpaceGuard:
    """The room checks of one open log (see the module docstring).

    Args:
        st: The log's shared state (its config, free-space cache and byte counters).
        active_bytes: The lengths of the files the writers append to, summed.
        room_ahead: The bytes already zero-filled ahead of data directory ``index``'s writer.
    """

    def __init__(self, st: LogState, active_bytes: Callable[[], int], room_ahead: Callable[[int], int]) -> None:
        self.st = st
        self._active_bytes = active_bytes
        self._room_ahead = room_ahead
        self.refusals = 0
        for fid, (_, path) in list(st.files.items()):
            if fid in st.file_bytes:
                continue
            try:
                fd = st.fs.open_read(path)
            except OSError:
                continue
            try:
                st.file_sealed(fid, st.fs.size(fd))
            finally:
                st.fs.close(fd)

    def held_bytes(self) -> int:
        """Bytes of the live data files now."""
        return self.st.sealed_bytes + self._active_bytes()

    def free(self, index: int, fresh: bool = False) -> int:
        """Free bytes on data directory ``index``'s file system (a reading at most a second old, less writes)."""
        st = self.st
        now = time.monotonic()
        cached = st.space.get(index)
        if fresh or cached is None or now - cached[0] > SPACE_REFRESH_S:
            free = st.fs.free_space(st.data_dirs[index])
            st.space[index] = (now, free)
            st.space_written[index] = 0
            return free
        return cached[1] - st.space_written.get(index, 0)

    def _refusal(self, index: int, nbytes: int) -> ChannelFullError | None:
        """Why a put of ``nbytes`` to data directory ``index`` may not write now (None: it may)."""
        cfg = self.st.config
        limit = cfg.max_bytes
        if limit is not None:
            held = self.held_bytes()
            if (held + nbytes > limit) if nbytes else (held >= limit):
                return ChannelFullError(
                    f"channel is full: its data files hold {held} bytes, max_bytes={limit}"
                    + (f", and this commit needs {nbytes} more" if nbytes else "")
                    + f"; no room appeared within keep_alive={cfg.keep_alive} s: take (or acknowledge) "
                    "events so that data files retire, or raise max_bytes",
                    "max_bytes",
                )
        floor = cfg.minimum_required_space
        if floor:  # 0: no check before writing; a write that runs out of space raises DiskFullError
            need = floor + max(0, nbytes - self._room_ahead(index))
            free = self.free(index)
            if free < need:
                free = self.free(index, fresh=True)  # never refuse on an old reading: space may have come back
            if free < need:
                self.st.space.pop(index, None)  # read afresh next time too
                return DiskSpaceError(self.st.data_dirs[index], free, floor, needed=need)
        return None

    def roomy(self, index: int, nbytes: int) -> bool:
        """Whether ``nbytes`` surely fit, by a recent reading alone (the common case, quick; False: look closer)."""
        st = self.st
        cfg = st.config
        if cfg.max_bytes is not None:
            return False
        floor = cfg.minimum_required_space
        if not floor:
            return True
        cached = st.space.get(index)
        return (
            cached is not None
            and time.monotonic() - cached[0] <= SPACE_REFRESH_S
            and cached[1] - st.space_written.get(index, 0) >= floor + nbytes
        )

    def check(self, index: int, nbytes: int = 0, wait: float = 0.0) -> None:
        """Return once a put (whose commit writes ``nbytes``; 0: not known yet) has room, waiting up to ``wait`` s.

        Raises:
            ChannelFullError: ``max_bytes`` is reached (``reason="max_bytes"``), or
                :class:`DiskSpaceError` (``reason="min_free"``): free space is under
                the floor. Nothing was written.
        """
        if self.roomy(index, nbytes):
            return
        err = self._refusal(index, nbytes)
        if err is None:
            return
        deadline = time.monotonic() + wait
        room = self.st.room
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.refusals += 1
                raise err
            with room:
                room.wait(min(left, POLL_S))  # a retirement wakes it at once
            self.st.check_writable()  # closed or failed while waiting: say so, not "full"
            err = self._refusal(index, nbytes)
            if err is None:
                return

    def out_of_space(self, index: int, exc: OSError) -> DiskFullError:
        """The error a commit raises when its write ran out of space and was undone (the log did not fail)."""
        self.st.space.pop(index, None)
        self.refusals += 1
        err_no = exc.errno if exc.errno is not None else errno.ENOSPC
        return DiskFullError(self.st.data_dirs[index], err_no, self.st.config.minimum_required_space)

    def stats(self, data_dirs: Sequence[str]) -> dict[str, int | None]:
        """``stats()``'s room keys: bytes held, the limits, the least free space of the data directories."""
        free: int | None = None
        for i in range(len(data_dirs)):
            try:
                f = self.st.fs.free_space(data_dirs[i])
            except OSError:
                continue
            free = f if free is None else min(free, f)
        return {
            "data_bytes": self.held_bytes(),
            "max_bytes": self.st.config.max_bytes,
            "disk_free": free,
            "minimum_required_space": self.st.config.minimum_required_space,
            "space_refusals": self.refusals,
        }
