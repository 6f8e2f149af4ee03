"""The write-ahead log (issue 11): records/s of WriteAheadLog against raw append + fdatasync.

    .venv/bin/python -m bench.wal [--seconds S] [--repeats R] [--quick]

Cases, each for 100 B and 4 KiB records, all with ``fsync="commit"`` (every
record durable before ``write`` returns):

* ``write x1``: one thread calling ``WriteAheadLog.write`` in a loop;
* ``write x16``: 16 threads calling it at once (they share fsyncs);
* ``write_many x100``: one thread writing batches of 100 records;
* baselines in the same run: a file opened ``O_APPEND`` and written with
  ``os.write`` + ``os.fdatasync`` per record (``raw per record``), and per
  batch of 100 records joined into one write (``raw per batch x100``). These
  have no framing, no checksum, no recovery: the cost of the disk alone.

Each case runs for ``--seconds`` in a fresh directory; the cases of one
record size run one after the other, in reversed order every other repeat, so
a noisy minute on a shared disk hits all of them alike. Every ratio is taken
within one repeat, then summarised as median and min-max over the repeats.
Prints one JSON line per result on stdout and a table on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import filechannel

from .run import machine_info, spread

SIZES = (100, 4096)
THREADS = 16
BATCH = 100
Case = Callable[[str, int, float], dict[str, Any]]


def _wal_write(d: str, size: int, seconds: float) -> dict[str, Any]:
    data = os.urandom(size)
    with filechannel.WriteAheadLog(d) as w:
        w.write(data)  # creates the first file
        n = 0
        t0 = time.perf_counter()
        stop = t0 + seconds
        while time.perf_counter() < stop:
            w.write(data)
            n += 1
        wall = time.perf_counter() - t0
        fsyncs = w.stats()["fsyncs"]
    return {"records": n, "records_per_s": n / wall, "fsyncs": fsyncs}


def _wal_threads(d: str, size: int, seconds: float) -> dict[str, Any]:
    data = os.urandom(size)
    counts = [0] * THREADS
    with filechannel.WriteAheadLog(d) as w:
        w.write(data)
        start = threading.Barrier(THREADS + 1)
        stop_at = [0.0]

        def work(i: int) -> None:
            start.wait()
            n = 0
            while time.perf_counter() < stop_at[0]:
                w.write(data)
                n += 1
            counts[i] = n

        threads = [threading.Thread(target=work, args=(i,)) for i in range(THREADS)]
        for t in threads:
            t.start()
        t0 = time.perf_counter()
        stop_at[0] = t0 + seconds
        start.wait()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        fsyncs = w.stats()["fsyncs"]
    n = sum(counts)
    return {"records": n, "records_per_s": n / wall, "fsyncs": fsyncs}


def _wal_many(d: str, size: int, seconds: float) -> dict[str, Any]:
    batch = [os.urandom(size) for _ in range(BATCH)]
    with filechannel.WriteAheadLog(d) as w:
        w.write(batch[0])
        n = 0
        t0 = time.perf_counter()
        stop = t0 + seconds
        while time.perf_counter() < stop:
            w.write_many(batch)
            n += BATCH
        wall = time.perf_counter() - t0
        fsyncs = w.stats()["fsyncs"]
    return {"records": n, "records_per_s": n / wall, "fsyncs": fsyncs}


def _raw(per: int) -> Case:
    def run(d: str, size: int, seconds: float) -> dict[str, Any]:
        os.makedirs(d, exist_ok=True)
        blob = os.urandom(size) * per
        fd = os.open(os.path.join(d, "raw.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            n = 0
            t0 = time.perf_counter()
            stop = t0 + seconds
            while time.perf_counter() < stop:
                os.write(fd, blob)
                os.fdatasync(fd)
                n += per
            wall = time.perf_counter() - t0
        finally:
            os.close(fd)
        return {"records": n, "records_per_s": n / wall, "fsyncs": n // per}

    return run


CASES: dict[str, Case] = {
    "wal write x1": _wal_write,
    f"wal write x{THREADS} threads": _wal_threads,
    f"wal write_many x{BATCH}": _wal_many,
    "raw per record": _raw(1),
    f"raw per batch x{BATCH}": _raw(BATCH),
}
RATIOS = [
    ("wal write x1 / raw per record", "wal write x1", "raw per record"),
    (f"wal write x{THREADS} threads / raw per record", f"wal write x{THREADS} threads", "raw per record"),
    (f"wal write_many x{BATCH} / raw per batch x{BATCH}", f"wal write_many x{BATCH}", f"raw per batch x{BATCH}"),
]


def main(argv: list[str] | None = None) -> int:
    """Run the cases and print JSON lines (stdout) and a table (stderr)."""
    ap = argparse.ArgumentParser(prog="python -m bench.wal", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, help="seconds per case (default 3, quick 0.3)")
    ap.add_argument("--repeats", type=int, help="repeats per case (default 5, quick 1)")
    ap.add_argument("--quick", action="store_true", help="a few-second smoke run")
    ap.add_argument("--data-dir", default=None, help="where logs are created (default: the temp dir)")
    args = ap.parse_args(argv)
    seconds = args.seconds or (0.3 if args.quick else 3.0)
    repeats = args.repeats or (1 if args.quick else 5)
    machine = machine_info(args.data_dir or tempfile.gettempdir())
    root = tempfile.mkdtemp(prefix="fc-wal-bench-", dir=args.data_dir)
    runs: dict[tuple[int, str], list[dict[str, Any]]] = {}
    ratios: dict[tuple[int, str], list[dict[str, Any]]] = {}
    load_before = os.getloadavg()
    k = 0
    try:
        for size in SIZES:
            for rep in range(repeats):
                names = list(CASES)
                if rep % 2:
                    names.reverse()
                got: dict[str, dict[str, Any]] = {}
                for name in names:
                    k += 1
                    d = os.path.join(root, f"c{k}")
                    try:
                        got[name] = CASES[name](d, size, seconds)
                    finally:
                        shutil.rmtree(d, ignore_errors=True)
                    runs.setdefault((size, name), []).append(got[name])
                for label, a, b in RATIOS:
                    ratios.setdefault((size, label), []).append(
                        {"ratio": got[a]["records_per_s"] / got[b]["records_per_s"]}
                    )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out = sys.stdout
    for (size, name), rs in runs.items():
        rec = {"machine": machine, "workload": "write", "system": name, "event_size": size, "fsync": "commit"}
        rec.update(spread(rs, "records_per_s"), unit="records/s")
        out.write(json.dumps(rec) + "\n")
    for (size, label), rs in ratios.items():
        rec = {"machine": machine, "workload": "ratio", "system": label, "event_size": size, "fsync": "commit"}
        rec.update(spread(rs, "ratio"), unit="x")
        out.write(json.dumps(rec) + "\n")
    run = {
        "type": "run",
        "command": "python -m bench.wal " + " ".join(argv if argv is not None else sys.argv[1:]),
        "seconds_per_case": seconds,
        "repeats": repeats,
        "load_before": load_before,
        "load_after": os.getloadavg(),
    }
    out.write(json.dumps(run) + "\n")
    err = sys.stderr
    for size in SIZES:
        for name in CASES:
            s = spread(runs[(size, name)], "records_per_s")
            err.write(f"{size:>5} B  {name:<32} {s['median']:>10,.0f} records/s  ({s['min']:,.0f}-{s['max']:,.0f})\n")
        for label, _a, _b in RATIOS:
            s = spread(ratios[(size, label)], "ratio")
            err.write(f"{size:>5} B  {label:<48} {s['median']:>6.2f}x  ({s['min']:.2f}-{s['max']:.2f})\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
