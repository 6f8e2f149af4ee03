"""The systems the bench compares, behind one small interface.

Every system is a class with ``open()``, ``close()``, ``put_batch(events)``
(one durable transaction holding all of ``events``), ``take_batch(n)`` (open a
take transaction, return up to ``n`` bodies in FIFO order) and ``ack()``
(commit that take transaction). ``threadsafe`` systems can be driven from many
threads at once, each thread calling ``put_batch`` on the same object.

The physical limits (raw appends with fdatasync, a group-commit loop, a plain
Python framing loop) are not queues; they live in ``phys.py``.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from typing import Any, ClassVar

import filechannel
from filechannel import format as fmt


class System:
    name = "?"
    fsync = "?"  # what "durable" means for this system, as stated in every JSON line
    threadsafe = False

    def __init__(self, path: str) -> None:
        self.path = path

    @classmethod
    def available(cls) -> bool:
        return True

    def open(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def put_batch(self, events: list[bytes]) -> None:
        raise NotImplementedError

    def take_batch(self, n: int) -> list[bytes]:
        raise NotImplementedError

    def ack(self) -> None:
        raise NotImplementedError


class FileChannelSystem(System):
    threadsafe = True
    mode = "commit"
    options: ClassVar[dict[str, Any]] = {}

    def open(self, **options: Any) -> None:
        opts: dict[str, Any] = {"fsync": self.mode, "capacity": 4_000_000, "transaction_capacity": 10_000}
        opts.update(self.options)
        opts.update(options)
        self.ch = filechannel.open(self.path, **opts)
        self.tx: Any = None

    def close(self) -> None:
        self.ch.close()

    def put_batch(self, events: list[bytes]) -> None:
        # The batch API, as SQLite's adapter uses executemany: one check and one
        # capacity reservation per batch (Transaction.put per event is ~25 % slower).
        tx = self.ch.transaction()
        if len(events) == 1:
            tx.put(events[0])
        else:
            tx.put_many(events)
        tx.commit()

    def take_batch(self, n: int) -> list[bytes]:
        self.tx = self.ch.transaction()
        return [ev.body for ev in self.tx.take_batch(n)]

    def ack(self) -> None:
        self.tx.commit()


class FileChannelCommit(FileChannelSystem):
    name = "filechannel-commit"
    fsync = "commit"
    mode = "commit"


class FileChannelPure(FileChannelCommit):
    """``filechannel-commit`` on the pure-Python path (the C accelerator switched off while open)."""

    name = "filechannel-commit pure-python"

    @classmethod
    def available(cls) -> bool:
        return fmt.speedups is not None  # without the accelerator, filechannel-commit is this already

    def open(self, **options: Any) -> None:
        self._saved = fmt.speedups
        fmt.speedups = None
        try:
            super().open(**options)
        except BaseException:
            fmt.speedups = self._saved
            raise

    def close(self) -> None:
        try:
            super().close()
        finally:
            fmt.speedups = self._saved


class FileChannelFullReplay(FileChannelCommit):
    """Reopens by replaying every data file, ignoring checkpoints (for restart times)."""

    name = "filechannel-commit replay=full"
    options: ClassVar[dict[str, Any]] = {"replay": "full"}


class FileChannelInterval(FileChannelSystem):
    name = "filechannel-interval"
    fsync = "interval"
    mode = "interval"


class SqliteWalFull(System):
    """Stdlib sqlite3, WAL, synchronous=FULL: INSERT per put, DELETE per take, one txn per batch."""

    name = "sqlite-wal-full"
    fsync = "FULL"
    threadsafe = True

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(os.path.join(self.path, "q.db"), isolation_level=None, check_same_thread=False)
        db.execute("PRAGMA busy_timeout=60000")
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        return db

    def open(self) -> None:
        os.makedirs(self.path, exist_ok=True)
        self.db = self._connect()
        self.db.execute("CREATE TABLE IF NOT EXISTS q (id INTEGER PRIMARY KEY, body BLOB NOT NULL)")
        assert self.db.execute("PRAGMA synchronous").fetchone()[0] == 2
        self._local = threading.local()
        self._conns = [self.db]
        self._main = threading.get_ident()

    def _db(self) -> sqlite3.Connection:
        if threading.get_ident() == self._main:
            return self.db
        db = getattr(self._local, "db", None)
        if db is None:
            db = self._local.db = self._connect()
            self._conns.append(db)
        return db

    def close(self) -> None:
        for db in self._conns:
            db.close()

    def put_batch(self, events: list[bytes]) -> None:
        db = self._db()
        db.execute("BEGIN IMMEDIATE")
        db.executemany("INSERT INTO q (body) VALUES (?)", [(e,) for e in events])
        db.execute("COMMIT")

    def take_batch(self, n: int) -> list[bytes]:
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        rows = db.execute("SELECT id, body FROM q ORDER BY id LIMIT ?", (n,)).fetchall()
        db.executemany("DELETE FROM q WHERE id = ?", [(r[0],) for r in rows])
        return [r[1] for r in rows]

    def ack(self) -> None:
        self.db.execute("COMMIT")


class _PersistQueue(System):
    @classmethod
    def available(cls) -> bool:
        try:
            import persistqueue  # noqa: F401
        except ImportError:
            return False
        return True


class PQSqliteAck(_PersistQueue):
    """persist-queue SQLiteAckQueue: every put, get and ack is its own fsynced commit (WAL, FULL)."""

    name = "pq-sqlite-ack"
    fsync = "FULL (per item)"
    threadsafe = True

    def open(self) -> None:
        import persistqueue

        self.q = persistqueue.SQLiteAckQueue(self.path, multithreading=True)
        self._ids: list[int] = []

    def close(self) -> None:
        self.q.close()

    def put_batch(self, events: list[bytes]) -> None:
        put = self.q.put
        for e in events:
            put(e)

    def take_batch(self, n: int) -> list[bytes]:
        from persistqueue import Empty

        out: list[bytes] = []
        ids: list[int] = []
        for _ in range(n):
            try:
                item = self.q.get(block=False, raw=True)
            except Empty:
                break
            ids.append(item["pqid"])
            out.append(item["data"])
        self._ids = ids
        return out

    def ack(self) -> None:
        for i in self._ids:
            self.q.ack(id=i)


def _fsync_path(p: str) -> None:
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class PQFileFsync(_PersistQueue):
    """persist-queue file Queue(autosave=False), plus an fsync of chunk, info and dir per batch.

    The library never fsyncs its info file; the bench adds the fsyncs so the
    durability matches the others (batch-durable, not batch-atomic).
    """

    name = "pq-file+fsync"
    fsync = "fsync per batch (added by the bench)"
    threadsafe = True

    def open(self) -> None:
        import persistqueue

        os.makedirs(self.path, exist_ok=True)
        self.q = persistqueue.Queue(self.path, autosave=False, tempdir=self.path)
        self._taken = 0
        self._lock = threading.Lock()

    def close(self) -> None:
        for f in (self.q.headf, self.q.tailf):
            f.close()

    def _sync(self) -> None:
        os.fsync(self.q.headf.fileno())
        _fsync_path(os.path.join(self.path, "info"))
        _fsync_path(self.path)

    def put_batch(self, events: list[bytes]) -> None:
        with self._lock:
            put = self.q.put
            for e in events:
                put(e)
            self._sync()

    def take_batch(self, n: int) -> list[bytes]:
        from persistqueue import Empty

        out: list[bytes] = []
        for _ in range(n):
            try:
                out.append(self.q.get(block=False))
            except Empty:
                break
        self._taken = len(out)
        return out

    def ack(self) -> None:
        for _ in range(self._taken):
            self.q.task_done()
        self._sync()


QUEUES: list[type[System]] = [
    FileChannelCommit,
    FileChannelPure,
    FileChannelInterval,
    SqliteWalFull,
    PQSqliteAck,
    PQFileFsync,
]
SLOW = {PQSqliteAck.name, PQFileFsync.name}  # run on fewer events, rates stay comparable
