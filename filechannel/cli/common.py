"""What every command of the ``filechannel`` command line shares.

The one-line usage errors (:class:`Parser`), the exit-status paragraphs
(:func:`epilog`), the checks of a channel directory (:func:`existing_channel`),
signals held while a commit is counted (:class:`Sigint`), the library's
warnings on stderr (:func:`library_warnings`), the keystore of a command
(:func:`encryption_of`), the channel options the command line can set
(:data:`CONFIG_FLAGS`) and the options several commands take
(:func:`flume_args`, :func:`log_level_arg`).
"""

from __future__ import annotations

import argparse
import base64
import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

from filechannel._fs import is_locked
from filechannel.crypto import Encryption
from filechannel.directory import CHANNEL_FILE, LOCK_FILE, WAL_FILE
from filechannel.errors import ChannelError, NotAChannelError

from .cli import echo

EPILOG = (
    "Exit status: 0 on success, 1 when verify finds problems or take's output closed early (its batch rolled back), "
    "2 on bad input or a channel error, 130 when interrupted (SIGINT), 143 when terminated (SIGTERM)."
)


STOPPED = "130 when interrupted (SIGINT), 143 when terminated (SIGTERM)"


def epilog(one: str | None = None, stopped: str = STOPPED) -> str:
    """One command's exit-status paragraph: what applies to it only (``one``: when it exits 1)."""
    codes = ["0 on success", *([f"1 {one}"] if one else []), "2 on bad input or a channel error", stopped]
    return "Exit status: " + ", ".join(codes) + "."


def existing_channel(path: str) -> str:
    """Return ``path`` if it is a channel directory; else a ChannelError saying what it is and what to do."""
    if not os.path.exists(path):
        raise ChannelError(
            f"{path}: no such channel directory (create one with `filechannel put {path}` or filechannel.open)"
        )
    if not os.path.isdir(path):
        raise NotAChannelError(path, "it is a file")
    if not os.path.exists(os.path.join(path, CHANNEL_FILE)):
        raise NotAChannelError(path, "no CHANNEL file (create a channel with `filechannel put` or filechannel.open)")
    if os.path.exists(os.path.join(path, WAL_FILE)):
        raise NotAChannelError(
            path, f"it is a write-ahead log; inspect it with `filechannel wal dump {path}` or `filechannel wal verify`"
        )
    return path


class Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line, like every other error."""

    def error(self, message: str) -> NoReturn:
        """Exit with status 2 and one line naming the problem."""
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


LOG_LEVELS = ("debug", "info", "warning", "error")


def body_fields(body: bytes, key: str = "body") -> dict[str, str]:
    """``body`` for a JSON line: ``{key: text, key_encoding: "utf-8"}``, or base64 with ``"base64"``.

    The encoding is always given, so no text can pass for bytes (``"base64:gIE="``
    and the bytes ``80 81`` print differently).
    """
    try:
        return {key: body.decode("utf-8"), f"{key}_encoding": "utf-8"}
    except UnicodeDecodeError:
        return {key: base64.b64encode(body).decode("ascii"), f"{key}_encoding": "base64"}


def in_use(directory: str) -> bool:
    """Return whether a process holds the channel's lock (read-only: creates and writes nothing)."""
    return is_locked(os.path.join(directory, LOCK_FILE))


def progress_line(msg: str) -> None:
    """Show a progress message on stderr, when stderr is a terminal."""
    if sys.stderr.isatty():
        echo(msg, file=sys.stderr)


class _WarningLine(logging.Formatter):
    """One line per record (``filechannel: warning: ...``, ``filechannel: info: ...``), never a traceback."""

    def format(self, record: logging.LogRecord) -> str:
        kind = "warning" if record.levelno >= logging.WARNING else record.levelname.lower()
        return f"filechannel: {kind}: " + " ".join(record.getMessage().split("\n"))


@contextmanager
def library_warnings(level: int = logging.WARNING) -> Iterator[None]:
    """Show the library's records from ``level`` on (default WARNING) on stderr while a command runs.

    The package logger has only a NullHandler, so without this a loss the library
    reports (a record dropped with ``on_corruption="skip"``, when opening or when
    taking, a truncated tail, an unusable checkpoint) would go unseen.
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(level)
    handler.setFormatter(_WarningLine())
    pkg = logging.getLogger("filechannel")
    old = pkg.level
    if level < logging.WARNING:
        pkg.setLevel(level)
    pkg.addHandler(handler)
    try:
        yield
    finally:
        pkg.removeHandler(handler)
        pkg.setLevel(old)


def log_level_of(args: argparse.Namespace) -> int | None:
    """The level ``--log-level`` or ``-v`` asks for (None: neither was given)."""
    if args.log_level is not None:
        return int(getattr(logging, args.log_level.upper()))
    if args.verbose:
        return logging.INFO if args.verbose == 1 else logging.DEBUG
    return None


class Stopped(KeyboardInterrupt):
    """SIGINT or SIGTERM, raised where the command may stop (``signum`` says which)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def stopped_by(exc: KeyboardInterrupt) -> tuple[str, int]:
    """Return how a summary names the signal (``interrupted``...) and the exit status (128 + its number)."""
    signum = exc.signum if isinstance(exc, Stopped) else signal.SIGINT
    if signum == signal.SIGINT:
        return "interrupted", 130
    return f"interrupted by {signal.Signals(signum).name}", 128 + signum


