"""The tailing source: follows log files into a channel, exactly once (``filechannel serve --tail``).

This module owns :class:`TailSource`. It reads files matching glob patterns
line by line (or by another delimiter) and puts each line as an event with
the headers ``file`` (the name the file was found under) and ``offset`` (the
line's byte offset in it). Its only state is a set of channel marks
(``tail:<name>:<slot>`` -> JSON ``{path, dev, inode, fp, fp_len, offset}``),
and each transaction marks the read positions of the files it read from
together with their lines, so the positions and the lines commit atomically:
a crash at any point resumes exactly after the last committed line, neither
losing nor repeating one.

A followed file is known by its (device, inode) and by a fingerprint of its
first bytes (a hash of ``[0, fp_len)``, ``fp_len = min(1024, offset)``): the
bytes already read, which an appending writer never changes. Each poll checks
it, so a file truncated in place or replaced (a new file that reuses the
inode) is detected; a copy whose first bytes match a truncated file is taken as
its continuation (copy-truncate rotation). A file renamed out of the glob keeps
its open descriptor and is read to its end; after a restart it is found again
by its inode in its directory. Slots (mark keys) are reused once a file is
finished, so the channel's mark keys stay bounded by the files followed at
once (marks cannot be deleted; a channel holds at most 4096 keys).

A name the glob matches is followed only if it resolves, through every symlink,
to a file inside the glob's directory (the pattern before its first wildcard),
unless ``follow_symlinks``: a link to a keystore or a TLS key dropped among the
logs never becomes events. Files are opened by their resolved name with
``O_NOFOLLOW``, and the opened descriptor is checked (identity and place) before
a byte is read, so a link swapped in after the check is refused.
"""

from __future__ import annotations

import errno
import glob as _glob
import hashlib
import json
import logging
import os
import stat as _stat
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from filechannel import format as fmt
from filechannel.channel import FileChannel
from filechannel.errors import ChannelFullError, ConfigError, DiskSpaceError

__all__ = ["DEFAULT_BATCH", "FINGERPRINT_BYTES", "TailSource", "make_tails", "parse_tail_specs"]

logger = logging.getLogger("filechannel.agent.tail")  # the name users configure, kept from before the move

FINGERPRINT_BYTES = 1024
DEFAULT_BATCH = 1000
_FREE = b"{}"
_MAX_MARKS_PER_TX = fmt.MAX_MARKS_PER_RECORD
_MAX_MARK_VALUE = 1024


