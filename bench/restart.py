"""Restart time, checkpoint cost and commit latency during a checkpoint (issue 4).

    .venv/bin/python -m bench.restart [--sizes 10000,100000,1000000] [--repeats 3] [--quick]

Prints one JSON line per result and a summary table. For each queue size N of
100-byte events it builds two channels: "fresh" (N events put) and "history"
(10 N events put and taken first, then N put: the same queue after ten times
more traffic). It then times opening each one from its checkpoint and with
``replay="full"``, interleaved, and measures commit latency (p50/p99) while
checkpoints of the largest queue are being written (explicit ones back to back,
then paced background ones), against no checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time

import filechannel

BODY = b"x" * 100
BATCH = 1000


def build(d: str, n: int, history: bool) -> None:
    with filechannel.open(d, minimum_required_space=0, checkpoint_interval=0, fsync="interval") as ch:
        if history:
            for _ in range(0, 10 * n, BATCH):
                with ch.transaction() as tx:
                    for _ in range(BATCH):
                        tx.put(BODY)
                with ch.transaction() as tx:
                    tx.take_batch(BATCH)
            ch.retire_files()
        for i in range(0, n, BATCH):
            with ch.transaction() as tx:
                for _ in range(min(BATCH, n - i)):
                    tx.put(BODY)
        ch.sync()
    # close() wrote a checkpoint


def time_open(d: str, replay: str) -> tuple[float, int, str]:
    t0 = time.perf_counter()
    ch = filechannel.open(d, minimum_required_space=0, checkpoint_interval=0, replay=replay)
    took = time.perf_counter() - t0
    size, source = ch.size, ch.stats()["recovery_source"]
    # Leave without rewriting the checkpoint, so every repeat opens the same state.
    ch._core.closed = True
    ch._ckpt_stop.set()
    ch._log.close()
    return took, size, source


def disk_bytes(d: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(d):
        for f in files:
            total += os.path.getsize(os.path.join(root, f))
    return total


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3 if xs else float("nan")


def _commits(ch: filechannel.FileChannel, stop: threading.Event, out: list[tuple[float, float]]) -> None:
    """Single-event put transactions until ``stop``; each as ``(start, end)`` in perf_counter seconds."""
    while not stop.is_set():
        t0 = time.perf_counter()
        with ch.transaction() as tx:
            tx.put(BODY)
        out.append((t0, time.perf_counter()))


def latency_during_checkpoint(d: str, seconds: float, spread_interval: float = 10.0) -> dict[str, float]:
    """Commit latency of single-event put transactions, with and without checkpoints being written.

    Three phases on the same channel: no checkpoint; explicit ``checkpoint()`` calls
    back to back (never paced: the worst case); background checkpoints every
    ``spread_interval`` seconds with the default ``checkpoint_spread`` (0.5), whose
    writes are spread over half the interval. In the last phase only the commits
    that overlap a checkpoint being written count as "during".
    """
    out: dict[str, float] = {}
    ch = filechannel.open(d, minimum_required_space=0, checkpoint_interval=0, capacity=100_000_000)
    try:

        def run(with_ckpt: bool) -> tuple[list[tuple[float, float]], float]:
            lat: list[tuple[float, float]] = []
            stop = threading.Event()
            t = threading.Thread(target=_commits, args=(ch, stop, lat))
            t.start()
            ck_time = 0.0
            t_end = time.perf_counter() + seconds
            if with_ckpt:
                while time.perf_counter() < t_end:
                    t0 = time.perf_counter()
                    ch.checkpoint()
                    ck_time = max(ck_time, time.perf_counter() - t0)
            else:
                time.sleep(seconds)
            stop.set()
            t.join()
            return lat, ck_time

        base, _ = run(False)
        during, ck = run(True)
    finally:
        ch.close()
    base_lat = [b - a for a, b in base]
    dur_lat = [b - a for a, b in during]
    out.update(
        {
            "p50_ms_no_checkpoint": round(_pct(base_lat, 0.5), 3),
            "p99_ms_no_checkpoint": round(_pct(base_lat, 0.99), 3),
            "p50_ms_during_checkpoint": round(_pct(dur_lat, 0.5), 3),
            "p99_ms_during_checkpoint": round(_pct(dur_lat, 0.99), 3),
            "commits_no_checkpoint": len(base_lat),
            "commits_during_checkpoint": len(dur_lat),
            "checkpoint_seconds_max": round(ck, 3),
        }
    )
    # Background checkpoints, paced: record when each one is being written.
    ch = filechannel.open(d, minimum_required_space=0, checkpoint_interval=spread_interval, capacity=100_000_000)
    spans: list[tuple[float, float]] = []
    write = ch._store.write

    def timed_write(*args: object) -> tuple[int, int]:
        t0 = time.perf_counter()
        try:
            return write(*args)  # type: ignore[arg-type]
        finally:
            spans.append((t0, time.perf_counter()))

    ch._store.write = timed_write  # type: ignore[method-assign]
    try:
        lat: list[tuple[float, float]] = []
        stop = threading.Event()
        t = threading.Thread(target=_commits, args=(ch, stop, lat))
        t.start()
        time.sleep(max(seconds, 3.2 * spread_interval))
        stop.set()
        t.join()
    finally:
        ch.close()
    spans = spans[:-1]  # the last one is close()'s, after the commits stopped
    inside = [b - a for a, b in lat if any(a < e and b > s for s, e in spans)]
    outside = [b - a for a, b in lat if not any(a < e and b > s for s, e in spans)]
    out.update(
        {
            "background_checkpoints": len(spans),
            "background_checkpoint_seconds": round(max((e - s for s, e in spans), default=0.0), 3),
            "p50_ms_during_background_checkpoint": round(_pct(inside, 0.5), 3),
            "p99_ms_during_background_checkpoint": round(_pct(inside, 0.99), 3),
            "p99_ms_between_background_checkpoints": round(_pct(outside, 0.99), 3),
            "commits_during_background_checkpoint": len(inside),
        }
    )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="10000,100000,1000000")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one repeat (CI smoke)")
    ap.add_argument("--latency-seconds", type=float, default=3.0)
    ap.add_argument("--latency-only", action="store_true", help="only the commit latency during a checkpoint")
    ap.add_argument(
        "--spread-interval",
        type=float,
        default=10.0,
        help="checkpoint_interval of the paced background phase (its checkpoints spread over half of it)",
    )
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    repeats = args.repeats
    if args.quick:
        sizes, repeats, args.latency_seconds, args.spread_interval = [2000], 1, 0.5, 0.2
    machine = {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()}
    root = tempfile.mkdtemp(prefix="fc-restart-", dir=os.environ.get("BENCH_DIR"))
    rows = []
    try:
        for n in sizes:
            dirs = {}
            for kind in ("fresh",) if args.latency_only else ("fresh", "history"):
                d = os.path.join(root, f"{kind}-{n}")
                t0 = time.perf_counter()
                build(d, n, kind == "history")
                dirs[kind] = d
                print(f"# built {kind} {n} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
            times: dict[tuple[str, str], list[float]] = {}
            for _ in range(0 if args.latency_only else repeats):
                for kind, d in dirs.items():
                    for replay in ("checkpoint", "full"):
                        took, size, source = time_open(d, replay)
                        assert size == n, (size, n)
                        assert source == ("full" if replay == "full" else "checkpoint"), source
                        times.setdefault((kind, replay), []).append(took)
            for (kind, replay), ts in times.items():
                row = {
                    "bench": "restart",
                    "queue_events": n,
                    "event_bytes": 100,
                    "history": kind,
                    "replay": replay,
                    "median_s": round(statistics.median(ts), 4),
                    "min_s": round(min(ts), 4),
                    "max_s": round(max(ts), 4),
                    "repeats": len(ts),
                    "disk_bytes": disk_bytes(dirs[kind]),
                    "machine": machine,
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
        biggest = os.path.join(root, f"fresh-{sizes[-1]}")
        lat = {
            "bench": "commit_latency_during_checkpoint",
            "queue_events": sizes[-1],
            **latency_during_checkpoint(biggest, args.latency_seconds, args.spread_interval),
            "machine": machine,
        }
        print(json.dumps(lat), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("\n| queue | history | replay | median s | [min-max] |", file=sys.stderr)
    print("|---|---|---|---|---|", file=sys.stderr)
    for r in rows:
        print(
            f"| {r['queue_events']} | {r['history']} | {r['replay']} | {r['median_s']} | [{r['min_s']}-{r['max_s']}] |",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
