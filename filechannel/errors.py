"""The whole exception hierarchy of filechannel (and the advice its corruption errors carry), nothing else.

Every error the library raises on purpose is a ``ChannelError``. Where callers
expect a builtin (``ValueError`` for bad options, ``RuntimeError`` for misuse),
the class also derives from it. OS errors from a failed write or fsync are
re-raised unchanged as the ``__cause__`` of nothing: they propagate as
``OSError`` so that callers see ``errno``.
"""

from __future__ import annotations

import os


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
    """The channel directory is already open, in this process or another.

    ``holder`` describes who holds it (``"pid 4242 on host web-1 since
    2026-01-02T03:04:05+00:00"``), as the holder wrote it into the ``LOCK`` file,
    or is None when that is unknown. It is informational only: the lock itself
    is what keeps a second opener out.
    """

    def __init__(self, path: str, holder: str | None = None) -> None:
        self.path = path
        self.holder = holder
        by = f" (held by {holder})" if holder else " (in this or another process)"
        super().__init__(f"channel directory {path} is already open by another FileChannel{by}; close it first")


class ChannelFullError(ChannelError):
    """A put found no room within ``keep_alive``: nothing of it was written.

    ``.reason`` names the limit that was reached: ``"capacity"`` (events),
    ``"max_bytes"`` (bytes of data files), ``"min_free"`` (the file system's
    free space is under ``minimum_required_space``) or ``"disk_full"`` (the
    file system refused a write with ENOSPC or EDQUOT; the write was undone).
    Take events (or acknowledge them) so that data files retire, free disk
    space, or raise the limit; puts resume by themselves, no restart needed.
    """

    def __init__(self, message: str, reason: str = "capacity") -> None:
        self.reason = reason
        super().__init__(message)


class TransactionCapacityError(ChannelError):
    """A transaction holds more than ``transaction_capacity`` puts or takes."""


class InvalidEventError(ChannelError, ValueError):
    """An event that cannot be stored, e.g. a header that is not valid UTF-8 text.

    Nothing of the event is written; the transaction stays open and usable.
    """


class EventTooLargeError(InvalidEventError):
    """An event (body plus encoded headers) is larger than ``max_event_size``."""

    def __init__(self, size: int, limit: int) -> None:
        self.size = size
        self.limit = limit
        super().__init__(
            f"event of {size} bytes (body and headers) exceeds max_event_size={limit}; "
            "put a smaller event or open the channel with a larger max_event_size="
        )


