"""SimFS: an in-memory, crashable file system implementing ``filechannel._fs.FS``.

It keeps, for every file, what reads see (``data``), what survives a power cut
(``durable``, as of the last successful fsync/fdatasync) and the writes and
truncations since (``pending``); for every directory, its current entries and
its durable entries, plus an ordered list of namespace changes (create, mkdir,
rename, unlink) not yet made durable by an ``fsync_dir`` of their directory.

``crash(seed, mode)`` returns a new SimFS holding one possible post-power-cut
state, chosen by a seeded RNG (so every failure replays from its seed):

* ``drop``: every unsynced write and namespace change is lost;
* ``keep``: every write reached the disk (like ``kill -9``);
* ``prefix``: an in-order prefix of each file's unsynced writes persisted;
* ``subset``: a random subset persisted (reordered writeback);
* ``torn``: like ``subset``, and persisted writes are torn at 512 B or 4 KiB
  granularity, each torn sector holding zeros, garbage or the old contents;
* ``extend``: like ``prefix``, and the file size reached the disk without its
  data (the tail reads back as zeros or garbage);
* ``random``: one of the above per file;
* ``torn_prefix``: an in-order prefix of each file's unsynced writes
  persisted, and the write after it persisted in part (a random byte prefix),
  with an in-order prefix of the namespace changes (never chosen by ``random``).

Namespace changes since the last directory fsync are, except in ``drop`` and
``keep``, each applied or not (``dir_model="posix"``, the default: nothing in
the namespace is durable without an fsync of the directory), or applied as an
in-order prefix (``dir_model="ext4"``, where an fsync of any file also commits
every earlier namespace change, as the ext4 journal does).

Faults: :meth:`SimFS.inject` makes the N-th later call of an operation raise
``OSError`` (EIO, ENOSPC, ...) or write only part of its data first. A failed
fsync forgets the unsynced writes as Linux does (the page cache still shows
them, the disk never gets them). ``capacity`` bounds the bytes stored, so a
write past it is short and then fails with ENOSPC.

Every mutating call is appended to ``trace`` and reported to ``on_op``; the
crash-point tests snapshot the file system there.

Permissions: every file and directory records the mode it was created with
(``file_mode`` / ``dir_mode``, as ``OsFS``; a lock file ``LOCK_MODE``) and an
owner (``uid``, the creating SimFS's, by default this process's effective
uid); :meth:`SimFS.mode`, :meth:`SimFS.chown` and ``chmod`` let tests look
and change them. Nothing enforces them: the simulated process may do anything.

Threads: :class:`ConcurrentSimFS` serialises every call under one re-entrant
lock (``mutex``, which a test also holds to read the file system and its own
model at one instant) and can make each fsync/fdatasync take ``sync_delay``
seconds, spent before the sync takes effect and outside the lock, as a real
sync releases the GIL: committers on other threads run meanwhile, so group
commits form, and a commit that returns before the sync covering it is seen
with its bytes not yet durable (:meth:`SimFS.durable_bytes`).
"""

from __future__ import annotations

import errno
import functools
import os
import posixpath
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from filechannel._fs import DIR_MODE, FILE_MODE, LOCK_MODE, Data

CRASH_MODES = ("drop", "keep", "prefix", "subset", "torn", "extend", "random", "torn_prefix")
_FILE_MODES = ("drop", "keep", "prefix", "subset", "torn", "extend")
# The (mode, seed) pairs a crash-point harness tries at every persistence point: the two
# extremes once, and each mode that draws from its seed with a few seeds.
CRASH_VARIANTS: tuple[tuple[str, int], ...] = tuple(
    (mode, seed)
    for mode, seeds in {"drop": 1, "keep": 1, "prefix": 2, "subset": 2, "torn": 3, "extend": 2, "random": 2}.items()
    for seed in range(seeds)
)
MUTATING_OPS = frozenset(
    {"makedirs", "create", "pwrite_all", "truncate", "fdatasync", "fsync", "fsync_dir", "replace", "unlink", "lock"}
)


