"""The one I/O seam: every durability-relevant system call goes through here.

``OsFS`` performs writes, fsyncs, truncations, renames, unlinks, directory
syncs, locks and free-space queries with plain ``os`` calls on raw file
descriptors (never buffered file objects: a failed flush of a buffer can leave
bytes behind that a later flush writes). Tests replace it with a simulated,
crashable file system that implements the same :class:`FS` protocol.

Rules this module keeps:

* writes loop on short writes and raise on any error; nothing here retries a
  failed write or fsync;
* ``fsync_dir`` is explicit: callers decide when a namespace change must be
  durable;
* every file and directory it creates gets exactly the file system object's
  ``file_mode`` / ``dir_mode`` (0600 / 0700 unless set otherwise), whatever the
  umask: created with that mode, then ``fchmod``/``chmod``-ed to it; a lock file
  is always :data:`LOCK_MODE` (0600), since anyone who can open it can ``flock`` it;
* nothing here knows the channel's format or policy (``permissions.py`` picks the modes).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import stat
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

#: What a write takes: one buffer, or a sequence of buffers written back to back (a gathered
#: write: ``pwritev``, so the caller need not join them into one copy first).
Data = bytes | Sequence[bytes]

#: Buffers per ``pwritev`` call (Linux's IOV_MAX is 1024).
_IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX")) if hasattr(os, "sysconf") else 16

#: The modes of what filechannel creates unless told otherwise: owner only.
FILE_MODE = 0o600
DIR_MODE = 0o700
#: A lock file's mode, whatever the others: ``flock`` needs only a descriptor, even a
#: read-only one, so anyone who can open the file could lock the owner out.
LOCK_MODE = 0o600


class FS(Protocol):
    """The file-system operations filechannel performs.

    ``file_mode`` and ``dir_mode`` are the permission bits of every file
    (:meth:`create`) and directory (:meth:`makedirs`) it creates, exactly,
    whatever the process's umask.
    """

    file_mode: int
    dir_mode: int

    def makedirs(self, path: str) -> None:
        """Create ``path`` and its missing parents, each with ``dir_mode`` (not durable by itself)."""

    def listdir(self, path: str) -> list[str]:
        """Return the entry names of a directory."""

    def exists(self, path: str) -> bool:
        """Return whether ``path`` exists."""

    def isdir(self, path: str) -> bool:
        """Return whether ``path`` is a directory."""

    def create(self, path: str) -> int:
        """Create a new file (mode ``file_mode``) for reading and writing; fail if it exists."""

    def open_read(self, path: str) -> int:
        """Open an existing file read-only."""

    def open_rw(self, path: str) -> int:
        """Open an existing file for reading and writing."""

    def pwrite_all(self, fd: int, data: Data, offset: int) -> None:
        """Write all of ``data`` (a buffer, or buffers back to back) at ``offset``, or raise ``OSError``."""

    def pread(self, fd: int, n: int, offset: int) -> bytes:
        """Read up to ``n`` bytes at ``offset`` (fewer only at end of file)."""

    def size(self, fd: int) -> int:
        """Return the current size of an open file."""

    def dup(self, fd: int) -> int:
        """Return a second descriptor of the same open file (its writes, its sync errors, its data).

        A sync through it covers what was written through ``fd``, and reports the
        write-back errors ``fd`` would (they share one open file description).
        """

    def fdatasync(self, fd: int) -> None:
        """Make a file's data durable."""

    def fsync(self, fd: int) -> None:
        """Make a file's data and metadata durable."""

    def truncate(self, fd: int, size: int) -> None:
        """Cut an open file to ``size`` bytes."""

    def close(self, fd: int) -> None:
        """Close a descriptor."""

    def fsync_dir(self, path: str) -> None:
        """Make the entries of a directory (creates, renames, unlinks) durable."""

    def replace(self, src: str, dst: str) -> None:
        """Atomically rename ``src`` over ``dst``."""

    def unlink(self, path: str) -> None:
        """Remove a file."""

    def lock(self, path: str) -> int:
        """Take an exclusive, non-blocking lock on ``path`` (created with :data:`LOCK_MODE` if missing).

        Raises ``BlockingIOError`` if held.
        """

    def unlock(self, handle: int) -> None:
        """Release a lock taken by :meth:`lock`."""

    def free_space(self, path: str) -> int:
        """Return the bytes available to unprivileged users on ``path``'s file system."""

    def stat_token(self, path: str) -> tuple[int, int, int, int]:
        """Return ``(inode, size, mtime_ns, ctime_ns)`` of ``path`` (one ``stat``; no data read).

        It changes when the file changes or, for a directory, when an entry is
        added, renamed over or removed, within the file system's timestamp
        granularity: a change in the same clock tick as the previous one may
        leave it equal, so callers distrust a token whose times are recent.
        Raises ``FileNotFoundError`` when ``path`` does not exist.
        """

    def stat_owner(self, path: str) -> tuple[int, int]:
        """Return ``(uid, permission bits)`` of ``path`` (following symbolic links).

        Raises ``FileNotFoundError`` when ``path`` does not exist.
        """

    def chmod(self, path: str, mode: int) -> None:
        """Set the permission bits of ``path``."""