def _fingerprint(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _pread(fd: int, n: int, offset: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = os.pread(fd, n - len(out), offset + len(out))
        if not chunk:
            break
        out += chunk
    return out


def _glob_base(pattern: str) -> str:
    """The directory a glob pattern stays in: its leading path components without a wildcard."""
    parts = os.path.abspath(pattern).split(os.sep)
    for i, part in enumerate(parts):
        if _glob.has_magic(part):
            return os.sep.join(parts[:i]) or os.sep
    return os.path.dirname(os.sep.join(parts)) or os.sep


def _inside(real: str, bases: Sequence[str]) -> bool:
    """Whether the resolved path ``real`` is in (below) one of the resolved directories ``bases``."""
    return any(real.startswith(b.rstrip(os.sep) + os.sep) for b in bases)


def _fd_path(fd: int) -> str | None:
    """The name the kernel gives the file open as ``fd`` (Linux ``/proc``), or None where there is none."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


@dataclass
class _File:
    """One followed file (a slot): where it is, what it begins with, how far it is committed."""

    slot: int
    path: str  # the name it was first found under (the ``file`` header)
    dev: int
    ino: int
    fp: str
    fp_len: int
    offset: int
    split: int | None = None  # the start of a long line being split, when its pieces are not all out
    fd: int | None = None
    size_seen: int = -1
    mtime_seen: int = -1
    idle_since: float | None = None  # out of the glob (or deleted) and at its end since then
    head: bytes = b""  # the fingerprinted bytes themselves (to recognize a copy still being written)

    def value(self) -> bytes:
        d: dict[str, Any] = {
            "path": self.path,
            "dev": self.dev,
            "inode": self.ino,
            "fp": self.fp,
            "fp_len": self.fp_len,
            "offset": self.offset,
        }
        if self.split is not None:
            d["split"] = self.split
        return json.dumps(d, sort_keys=True, separators=(",", ":")).encode()


@dataclass
class _Read:
    """What one file gave to the transaction being built: its events and its state after them."""

    events: list[tuple[bytes, dict[str, str]]] = field(default_factory=list)
    offset: int = 0
    split: int | None = None
    fp: str = ""
    fp_len: int = 0
    head: bytes = b""
    nbytes: int = 0
    splits: int = 0


class TailSource:
    """Follow files matching ``patterns`` into ``channel``, exactly once (see the module docstring).

    Args:
        channel: An open :class:`FileChannel` (owned by this process).
        patterns: Glob patterns (``**`` allowed), e.g. ``"/var/log/app/*.log"``.
        name: Names this source's marks (``tail:<name>:<slot>``); sources of one channel need distinct names.
        delimiter: What ends a line (not included in the event body).
        batch_size: The most lines per transaction, at most the channel's ``transaction_capacity``
            (default: ``DEFAULT_BATCH`` = 1000, or the transaction capacity when it is smaller).
        poll_interval: Seconds between polls once everything is read.
        rotate_grace: Seconds a file that left the glob (renamed or deleted) is still watched at its end
            before it is finished (its unterminated last line put, its slot freed); also how long a new file
            that begins like a followed one is held as a possible copy before it is read as a new file.
        read_size: Bytes read per ``pread``.
        follow_symlinks: Also follow a symlink (of a file or of a directory on the way to it) that leads
            out of the glob's directory. Off by default: such a name is skipped with one warning, so a
            link to a keystore, a TLS key or ``/etc/shadow`` dropped among the logs never becomes events.
            A link to a file inside the glob's directory (the part of the pattern before its first
            wildcard) is followed either way.

    A line longer than what fits in one event (``max_event_size`` less the headers) is split into pieces
    of that size, each with the header ``split`` = the byte offset where the line starts; consumers join
    consecutive events with the same ``file`` and ``split``. Nothing is dropped.

    Raises:
        ConfigError: No pattern, an empty delimiter, or a bad batch size, interval or grace.
    """

    def __init__(
        self,
        channel: FileChannel,
        patterns: str | Sequence[str],
        *,
        name: str = "tail",
        delimiter: bytes = b"\n",
        batch_size: int | None = None,
        poll_interval: float = 0.25,
        rotate_grace: float = 10.0,
        read_size: int = 1 << 20,
        follow_symlinks: bool = False,
    ) -> None:
        pats = (patterns,) if isinstance(patterns, str) else tuple(patterns)
        if not pats or not all(isinstance(p, str) and p for p in pats):
            raise ConfigError("patterns", f"give at least one glob pattern, got {patterns!r}")
        if not isinstance(delimiter, bytes) or not delimiter:
            raise ConfigError("delimiter", f"a non-empty bytes delimiter, got {delimiter!r}")
        cap = channel.config.transaction_capacity
        if batch_size is None:
            batch_size = min(DEFAULT_BATCH, cap)
        if type(batch_size) is not int or not 1 <= batch_size <= cap:
            raise ConfigError("batch_size", f"an int in [1, transaction_capacity={cap}], got {batch_size!r}")
        for opt, v in (("poll_interval", poll_interval), ("rotate_grace", rotate_grace)):
            if not isinstance(v, (int, float)) or v < 0:
                raise ConfigError(opt, f"seconds >= 0, got {v!r}")
        if not name or ":" in name or len(name) > 64:
            raise ConfigError("name", f"1 to 64 characters without ':', got {name!r}")
        self.channel = channel
        self.patterns = pats
        self.name = name
        self.delimiter = delimiter
        self.batch_size = batch_size
        self.poll_interval = float(poll_interval)
        self.rotate_grace = float(rotate_grace)
        self.read_size = max(int(read_size), 4096)
        self.follow_symlinks = bool(follow_symlinks)
        self._link_warned: set[str] = set()  # names skipped for leading out (warned once each)
        self._link_refused: set[str] = set()  # those the current scan skipped
        self._prefix = f"tail:{name}:"
        self._files: dict[tuple[int, int], _File] = {}
        self._free_slots: set[int] = set()
        self._next_slot = 0
        self._dirty: dict[int, bytes] = {}  # slot -> mark value to commit with the next transaction
        self._held: dict[tuple[int, int], float] = {}  # possible copies of followed files: first seen
        self._refused: set[tuple[int, int]] = set()
        self._claimed: set[tuple[int, int]] = set()  # inodes of committed marks, while resuming
        self._missing: dict[int, tuple[_File, float]] = {}  # marks whose file is not found (yet): since when
        self._resumed = False
        self._rr = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.counters = {
            "lines": 0,
            "bytes": 0,
            "transactions": 0,
            "truncations": 0,
            "lost_bytes": 0,
            "split_lines": 0,
            "copies_followed": 0,
            "files_finished": 0,
            "files_gone": 0,
            "full_retries": 0,
            "links_refused": 0,
        }

    # -- the public API ------------------------------------------------------------------------

    def poll(self) -> int:
        """Look for files, read up to ``batch_size`` lines and commit them with their positions.

        Returns the number of lines committed (0 when nothing was new). Raises what
        the commit raises, except ``ChannelFullError``, ``DiskSpaceError`` and a disk
        full during the write (logged; the same lines are read again at the next poll).
        """
        if not self._resumed:
            self._resume()
        matched = self._scan()
        self._retry_missing(matched)
        self._check_files(matched)
        self._discover(matched)
        reads = self._read_all()
        self._finish_idle(matched, reads)
        return self._commit(reads)

    def drain(self, max_polls: int = 1_000_000) -> int:
        """Poll until a poll commits nothing; returns the lines committed (for tools and tests)."""
        total = 0
        for _ in range(max_polls):
            full = self.counters["full_retries"]
            n = self.poll()
            total += n
            if n == 0 and (not self._dirty or self.counters["full_retries"] > full):
                break
        return total

    def start(self) -> TailSource:
        """Run :meth:`poll` in a background thread until :meth:`stop`."""
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name=f"filechannel-tail-{self.name}", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Stop the thread after the transaction in progress (it commits or rolls back whole); close files."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("tail source %r: its transaction did not end within %s s", self.name, timeout)
                return
            self._thread = None
        for f in self._files.values():
            if f.fd is not None:
                os.close(f.fd)
                f.fd = None
        self._files.clear()
        self._resumed = False

    close = stop

    def __enter__(self) -> TailSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stats(self) -> dict[str, int]:
        """Counters (lines, bytes, transactions, truncations, lost_bytes, ...), files followed, bytes behind."""
        behind = 0
        for f in self._files.values():
            if f.size_seen > f.offset:
                behind += f.size_seen - f.offset
        return {**self.counters, "files": len(self._files), "bytes_behind": behind}

    def positions(self) -> dict[str, dict[str, Any]]:
        """The committed marks of this source: ``{mark key: {path, dev, inode, fp, fp_len, offset}}``."""
        out = {}
        for k, v in self.channel.marks().items():
            if k.startswith(self._prefix) and v != _FREE:
                out[k] = json.loads(v)
        return out

    def __repr__(self) -> str:
        return f"<TailSource {self.name!r} {list(self.patterns)} files={len(self._files)}>"

    # -- the loop ------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                n = self.poll()
                if n < self.batch_size:
                    self._stop.wait(self.poll_interval)
        except BaseException as exc:  # noqa: BLE001  (the thread ends: say why, keep it for the owner)
            self.error = exc
            logger.error("tail source %r stopped: %s", self.name, exc)

    # -- state -----------------------------------------------------------------------------------

    def _key(self, slot: int) -> str:
        return f"{self._prefix}{slot}"

    def _new_slot(self) -> int:
        if self._free_slots:
            s = min(self._free_slots)
            self._free_slots.discard(s)
            return s
        s = self._next_slot
        self._next_slot += 1
        return s

    def _free(self, f: _File) -> None:
        self._files.pop((f.dev, f.ino), None)
        if f.fd is not None:
            os.close(f.fd)
            f.fd = None
        self._free_slots.add(f.slot)
        self._dirty[f.slot] = _FREE

    def _resume(self) -> None:
        """Find every file of the committed marks again (by inode, then by fingerprint)."""
        self._files.clear()
        self._free_slots.clear()
        self._dirty.clear()
        self._held.clear()
        self._missing.clear()
        marks = {k: v for k, v in self.channel.marks().items() if k.startswith(self._prefix)}
        slots: dict[int, bytes] = {}
        for k, v in marks.items():
            try:
                slots[int(k[len(self._prefix) :])] = v
            except ValueError:
                logger.warning("ignoring mark %r: not a tail slot", k)
        self._next_slot = max(slots, default=-1) + 1
        matched = self._scan()
        found: list[_File] = []
        for slot in sorted(slots):
            v = slots[slot]
            if v == _FREE:
                self._free_slots.add(slot)
                continue
            try:
                d = json.loads(v)
                f = _File(slot, d["path"], d["dev"], d["inode"], d["fp"], d["fp_len"], d["offset"], d.get("split"))
            except (ValueError, KeyError, TypeError):
                logger.error("tail mark %s does not decode; its file is not followed (slot freed)", self._key(slot))
                self._free_slots.add(slot)
                self._dirty[slot] = _FREE
                continue
            found.append(f)
        # a file another mark names is never taken for a copy
        self._claimed = {(f.dev, f.ino) for f in found}
        try:
            for f in found:
                self._locate(f, matched)
        finally:
            self._claimed = set()
        self._resumed = True

    def _locate(self, f: _File, matched: dict[tuple[int, int], str], since: float | None = None) -> None:
        """Open the file of a committed mark: by its inode, else a copy by its fingerprint, else report it gone."""
        if (f.dev, f.ino) in self._files:
            logger.error(
                "marks %s and %s name the same file; keeping the first", self._files[(f.dev, f.ino)].slot, f.slot
            )
            self._free_slots.add(f.slot)
            self._dirty[f.slot] = _FREE
            return
        where = matched.get((f.dev, f.ino)) or self._find_inode(f)
        if where is not None and (f.dev, f.ino) not in self._files:
            fd = self._open(where, (f.dev, f.ino))
            if fd is not None:
                st = os.fstat(fd)
                if (st.st_dev, st.st_ino) == (f.dev, f.ino) and self._same(fd, st.st_size, f):
                    f.fd, f.head = fd, _pread(fd, f.fp_len, 0)
                    self._files[(f.dev, f.ino)] = f
                    logger.info("resuming %s at byte %d (%s)", f.path, f.offset, where)
                    return
                os.close(fd)
        if self._follow_copy(f, matched):
            self._files[(f.dev, f.ino)] = f
            return
        if where is not None and (f.dev, f.ino) in matched:
            fd = self._open(where, (f.dev, f.ino))
            if fd is not None:
                logger.warning(
                    "%s was truncated or replaced while the source was down: restarting it at byte 0; "
                    "lines written after byte %d before that, if any, were lost",
                    where,
                    f.offset,
                )
                self.counters["truncations"] += 1
                f.fd, f.offset, f.fp, f.fp_len, f.split, f.head = fd, 0, _fingerprint(b""), 0, None, b""
                self._files[(f.dev, f.ino)] = f
                self._dirty[f.slot] = f.value()
                return
        # Not found: a directory listing can miss a file being renamed, so look again at the next polls
        # before calling it gone (reading it later as a new file would repeat its lines).
        now = time.monotonic()
        since = now if since is None else since
        if now - since < max(self.rotate_grace, 20 * self.poll_interval, 0.5):
            self._missing[f.slot] = (f, since)
            return
        logger.warning(
            "%s (inode %d) is gone: lines written after byte %d, if any, were not read", f.path, f.ino, f.offset
        )
        self.counters["files_gone"] += 1
        self._free_slots.add(f.slot)
        self._dirty[f.slot] = _FREE

    def _retry_missing(self, matched: dict[tuple[int, int], str]) -> None:
        for slot in list(self._missing):
            f, since = self._missing.pop(slot)
            self._claimed = {(m.dev, m.ino) for m, _ in self._missing.values()}
            try:
                self._locate(f, matched, since)
            finally:
                self._claimed = set()

    def _find_inode(self, f: _File) -> str | None:
        """The path of ``f``'s inode: its recorded name, else a name in the same directory (renamed)."""
        try:
            st = os.stat(f.path)
            if (st.st_dev, st.st_ino) == (f.dev, f.ino):
                return f.path
        except OSError:
            pass
        try:
            with os.scandir(os.path.dirname(f.path) or ".") as it:
                for e in it:
                    try:
                        if e.inode() == f.ino and e.is_file(follow_symlinks=False) and e.stat().st_dev == f.dev:
                            return e.path
                    except OSError:
                        continue
        except OSError:
            pass
        return None

    def _bases(self) -> list[str]:
        """The resolved directories of the glob patterns (where a followed file must be, links resolved)."""
        return [os.path.realpath(_glob_base(p)) for p in self.patterns]

    def _refuse_link(self, path: str, real: str, bases: Sequence[str]) -> None:
        """Skip ``path``, which leads out of the globs' directories: one warning per path."""
        self._link_refused.add(path)
        if path in self._link_warned:
            return
        self._link_warned.add(path)
        self.counters["links_refused"] += 1
        logger.warning(
            "%s leads to %s through a symlink, outside the glob's directory (%s): not followed "
            "(to follow links out of it: serve --tail-follow-symlinks, or TailSource(follow_symlinks=True))",
            path,
            real,
            ", ".join(bases),
        )

    def _lookup(
        self, path: str, bases: Sequence[str], dirs: dict[str, tuple[str, bool]], warn: bool
    ) -> os.stat_result | None:
        """The stat of the file ``path`` names, or None: not there, or it leads out through a symlink.

        Without ``follow_symlinks``, the name is resolved and must be inside ``bases``; ``dirs``
        caches, for one scan, each directory's resolved path and whether it is inside. ``warn``:
        say so (once per path) when it is not.
        """
        try:
            if self.follow_symlinks:
                return os.stat(path)
            st = os.lstat(path)
            if _stat.S_ISLNK(st.st_mode):
                real = os.path.realpath(path)
                st = os.stat(real)
                inside = _inside(real, bases)
            else:
                d, _, name = path.rpartition(os.sep)  # (an absolute, normalized path)
                cached = dirs.get(d)
                if cached is None:
                    real_dir = os.path.realpath(d or os.sep)
                    cached = dirs[d] = (real_dir, _inside(os.path.join(real_dir, "x"), bases))
                real_dir, inside = cached
                if not inside:
                    real = os.path.join(real_dir, name)
        except OSError:
            return None
        if inside:
            return st
        if warn:
            self._refuse_link(path, real, bases)
        return None

    def _open(self, path: str, expect: tuple[int, int]) -> int | None:
        """Open the regular file ``path`` names for reading if it is ``expect`` (device, inode), else None.

        ``expect`` is the identity the caller checked (a scan's stat, a mark): a file replaced
        since (a link swapped in, say) is not the one opened. Without ``follow_symlinks`` also:
        the name is resolved, must be inside the globs' directories, its last component is opened
        with ``O_NOFOLLOW``, and the file actually opened must be inside too (its kernel name,
        else the name resolved again and its identity).
        """
        flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0)
        bases: list[str] = []
        target = path
        if not self.follow_symlinks:
            bases = self._bases()
            target = os.path.realpath(path)
            if not _inside(target, bases):
                self._refuse_link(path, target, bases)
                return None
            flags |= getattr(os, "O_NOFOLLOW", 0)
        try:
            fd = os.open(target, flags)
        except OSError as exc:
            if exc.errno == errno.ELOOP and not self.follow_symlinks:
                self._refuse_link(path, f"{target} (made a symlink while it was opened)", bases)
            else:
                logger.warning("cannot open %s: %s", path, exc.strerror or exc)
            return None
        ok = False
        try:
            st = os.fstat(fd)
            ok = _stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) == expect  # else replaced since the check
            if ok and not self.follow_symlinks:
                where = _fd_path(fd)
                if where is None:  # no /proc: the name, resolved again, must still be the file opened
                    where = os.path.realpath(path)
                    again = os.stat(where)
                    ok = (again.st_dev, again.st_ino) == (st.st_dev, st.st_ino)
                if not (ok and _inside(where, bases)):
                    ok = False
                    self._refuse_link(path, where, bases)
        except OSError as exc:
            logger.warning("cannot check %s: %s", path, exc.strerror or exc)
        if not ok:
            os.close(fd)
            return None
        return fd

    def _same(self, fd: int, size: int, f: _File) -> bool:
        """Whether the file behind ``fd`` still holds what ``f`` read: long enough, same first bytes."""
        if size < f.offset:
            return False
        if f.fp_len == 0:
            return True
        return _fingerprint(_pread(fd, f.fp_len, 0)) == f.fp

    def _follow_copy(self, f: _File, matched: dict[tuple[int, int], str]) -> bool:
        """Copy-truncate: switch ``f`` to an untracked file that begins with its fingerprinted bytes."""
        if f.fp_len == 0:
            return False
        paths = set(matched.values())
        try:
            with os.scandir(os.path.dirname(f.path) or ".") as it:
                paths.update(e.path for e in it)
        except OSError:
            pass
        best: tuple[int, str, os.stat_result] | None = None
        bases, dirs = self._bases(), dict[str, tuple[str, bool]]()
        for p in paths:
            st = self._lookup(p, bases, dirs, warn=False)
            if st is None:
                continue
            key = (st.st_dev, st.st_ino)
            if (
                not _stat.S_ISREG(st.st_mode)
                or key in self._files
                or key in self._claimed
                or key == (f.dev, f.ino)
                or any(key == (m.dev, m.ino) for m, _ in self._missing.values())
            ):
                continue
            if st.st_size < f.offset or st.st_size < f.fp_len:
                continue
            if best is not None and st.st_mtime_ns <= best[0]:
                continue
            fd = self._open(p, key)
            if fd is None:
                continue
            try:
                if _fingerprint(_pread(fd, f.fp_len, 0)) == f.fp:
                    best = (st.st_mtime_ns, p, st)
            finally:
                os.close(fd)
        if best is None:
            return False
        _, p, st = best
        fd = self._open(p, (st.st_dev, st.st_ino))  # the file whose first bytes were compared, or none
        if fd is None:
            return False
        if f.fd is not None:
            os.close(f.fd)
        logger.info("%s was copied to %s and truncated: reading the copy from byte %d", f.path, p, f.offset)
        self._files.pop((f.dev, f.ino), None)
        self._held.pop((st.st_dev, st.st_ino), None)
        f.fd, f.dev, f.ino = fd, st.st_dev, st.st_ino
        f.size_seen, f.mtime_seen, f.idle_since = -1, -1, None
        self._dirty[f.slot] = f.value()
        self.counters["copies_followed"] += 1
        return True

    # -- one poll ----------------------------------------------------------------------------

    def _scan(self) -> dict[tuple[int, int], str]:
        """The regular files matching the patterns, by (device, inode); not those leading out through a link."""
        out: dict[tuple[int, int], str] = {}
        bases, dirs = self._bases(), dict[str, tuple[str, bool]]()
        self._link_refused = set()
        for pat in self.patterns:
            for p in sorted(_glob.glob(pat, recursive=True)):
                path = os.path.abspath(p)
                st = self._lookup(path, bases, dirs, warn=True)
                if st is not None and _stat.S_ISREG(st.st_mode):
                    out.setdefault((st.st_dev, st.st_ino), path)
        self._link_warned &= self._link_refused  # a name that leads out again later is warned about again
        return out

    def _check_files(self, matched: dict[tuple[int, int], str]) -> None:
        """Detect truncation or replacement of every followed file (size and fingerprint)."""
        for f in list(self._files.values()):
            assert f.fd is not None
            st = os.fstat(f.fd)
            if st.st_size == f.size_seen and st.st_mtime_ns == f.mtime_seen:
                continue
            if not self._same(f.fd, st.st_size, f):
                self._truncated(f, st.st_size, matched)
                continue
            f.size_seen, f.mtime_seen = st.st_size, st.st_mtime_ns

    def _truncated(self, f: _File, size: int, matched: dict[tuple[int, int], str]) -> None:
        if self._follow_copy(f, matched):
            self._files[(f.dev, f.ino)] = f
            return
        unread = max(0, f.size_seen - f.offset)
        self.counters["truncations"] += 1
        self.counters["lost_bytes"] += unread
        logger.warning(
            "%s was truncated in place (to %d bytes, below the %d read) or rewritten: restarting at byte 0%s",
            f.path,
            size,
            f.offset,
            f"; {unread} bytes written before the truncation were never read (lost)" if unread else "",
        )
        f.offset, f.fp, f.fp_len, f.split, f.head = 0, _fingerprint(b""), 0, None, b""
        f.size_seen, f.mtime_seen = -1, -1
        self._dirty[f.slot] = f.value()

    def _discover(self, matched: dict[tuple[int, int], str]) -> None:
        """Follow new files of the glob from byte 0 (holding a possible copy of a followed file first)."""
        now = time.monotonic()
        for key in [k for k in self._held if k not in matched]:
            del self._held[key]
        missing = {(m.dev, m.ino) for m, _ in self._missing.values()}
        for key, path in matched.items():
            if key in self._files or key in self._refused or key in missing:
                continue
            fd = self._open(path, key)
            if fd is None:
                continue
            st = os.fstat(fd)
            if st.st_size == 0:  # nothing yet
                os.close(fd)
                continue
            like = self._looks_like_copy(fd)
            if like is not None:
                first = self._held.setdefault(key, now)
                if now - first < self.rotate_grace:
                    os.close(fd)
                    continue
                logger.warning(
                    "%s begins like %s (a copy?) but that file was not truncated: reading it as a new file",
                    path,
                    like.path,
                )
            self._held.pop(key, None)
            try:
                path.encode("utf-8")
            except UnicodeEncodeError:
                logger.error("%r: the file name is not UTF-8 text (it is the file header); not followed", path)
                self._refused.add(key)
                os.close(fd)
                continue
            f = _File(-1, path, key[0], key[1], _fingerprint(b""), 0, 0, fd=fd)
            if len(f.value()) + 40 > _MAX_MARK_VALUE:
                logger.error("%s: the path is too long to record its position in a mark; not followed", path)
                self._refused.add(key)
                os.close(fd)
                continue
            f.slot = self._new_slot()
            self._files[key] = f
            logger.info("following %s (inode %d) from byte 0", path, key[1])

    def _looks_like_copy(self, fd: int) -> _File | None:
        """A followed file this new file may be a copy of (held until that file is truncated, or for a while).

        It begins with the same bytes (a copy being made is a prefix), compared with what the
        followed file holds now and with the bytes of it already put.
        """
        mine = _pread(fd, FINGERPRINT_BYTES, 0)
        if not mine:
            return None
        for f in self._files.values():
            assert f.fd is not None
            n = min(len(mine), f.fp_len)
            if n and len(f.head) == f.fp_len and mine[:n] == f.head[:n]:
                return f
            if _pread(f.fd, len(mine), 0) == mine:
                return f
        return None

    def _room(self, f: _File) -> int:
        """The most body bytes one event of ``f`` holds (max_event_size less its largest headers)."""
        big = str(10**19)
        hdr = fmt.encode_event(b"", {"file": f.path, "offset": big, "split": big})
        return self.channel.config.max_event_size - len(hdr)

    def _read_all(self) -> dict[int, _Read]:
        """Read lines from the followed files, round robin, until the batch or the mark budget is full."""
        reads: dict[int, _Read] = {}
        files = sorted(self._files.values(), key=lambda f: f.slot)
        if not files:
            return reads
        budget = self.batch_size
        start = self._rr % len(files)
        self._rr += 1
        for f in files[start:] + files[:start]:
            if budget <= 0 or len(reads) + len(self._dirty) >= _MAX_MARKS_PER_TX:
                break
            r = self._read(f, budget, final=False)
            if r is not None:
                reads[f.slot] = r
                budget -= len(r.events)
        return reads

    def _read(self, f: _File, budget: int, final: bool) -> _Read | None:
        """Up to ``budget`` complete lines of ``f`` from its offset (``final``: its unterminated tail too)."""
        assert f.fd is not None
        room = self._room(f)
        if room <= 0:
            if (f.dev, f.ino) not in self._refused:
                logger.error("%s: max_event_size leaves no room for a line after the headers; not read", f.path)
                self._refused.add((f.dev, f.ino))
            return None
        delim, dl = self.delimiter, len(self.delimiter)
        size = max(self.read_size, room + dl)
        pos, split = f.offset, f.split
        events: list[tuple[bytes, dict[str, str]]] = []
        nbytes = splits = 0
        head: bytes | None = None
        while len(events) < budget:
            if head is None and pos < FINGERPRINT_BYTES:
                # the first bytes and the lines in one read: the fingerprint is of what the lines came from
                whole = os.pread(f.fd, size + pos, 0)
                head, data = whole[:FINGERPRINT_BYTES], whole[pos:]
                if len(whole) < pos or _fingerprint(head[: f.fp_len]) != f.fp:
                    return None  # changed since the check: the next poll's check sees how
            else:
                data = os.pread(f.fd, size, pos)
            if not data:
                break
            i, n = 0, len(data)
            while len(events) < budget:
                j = data.find(delim, i)
                if j >= 0 and j - i <= room:
                    end, after = j, j + dl  # a line
                elif n - i > room or (j >= 0 and j - i > room):
                    body = data[i : i + room]
                    if split is None:
                        split = pos + i
                        splits += 1
                    events.append((body, {"file": f.path, "offset": str(pos + i), "split": str(split)}))
                    nbytes += len(body)
                    i += room
                    continue
                elif final and j < 0 and i < n and n < size:
                    end = after = n  # the unterminated tail (then nothing is left: the loop ends)
                else:
                    break
                body = data[i:end]
                hdrs = {"file": f.path, "offset": str(pos + i)}
                if split is not None:  # the last piece of a split line
                    hdrs["split"] = str(split)
                    split = None
                events.append((body, hdrs))
                nbytes += len(body)
                i = after
            pos += i
            if i == 0 or n < size:
                break
        if pos == f.offset and split == f.split:
            return None
        r = _Read(events, pos, split, f.fp, f.fp_len, f.head)
        if head is not None:
            r.fp_len = min(FINGERPRINT_BYTES, pos)
            r.head = head[: r.fp_len]
            r.fp = _fingerprint(r.head)
        elif _fingerprint(_pread(f.fd, f.fp_len, 0)) != f.fp:
            return None  # truncated or replaced while we read: the lines may be another file's
        r.nbytes, r.splits = nbytes, splits
        return r

    def _finish_idle(self, matched: dict[tuple[int, int], str], reads: dict[int, _Read]) -> None:
        """Finish the files that left the glob (renamed away or deleted) once read to their end and idle."""
        now = time.monotonic()
        for key, f in list(self._files.items()):
            if key in matched or f.slot in reads:
                f.idle_since = None
                continue
            if f.size_seen > f.offset:
                # the unterminated tail of a file nobody writes anymore
                if f.idle_since is None:
                    f.idle_since = now
                    continue
                if now - f.idle_since < self.rotate_grace:
                    continue
                if len(reads) + len(self._dirty) >= _MAX_MARKS_PER_TX:
                    continue
                r = self._read(f, self.batch_size - sum(len(x.events) for x in reads.values()), final=True)
                if r is not None:
                    reads[f.slot] = r
                continue
            if f.idle_since is None:
                f.idle_since = now
            elif now - f.idle_since >= self.rotate_grace:
                logger.info("finished %s (inode %d) at byte %d: it left the glob", f.path, f.ino, f.offset)
                self.counters["files_finished"] += 1
                self._free(f)

    def _commit(self, reads: dict[int, _Read]) -> int:
        """One transaction: the lines read and every changed position, or nothing."""
        if not reads and not self._dirty:
            return 0
        by_slot = {f.slot: f for f in self._files.values()}
        room = _MAX_MARKS_PER_TX - len(reads)  # _read_all leaves room for at least one dirty mark
        marks = {s: v for s, v in list(self._dirty.items())[:room] if s not in reads}
        for slot, r in reads.items():
            f = by_slot[slot]
            marks[slot] = _File(slot, f.path, f.dev, f.ino, r.fp, r.fp_len, r.offset, r.split).value()
        n = sum(len(r.events) for r in reads.values())
        try:
            with self.channel.transaction() as tx:
                for r in reads.values():
                    for body, hdrs in r.events:
                        tx.put(body, hdrs)
                for slot, value in marks.items():
                    tx.mark(self._key(slot), value)
        except (ChannelFullError, DiskSpaceError, OSError) as exc:
            if isinstance(exc, OSError) and exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise  # the channel has failed (it refuses further work): the source stops
            # (a disk full during the write: the channel cut it back and keeps working)
            self.counters["full_retries"] += 1
            logger.warning("tail source %r: %s; the same lines are read again at the next poll", self.name, exc)
            return 0
        for slot in list(marks) + list(reads):
            self._dirty.pop(slot, None)
        for slot, r in reads.items():
            f = by_slot[slot]
            f.offset, f.split, f.fp, f.fp_len, f.head = r.offset, r.split, r.fp, r.fp_len, r.head
            self.counters["bytes"] += r.nbytes
            self.counters["split_lines"] += r.splits
        self.counters["lines"] += n
        self.counters["transactions"] += 1
        return n