class Sigint:
    """Hold Ctrl-C (SIGINT) and SIGTERM back while the channel commits, so the summary's count is exact.

    Outside :meth:`held`, either signal raises :class:`Stopped` (a
    ``KeyboardInterrupt``) at once (also while blocked reading stdin or
    printing). Inside, it is remembered and raised when the block ends, after
    the commit (or rollback) and its count are done: a signal never lands
    half-way through the channel's own bookkeeping, and a batch is either
    counted as committed or it was rolled back.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self._depth = 0
        self._pending: int | None = None
        self._old: dict[int, Any] = {}

    def __enter__(self) -> Sigint:
        # Only the main thread may set handlers; a signal the parent ignores stays ignored.
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                if signal.getsignal(signum) not in (signal.SIG_IGN, None):
                    self._old[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, old in self._old.items():
            signal.signal(signum, old)
        self._old.clear()

    def _handle(self, signum: int, frame: object) -> None:
        if self._depth:
            if self._pending is None:
                self._pending = signum
        else:
            raise Stopped(signum)

    @contextmanager
    def held(self) -> Iterator[None]:
        """Run the block with SIGINT and SIGTERM deferred to its end."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
        if self._pending is not None and not self._depth:
            signum, self._pending = self._pending, None
            raise Stopped(signum)


def stdout_to_devnull() -> None:
    """Point stdout at /dev/null after EPIPE, so the flush at exit cannot fail again (Python docs, signal)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, ValueError, OSError):  # not a real file (tests capture it)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def size_arg(text: str) -> int:
    """A size for ``--max-bytes``, ``--cache-bytes``, ...: bytes, or a number with K, M, G or T (powers of 1024)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.I)
    if m is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: give bytes or a number with K, M, G or T (e.g. 10G)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()])


def room_args(sp: argparse.ArgumentParser, prefix: str = "") -> None:
    """``--max-bytes`` and ``--min-free-bytes`` (the byte limit and the free-space floor) on ``sp``."""
    sp.add_argument(
        "--max-bytes",
        type=size_arg,
        metavar="SIZE",
        help=f"{prefix}most bytes of data files the channel may hold, e.g. 10G (default: no limit)",
    )
    sp.add_argument(
        "--min-free-bytes",
        dest="minimum_required_space",
        type=size_arg,
        metavar="SIZE",
        help=f"{prefix}refuse puts while the data directory's file system has less free space, e.g. 1G (default 64M)",
    )


# Channel options the command line can set, and the flag that sets each.
CONFIG_FLAGS = {
    "capacity": "--capacity",
    "max_bytes": "--max-bytes",
    "minimum_required_space": "--min-free-bytes",
    "transaction_capacity": "--transaction-capacity",
    "max_event_size": "--max-event-size",
    "fsync": "--fsync",
    "on_corruption": "--on-corruption",
    "cache_bytes": "--cache-bytes",
}


def encryption_of(args: argparse.Namespace) -> Encryption | None:
    """The ``--keystore`` given, loaded (its last key is the one new files use), or None."""
    path = getattr(args, "keystore", None)
    return None if path is None else Encryption(keys=path)


def flume_args(sp: argparse.ArgumentParser) -> None:
    """``--flume-properties`` and ``--flume-channel``: a Flume FileChannel's configuration as channel options."""
    sp.add_argument(
        "--flume-properties",
        metavar="FILE",
        help="take the channel options from a Flume agent's FileChannel configuration (docs/flume.md); "
        "flags given here win",
    )
    sp.add_argument(
        "--flume-channel",
        metavar="NAME",
        help="which channel of --flume-properties (agent.channels.NAME, or NAME); needed when it has several",
    )


def log_level_arg(p: argparse.ArgumentParser, default: str | None) -> None:
    """``--log-level LEVEL``, one spelling wherever it is given: any case, shown in lower case.

    ``serve`` repeats the global option (``serve DIR --log-level info`` reads naturally); its
    copy sets nothing when absent, so ``filechannel --log-level debug serve DIR`` is not undone.
    """
    where = f"default {default}" if default else "overrides -v"
    p.add_argument(
        "--log-level",
        type=str.lower,
        choices=LOG_LEVELS,
        metavar="LEVEL",
        default=argparse.SUPPRESS if default else None,
        help=f"show the library's log on stderr from LEVEL on ({', '.join(LOG_LEVELS)}, any case; {where})",
    )
