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
* nothing here knows the channel's format or policy.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
from collections.abc import Iterator, Sequence
from typing import Protocol

#: What a write takes: one buffer, or a sequence of buffers written back to back (a gathered
#: write: ``pwritev``, so the caller need not join them into one copy first).
Data = bytes | Sequence[bytes]

#: Buffers per ``pwritev`` call (Linux's IOV_MAX is 1024).
_IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX")) if hasattr(os, "sysconf") else 16


class FS(Protocol):
    """The file-system operations filechannel performs."""

    def makedirs(self, path: str) -> None:
        """Create ``path`` and its parents if missing (not durable by itself)."""

    def listdir(self, path: str) -> list[str]:
        """Return the entry names of a directory."""

    def exists(self, path: str) -> bool:
        """Return whether ``path`` exists."""

    def isdir(self, path: str) -> bool:
        """Return whether ``path`` is a directory."""

    def create(self, path: str) -> int:
        """Create a new file for reading and writing; fail if it exists."""

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
        """Take an exclusive, non-blocking lock on ``path``; raise ``BlockingIOError`` if held."""

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


class OsFS:
    """The real file system, through ``os`` on raw descriptors."""

    def makedirs(self, path: str) -> None:
        """Create ``path`` and its parents if missing."""
        os.makedirs(path, exist_ok=True)

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
        """Create a new file for reading and writing; fail if it exists."""
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)

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
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
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


def read_file(fs: FS, path: str) -> bytes:
    """Read a whole file through ``fs``."""
    fd = fs.open_read(path)
    try:
        return fs.pread(fd, fs.size(fd), 0)
    finally:
        fs.close(fd)


def truncate_durably(fs: FS, path: str, size: int) -> None:
    """Cut ``path`` to ``size`` bytes and fsync it (the caller fsyncs the directory if it must)."""
    fd = fs.open_rw(path)
    try:
        fs.truncate(fd, size)
        fs.fsync(fd)
    finally:
        fs.close(fd)


def replace_durably(fs: FS, tmp: str, path: str, data: bytes) -> None:
    """Write ``data`` to ``tmp``, fsync it, and rename it over ``path`` (the caller fsyncs the directory)."""
    fd = fs.create(tmp)
    try:
        fs.pwrite_all(fd, data, 0)
        fs.fsync(fd)
    finally:
        fs.close(fd)
    fs.replace(tmp, path)


DEFAULT_FS: OsFS = OsFS()


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