class OsFS:
    """The real file system, through ``os`` on raw descriptors.

    Args:
        file_mode: Permission bits of every file it creates (default 0600).
        dir_mode: Permission bits of every directory it creates (default 0700).
    """

    # Class attributes, so that a subclass whose __init__ does not call this one's has them.
    file_mode: int = FILE_MODE
    dir_mode: int = DIR_MODE

    def __init__(self, file_mode: int = FILE_MODE, dir_mode: int = DIR_MODE) -> None:
        self.file_mode = file_mode
        self.dir_mode = dir_mode

    def makedirs(self, path: str) -> None:
        """Create ``path`` and its missing parents, each with exactly ``dir_mode``."""
        missing = []
        p = os.path.abspath(path)
        while not os.path.isdir(p):
            missing.append(p)
            parent = os.path.dirname(p)
            if parent == p:
                break
            p = parent
        mode = self.dir_mode
        for d in reversed(missing):
            try:
                os.mkdir(d, mode)
            except FileExistsError:
                if not os.path.isdir(d):
                    raise
                continue  # made meanwhile by someone else: theirs, left as it is
            os.chmod(d, mode)  # whatever the umask took away

    def listdir(self, path: str) -> list[str]:
        """Return the entry names of a directory."""
        return os.listdir(path)

    def exists(self, path: str) -> bool:
        """Return whether ``path`` exists."""
        return os.access(path, os.F_OK)  # os.path.exists without an exception when it does not

    def isdir(self, path: str) -> bool:
        """Return whether ``path`` is a directory."""
        return os.path.isdir(path)

    def create(self, path: str) -> int:
        """Create a new file with exactly ``file_mode`` for reading and writing; fail if it exists."""
        mode = self.file_mode
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
        try:
            os.fchmod(fd, mode)  # whatever the umask took away
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        return fd

    def open_read(self, path: str) -> int:
        """Open an existing file read-only."""
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)

    def open_rw(self, path: str) -> int:
        """Open an existing file for reading and writing."""
        return os.open(path, os.O_RDWR | os.O_CLOEXEC)

    def pwrite_all(self, fd: int, data: Data, offset: int) -> None:
        """Write all of ``data`` at ``offset``, looping on short writes.

        A sequence of buffers goes out with ``pwritev`` (no joined copy).
        """
        if not isinstance(data, (bytes, bytearray, memoryview)):
            _pwritev_all(fd, list(data), offset)
            return
        view = memoryview(data)
        while view:
            n = os.pwrite(fd, view, offset)
            if n <= 0:  # pragma: no cover - the kernel raises instead
                raise OSError(errno.EIO, "pwrite wrote nothing")
            view = view[n:]
            offset += n

    def pread(self, fd: int, n: int, offset: int) -> bytes:
        """Read up to ``n`` bytes at ``offset``, looping on short reads."""
        first = os.pread(fd, n, offset)
        if len(first) == n or not first:
            return first
        parts = [first]
        got = len(first)
        while got < n:
            more = os.pread(fd, n - got, offset + got)
            if not more:
                break
            parts.append(more)
            got += len(more)
        return b"".join(parts)

    def size(self, fd: int) -> int:
        """Return the current size of an open file."""
        return os.fstat(fd).st_size

    def dup(self, fd: int) -> int:
        """Return a second descriptor of the same open file description."""
        return os.dup(fd)

    def fdatasync(self, fd: int) -> None:
        """Make a file's data durable."""
        os.fdatasync(fd)

    def fsync(self, fd: int) -> None:
        """Make a file's data and metadata durable."""
        os.fsync(fd)

    def truncate(self, fd: int, size: int) -> None:
        """Cut an open file to ``size`` bytes."""
        os.ftruncate(fd, size)

    def close(self, fd: int) -> None:
        """Close a descriptor (close can report deferred write errors)."""
        os.close(fd)

    def fsync_dir(self, path: str) -> None:
        """Make the entries of a directory durable."""
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def replace(self, src: str, dst: str) -> None:
        """Atomically rename ``src`` over ``dst``."""
        os.replace(src, dst)

    def unlink(self, path: str) -> None:
        """Remove a file."""
        os.unlink(path)

    def lock(self, path: str) -> int:
        """Take an exclusive ``flock`` on ``path`` (created if needed).

        ``flock`` locks belong to the open file description, so a second
        open of the same directory, even in this process, is refused, and a
        crashed process never leaves a stale lock behind.
        """
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, LOCK_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            st = os.fstat(fd)
            if stat.S_IMODE(st.st_mode) != LOCK_MODE and st.st_uid == os.geteuid():
                os.fchmod(fd, LOCK_MODE)  # new (the umask), or left wider by an older version
        except BaseException:
            os.close(fd)
            raise
        return fd

    def unlock(self, handle: int) -> None:
        """Release a lock taken by :meth:`lock`."""
        try:
            fcntl.flock(handle, fcntl.LOCK_UN)
        finally:
            os.close(handle)

    def free_space(self, path: str) -> int:
        """Return the bytes available to unprivileged users on ``path``'s file system."""
        st = os.statvfs(path)
        return st.f_bavail * st.f_frsize

    def stat_token(self, path: str) -> tuple[int, int, int, int]:
        """Return ``(inode, size, mtime_ns, ctime_ns)`` of ``path`` (one ``stat``)."""
        st = os.stat(path)
        return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns

    def stat_owner(self, path: str) -> tuple[int, int]:
        """Return ``(uid, permission bits)`` of ``path`` (one ``stat``)."""
        st = os.stat(path)
        return st.st_uid, stat.S_IMODE(st.st_mode)

    def chmod(self, path: str, mode: int) -> None:
        """Set the permission bits of ``path``."""
        os.chmod(path, mode)


