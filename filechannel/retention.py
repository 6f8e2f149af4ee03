"""Retiring data files: the RETIRE record first, then the unlink.

This module owns how a data file stops being part of the channel. Which files
may go is the channel's decision (no queued event, no open transaction and no
consumer needs them); how they go is decided here: each leaves its writer's
live list, a RETIRE record naming it is made durable in the active file of its
data directory, and only then is it unlinked and its directory entry synced.
Recovery never mistakes a retired file for a missing one, nor replays one whose
unlink did not persist.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from . import format as fmt
from .logstate import LogState
from .writer import Item, Writer

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
