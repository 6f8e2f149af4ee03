"""The consumer registry: named external consumers and their durable acknowledgements.

This module owns ``DIR/consumers/``: one ``<name>.ack`` file per registered
consumer (a reader in any process, see ``ChannelReader``), holding the
position below which that consumer has processed every event. It knows
nothing of queues or transactions: the owning channel reads the registry and
turns the lowest acknowledgement into a committed take (``FileChannel.apply_acks``).

Each file is a checksummed one-line JSON object (:func:`filechannel.log.encode_meta`)::

    {"acked":17,"identity":"query-1","name":"q","registered_ns":...,"seq":4,"version":1}
    crc32:xxxxxxxx

``seq`` counts the file's writes (absent in files written before it: 0). An
encrypted channel's ``ANCHOR`` and checkpoints record, for each consumer, the
newest ``(registered_ns, seq)`` its owner read; an ``.ack`` older than that was
put back from the past and is refused (``CorruptLogError``), so its reader does
not read acknowledged events again.

Files and ``consumers/`` get the modes of the channel's ``permissions``, or
in a process that does not know them (a reader) of the policy the channel
directory's mode shows (``permissions.policy_of``). Every write is atomic and
durable when it returns, all through the ``_fs`` seam: a temporary file
(``.<name>.ack.tmp-<pid>-<ns>``, never read), fsync, rename over
``<name>.ack``, fsync of ``consumers/`` (whose own entry in the channel
directory is fsynced when it is created). A crash leaves the old
file or the new one, never a mix; a leftover temporary file is ignored, and
deleted by the next registration of that name once it is a minute old (a
younger one may be another process's write in progress) or by its removal.

One process writes a given consumer's file at a time (the reader that owns
the name); acknowledgements are monotone and idempotent, so a repeated or
late ``ack`` changes nothing.
"""

from __future__ import annotations

import builtins
import dataclasses
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ._fs import FS, FileTooLarge, read_file, replace_durably
from .directory import encode_meta, split_meta, verify_mac
from .errors import ChannelError, ConfigError, ConsumerIdentityError, CorruptLogError, FormatError
from .format import AckMark
from .permissions import fs_for, policy_of

if TYPE_CHECKING:
    from .crypto import MetaMac

__all__ = ["CONSUMERS_DIR", "ConsumerState", "ConsumerStore", "validate_name"]

logger = logging.getLogger(__name__)

CONSUMERS_DIR = "consumers"
ACK_SUFFIX = ".ack"
MAX_NAME_LEN = 100
MAX_ACK_FILE = 64 * 1024  # an ack file is one short JSON line (and a checksum and MAC line)
_NAME_RE = re.compile(r"[A-Za-z0-9._-]+")
_TMP_MARK = ".tmp-"
# A directory token whose times are this recent may not show a change made in
# the same timestamp tick (coarse file-system clocks), so it is not trusted.
_RACY_NS = 2_000_000_000
_STALE_TMP_NS = 60_000_000_000  # a temporary file this old is no write in progress
_REMEDY = "unregister it with `filechannel consumers DIR --remove {name}` (its reader then registers again)"


@dataclass(frozen=True)
class ConsumerState:
    """One registered consumer, as its ``.ack`` file records it.

    Attributes:
        name: The consumer's name (``[A-Za-z0-9._-]``, at most 100 characters).
        identity: A token of the query or job that reads under this name, or None.
        acked: Every position below this one has been processed by the consumer.
        registered_ns: When the consumer was first registered (``time.time_ns()``).
    """

    name: str
    identity: str | None
    acked: int
    registered_ns: int
    seq: int = field(default=0, compare=False)  # how many times the file was written (0: before the field)