def _pwritev_all(fd: int, bufs: list[bytes], offset: int) -> None:
    """Write ``bufs`` back to back at ``offset`` with ``pwritev``, looping on short writes."""
    total = sum(map(len, bufs))
    done = os.pwritev(fd, bufs, offset) if len(bufs) <= _IOV_MAX else 0
    if done == total:  # the usual case: everything in one call
        return
    views = [memoryview(b) for b in bufs if len(b)]
    i = 0
    n = done
    while True:
        while n and i < len(views):  # step over what went out; a partly written buffer keeps its rest
            k = len(views[i])
            if n >= k:
                n -= k
                i += 1
            else:
                views[i] = views[i][n:]
                n = 0
        if i == len(views):
            return
        n = os.pwritev(fd, views[i : i + _IOV_MAX], offset + done)
        if n <= 0:  # pragma: no cover - the kernel raises instead
            raise OSError(errno.EIO, "pwritev wrote nothing")
        done += n


@contextlib.contextmanager
def map_file(fs: FS, path: str) -> Iterator[bytes | mmap.mmap]:
    """A read-only view of a whole file, valid inside the ``with`` block only.

    On the real file system (:class:`OsFS`) the file is mapped: its pages are
    read when touched, so a huge or sparse file costs no heap (a ``MemoryError``
    of :func:`read_file`); any other ``FS`` (the simulated one) reads it whole.
    The view supports the buffer protocol, ``find``, indexing and slicing (what
    the scanner and the C accelerator use). Memoryviews of it must be released
    before the block ends.
    """
    fd = fs.open_read(path)
    try:
        size = fs.size(fd)
        if isinstance(fs, OsFS) and size > 0:
            m = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
            try:
                yield m
            finally:
                m.close()
        else:
            yield fs.pread(fd, size, 0)
    finally:
        fs.close(fd)