class _File:
    __slots__ = ("data", "durable", "mode", "pending", "uid")

    def __init__(self, data: bytes = b"", mode: int = FILE_MODE, uid: int = 0) -> None:
        self.data = bytearray(data)
        self.durable = bytes(data)
        # ("w", offset, bytes) or ("t", size), in order, since the last sync
        self.pending: list[tuple[Any, ...]] = []
        self.mode = mode
        self.uid = uid


class _Dir:
    __slots__ = ("durable", "entries", "mode", "uid")

    def __init__(self, mode: int = DIR_MODE, uid: int = 0) -> None:
        self.entries: dict[str, _File | _Dir] = {}
        self.durable: dict[str, _File | _Dir] = {}
        self.mode = mode
        self.uid = uid


@dataclass
class _Fault:
    op: str
    skip: int
    times: int | None
    err: int
    short: int | None
    path: str | None
    fired: int = 0


@dataclass
class _OpenFile:
    node: _File
    path: str
    writable: bool


@dataclass
class Stats:
    """Counts of what a SimFS did (summed into the reliability report)."""

    ops: dict[str, int] = field(default_factory=dict)
    faults_fired: int = 0


def _apply_write(buf: bytearray, off: int, data: bytes) -> None:
    end = off + len(data)
    if off > len(buf):
        buf.extend(b"\0" * (off - len(buf)))
    buf[off:end] = data


def _apply(buf: bytearray, op: tuple[Any, ...]) -> None:
    if op[0] == "w":
        _apply_write(buf, op[1], op[2])
    else:
        size = op[1]
        if size < len(buf):
            del buf[size:]
        else:
            buf.extend(b"\0" * (size - len(buf)))


