"""The whole exception hierarchy of filechannel, and nothing else.

Every error the library raises on purpose is a ``ChannelError``. Where callers
expect a builtin (``ValueError`` for bad options, ``RuntimeError`` for misuse),
the class also derives from it. OS errors from a failed write or fsync are
re-raised unchanged as the ``__cause__`` of nothing: they propagate as
``OSError`` so that callers see ``errno``.
"""

from __future__ import annotations


class ChannelError(Exception):
    """Root of every error raised by filechannel."""


class ConfigError(ChannelError, ValueError):
    """An option passed to :func:`filechannel.open` is unknown or invalid."""

    def __init__(self, option: str, reason: str) -> None:
        self.option = option
        self.reason = reason
        super().__init__(f"invalid option {option}: {reason}")


class ChannelClosedError(ChannelError):
    """The channel was closed, or has failed and refuses further work."""


class ChannelLockedError(ChannelError):
    """The channel directory is already open, in this process or another."""

    def __init__(self, path: str) -> None:
        self.path = path
        super().__init__(
            f"channel directory {path} is already open by another FileChannel "
            "(in this or another process); close it first"
        )


class ChannelFullError(ChannelError):
    """A put would exceed ``capacity`` and no room appeared within ``keep_alive``."""


class TransactionCapacityError(ChannelError):
    """A transaction holds more than ``transaction_capacity`` puts or takes."""


class TransactionStateError(ChannelError, RuntimeError):
    """A transaction was used after it committed, rolled back or failed."""


class DiskSpaceError(ChannelError):
    """Free space on a data directory is under ``minimum_required_space``."""

    def __init__(self, path: str, free: int, required: int) -> None:
        self.path = path
        self.free = free
        self.required = required
        super().__init__(
            f"only {free} bytes free on {path}, minimum_required_space={required}; "
            "free disk space or take events to drain the channel"
        )


class FormatError(ChannelError, ValueError):
    """Bytes that do not decode as filechannel's format (the only error of ``format``).

    ``offset`` is relative to the buffer that was decoded.
    """

    def __init__(self, offset: int, reason: str) -> None:
        self.offset = offset
        self.reason = reason
        super().__init__(f"{reason} at offset {offset}")


class CorruptLogError(ChannelError):
    """Acknowledged data on disk is damaged, missing or not from this channel."""

    def __init__(self, path: str, offset: int, reason: str) -> None:
        self.path = path
        self.offset = offset
        self.reason = reason
        super().__init__(
            f"{path} at byte {offset}: {reason} (run `filechannel verify` for a full "
            'report; open with on_corruption="skip" to recover what is intact)'
        )


class NotAChannelError(ChannelError):
    """A path that should be a channel directory is not one."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"{path} is not a filechannel directory: {reason}")