def read_file(fs: FS, path: str, limit: int | None = None) -> bytes:
    """Read a whole file through ``fs``.

    With ``limit``, a file larger than that is not read: ``FileTooLarge``
    (a small metadata file that size is damaged or crafted, never a reason to
    allocate its size).
    """
    fd = fs.open_read(path)
    try:
        size = fs.size(fd)
        if limit is not None and size > limit:
            raise FileTooLarge(path, size, limit)
        return fs.pread(fd, size, 0)
    finally:
        fs.close(fd)


class FileTooLarge(ValueError):
    """A file :func:`read_file` was asked to read whole is larger than its limit (``.size``, ``.limit``)."""

    def __init__(self, path: str, size: int, limit: int) -> None:
        self.path = path
        self.size = size
        self.limit = limit
        super().__init__(f"{path} is {size} bytes, more than the {limit} such a file can be")


def truncate_durably(fs: FS, path: str, size: int) -> None:
    """Cut ``path`` to ``size`` bytes and fsync it (the caller fsyncs the directory if it must)."""
    fd = fs.open_rw(path)
    try:
        fs.truncate(fd, size)
        fs.fsync(fd)
    finally:
        fs.close(fd)


def replace_durably(fs: FS, tmp: str, path: str, data: bytes) -> None:
    """Write ``data`` to ``tmp``, fsync it, rename it over ``path`` and fsync ``path``'s directory.

    ``tmp`` must be in that directory. When this returns, ``path`` holds ``data``
    durably; after a crash before that, it holds its old contents or ``data``.
    """
    fd = fs.create(tmp)
    try:
        fs.pwrite_all(fd, data, 0)
        fs.fsync(fd)
    finally:
        fs.close(fd)
    fs.replace(tmp, path)
    fs.fsync_dir(os.path.dirname(path) or ".")


DEFAULT_FS: OsFS = OsFS()


def is_locked(path: str) -> bool:
    """Return whether a process holds the ``flock`` of lock file ``path``, read-only.

    A read-only probe for inspections (``filechannel stat``) of a directory the
    caller may not write: it opens ``path`` read-only (``flock`` works on a
    read-only descriptor), creates nothing (a missing file means unlocked) and
    tries a shared lock, dropped at once. While it holds that shared lock (a few
    microseconds) an opener's exclusive lock would fail as if the channel were
    open, as with any ``flock`` probe.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def with_modes(fs: FS, file_mode: int, dir_mode: int) -> FS:
    """Return a file system like ``fs`` that creates files with ``file_mode`` and directories with ``dir_mode``.

    ``fs`` itself when it already does; a new :class:`OsFS` for a plain ``OsFS``
    (:data:`DEFAULT_FS` is shared and never changed); any other file system
    (a simulated one, a test's subclass) is set in place, since it holds state
    a copy would split.
    """
    if fs.file_mode == file_mode and fs.dir_mode == dir_mode:
        return fs
    if type(fs) is OsFS:
        return OsFS(file_mode, dir_mode)
    fs.file_mode = file_mode
    fs.dir_mode = dir_mode
    return fs


def write_private_file(path: str, data: bytes) -> None:
    """Durably replace ``path`` with ``data``, readable by its owner only (mode 0600; a keystore).

    Written as ``path.tmp-<pid>`` created with mode 0600 (never wider, not even
    for a moment), fsynced, renamed over ``path``, and the directory fsynced.
    """
    tmp = f"{path}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask did
        DEFAULT_FS.pwrite_all(fd, data, 0)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)
    DEFAULT_FS.fsync_dir(os.path.dirname(os.path.abspath(path)))


@contextmanager
def exclusive_lock(path: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path``, waiting for it (a sidecar lock file, e.g. a keystore's).

    The file is created mode 0600 if missing and never removed (removing a lock
    file lets two processes lock two different files); a symlink at ``path`` is
    refused (``O_NOFOLLOW``). Closing the descriptor releases the lock, so a
    crashed holder never leaves it held.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
