"""Depth: what a deep backlog costs in memory, checkpoints, restart and takes (issue 34).

    .venv/bin/python -m bench.depth [--sizes 200000,10000000,100000000] [--quick] [--data-dir DIR]

For each queue depth N (100-byte events, put 10 000 per transaction,
``fsync="interval"``, no background checkpoints) a fresh process builds the
channel and prints one JSON line with the row of the issue's table:

- ``rss_growth_mb``: resident memory after the puts minus before the open;
- ``checkpoint_bytes`` and ``checkpoint_seconds``: one explicit checkpoint,
  written while another thread commits one-event put transactions;
- ``put1_stall_ms``: the longest of those commits that overlapped the checkpoint;
- ``reopen_seconds`` and ``rss_after_reopen_mb`` (growth over the fresh
  process's baseline, after close and reopen);
- ``take_rate``: events per second taken from the head of the reopened
  channel (``take_batch(1000)`` per transaction, ``TAKE_EVENTS`` of them), and
  ``take_cpu_rate``, the same over the taking thread's CPU time (on a shared
  machine the wall rate swings with others' load; the gap to the CPU rate is
  waiting, for the disk or for a core);
- the reader (``ChannelReader``, a view, on the closed channel before the
  reopen): ``reader_open_seconds`` to open it and answer ``available()``,
  ``reader_rss_mb`` its memory growth, ``reader_read_rate`` events per second
  read from the head (``read`` of 1000 at a time, ``READ_EVENTS`` of them)
  and ``reader_lag_bytes_seconds`` for ``record_bytes`` of the whole queue
  (runs the reader has not read yet count their extent in the data files: no walk).

The first size is the shallow reference: each later row also carries
``take_ratio``, its take rate over the first size's (measured in this run).
``--quick`` (CI) runs 200 000 and 1 M. Data files need about 160 B per event.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

BODY = b"x" * 100
BATCH = 10_000
TAKE_EVENTS = 200_000
TAKE_BATCH = 1000
READ_EVENTS = 200_000
READ_BATCH = 1000
OPTIONS: dict[str, Any] = {
    "fsync": "interval",
    "checkpoint_interval": 0,
    "minimum_required_space": 0,
    "capacity": 1 << 40,
}


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0  # pragma: no cover - not Linux


def _trim() -> None:
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def _put1_loop(ch: Any, stop: threading.Event, out: list[tuple[float, float]]) -> None:
    clock = time.perf_counter
    while not stop.is_set():
        t0 = clock()
        with ch.transaction() as tx:
            tx.put(BODY)
        out.append((t0, clock()))


def reader_row(d: str) -> dict[str, Any]:
    """Open a ``ChannelReader`` on the channel in ``d`` and measure its memory, open, read and byte count."""
    from filechannel import ChannelReader

    _trim()
    rss0 = _rss()
    t0 = time.perf_counter()
    rd = ChannelReader(d)
    start, end = rd.available()
    opened = time.perf_counter() - t0
    _trim()
    grown = _rss() - rss0
    m = min(READ_EVENTS, end - start)
    t0 = time.perf_counter()
    got = 0
    pos = start
    while got < m:
        events = rd.read(pos, min(end, pos + min(READ_BATCH, m - got)))
        got += len(events)
        last = events[-1].position
        assert last is not None
        pos = last + 1
    read_seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    lag_bytes = rd.record_bytes([start], end)[0]
    lag_seconds = time.perf_counter() - t0
    rd.close()
    return {
        "reader_open_seconds": round(opened, 4),
        "reader_rss_mb": round(grown / 1e6, 1),
        "reader_read_rate": round(got / read_seconds),
        "reader_lag_bytes": lag_bytes,
        "reader_lag_bytes_seconds": round(lag_seconds, 4),
    }


def one(d: str, n: int) -> dict[str, Any]:
    """Build a channel of ``n`` queued events in ``d`` and measure its row (in this process)."""
    import filechannel

    _trim()
    rss0 = _rss()
    ch = filechannel.open(d, **OPTIONS)
    t0 = time.perf_counter()
    for i in range(0, n, BATCH):
        with ch.transaction() as tx:
            tx.put_many([BODY] * min(BATCH, n - i))
    put_seconds = time.perf_counter() - t0
    ch.sync()
    _trim()
    rss_grown = _rss() - rss0
    # One checkpoint while a thread commits one-event transactions.
    lat: list[tuple[float, float]] = []
    stop = threading.Event()
    th = threading.Thread(target=_put1_loop, args=(ch, stop, lat))
    th.start()
    time.sleep(0.3)
    c0 = time.perf_counter()
    info = ch.checkpoint()
    c1 = time.perf_counter()
    time.sleep(0.1)
    stop.set()
    th.join()
    during = [b - a for a, b in lat if a < c1 and b > c0]
    ch.close()
    reader = reader_row(d)
    _trim()
    t0 = time.perf_counter()
    ch = filechannel.open(d, **OPTIONS)
    reopen = time.perf_counter() - t0
    _trim()
    rss_reopen = _rss() - rss0
    queued = ch.size
    m = min(TAKE_EVENTS, queued)
    t0, cpu0 = time.perf_counter(), time.thread_time()
    got = 0
    while got < m:
        with ch.transaction() as tx:
            got += len(tx.take_batch(min(TAKE_BATCH, m - got)))
    take_seconds, take_cpu = time.perf_counter() - t0, time.thread_time() - cpu0
    ch.close()
    return {
        "queued": n,
        "put_rate": round(n / put_seconds),
        "rss_growth_mb": round(rss_grown / 1e6, 1),
        "checkpoint_bytes": info["bytes"],
        "checkpoint_seconds": round(c1 - c0, 4),
        "put1_stall_ms": round(max(during, default=0.0) * 1e3, 2),
        "put1_during_checkpoint": len(during),
        "reopen_seconds": round(reopen, 4),
        "rss_after_reopen_mb": round(rss_reopen / 1e6, 1),
        "take_rate": round(got / take_seconds),
        "take_cpu_rate": round(got / take_cpu),
        **reader,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="200000,10000000,100000000")
    ap.add_argument("--quick", action="store_true", help="200 000 and 1 M (CI)")
    ap.add_argument("--data-dir", default=os.environ.get("BENCH_DIR"), help="where the channels are built")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # the child: one size in DIR
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one is not None:
        print(json.dumps(one(args.dir, args.one)), flush=True)
        return 0
    sizes = [200_000, 1_000_000] if args.quick else [int(s) for s in args.sizes.split(",")]
    machine = {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()}
    print(json.dumps({"bench": "depth", "machine": machine}), flush=True)
    shallow: dict[str, Any] | None = None
    for n in sizes:
        root = tempfile.mkdtemp(prefix="fc-depth-", dir=args.data_dir)
        try:
            d = os.path.join(root, "ch")
            cmd = [sys.executable, "-m", "bench.depth", "--one", str(n), "--dir", d]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            row = json.loads(out.strip().splitlines()[-1])
        finally:
            shutil.rmtree(root, ignore_errors=True)
        if shallow is None:
            shallow = row
        row["take_ratio"] = round(row["take_rate"] / shallow["take_rate"], 3)
        row["reader_read_ratio"] = round(row["reader_read_rate"] / shallow["reader_read_rate"], 3)
        print(json.dumps({"bench": "depth", **row}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
