"""Tail throughput: ``TailSource`` against ``cat FILE`` into an in-process put loop (issue 25).

    .venv/bin/python -m bench.tail [--lines 200000] [--size 100] [--batch 1000] [--repeats 3]

Writes one file of ``--lines`` lines of ``--size`` bytes, then, per repeat and
interleaved, times (a) ``cat FILE`` in a subprocess whose output this process
splits into lines and puts, ``--batch`` per transaction, into a fresh channel
(no headers; and again with the ``file`` and ``offset`` headers the tail
source puts), and (b) a ``TailSource`` draining the same file into a fresh
channel (``file`` and ``offset`` headers and its position marks in every
transaction, ``--batch`` lines each). Both channels have the same options
(fsync on). Prints one JSON line per run and a summary with the ratio of the
medians, tail / cat.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time

import filechannel
from filechannel.sources.tail import TailSource

OPTS = {"capacity": 10_000_000, "transaction_capacity": 10_000, "checkpoint_interval": 0}


def make_file(path: str, lines: int, size: int) -> None:
    with open(path, "wb") as f:
        for i in range(lines):
            f.write(b"%08d " % i + b"x" * (size - 10) + b"\n")


def run_cat(path: str, chan: str, batch: int, headers: bool = False) -> float:
    t0 = time.perf_counter()
    with filechannel.open(chan, **OPTS) as ch:
        proc = subprocess.Popen(["cat", path], stdout=subprocess.PIPE)
        assert proc.stdout is not None
        pending: list[tuple[bytes, dict[str, str] | None]] = []
        offset = 0
        for line in proc.stdout:
            pending.append((line.rstrip(b"\n"), {"file": path, "offset": str(offset)} if headers else None))
            offset += len(line)
            if len(pending) == batch:
                with ch.transaction() as tx:
                    for b, h in pending:
                        tx.put(b, h)
                pending = []
        if pending:
            with ch.transaction() as tx:
                for b, h in pending:
                    tx.put(b, h)
        proc.wait()
    return time.perf_counter() - t0


def run_cat_headers(path: str, chan: str, batch: int) -> float:
    return run_cat(path, chan, batch, headers=True)


def run_tail(path: str, chan: str, batch: int) -> float:
    t0 = time.perf_counter()
    with filechannel.open(chan, **OPTS) as ch:
        src = TailSource(ch, path, batch_size=batch)
        src.drain()
        src.stop()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.tail", description=__doc__)
    ap.add_argument("--lines", type=int, default=200_000)
    ap.add_argument("--size", type=int, default=100, help="bytes per line, newline included")
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--data-dir", default=None)
    args = ap.parse_args(argv)
    root = tempfile.mkdtemp(prefix="bench-tail-", dir=args.data_dir)
    try:
        path = os.path.join(root, "app.log")
        make_file(path, args.lines, args.size)
        res: dict[str, list[float]] = {"cat": [], "cat+headers": [], "tail": []}
        for r in range(args.repeats):
            for kind, fn in (("cat", run_cat), ("cat+headers", run_cat_headers), ("tail", run_tail)):
                chan = os.path.join(root, f"{kind}-{r}")
                secs = fn(path, chan, args.batch)
                with filechannel.open(chan, **OPTS) as ch:
                    assert ch.size == args.lines, (kind, ch.size)
                shutil.rmtree(chan)
                rate = args.lines / secs
                res[kind].append(rate)
                print(json.dumps({"kind": kind, "repeat": r, "lines": args.lines, "seconds": secs, "lines_s": rate}))
        cat, tail = statistics.median(res["cat"]), statistics.median(res["tail"])
        cath = statistics.median(res["cat+headers"])
        print(
            f"\n{args.lines} lines of {args.size} B, {args.batch} per transaction, {args.repeats} repeats "
            f"({platform.machine()}, {os.cpu_count()} CPUs)"
        )
        print(f"cat | put loop : {cat:12,.0f} lines/s (median; runs {', '.join(f'{x:,.0f}' for x in res['cat'])})")
        runs = ", ".join(f"{x:,.0f}" for x in res["cat+headers"])
        print(f"cat | put+hdrs : {cath:12,.0f} lines/s (median; runs {runs})")
        print(f"TailSource     : {tail:12,.0f} lines/s (median; runs {', '.join(f'{x:,.0f}' for x in res['tail'])})")
        print(f"ratio tail/cat : {tail / cat:.2f}   tail/(cat with the same headers): {tail / cath:.2f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
