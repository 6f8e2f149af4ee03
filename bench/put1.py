"""One-event transactions: filechannel against SQLite WAL synchronous=FULL (issue 26).

    .venv/bin/python -m bench.put1 [--repeats 5] [--n 3000] [--seconds 3] [--size 100]
                                   [--data-dir /var/tmp] [--cpu]

Per repeat (the two systems interleaved, in reversed order every other repeat,
each in a fresh directory), one JSON line per system and phase:

- ``put1``: ``--n`` events, each in its own durable transaction, one thread
  (``events_per_s``, and the median commit latency ``p50_us``);
- ``put1 16 threads``: 16 threads putting one event per transaction for
  ``--seconds`` (group commit on our side; SQLite serialises its writers);
- ``--cpu``: the same single-thread loop on tmpfs (``/dev/shm``), timed by the
  thread's CPU clock (``cpu_us`` per transaction): what is left when an
  fdatasync is nearly free.

Then the ratios filechannel / SQLite per repeat and their medians.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from typing import Any

from .systems import FileChannelCommit, SqliteWalFull, System

THREADS = 16
SYSTEMS: tuple[type[System], ...] = (FileChannelCommit, SqliteWalFull)


def _fresh(root: str | None) -> str:
    return tempfile.mkdtemp(prefix="fc-put1-", dir=root)


def single(cls: type[System], root: str | None, n: int, size: int) -> dict[str, Any]:
    """``n`` one-event transactions from one thread: events/s and the median commit latency."""
    d = _fresh(root)
    s = cls(d)
    s.open()
    body = os.urandom(size)
    lat: list[float] = []
    clock = time.perf_counter
    try:
        t0 = clock()
        for _ in range(n):
            t = clock()
            s.put_batch([body])
            lat.append(clock() - t)
        wall = clock() - t0
    finally:
        s.close()
        shutil.rmtree(d, ignore_errors=True)
    return {"events_per_s": n / wall, "p50_us": statistics.median(lat) * 1e6}


def cpu(cls: type[System], n: int, size: int) -> dict[str, Any]:
    """CPU per one-event transaction on tmpfs (the thread's CPU clock)."""
    d = _fresh("/dev/shm" if os.path.isdir("/dev/shm") else None)
    s = cls(d)
    s.open()
    body = os.urandom(size)
    try:
        for _ in range(min(n, 1000)):  # warm up
            s.put_batch([body])
        t0 = time.thread_time_ns()
        for _ in range(n):
            s.put_batch([body])
        used = time.thread_time_ns() - t0
    finally:
        s.close()
        shutil.rmtree(d, ignore_errors=True)
    return {"cpu_us": used / n / 1000}


def threaded(cls: type[System], root: str | None, seconds: float, size: int) -> dict[str, Any]:
    """16 threads, one event per transaction, for ``seconds``."""
    d = _fresh(root)
    s = cls(d)
    s.open()
    body = os.urandom(size)
    stop = threading.Event()
    counts = [0] * THREADS
    errors: list[BaseException] = []

    def work(i: int) -> None:
        c = 0
        try:
            while not stop.is_set():
                s.put_batch([body])
                c += 1
        except BaseException as exc:  # reported below
            errors.append(exc)
        counts[i] = c

    ths = [threading.Thread(target=work, args=(i,)) for i in range(THREADS)]
    t0 = time.perf_counter()
    try:
        for t in ths:
            t.start()
        time.sleep(seconds)
        stop.set()
        for t in ths:
            t.join()
        wall = time.perf_counter() - t0
    finally:
        s.close()
        shutil.rmtree(d, ignore_errors=True)
    if errors:
        raise errors[0]
    return {"events_per_s": sum(counts) / wall}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.put1", description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--n", type=int, default=3000, help="one-event transactions per single-thread run")
    ap.add_argument("--seconds", type=float, default=3.0, help="length of each 16-thread run")
    ap.add_argument("--size", type=int, default=100)
    ap.add_argument("--data-dir", default="/var/tmp", help="a directory on the disk under test")
    ap.add_argument("--cpu", action="store_true", help="also the CPU per transaction on tmpfs")
    ap.add_argument("--no-threads", action="store_true")
    a = ap.parse_args(argv)
    ratios: dict[str, list[float]] = {}
    for rep in range(a.repeats):
        order = SYSTEMS if rep % 2 == 0 else tuple(reversed(SYSTEMS))
        got: dict[str, dict[str, dict[str, Any]]] = {}
        for cls in order:
            res = got.setdefault(cls.name, {})
            res["put1"] = single(cls, a.data_dir, a.n, a.size)
            if not a.no_threads:
                res[f"put1 {THREADS} threads"] = threaded(cls, a.data_dir, a.seconds, a.size)
            if a.cpu:
                res["cpu"] = cpu(cls, a.n * 5, a.size)
            for phase, r in res.items():
                print(json.dumps({"repeat": rep, "system": cls.name, "phase": phase, "size": a.size, **r}), flush=True)
        ours, theirs = got[FileChannelCommit.name], got[SqliteWalFull.name]
        for phase in ours:
            if phase == "cpu":
                ratios.setdefault("cpu (sqlite/ours)", []).append(theirs[phase]["cpu_us"] / ours[phase]["cpu_us"])
                continue
            ratios.setdefault(phase, []).append(ours[phase]["events_per_s"] / theirs[phase]["events_per_s"])
            if "p50_us" in ours[phase]:
                ratios.setdefault(f"{phase} p50 (sqlite/ours)", []).append(
                    theirs[phase]["p50_us"] / ours[phase]["p50_us"]
                )
    for phase, rs in ratios.items():
        print(
            json.dumps(
                {"ratio": phase, "median": round(statistics.median(rs), 2), "per_repeat": [round(r, 2) for r in rs]}
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