def make_tails(channels: Iterable[Any], specs: Iterable[str], **options: Any) -> list[TailSource]:
    """One :class:`TailSource` (not started) per served channel named in ``specs`` (``--tail``).

    ``channels`` are the agent's served channels (each with ``name`` and ``channel``, the owned
    :class:`FileChannel` or None when served read-only). Everything is checked here, so an agent
    makes its sources before it listens, and starts them before it says it serves.

    Raises:
        ConfigError: A spec naming no served channel, a channel served read-only, or a bad option.
    """
    by_name = {ch.name: ch for ch in channels}
    sources: list[TailSource] = []
    for name, patterns in parse_tail_specs(specs, sorted(by_name)).items():
        channel = by_name[name].channel
        if channel is None:
            raise ConfigError("tail", "the tail source puts into the channel: start the agent with --writable")
        sources.append(TailSource(channel, patterns, **options))
    return sources


def parse_tail_specs(specs: Iterable[str], names: Sequence[str]) -> dict[str, list[str]]:
    """``--tail GLOB`` / ``--tail NAME=GLOB`` as ``{channel name: [globs]}`` for the served channel ``names``.

    Raises:
        ConfigError: No channel named, or an unknown one, while several channels are served.
    """
    out: dict[str, list[str]] = {}
    for spec in specs:
        name, sep, pattern = spec.partition("=")
        if sep and name in names and pattern:
            out.setdefault(name, []).append(pattern)
        elif len(names) == 1:
            out.setdefault(names[0], []).append(spec)
        else:
            raise ConfigError("tail", f"{spec!r}: several channels are served ({', '.join(names)}): give NAME=GLOB")
    return out
