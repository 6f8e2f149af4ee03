"""A channel on the simulated file system that can be power-cut at any instant and reopened.

:class:`CrashableChannel` opens a :class:`filechannel.FileChannel` on a
:class:`~filechannel.testing.simfs.SimFS`; :meth:`CrashableChannel.crash`
takes the file system as a power cut would leave it at that instant (through
:meth:`SimFS.crash`, the same model the project's own crash-point harness
uses), abandons the old channel and reopens the channel on what survived. What
survives is what the durability contract promises, and nothing else: with
``fsync="commit"`` every transaction whose ``commit()`` returned; open
transactions and unsynced writes are lost.
"""

from __future__ import annotations

import logging
from typing import Any

import filechannel
from filechannel.errors import ChannelError

from .simfs import SimFS

__all__ = ["LOSSES", "CrashableChannel"]

logger = logging.getLogger(__name__)

# lose= -> the SimFS crash mode
LOSSES = {
    "unsynced": "drop",  # every write and namespace change not made durable by a sync is lost
    "nothing": "keep",  # every write reached the disk (what kill -9 leaves)
    "torn": "torn_prefix",  # a random prefix of the unsynced writes, the last of them torn
}
DEFAULT_PATH = "/sim/channel"


class CrashableChannel:
    """A channel on a :class:`SimFS`; attribute access goes to the current :class:`FileChannel`.

    Args:
        path: The channel directory on the simulated file system (absolute).
        fs: The file system (default: a fresh ``SimFS()``).
        **options: Passed to :func:`filechannel.open` on every (re)open;
            ``background`` defaults to False (no threads to race the crash).
    """

    def __init__(self, path: str = DEFAULT_PATH, fs: SimFS | None = None, **options: Any) -> None:
        self.path = path
        self.fs = fs if fs is not None else SimFS()
        options.setdefault("background", False)
        options.setdefault("minimum_required_space", 0)
        self.options = options
        self.crashes = 0
        self.channel: filechannel.FileChannel = filechannel.open(path, fs=self.fs, **options)

    def __getattr__(self, name: str) -> Any:
        if name == "channel":  # not set yet (the open failed): no recursion
            raise AttributeError(name)
        return getattr(self.channel, name)

    def __repr__(self) -> str:
        return f"<CrashableChannel {self.path!r} crashes={self.crashes} {self.channel!r}>"

    def crash(self, lose: str = "unsynced", seed: int = 0) -> filechannel.FileChannel:
        """Cut the power now; return the channel reopened on what survived.

        Args:
            lose: ``"unsynced"`` (every write not made durable by an fsync is
                lost, the worst power cut), ``"nothing"`` (every write reached
                the disk, as after ``kill -9``), or ``"torn"`` (a random prefix
                of the unsynced writes survived, the last one torn).
            seed: Picks the prefix and the tear for ``"torn"``; the same seed on
                the same history gives the same state.

        Returns:
            The reopened channel (also :attr:`channel`). Transactions and
            events of the old channel object are dead: use the new one.
        """
        mode = LOSSES.get(lose)
        if mode is None:
            raise ValueError(f"lose must be one of {', '.join(map(repr, LOSSES))}, not {lose!r}")
        after = self.fs.crash(seed, mode)
        old, old_fs = self.channel, self.fs
        # The old channel lives on in the discarded file system only: closing it stops its threads
        # and releases its descriptors; whatever it writes there is gone with it.
        old_fs.on_op = None
        try:
            old.close()
        except (ChannelError, OSError) as exc:
            logger.debug("closing the crashed channel on the discarded file system: %s", exc)
        self.fs = after
        self.crashes += 1
        self.channel = filechannel.open(self.path, fs=after, **self.options)
        return self.channel

    def reopen(self) -> filechannel.FileChannel:
        """Close the channel cleanly and open it again (a restart without a crash)."""
        self.channel.close()
        self.channel = filechannel.open(self.path, fs=self.fs, **self.options)
        return self.channel

    def close(self) -> None:
        """Close the current channel."""
        self.channel.close()