def validate_name(name: object) -> str:
    """Return ``name`` if it is a valid consumer name.

    Args:
        name: The candidate: a non-empty str of ``A-Z a-z 0-9 . _ -``, at most 100 characters.

    Returns:
        The name, unchanged.

    Raises:
        ConfigError: The name is not a str, is empty, too long or has another character.
    """
    if not isinstance(name, str):
        raise ConfigError("consumer", f"a consumer name must be a str, got {type(name).__name__}")
    if not name:
        raise ConfigError("consumer", "a consumer name must not be empty")
    if len(name) > MAX_NAME_LEN:
        raise ConfigError("consumer", f"a consumer name has at most {MAX_NAME_LEN} characters, got {len(name)}")
    if not _NAME_RE.fullmatch(name):
        raise ConfigError("consumer", f"{name!r}: a consumer name may only hold A-Z, a-z, 0-9, '.', '_' and '-'")
    return name


def _check_position(value: object, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{what} must be an int position, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{what} must be a position >= 0, got {value}")
    return value


def _check_identity(identity: object) -> str | None:
    if identity is not None and not isinstance(identity, str):
        raise TypeError(f"identity must be a str or None, got {type(identity).__name__}")
    return identity


class ConsumerStore:
    """The consumers registered on one channel directory (``DIR/consumers/*.ack``).

    Safe to use from several threads; several processes may read the registry
    while one process writes a given consumer's file.

    Args:
        fs: The I/O seam (tests pass a simulated file system).
        directory: The channel directory.
        permissions: The channel's ``permissions`` policy; ``None``: the one the
            channel directory's mode shows, looked up at the first write.
    """

    def __init__(
        self,
        fs: FS,
        directory: str,
        permissions: str | None = None,
        mac: MetaMac | None = None,
        required: bool = False,
        seen: dict[str, AckMark] | None = None,
    ) -> None:
        self.fs = fs
        # An encrypted channel's ANCHOR and checkpoints record how far the owner saw each
        # ack go (registration time, write count): an older ack put back is refused. The
        # owner (``owner``) keeps ``seen`` up to date with what it reads, for the next ANCHOR.
        self.seen = seen
        self.owner = False
        self.permissions = permissions
        # An encrypted channel's acks carry a MAC (``ack:<name>``); once the channel has
        # authenticated data files (``required``) an ack without one is refused too.
        self.mac = mac
        self.required = required
        self.directory = os.fspath(directory)
        self.path = os.path.join(self.directory, CONSUMERS_DIR)
        self._lock = threading.Lock()
        self._cache: tuple[tuple[int, int, int, int] | None, dict[str, ConsumerState]] | None = None
        self._writing_fs: FS | None = None  # self.fs with the policy's modes, once looked up

    def file_path(self, name: str) -> str:
        """Return the path of consumer ``name``'s ``.ack`` file."""
        return os.path.join(self.path, name + ACK_SUFFIX)

    # -- reading -------------------------------------------------------------------------

    def list(self) -> dict[str, ConsumerState]:
        """Return every registered consumer, by name (temporary files are ignored).

        Raises:
            CorruptLogError: An ``.ack`` file does not decode; the error names it.
        """
        out: dict[str, ConsumerState] = {}
        for name in self.names():
            state = self._read(name)
            if state is not None:
                out[name] = state
        return out

    def names(self) -> builtins.list[str]:
        """The names of the registered consumers (their ``.ack`` files; temporary files ignored), sorted."""
        try:
            entries = self.fs.listdir(self.path)
        except FileNotFoundError:
            return []
        out: builtins.list[str] = []
        for entry in sorted(entries):
            if not entry.endswith(ACK_SUFFIX) or _TMP_MARK in entry:
                continue
            name = entry[: -len(ACK_SUFFIX)]
            if name and len(name) <= MAX_NAME_LEN and _NAME_RE.fullmatch(name):  # else: not a name written here
                out.append(name)
        return out

    def get(self, name: str) -> ConsumerState | None:
        """Return consumer ``name``, or None if it is not registered.

        Raises:
            ConfigError: ``name`` is not a valid consumer name.
            CorruptLogError: Its ``.ack`` file does not decode.
        """
        return self._read(validate_name(name))

    def mtime_token(self) -> tuple[int, int, int, int] | None:
        """Return a token that changes when a consumer file is added, replaced or removed.

        One ``access`` of ``DIR/consumers`` (None while that directory does not
        exist, the usual case) and, when it exists, one ``stat``.
        Within the file system's timestamp granularity two changes may share a
        token: :meth:`cached_list` distrusts recent tokens for that reason.
        """
        if not self.fs.exists(self.path):  # no consumer yet (the usual case): no exception to raise
            return None
        try:
            return self.fs.stat_token(self.path)
        except FileNotFoundError:
            return None

    def cached_list(self) -> dict[str, ConsumerState]:
        """Return :meth:`list`, re-read only when :meth:`mtime_token` changed.

        Costs one or two system calls (see :meth:`mtime_token`) while the
        registry is unchanged. A token whose times are within 2 s of now is not
        trusted (a change in the same timestamp tick would not show), so the
        files are read again until it settles.
        The returned dict is shared: do not modify it.

        Raises:
            CorruptLogError: An ``.ack`` file does not decode.
        """
        token = self.mtime_token()
        cache = self._cache
        if cache is not None and cache[0] == token:
            return cache[1]
        states = self.list()
        if token is None or max(token[2], token[3]) <= time.time_ns() - _RACY_NS:
            self._cache = (token, states)
        return states

    def _read(self, name: str) -> ConsumerState | None:
        path = self.file_path(name)
        try:
            buf = read_file(self.fs, path, MAX_ACK_FILE)
        except FileNotFoundError:
            return None
        except FileTooLarge as exc:
            raise CorruptLogError(
                path, 0, f"consumer {name}: {exc.size} bytes, not an ack file", _REMEDY.format(name=name)
            ) from exc
        try:
            obj, line, key_id, tag = split_meta(buf, f"consumer {name}")
            state = _state_of(name, obj)
        except FormatError as exc:
            raise CorruptLogError(path, exc.offset, exc.reason, _REMEDY.format(name=name)) from exc
        problem = verify_mac(self.mac, self.required, path, _role(name), line, key_id, tag)
        if problem is not None:
            raise CorruptLogError(path, 0, f"consumer {name}: {problem}", _REMEDY.format(name=name))
        if self.seen is not None and key_id is not None:
            self._check_fresh(path, state)
        return state

    def _check_fresh(self, path: str, state: ConsumerState) -> None:
        """Refuse an ``.ack`` older than the one the owner last saw (see ``seen``); the owner notes a newer one."""
        assert self.seen is not None
        mark = self.seen.get(state.name)
        if mark is not None and (state.registered_ns, state.seq) < (mark.registered_ns, mark.seq):
            raise CorruptLogError(
                path,
                0,
                f"consumer {state.name}: its .ack is older than the one the channel's owner recorded (write "
                f"{state.seq} of registration {state.registered_ns}, the owner saw write {mark.seq} of "
                f"registration {mark.registered_ns}): an older .ack was put back; its reader would read "
                "acknowledged events again",
                _REMEDY.format(name=state.name),
            )
        if self.owner and (mark is None or (state.registered_ns, state.seq) > (mark.registered_ns, mark.seq)):
            self.seen[state.name] = AckMark(state.name, state.registered_ns, state.seq)

    def seal_all(self) -> int:
        """Rewrite every ack whose MAC is missing or made with another key than the active one; return how many.

        At a channel's open: when it just got keys, and after a key rotation (so an
        old key can be dropped once no data file uses it).

        Raises:
            CorruptLogError: An ``.ack`` file does not decode.
        """
        if self.mac is None:
            return 0
        n = 0
        with self._lock:
            for name in self.list():
                _obj, _line, key_id, _tag = split_meta(
                    read_file(self.fs, self.file_path(name), MAX_ACK_FILE), f"consumer {name}"
                )
                if key_id != self.mac.key_id:
                    st = self._read(name)
                    assert st is not None
                    self._write(st)
                    n += 1
        if n:
            logger.info("added a MAC to %d consumer ack file(s) of %s", n, self.directory)
        return n

    # -- writing -------------------------------------------------------------------------

    def register(self, name: str, identity: str | None, start: int, reset: bool = False) -> ConsumerState:
        """Register consumer ``name`` (durably), or return it if it is registered already.

        A new consumer starts with ``acked=start``; an existing one keeps its
        acknowledged position (``start`` is then ignored). An existing consumer
        recorded without an identity adopts ``identity``.

        Args:
            name: The consumer name.
            identity: A token of the query or job reading under this name, or None.
            start: The acknowledged position of a new consumer (usually the channel's head).
            reset: Replace a different recorded identity instead of refusing it.

        Returns:
            The consumer as recorded.

        Raises:
            ConfigError: ``name`` is not a valid consumer name.
            ConsumerIdentityError: The consumer is registered with another identity and ``reset`` is False.
            CorruptLogError: Its existing ``.ack`` file does not decode.
            OSError: Writing the file failed (nothing changed).
        """
        validate_name(name)
        _check_identity(identity)
        _check_position(start, "start")
        with self._lock:
            # A reader killed in the middle of an ack leaves a temporary file; its restart sweeps it.
            self._clean_temporaries(name, older_than_ns=_STALE_TMP_NS)
            cur = self._read(name)
            if cur is None:
                state = self._write(ConsumerState(name, identity, start, time.time_ns()))
                logger.info("registered consumer %s (identity %r) at position %d", name, identity, start)
                return state
            if identity is None or cur.identity == identity:
                return cur
            if cur.identity is not None and not reset:
                raise ConsumerIdentityError(name, cur.identity, identity)
            if cur.identity is not None:
                logger.warning("consumer %s: identity %r replaced by %r (reset)", name, cur.identity, identity)
            return self._write(ConsumerState(name, identity, cur.acked, cur.registered_ns, cur.seq))

    def ack(self, name: str, identity: str | None, end: int) -> int:
        """Record durably that consumer ``name`` has processed every position below ``end``.

        Monotone and idempotent: an ``end`` at or below the recorded one writes
        nothing and returns the recorded one.

        Args:
            name: The consumer name.
            identity: The identity it registered with (None skips the check).
            end: The first position not processed.

        Returns:
            The acknowledged position now recorded.

        Raises:
            ConfigError: ``name`` is not a valid consumer name.
            ChannelError: The consumer is not registered.
            ConsumerIdentityError: The consumer is registered with another identity.
            CorruptLogError: Its ``.ack`` file does not decode.
            OSError: Writing the file failed (the previous acknowledgement stands).
        """
        validate_name(name)
        _check_identity(identity)
        _check_position(end, "end")
        with self._lock:
            cur = self._read(name)
            if cur is None:
                raise ChannelError(
                    f"consumer {name!r} is not registered on {self.directory} (it was removed, or never "
                    "registered): open a ChannelReader with this consumer name to register it"
                )
            if identity is not None and cur.identity is not None and identity != cur.identity:
                raise ConsumerIdentityError(name, cur.identity, identity)
            if end <= cur.acked:
                return cur.acked
            self._write(ConsumerState(name, cur.identity or identity, end, cur.registered_ns, cur.seq))
            return end

    def reset(self, name: str, position: int) -> ConsumerState:
        """Set consumer ``name``'s acknowledged position to ``position``, backwards or forwards (durably).

        What ``filechannel consumers --reset`` does (Kafka's ``--reset-offsets``):
        stop the consumer's reader first. The caller checks ``position`` against
        what the channel still holds; moving below what the owner already took
        cannot bring those events back.

        Raises:
            ConfigError: ``name`` is not a valid consumer name.
            ChannelError: The consumer is not registered.
            CorruptLogError: Its ``.ack`` file does not decode (or its MAC fails).
            OSError: Writing the file failed (the previous position stands).
        """
        validate_name(name)
        _check_position(position, "position")
        with self._lock:
            cur = self._read(name)
            if cur is None:
                raise ChannelError(f"consumer {name!r} is not registered on {self.directory}")
            state = self._write(ConsumerState(name, cur.identity, position, cur.registered_ns, cur.seq))
            logger.info("consumer %s: acknowledged position reset from %d to %d", name, cur.acked, position)
            return state

    def remove(self, name: str) -> bool:
        """Unregister consumer ``name`` durably; return whether it was registered.

        Raises:
            ConfigError: ``name`` is not a valid consumer name.
            OSError: Removing the file failed.
        """
        validate_name(name)
        with self._lock:
            path = self.file_path(name)
            if not self.fs.exists(path):
                return False
            self.fs.unlink(path)
            self.fs.fsync_dir(self.path)
            self._clean_temporaries(name)
            logger.info("unregistered consumer %s", name)
            return True

    def _write(self, state: ConsumerState) -> ConsumerState:
        """Write ``state`` as the next write of its file (``seq`` one more); return what was written."""
        state = dataclasses.replace(state, seq=state.seq + 1)
        fs = self._writing_fs
        if fs is None:
            policy = self.permissions or policy_of(self.fs, self.directory)
            fs = self._writing_fs = fs_for(self.fs, policy)
        if not fs.isdir(self.path):
            fs.makedirs(self.path)
            fs.fsync_dir(self.directory)
        data = encode_meta(
            {
                "name": state.name,
                "identity": state.identity,
                "acked": state.acked,
                "registered_ns": state.registered_ns,
                "seq": state.seq,
                "version": 1,
            },
            self.mac,
            _role(state.name),
        )
        tmp = os.path.join(self.path, f".{state.name}{ACK_SUFFIX}{_TMP_MARK}{os.getpid()}-{time.time_ns()}")
        replace_durably(fs, tmp, self.file_path(state.name), data)
        return state

    def _clean_temporaries(self, name: str, older_than_ns: int = 0) -> None:
        """Delete temporary files a crash left behind while writing ``name``'s file.

        With ``older_than_ns``, only those whose name says they were created at
        least that long ago (a younger one may be a write in progress elsewhere).
        """
        prefix = f".{name}{ACK_SUFFIX}{_TMP_MARK}"
        try:
            left = [e for e in self.fs.listdir(self.path) if e.startswith(prefix)]
        except FileNotFoundError:
            return
        now = time.time_ns()
        for e in left:
            if older_than_ns:
                created = e[len(prefix) :].rpartition("-")[2]
                if created.isdigit() and now - int(created) < older_than_ns:
                    continue
            try:
                self.fs.unlink(os.path.join(self.path, e))
            except FileNotFoundError:
                pass


def _role(name: str) -> str:
    return f"ack:{name}"


def _state_of(name: str, obj: dict[str, Any]) -> ConsumerState:
    """Return the state an ``.ack`` file's object records.

    Raises:
        FormatError: A field is missing or of the wrong type, or the name differs from the file's.
    """
    if obj.get("version") != 1:
        raise FormatError(0, f"consumer {name}: unsupported version {obj.get('version')!r}")
    if obj.get("name") != name:
        raise FormatError(0, f"consumer {name}: the file records the name {obj.get('name')!r}")
    identity = obj.get("identity")
    if identity is not None and not isinstance(identity, str):
        raise FormatError(0, f"consumer {name}: identity is not a string")
    seq = _count_field(obj, name, "seq") if "seq" in obj else 0
    return ConsumerState(
        name, identity, _count_field(obj, name, "acked"), _count_field(obj, name, "registered_ns"), seq
    )


def _count_field(obj: dict[str, Any], name: str, key: str) -> int:
    v = obj.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise FormatError(0, f"consumer {name}: {key} is not an int >= 0")
    return v
