"""CPU per event on the hot paths, C accelerator against the pure-Python twin (issue 14).

    .venv/bin/python -m bench.cpu [--n 200000] [--repeats 5] [--replay 1000000] [--stages take] [--profile]

No fsync and a tmpfs directory (``/dev/shm`` when it exists): what is left is
the CPU each path spends per event. Stages, per event, median and spread over
interleaved repeats (C, pure, pure, C, ...):

- ``frame``: framing and checksumming 100-event batches alone (``add_puts``);
- ``put x100``: ``Transaction.put_many`` + ``commit`` with ``fsync="interval"``;
- ``take x100``: ``take_batch`` + ``commit`` of the same events (with the default
  16 MiB take cache: at 100 B about half of them are cache hits, at 4 KiB few);
- ``take x100 disk``: the same with ``cache_bytes=0``: every event read from disk
  (the page cache of tmpfs), verified and decoded;
- ``scan``: ``Scanner.scan`` of a data file already in memory;
- ``replay``: ``filechannel.open(replay="full")`` of ``--replay`` queued events.

``--profile`` also prints the top of a cProfile of ``put x100`` and of the replay on each path.
One JSON line per result on stdout, like the rest of ``bench``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import filechannel
from filechannel import format as fmt
from filechannel import scan

ACCEL = fmt.speedups


@contextmanager
def path(name: str) -> Iterator[None]:
    """Run with the C accelerator (``"c"``) or the pure-Python twin (``"python"``)."""
    saved = fmt.speedups
    fmt.speedups = ACCEL if name == "c" else None
    try:
        yield
    finally:
        fmt.speedups = saved


def tmpdir() -> str:
    return tempfile.mkdtemp(prefix="fc-cpu-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)


def opened(d: str, **kw: object) -> filechannel.FileChannel:
    opts: dict[str, object] = {
        "fsync": "interval",
        "minimum_required_space": 0,
        "capacity": 10_000_000,
        "transaction_capacity": 10_000,
        "checkpoint_interval": 0,
    }
    opts.update(kw)
    return filechannel.open(d, **opts)  # type: ignore[arg-type]


def stage_frame(n: int, size: int) -> float:
    kind = fmt.default_crc_kind()
    enc = fmt.record_encoder(fmt.file_seed(kind, b"\1" * 16, 1), kind)
    payloads = [fmt.EMPTY_HEADERS + os.urandom(size)] * 100
    t0 = time.perf_counter()
    off = 0
    for i in range(n // 100):
        parts: list[bytes] = []
        off = enc.add_puts(parts, i * 100, i, payloads, [], [], off)
        b"".join(parts)
    return (time.perf_counter() - t0) / n


def stage_put_take(n: int, size: int, **kw: object) -> tuple[float, float]:
    d = tmpdir()
    try:
        body = os.urandom(size)
        batch = [body] * 100
        with opened(d, **kw) as ch:
            t0 = time.perf_counter()
            for _ in range(n // 100):
                tx = ch.transaction()
                tx.put_many(batch)
                tx.commit()
            put = (time.perf_counter() - t0) / n
            t0 = time.perf_counter()
            for _ in range(n // 100):
                tx = ch.transaction()
                tx.take_batch(100)
                tx.commit()
            take = (time.perf_counter() - t0) / n
        return put, take
    finally:
        shutil.rmtree(d, ignore_errors=True)


def build(d: str, n: int) -> None:
    batch = [b"x" * 100] * 1000
    with opened(d) as ch:
        for _ in range(n // 1000):
            tx = ch.transaction()
            tx.put_many(batch)
            tx.commit()


def stage_replay(d: str, n: int) -> float:
    t0 = time.perf_counter()
    ch = opened(d, replay="full", capacity=max(10_000_000, 2 * n))
    took = time.perf_counter() - t0
    assert ch.size == n, (ch.size, n)
    # leave without writing a checkpoint, so every repeat replays the same files
    ch._core.closed = True
    ch._ckpt_stop.set()
    ch._log.close()
    return took


def stage_scan(d: str) -> tuple[float, int]:
    """Scanner.scan alone over every data file of ``d`` (bytes already read)."""
    ch = opened(d)
    log = ch._log
    files = [(fid, log.file_path(fid)) for fid in log.file_ids()]
    bufs = []
    for fid, p in files:
        with open(p, "rb") as f:
            bufs.append((fid, p, f.read()))
    ch.close()
    n = 0
    t0 = time.perf_counter()
    prev = 0
    for fid, p, buf in bufs:
        hdr = fmt.decode_file_header(buf)
        assert isinstance(hdr, fmt.FileHeader)
        fs = scan.Scanner(log, p, fid, buf, hdr).scan(False, prev)
        prev = fs.last_woid
        n += len(fs.records)
    return time.perf_counter() - t0, n


def profile(fn: Callable[[], object], top: int = 14) -> str:
    pr = cProfile.Profile()
    pr.enable()
    fn()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(top)
    return s.getvalue()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=200_000, help="events per put/take/frame stage")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--replay", type=int, default=1_000_000, help="queued events for the replay and scan stages")
    ap.add_argument("--stages", default="frame,put,take,scan,replay", help="comma-separated stages to run")
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args(argv)
    stages = set(a.stages.split(","))
    paths = ["c", "python"] if ACCEL is not None else ["python"]
    if ACCEL is None:
        print("# the C accelerator is not active: only the pure-Python path is measured", file=sys.stderr)
    res: dict[tuple[str, str, int], list[float]] = {}

    def add(stage: str, p: str, size: int, v: float) -> None:
        res.setdefault((stage, p, size), []).append(v)

    rd = tmpdir()
    try:
        if stages & {"scan", "replay"}:
            build(rd, a.replay)
        for r in range(a.repeats):
            order = paths if r % 2 == 0 else paths[::-1]
            for p in order:
                with path(p):
                    for size in (100, 4096):
                        n = a.n if size == 100 else a.n // 4
                        if "frame" in stages:
                            add("frame", p, size, stage_frame(a.n, size))
                        if stages & {"put", "take"}:
                            put, take = stage_put_take(n, size)
                            add("put x100", p, size, put)
                            add("take x100", p, size, take)
                        if "take" in stages:
                            add("take x100 disk", p, size, stage_put_take(n, size, cache_bytes=0)[1])
                    if "scan" in stages:
                        t, _count = stage_scan(rd)
                        add("scan", p, 100, t / a.replay)
                    if "replay" in stages:
                        add("replay", p, 100, stage_replay(rd, a.replay))
        for (stage, p, size), vals in sorted(res.items()):
            unit = "s" if stage == "replay" else "us_per_event"
            scale = 1 if stage == "replay" else 1e6
            rec = {
                "stage": stage,
                "path": p,
                "event_size": size,
                "unit": unit,
                "median": round(statistics.median(vals) * scale, 4),
                "min": round(min(vals) * scale, 4),
                "max": round(max(vals) * scale, 4),
                "repeats": len(vals),
                "events": a.replay if stage in ("replay", "scan") else a.n,
            }
            print(json.dumps(rec), flush=True)
        if len(paths) == 2:
            for stage, size in sorted({(s, z) for s, _p, z in res}):
                c, py = statistics.median(res[(stage, "c", size)]), statistics.median(res[(stage, "python", size)])
                print(json.dumps({"stage": stage, "event_size": size, "python_over_c": round(py / c, 2)}))
        if a.profile:
            for p in paths:
                with path(p):
                    print(f"# cProfile, put x100 100 B, path={p}")
                    print(profile(lambda: stage_put_take(a.n, 100)))
                    print(f"# cProfile, replay of {a.replay} events, path={p}")
                    print(profile(lambda: stage_replay(rd, a.replay)))
    finally:
        shutil.rmtree(rd, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
