"""Physical limits of durable appends on this machine, measured with the simplest code.

These are what any log (in any language) pays on this disk, and what a plain
Python loop pays to frame records. Each function returns a dict of metrics;
the main one is ``events_per_s`` (or ``MBps`` for bandwidth).
"""

from __future__ import annotations

import os
import struct
import threading
import time
from typing import Any

from google_crc32c import extend as crc_extend

_HEAD = struct.Struct("<BBHIQQ")  # the same 24-byte head + 8-byte crc frame as filechannel
_CRC = struct.Struct("<II")


def _open(path: str) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_TRUNC, 0o644)


def frame(payload: bytes, seq: int) -> bytes:
    head = _HEAD.pack(1, 0, 0, len(payload), seq, seq)
    return b"".join(
        (head, _CRC.pack(crc_extend(crc_extend(0, head), payload), 0), payload, b"\0" * (-len(payload) & 7))
    )


def append_fdatasync(d: str, n: int, size: int, deadline: float) -> dict[str, Any]:
    """One framed record per write, one fdatasync per record (single-event commits, no batching)."""
    rec = frame(os.urandom(size), 1)
    fd = _open(os.path.join(d, "append.log"))
    lat = []
    t0 = time.perf_counter()
    stop = t0 + deadline
    done = 0
    try:
        for _ in range(n):
            a = time.perf_counter()
            os.write(fd, rec)
            os.fdatasync(fd)
            b = time.perf_counter()
            lat.append(b - a)
            done += 1
            if b > stop:
                break
    finally:
        os.close(fd)
    wall = time.perf_counter() - t0
    lat.sort()
    return {"events": done, "events_per_s": done / wall, "p50_us": lat[len(lat) // 2] * 1e6}


def append_batch_fdatasync(
    d: str, n: int, size: int, batch: int, deadline: float, prealloc: bool = False
) -> dict[str, Any]:
    """Raw sequential append: ``batch`` pre-framed records per write, one fdatasync per batch.

    With ``prealloc`` the file is zero-filled (and synced) first, so an fdatasync
    has no file size change to journal (how SQLite's reused WAL behaves).
    """
    payload = os.urandom(size)
    data = b"".join(frame(payload, i) for i in range(batch))
    path = os.path.join(d, "batch.log")
    off = 0
    if prealloc:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        total = min(len(data) * (n // batch + 1), 256 << 20)
        zero = bytes(1 << 20)
        for i in range(0, total, len(zero)):
            os.pwrite(fd, zero, i)
        os.fsync(fd)
    else:
        fd = _open(path)
    t0 = time.perf_counter()
    stop = t0 + deadline
    done = 0
    try:
        while done < n:
            if prealloc:
                os.pwrite(fd, data, off)
                off += len(data)
            else:
                os.write(fd, data)
            os.fdatasync(fd)
            done += batch
            if time.perf_counter() > stop:
                break
    finally:
        os.close(fd)
    wall = time.perf_counter() - t0
    return {"events": done, "events_per_s": done / wall, "MBps": done * size / wall / 1e6}


def python_framing(d: str, n: int, size: int, batch: int) -> dict[str, Any]:
    """The floor of a pure-Python log: frame each record (struct + crc32c), join per batch, write; no fsync."""
    payload = os.urandom(size)
    head = _HEAD.pack
    crc = _CRC.pack
    pad = b"\0" * (-size & 7)
    fd = _open(os.path.join(d, "frame.log"))
    t0 = time.perf_counter()
    seq = 0
    try:
        while seq < n:
            parts = []
            for _ in range(batch):
                seq += 1
                h = head(1, 0, 0, size, seq, seq)
                parts += (h, crc(crc_extend(crc_extend(0, h), payload), 0), payload, pad)
            os.write(fd, b"".join(parts))
    finally:
        os.close(fd)
    wall = time.perf_counter() - t0
    return {"events": seq, "events_per_s": seq / wall, "MBps": seq * size / wall / 1e6}


def seq_bandwidth(d: str, total: int, deadline: float) -> dict[str, Any]:
    """Sequential 64 KiB writes with an fdatasync after every 1 MiB."""
    block = os.urandom(64 << 10)
    fd = _open(os.path.join(d, "bw.log"))
    t0 = time.perf_counter()
    stop = t0 + deadline
    written = 0
    try:
        while written < total:
            for _ in range(16):
                os.write(fd, block)
            written += 16 * len(block)
            os.fdatasync(fd)
            if time.perf_counter() > stop:
                break
    finally:
        os.close(fd)
    wall = time.perf_counter() - t0
    return {"bytes": written, "MBps": written / wall / 1e6}


class _GroupCommit:
    """Leader/follower group commit: the leader writes everything pending with one write and one fdatasync."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.cond = threading.Condition()
        self.buf: list[bytes] = []
        self.appended = 0
        self.durable = 0
        self.leading = False
        self.syncs = 0

    def append(self, rec: bytes) -> None:
        cond = self.cond
        with cond:
            self.buf.append(rec)
            self.appended += 1
            seq = self.appended
            while self.durable < seq:
                if self.leading:
                    cond.wait()
                    continue
                self.leading = True
                data, self.buf = self.buf, []
                target = self.appended
                cond.release()
                try:
                    os.write(self.fd, b"".join(data))
                    os.fdatasync(self.fd)
                finally:
                    cond.acquire()
                self.durable = target
                self.leading = False
                self.syncs += 1
                cond.notify_all()


def group_commit(d: str, threads: int, size: int, seconds: float) -> dict[str, Any]:
    """``threads`` threads each appending one durable framed record at a time, for ``seconds``."""
    fd = _open(os.path.join(d, "gc.log"))
    log = _GroupCommit(fd)
    rec = frame(os.urandom(size), 1)
    stop = threading.Event()
    counts = [0] * threads

    def work(i: int) -> None:
        c = 0
        while not stop.is_set():
            log.append(rec)
            c += 1
        counts[i] = c

    ths = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    t0 = time.perf_counter()
    for t in ths:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in ths:
        t.join()
    wall = time.perf_counter() - t0
    os.close(fd)
    ev = sum(counts)
    return {"events": ev, "events_per_s": ev / wall, "mean_batch": ev / max(log.syncs, 1)}