class SimFS:
    """An in-memory file system with a durability model (see the module docstring).

    Args:
        dir_model: ``"posix"`` (strict, default) or ``"ext4"``.
        capacity: Most bytes all files may hold; ``None`` for unlimited.
        free: What ``free_space`` reports; ``None`` derives it from ``capacity``.
    """

    file_mode: int = FILE_MODE
    dir_mode: int = DIR_MODE

    def __init__(self, dir_model: str = "posix", capacity: int | None = None, free: int | None = None) -> None:
        if dir_model not in ("posix", "ext4"):
            raise ValueError(dir_model)
        self.dir_model = dir_model
        self.capacity = capacity
        self.free = free
        #: The owner of what this file system creates (tests change it to act as another user).
        self.uid = os.geteuid()
        self.root = _Dir(0o755, 0)
        # Namespace changes not yet durable: (dirs touched, op tuple), in order.
        self.ns_pending: list[tuple[tuple[_Dir, ...], tuple[Any, ...]]] = []
        self._fds: dict[int, _OpenFile] = {}
        self._next_fd = 3
        self._locks: dict[int, str] = {}
        self._faults: list[_Fault] = []
        self.trace: list[tuple[str, str]] = []
        self.on_op: Callable[[str, str], None] | None = None
        self.stats = Stats()
        # Everything under / exists durably at start: a fresh, synced disk.
        self.makedirs("/sim")
        self._sync_all_namespace()
        self.trace.clear()
        self.stats = Stats()

    # -- helpers -------------------------------------------------------------------

    @staticmethod
    def _norm(path: str) -> str:
        p = posixpath.normpath(path)
        if not p.startswith("/"):
            raise ValueError(f"SimFS paths must be absolute: {path!r}")
        return p

    def _parts(self, path: str) -> list[str]:
        return [c for c in self._norm(path).split("/") if c]

    def _lookup(self, path: str) -> _File | _Dir | None:
        node: _File | _Dir = self.root
        for c in self._parts(path):
            if not isinstance(node, _Dir):
                return None
            nxt = node.entries.get(c)
            if nxt is None:
                return None
            node = nxt
        return node

    def _parent(self, path: str) -> tuple[_Dir, str]:
        parts = self._parts(path)
        if not parts:
            raise OSError(errno.EINVAL, "root has no parent", path)
        parent = self._lookup("/" + "/".join(parts[:-1]))
        if not isinstance(parent, _Dir):
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
        return parent, parts[-1]

    def _file(self, path: str) -> _File:
        node = self._lookup(path)
        if node is None:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
        if isinstance(node, _Dir):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", path)
        return node

    def _op(self, op: str, path: str) -> None:
        """Count a call and fire a matching injected fault (before the call acts)."""
        self.stats.ops[op] = self.stats.ops.get(op, 0) + 1
        for f in self._faults:
            if f.op != op or (f.path is not None and f.path not in path):
                continue
            if f.skip > 0:
                f.skip -= 1
                continue
            if f.times is not None and f.fired >= f.times:
                continue
            f.fired += 1
            self.stats.faults_fired += 1
            if f.short is not None:
                raise _Short(f.err, f.short)
            raise OSError(f.err, f"injected {errno.errorcode.get(f.err, f.err)} on {op}", path)

    def _done(self, op: str, path: str) -> None:
        self.trace.append((op, path))
        if self.on_op is not None:
            self.on_op(op, path)

    def _used(self) -> int:
        total = 0
        stack: list[_File | _Dir] = [self.root]
        seen: set[int] = set()
        while stack:
            n = stack.pop()
            if id(n) in seen:
                continue
            seen.add(id(n))
            if isinstance(n, _Dir):
                stack.extend(n.entries.values())
            else:
                total += len(n.data)
        for of in self._fds.values():
            if id(of.node) not in seen:
                seen.add(id(of.node))
                total += len(of.node.data)
        return total

    def _ns(self, dirs: tuple[_Dir, ...], op: tuple[Any, ...]) -> None:
        self.ns_pending.append((dirs, op))

    @staticmethod
    def _apply_ns(op: tuple[Any, ...], durable_of: Callable[[_Dir], dict[str, Any]]) -> None:
        kind = op[0]
        if kind == "link":
            _, d, name, node = op
            durable_of(d)[name] = node
        elif kind == "unlink":
            _, d, name = op
            durable_of(d).pop(name, None)
        else:  # rename
            _, sd, sname, dd, dname, node = op
            src = durable_of(sd)
            if src.get(sname) is node:
                del src[sname]
            durable_of(dd)[dname] = node

    def _sync_all_namespace(self) -> None:
        for _dirs, op in self.ns_pending:
            self._apply_ns(op, lambda d: d.durable)
        self.ns_pending.clear()

    # -- fault injection -------------------------------------------------------------

    def inject(
        self,
        op: str,
        nth: int = 1,
        err: int = errno.EIO,
        *,
        times: int | None = 1,
        short: int | None = None,
        path: str | None = None,
    ) -> None:
        """Make the ``nth`` next call of ``op`` (and ``times - 1`` after it) fail.

        ``times=None`` keeps failing for good. ``short`` (for ``pwrite_all``):
        write that many bytes first, then raise. ``path``: only calls whose
        path contains this string count.
        """
        self._faults.append(_Fault(op, nth - 1, times, err, short, path))

    def clear_faults(self) -> None:
        """Remove every injected fault."""
        self._faults.clear()

    def count(self, op: str, path: str | None = None) -> int:
        """Return how many times ``op`` was called (on a path containing ``path``)."""
        return sum(1 for o, p in self.trace if o == op and (path is None or path in p))

    # -- the FS protocol: namespace ----------------------------------------------------

    def makedirs(self, path: str) -> None:
        """Create ``path`` and its parents (each with ``dir_mode``, a pending namespace change)."""
        node: _Dir = self.root
        cur = ""
        for c in self._parts(path):
            cur += "/" + c
            nxt = node.entries.get(c)
            if nxt is None:
                self._op("makedirs", cur)
                nd = _Dir(self.dir_mode, self.uid)
                node.entries[c] = nd
                self._ns((node,), ("link", node, c, nd))
                self._done("makedirs", cur)
                nxt = nd
            if not isinstance(nxt, _Dir):
                raise FileExistsError(errno.EEXIST, "File exists", cur)
            node = nxt

    def listdir(self, path: str) -> list[str]:
        """Return the entry names of a directory."""
        node = self._lookup(path)
        if node is None:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
        if not isinstance(node, _Dir):
            raise NotADirectoryError(errno.ENOTDIR, "Not a directory", path)
        return list(node.entries)

    def exists(self, path: str) -> bool:
        """Return whether ``path`` exists."""
        return self._lookup(path) is not None

    def isdir(self, path: str) -> bool:
        """Return whether ``path`` is a directory."""
        return isinstance(self._lookup(path), _Dir)

    def _new_fd(self, node: _File, path: str, writable: bool) -> int:
        fd = self._next_fd
        self._next_fd += 1
        self._fds[fd] = _OpenFile(node, self._norm(path), writable)
        return fd

    def create(self, path: str, *, mode: int | None = None) -> int:
        """Create a new, empty file with ``file_mode`` (a pending namespace change); return a writable descriptor."""
        parent, name = self._parent(path)
        if name in parent.entries:
            raise FileExistsError(errno.EEXIST, "File exists", path)
        self._op("create", path)
        node = _File(mode=self.file_mode if mode is None else mode, uid=self.uid)
        parent.entries[name] = node
        self._ns((parent,), ("link", parent, name, node))
        fd = self._new_fd(node, path, True)
        self._done("create", path)
        return fd

    def dup(self, fd: int) -> int:
        """Return a second descriptor of the same file (a sync through it covers the file's writes)."""
        of = self._fd(fd)
        return self._new_fd(of.node, of.path, of.writable)

    def open_read(self, path: str) -> int:
        """Open an existing file read-only."""
        return self._new_fd(self._file(path), path, False)

    def open_rw(self, path: str) -> int:
        """Open an existing file for reading and writing."""
        return self._new_fd(self._file(path), path, True)

    def replace(self, src: str, dst: str) -> None:
        """Rename ``src`` over ``dst`` (a pending namespace change until both directories are synced)."""
        sp, sname = self._parent(src)
        dp, dname = self._parent(dst)
        node = sp.entries.get(sname)
        if node is None:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", src)
        self._op("replace", dst)
        del sp.entries[sname]
        dp.entries[dname] = node
        self._ns((sp, dp), ("rename", sp, sname, dp, dname, node))
        self._done("replace", dst)

    def unlink(self, path: str) -> None:
        """Remove a file (a pending namespace change)."""
        parent, name = self._parent(path)
        node = parent.entries.get(name)
        if node is None:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
        if isinstance(node, _Dir):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", path)
        self._op("unlink", path)
        del parent.entries[name]
        self._ns((parent,), ("unlink", parent, name))
        self._done("unlink", path)

    def fsync_dir(self, path: str) -> None:
        """Make the pending namespace changes of this directory durable."""
        node = self._lookup(path)
        if not isinstance(node, _Dir):
            raise FileNotFoundError(errno.ENOENT, "No such directory", path)
        self._op("fsync_dir", path)
        keep = []
        for dirs, op in self.ns_pending:
            if node in dirs:
                self._apply_ns(op, lambda d: d.durable)
            else:
                keep.append((dirs, op))
        self.ns_pending = keep
        self._done("fsync_dir", path)

    # -- the FS protocol: data ------------------------------------------------------------

    def _fd(self, fd: int) -> _OpenFile:
        of = self._fds.get(fd)
        if of is None:
            raise OSError(errno.EBADF, "Bad file descriptor")
        return of

    def pwrite_all(self, fd: int, data: Data, offset: int) -> None:
        """Write ``data`` at ``offset`` (pending until a sync); honour injected faults and ``capacity``.

        A sequence of buffers is one write of their concatenation, as ``pwritev`` is.
        """
        of = self._fd(fd)
        if not of.writable:
            raise OSError(errno.EBADF, "Bad file descriptor")
        data = bytes(data) if isinstance(data, (bytes, bytearray, memoryview)) else b"".join(data)
        try:
            self._op("pwrite_all", of.path)
        except _Short as s:
            part = data[: s.n]
            if part:
                of.node.pending.append(("w", offset, part))
                _apply_write(of.node.data, offset, part)
            self._done("pwrite_all", of.path)
            raise OSError(s.err, f"injected short write ({s.n} of {len(data)} bytes)", of.path) from None
        if self.capacity is not None:
            grow = max(0, offset + len(data) - len(of.node.data))
            room = self.capacity - self._used()
            if grow > room:
                fits = max(0, len(of.node.data) - offset) + max(0, room)
                part = data[: max(0, fits)]
                if part:
                    of.node.pending.append(("w", offset, part))
                    _apply_write(of.node.data, offset, part)
                    self._done("pwrite_all", of.path)
                raise OSError(errno.ENOSPC, "No space left on device", of.path)
        of.node.pending.append(("w", offset, data))
        _apply_write(of.node.data, offset, data)
        self._done("pwrite_all", of.path)

    def pread(self, fd: int, n: int, offset: int) -> bytes:
        """Read up to ``n`` bytes at ``offset`` of what reads see."""
        of = self._fd(fd)
        return bytes(of.node.data[offset : offset + n])

    def size(self, fd: int) -> int:
        """Return the size of an open file as reads see it."""
        return len(self._fd(fd).node.data)

    def truncate(self, fd: int, size: int) -> None:
        """Cut or extend an open file to ``size`` bytes (pending until a sync)."""
        of = self._fd(fd)
        self._op("truncate", of.path)
        of.node.pending.append(("t", size))
        _apply(of.node.data, ("t", size))
        self._done("truncate", of.path)

    def _sync(self, op: str, fd: int) -> None:
        of = self._fd(fd)
        node = of.node
        try:
            self._op(op, of.path)
        except OSError:
            # fsyncgate: the unsynced writes are dropped for good, yet still readable.
            node.pending.clear()
            self._done(op + "!failed", of.path)
            raise
        buf = bytearray(node.durable)
        for p in node.pending:
            _apply(buf, p)
        node.durable = bytes(buf)
        node.pending.clear()
        if self.dir_model == "ext4":
            self._sync_all_namespace()
        self._done(op, of.path)

    def fdatasync(self, fd: int) -> None:
        """Make the file's pending writes durable."""
        self._sync("fdatasync", fd)

    def fsync(self, fd: int) -> None:
        """Make the file's pending writes durable."""
        self._sync("fsync", fd)

    def close(self, fd: int) -> None:
        """Close a descriptor."""
        self._fd(fd)
        del self._fds[fd]

    # -- locks and space -------------------------------------------------------------------

    def lock(self, path: str) -> int:
        """Take an exclusive lock on ``path``, creating the file if missing."""
        p = self._norm(path)
        if p in self._locks.values():
            raise BlockingIOError(errno.EWOULDBLOCK, "Resource temporarily unavailable", path)
        if self._lookup(p) is None:
            self.close(self.create(p, mode=LOCK_MODE))
        self._op("lock", p)
        h = self._next_fd
        self._next_fd += 1
        self._locks[h] = p
        return h

    def unlock(self, handle: int) -> None:
        """Release a lock taken by :meth:`lock`."""
        del self._locks[handle]

    def free_space(self, path: str) -> int:
        """Return ``free``, else what ``capacity`` leaves, else 1 TiB."""
        if self.free is not None:
            return self.free
        if self.capacity is not None:
            return max(0, self.capacity - self._used())
        return 1 << 40

    def stat_token(self, path: str) -> tuple[int, int, int, int]:
        """Return a token that changes exactly when the file or the directory's entries change.

        The second item hashes the contents (a file's bytes, a directory's names and
        nodes); the times are 0: a simulated file system has no clock granularity to
        distrust.
        """
        node = self._lookup(path)
        if node is None:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
        if isinstance(node, _File):
            return id(node), hash(bytes(node.data)), 0, 0
        return id(node), hash(tuple(sorted((k, id(v)) for k, v in node.entries.items()))), 0, 0

    def stat_owner(self, path: str) -> tuple[int, int]:
        """Return ``(uid, mode)`` recorded for ``path``."""
        node = self._lookup(path)
        if node is None:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
        return node.uid, node.mode

    def chmod(self, path: str, mode: int) -> None:
        """Set the mode recorded for ``path`` (metadata: not a crash point)."""
        node = self._lookup(path)
        if node is None:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
        self._op("chmod", path)
        node.mode = mode

    # -- inspection (tests) -------------------------------------------------------------------

    def mode(self, path: str) -> int:
        """Return the mode recorded for ``path``."""
        return self.stat_owner(path)[1]

    def chown(self, path: str, uid: int) -> None:
        """Record another owner for ``path`` (tests)."""
        node = self._lookup(path)
        if node is None:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
        node.uid = uid

    def read(self, path: str) -> bytes:
        """Return a file's current contents."""
        return bytes(self._file(path).data)

    def durable_bytes(self, path: str) -> bytes:
        """Return what of a file's contents a power cut now would certainly leave (as of its last sync)."""
        return self._file(path).durable

    def write(self, path: str, data: bytes) -> None:
        """Replace a file's contents durably (tests use it to plant damage)."""
        node = self._lookup(path)
        if node is None:
            parent, name = self._parent(path)
            node = _File(mode=self.file_mode, uid=self.uid)
            parent.entries[name] = node
            parent.durable[name] = node
        assert isinstance(node, _File)
        node.data = bytearray(data)
        node.durable = bytes(data)
        node.pending.clear()

    def remove(self, path: str) -> None:
        """Remove a file durably (tests)."""
        parent, name = self._parent(path)
        del parent.entries[name]
        parent.durable.pop(name, None)

    def files(self, path: str = "/") -> dict[str, bytes]:
        """Return ``{path: contents}`` of every file under ``path``."""
        out: dict[str, bytes] = {}
        base = self._lookup(path)
        stack: list[tuple[str, _File | _Dir | None]] = [(self._norm(path), base)]
        while stack:
            p, n = stack.pop()
            if isinstance(n, _Dir):
                stack.extend((posixpath.join(p, k), v) for k, v in n.entries.items())
            elif isinstance(n, _File):
                out[p] = bytes(n.data)
        return out

    def open_fds(self) -> int:
        """Return how many descriptors are open (leak checks)."""
        return len(self._fds)

    # -- snapshots and crashes -----------------------------------------------------------------

    def snapshot(self) -> SimFS:
        """Return a copy of the whole state (no descriptors, locks, faults or hooks)."""
        memo: dict[int, Any] = {}

        def cp(n: _File | _Dir) -> _File | _Dir:
            got = memo.get(id(n))
            if got is not None:
                return got  # type: ignore[no-any-return]
            if isinstance(n, _File):
                f = _File.__new__(_File)
                f.data = bytearray(n.data)
                f.durable = n.durable
                f.pending = list(n.pending)
                f.mode = n.mode
                f.uid = n.uid
                memo[id(n)] = f
                return f
            d = _Dir(n.mode, n.uid)
            memo[id(n)] = d
            d.entries = {k: cp(v) for k, v in n.entries.items()}
            d.durable = {k: cp(v) for k, v in n.durable.items()}
            return d

        new = SimFS.__new__(SimFS)
        new.dir_model = self.dir_model
        new.capacity = self.capacity
        new.free = self.free
        new.file_mode = self.file_mode
        new.dir_mode = self.dir_mode
        new.uid = self.uid
        new.root = cp(self.root)  # type: ignore[assignment]

        def cpo(x: Any) -> Any:
            return cp(x) if isinstance(x, (_File, _Dir)) else x

        new.ns_pending = [
            (tuple(cp(d) for d in dirs), tuple(cpo(x) for x in op))  # type: ignore[misc]
            for dirs, op in self.ns_pending
        ]
        # Files still open (maybe unlinked) keep their pending data; only reachable ones matter.
        new._fds = {}
        new._next_fd = 3
        new._locks = {}
        new._faults = []
        new.trace = []
        new.on_op = None
        new.stats = Stats()
        return new

    def crash(self, seed: int, mode: str = "random") -> SimFS:
        """Return a new SimFS holding one possible state after a power cut now."""
        if mode not in CRASH_MODES:
            raise ValueError(mode)
        rng = random.Random(f"{seed}/{mode}")
        # 1. The namespace: which pending changes reached the disk.
        pending = self.ns_pending
        if mode == "drop" or not pending:
            chosen: list[tuple[Any, ...]] = []
        elif mode == "keep":
            chosen = [op for _, op in pending]
        elif mode == "torn_prefix" or self.dir_model == "ext4" or rng.random() < 0.5:
            chosen = [op for _, op in pending[: rng.randint(0, len(pending))]]
        else:
            chosen = [op for _, op in pending if rng.random() < 0.5]
        durable_maps: dict[int, dict[str, Any]] = {}

        def durable_of(d: _Dir) -> dict[str, Any]:
            m = durable_maps.get(id(d))
            if m is None:
                m = durable_maps[id(d)] = dict(d.durable)
            return m

        for op in chosen:
            self._apply_ns(op, durable_of)
        # 2. Rebuild the reachable tree with each file's post-crash contents.
        new = SimFS(dir_model=self.dir_model, capacity=self.capacity, free=self.free)
        new.file_mode = self.file_mode
        new.dir_mode = self.dir_mode
        new.uid = self.uid
        new.root = _Dir()
        built: dict[int, _File | _Dir] = {}

        def build(n: _File | _Dir) -> _File | _Dir:
            got = built.get(id(n))
            if got is not None:
                return got
            if isinstance(n, _File):
                out: _File | _Dir = _File(self._crash_file(n, rng, mode), n.mode, n.uid)
                built[id(n)] = out
                return out
            d = _Dir(n.mode, n.uid)
            built[id(n)] = d
            m = durable_maps.get(id(n), n.durable)
            for k, v in m.items():
                d.entries[k] = build(v)
            d.durable = dict(d.entries)
            return d

        new.root = build(self.root)  # type: ignore[assignment]
        new.ns_pending = []
        return new

    @staticmethod
    def _crash_file(n: _File, rng: random.Random, mode: str) -> bytes:
        ops = n.pending
        if not ops or mode == "drop":
            return n.durable
        if mode == "keep":
            return bytes(n.data)
        fmode = rng.choice(_FILE_MODES) if mode == "random" else mode
        if fmode == "drop":
            return n.durable
        if fmode == "keep":
            return bytes(n.data)
        if fmode == "torn_prefix":
            k = rng.randint(0, len(ops))
            buf = bytearray(n.durable)
            for p in ops[:k]:
                _apply(buf, p)
            if k < len(ops) and ops[k][0] == "w" and len(ops[k][2]) > 1:
                _, off, data = ops[k]
                _apply_write(buf, off, data[: rng.randint(1, len(data) - 1)])
            return bytes(buf)
        if fmode in ("prefix", "extend"):
            applied = ops[: rng.randint(0, len(ops))]
        else:
            applied = [p for p in ops if rng.random() < 0.5]
        buf = bytearray(n.durable)
        for p in applied:
            if fmode == "torn" and p[0] == "w" and rng.random() < 0.7:
                _tear(buf, p[1], p[2], rng)
            else:
                _apply(buf, p)
        if fmode == "extend" and len(n.data) > len(buf):
            fill = rng.choice(("zeros", "garbage"))
            extra = len(n.data) - len(buf)
            buf.extend(b"\0" * extra if fill == "zeros" else rng.randbytes(extra))
        return bytes(buf)