class RecordTooLargeError(EventTooLargeError):
    """A write-ahead log record larger than a data file of that log can hold (``max_file_size``)."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(size, limit)
        self.args = (
            f"record of {size} bytes exceeds the largest record this write-ahead log takes ({limit} bytes, "
            "set by max_file_size); write smaller records or open the log with a larger max_file_size=",
        )


class TransactionStateError(ChannelError, RuntimeError):
    """A transaction was used after it committed, rolled back or failed."""


class DiskSpaceError(ChannelFullError):
    """No room on a data directory's file system: a full channel, of the ``"min_free"`` or ``"disk_full"`` kind.

    ``"min_free"``: free space stayed under ``minimum_required_space`` (plus
    what the commit writes) for ``keep_alive`` seconds; nothing was written
    and the transaction stays open. ``"disk_full"``: the write itself ran out
    of space (:class:`DiskFullError`). Neither fails the channel.
    """

    def __init__(self, path: str, free: int, required: int, reason: str = "min_free", needed: int = 0) -> None:
        self.path = path
        self.free = free
        self.required = required
        if needed > required:
            msg = (
                f"only {free} bytes free on {path}: under minimum_required_space={required} plus the "
                f"{needed - required} bytes this commit writes; free disk space or take events to drain the channel"
            )
        else:
            msg = (
                f"only {free} bytes free on {path}, minimum_required_space={required}; "
                "free disk space or take events to drain the channel"
            )
        super().__init__(msg, reason)


class DiskFullError(DiskSpaceError, OSError):
    """A put's write ran out of space (ENOSPC or EDQUOT): a full channel (``reason="disk_full"``), and an ``OSError``.

    The write was cut back to where its batch began, so nothing of it stays in
    the file and the channel goes on; the transaction is undone (put it again
    later). ``errno`` is the file system's, so callers that catch ``OSError``
    see it as before.
    """

    def __init__(self, path: str, err: int, required: int) -> None:
        super().__init__(path, 0, required, "disk_full")
        self.args = (
            f"no space left on {path} ({os.strerror(err)}): the write was undone and nothing was put; "
            "free disk space or take events so that data files retire, then put again",
        )
        self.errno = err
        self.strerror = os.strerror(err)
        self.filename = path

    def __str__(self) -> str:
        return str(self.args[0])


class UnsafePermissionsError(ChannelError):
    """A channel directory is owned by another user, or open to others beyond ``permissions``.

    Attributes: ``path``, ``uid`` (its owner), ``mode`` (its permission bits),
    ``allowed`` (the widest mode ``permissions`` allows) and ``fix`` (what to run).
    """

    def __init__(self, path: str, uid: int, mode: int, allowed: int, reason: str, fix: str) -> None:
        self.path = path
        self.uid = uid
        self.mode = mode
        self.allowed = allowed
        self.reason = reason
        self.fix = fix
        super().__init__(f"refusing to open {path}: {reason}; {fix}")


class FormatError(ChannelError, ValueError):
    """Bytes that do not decode as filechannel's format (the only error of ``format``).

    ``offset`` is relative to the buffer that was decoded.
    """

    def __init__(self, offset: int, reason: str) -> None:
        self.offset = offset
        self.reason = reason
        super().__init__(f"{reason} at offset {offset}")


class EventFormatError(FormatError):
    """A PUT payload that does not decode as an event, though its record's frame verified.

    Raised by ``format.decode_event``; ``offset`` is relative to the payload. It is a
    :class:`FormatError` to every caller: the subclass only lets a batch decoder
    (``format.decode_puts``) say which of the two steps failed for a record.
    """


#: What a :class:`CorruptLogError` of a channel advises when its raiser gives no hint.
WRONG_KEY = "wrong key for this channel"
CHANNEL_HINT = (
    "run `filechannel verify DIR` for a full report; open with on_corruption='skip' to drop "
    "exactly what is damaged (each lost position is reported) and keep the rest"
)
#: The same advice for a write-ahead log (``filechannel.WriteAheadLog``): its tool and its words.
WAL_HINT = (
    "run `filechannel wal verify DIR` for a full report; open the WriteAheadLog with on_corruption='skip' "
    "to drop exactly what is damaged (each lost record is logged) and keep the rest"
)


class CorruptLogError(ChannelError):
    """Acknowledged data on disk is damaged, missing or not from this channel."""

    def __init__(self, path: str, offset: int, reason: str, hint: str | None = None) -> None:
        self.path = path
        self.offset = offset
        self.reason = reason
        self.hint = hint or CHANNEL_HINT
        super().__init__(self._text())

    def _text(self) -> str:
        return f"{self.path} at byte {self.offset}: {self.reason} ({self.hint})"

    def rehint(self, hint: str) -> None:
        """Replace the default channel advice with ``hint`` (a raiser's own hint is kept)."""
        if self.hint == CHANNEL_HINT:
            self.hint = hint
            self.args = (self._text(),)


class DecryptionError(CorruptLogError):
    """Encrypted data that cannot be decrypted: no key, the wrong key, or a record whose tag fails.

    Raised at open when encrypted data files exist and no ``encryption=``, no
    key for a file's key id (``.key_id``) or the wrong key is given; and for a
    record whose checksum is intact but whose authentication tag fails
    (tampering, or a record moved from elsewhere), with its path and offset,
    under the ``on_corruption`` policy like other damage. There is never a
    plaintext fallback.

    ``wrong_key`` is true when the keys given are not the channel's (no key for
    the file's key id, or a key that fails the file's key check): the message
    then starts with "wrong key for this channel" and names no byte offset, since
    nothing is damaged.
    """

    def __init__(
        self,
        path: str,
        offset: int,
        reason: str,
        key_id: str | None = None,
        hint: str | None = None,
        *,
        wrong_key: bool = False,
    ) -> None:
        self.key_id = key_id
        self.wrong_key = wrong_key
        super().__init__(path, offset, reason, hint)

    def _text(self) -> str:
        if self.wrong_key:
            return f"{WRONG_KEY}: {self.path}: {self.reason} ({self.hint})"
        return super()._text()


class NotAChannelError(ChannelError):
    """A path that should be a channel directory (or, ``expected``, a write-ahead log) is not one."""

    def __init__(self, path: str, reason: str, expected: str = "a filechannel directory") -> None:
        self.path = path
        self.reason = reason
        self.expected = expected
        super().__init__(f"{path} is not {expected}: {reason}")


class ChannelCopyError(ChannelError):
    """A channel directory is a copy of a live channel whose data directory it would share."""

    def __init__(self, path: str, original: str, data_dir: str) -> None:
        self.path = path
        self.original = original
        self.data_dir = data_dir
        super().__init__(
            f"{path} is a copy of the channel in {original}, and its data directory {data_dir} "
            f"belongs to that channel; open {original} instead, or, to restore a backup, put the channel "
            "directory back where it was (see docs/backup.md)"
        )


class DataDirOwnershipError(ChannelError):
    """A data directory belongs to another channel (nothing is damaged: the options name the wrong one)."""

    def __init__(self, data_dir: str, owner_id: str, channel_id: str | None, hint: str) -> None:
        self.data_dir = data_dir
        self.owner_id = owner_id
        self.channel_id = channel_id
        this = f", this is {channel_id}" if channel_id else ""
        super().__init__(f"data directory {data_dir} belongs to another channel (id {owner_id}{this}); {hint}")


class ConsumerIdentityError(ChannelError):
    """A consumer name is registered with another identity (another query or job uses it)."""

    def __init__(self, consumer: str, recorded: str | None, given: str | None) -> None:
        self.consumer = consumer
        self.recorded = recorded
        self.given = given
        super().__init__(
            f"consumer {consumer!r} is registered with identity {recorded!r}, not {given!r}: another query or job "
            "reads under this name; use another consumer name, take the name over with reset=True (its "
            f"acknowledged position is kept), or unregister it with `filechannel consumers DIR --remove {consumer}`"
        )


class ConsumerConflictError(ChannelError):
    """An in-process take on a channel that registered external consumers read."""

    def __init__(self, directory: str, consumers: list[str]) -> None:
        self.directory = directory
        self.consumers = list(consumers)
        names = ", ".join(repr(c) for c in self.consumers)
        first = self.consumers[0] if self.consumers else "NAME"
        super().__init__(
            f"channel {directory} has registered external consumers ({names}): an in-process take would remove "
            "events they have not read (a re-read must give the same events); read through "
            f"filechannel.ChannelReader, or unregister them with `filechannel consumers {directory} --remove {first}`"
        )


class DataLossError(ChannelError):
    """Positions a reader asked for are gone: retired, acknowledged already, or never in the channel."""

    def __init__(self, start: int, end: int, reason: str) -> None:
        self.start = start
        self.end = end
        self.reason = reason
        super().__init__(f"positions [{start}, {end}) are gone: {reason}")


class AckRangeError(ChannelError, ValueError):
    """``ChannelReader.ack(end)`` beyond what the channel has committed (``end`` > ``committed``).

    Nothing is acknowledged. Positions at or above ``committed`` do not exist
    yet: acknowledge only ends that :meth:`ChannelReader.available` returned.
    """

    def __init__(self, end: int, committed: int) -> None:
        self.end = end
        self.committed = committed
        super().__init__(
            f"cannot acknowledge up to {end}: only positions below {committed} are committed "
            "(acknowledge an end that available() or read() returned)"
        )


class InvalidHandleError(ChannelError, ValueError):
    """A write-ahead log handle that names no record of this log (``.reason`` says why).

    Its file was cleaned, it belongs to another log, its fields cannot describe
    a record, it points past the end of its data file, or the intact record at
    its offset has another write-order id. The log is fine: nothing to repair.
    A handle whose record is there but damaged raises :class:`CorruptLogError`.
    """

    def __init__(self, handle: object, reason: str) -> None:
        self.handle = handle
        self.reason = reason
        super().__init__(f"{handle!r}: {reason}")


# -- the agent (filechannel serve / filechannel.agent.connect) ------------------------------


class AgentError(ChannelError):
    """Root of the errors an agent call raises beyond the channel's own (``.uri`` names the agent)."""

    def __init__(self, uri: str, reason: str) -> None:
        self.uri = uri
        self.reason = reason
        super().__init__(f"agent {uri}: {reason}")


class AgentUnavailableError(AgentError):
    """The agent cannot be reached: stopped, not listening, the network, or a TLS handshake that failed."""


class AgentTimeoutError(AgentUnavailableError):
    """The agent did not answer within the call's deadline (``timeout``)."""


class AgentAuthError(AgentError):
    """The agent refused the caller: a missing or wrong bearer token, or a certificate name not allowed."""


class UnknownChannelError(AgentError):
    """The agent serves no channel with this id (``.channel``)."""

    def __init__(self, uri: str, channel: str, served: list[str]) -> None:
        self.channel = channel
        self.served = list(served)
        listed = ", ".join(self.served) or "none"
        super().__init__(uri, f"serves no channel with id {channel} (it serves: {listed})")


class AgentProtocolError(AgentError):
    """A request or an answer that does not follow the agent's wire format (another version?)."""