class ConcurrentSimFS(SimFS):
    """A :class:`SimFS` that several threads may call at once (see the module docstring).

    Args:
        sync_delay: Seconds each fsync/fdatasync sleeps, outside ``mutex``, before it takes effect.
        dir_model, capacity, free: As for :class:`SimFS`.

    :meth:`snapshot` and :meth:`crash` return plain :class:`SimFS` objects.
    """

    def __init__(
        self, dir_model: str = "posix", capacity: int | None = None, free: int | None = None, sync_delay: float = 0.0
    ) -> None:
        self.mutex = threading.RLock()
        self.sync_delay = sync_delay
        super().__init__(dir_model=dir_model, capacity=capacity, free=free)

    def _sync(self, op: str, fd: int) -> None:
        if self.sync_delay > 0:
            time.sleep(self.sync_delay)  # the device at work: other threads run, nothing is durable yet
        with self.mutex:
            super()._sync(op, fd)


def _serialised(name: str) -> Callable[..., Any]:
    plain = getattr(SimFS, name)

    @functools.wraps(plain)
    def call(self: ConcurrentSimFS, *args: Any, **kwargs: Any) -> Any:
        with self.mutex:
            return plain(self, *args, **kwargs)

    return call


# Every public call but fsync/fdatasync (whose _sync takes the lock after the delay).
for _name in (
    "inject",
    "clear_faults",
    "count",
    "makedirs",
    "listdir",
    "exists",
    "isdir",
    "create",
    "open_read",
    "open_rw",
    "dup",
    "replace",
    "unlink",
    "fsync_dir",
    "pwrite_all",
    "pread",
    "size",
    "truncate",
    "close",
    "lock",
    "unlock",
    "free_space",
    "stat_token",
    "read",
    "durable_bytes",
    "write",
    "remove",
    "files",
    "open_fds",
    "snapshot",
    "crash",
):
    setattr(ConcurrentSimFS, _name, _serialised(_name))


def _tear(buf: bytearray, off: int, data: bytes, rng: random.Random) -> None:
    """Persist one write sector by sector: each sector new, old, zeros or garbage."""
    g = rng.choice((512, 4096))
    end = off + len(data)
    if end > len(buf):
        # The size change may persist (extended with zeros) or not (old EOF kept).
        old_len = len(buf)
        buf.extend(b"\0" * (end - len(buf)))
    else:
        old_len = len(buf)
    pos = off
    while pos < end:
        stop = min(end, (pos // g + 1) * g)
        choice = rng.choice(("new", "new", "old", "zeros", "garbage"))
        if choice == "new":
            buf[pos:stop] = data[pos - off : stop - off]
        elif choice == "zeros":
            buf[pos:stop] = b"\0" * (stop - pos)
        elif choice == "garbage":
            buf[pos:stop] = rng.randbytes(stop - pos)
        pos = stop
    if end > old_len and rng.random() < 0.3:
        # The size did not reach the disk: cut back to the last sector written as new.
        cut = rng.randint(old_len, end)
        del buf[cut:]


class _Short(Exception):
    def __init__(self, err: int, n: int) -> None:
        super().__init__(err, n)
        self.err = err
        self.n = n
