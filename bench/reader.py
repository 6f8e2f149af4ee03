"""Reading from another process: ChannelReader throughput, parallel segments, available() cost (issue 8).

    .venv/bin/python -m bench.reader [--n N] [--repeats R] [--quick]

Prints one JSON line per result on stdout and a summary table on stderr. Every
ratio is taken between cases of the same repeat (same process, same minute of
the shared disk), then summarised as median and min-max over the repeats.

``follow x100``: an owner process (multiprocessing ``spawn``, so it shares no
GIL with the reader) puts N events in transactions of 100 with
``fsync="commit"`` or ``"interval"``; the reader, in this process, loops
``available()`` / ``read(start, end, limit=L)`` / ``ack()`` until it has read
N events (it sleeps 0.5 ms when nothing is available), with L = 100 (an ack
per 100 events, like a take commit per 100) and L = 1000. Baselines of the
same repeat: the owner's put rate with no reader (``put x100``), then on that
closed channel a reader catching up with the same loop (``catch-up``, then
unregistered so the events stay queued) and an in-process ``take_batch(100)`` +
commit loop (``take x100``, on the reopened channel: from disk, like the reader).

``read all``: a closed channel of N events read by one process with
``read(limit=events per segment)``, by one process with ``read_segment()`` on
every segment, and by 2 spawned processes each calling ``read_segment()`` on
half of the segments (the pool is started before timing; planning with
``segments()`` and pickling the segments to the workers are timed). Workers
return counts, not events.

``available() idle``: microseconds per call (median of the calls; p99 in
``extra``) on a channel with one data file and on one with about 50 live data
files, each closed and with its owner open but idle (in the owner process),
against ``os.stat`` of a data file and ``os.listdir`` of the data directory in
the same run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from multiprocessing.connection import Connection
from typing import Any

import filechannel
from filechannel._fs import DEFAULT_FS
from filechannel.consumers import ConsumerStore
from filechannel.scan import SEG_RE

from .run import machine_info, run_record, spread

BATCH = 100
SIZES = (100, 4096)
FSYNCS = ("commit", "interval")
OWNER_OPTS: dict[str, Any] = {"capacity": 4_000_000, "transaction_capacity": 10_000}
IDLE_FILES = 50
IDLE_FILE_SIZE = 16 << 10  # max_file_size of the ~50-file channel
SEGMENT_BYTES = 256 << 10  # max_bytes for segments(): many segments, so halves balance
POLL_SLEEP = 0.0005
READ_LIMITS = (100, 1000)  # events per read() and ack() of the reader's loop
DEADLINE = 300.0  # a follow or catch-up loop that reads nothing new for this long fails


def _bodies(size: int) -> list[bytes]:
    """One transaction's bodies: the index in the batch in the first 8 bytes, random after."""
    return [i.to_bytes(8, "little") + os.urandom(size - 8) for i in range(BATCH)]


def _cpu_ticks() -> list[int]:
    """The machine's CPU time counters (/proc/stat: user nice system idle iowait irq softirq steal)."""
    try:
        with open("/proc/stat") as f:
            return [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return []


def _steal_pct(before: list[int], after: list[int]) -> float:
    """Share of the machine's CPU time the hypervisor gave to others (steal) between two readings."""
    d = [b - a for a, b in zip(before, after, strict=False)]
    return 100 * d[7] / sum(d) if len(d) == 8 and sum(d) else float("nan")


def _count_files(d: str) -> int:
    return sum(1 for name in os.listdir(os.path.join(d, "data")) if SEG_RE.match(name))


# -- the owner: a spawned process that puts --------------------------------------------------


def _owner_main(conn: Connection) -> None:
    """Serve put jobs ``(dir, n, size, fsync, hold, options, files)``.

    Each job: open, send ready, wait for go, put ``n`` events in transactions of 100
    (or, with ``files``, transactions of 10 until there are that many data files),
    send the put time, [wait for close], close, send a few counters.
    """
    while True:
        job = conn.recv()
        if job is None:
            return
        try:
            d, n, size, fsync, hold, options, files = job
            bodies = _bodies(size)
            ch = filechannel.open(d, fsync=fsync, **{**OWNER_OPTS, **options})
            try:
                conn.send(("ready", None))
                conn.recv()  # go
                t0 = time.perf_counter()
                if files:
                    while _count_files(d) < files:
                        tx = ch.transaction()
                        tx.put_many(bodies[:10])
                        tx.commit()
                else:
                    for _ in range(n // BATCH):
                        tx = ch.transaction()
                        tx.put_many(bodies)
                        tx.commit()
                conn.send(("put", time.perf_counter() - t0))
                if hold:
                    conn.recv()  # the reader has read everything
                st = ch.stats()
            finally:
                ch.close()
            conn.send(("closed", {"acked_events_taken": st["acked_events_taken"], "queue_size": st["queue_size"]}))
        except BaseException as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class Owner:
    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_owner_main, args=(child,), name="bench-owner", daemon=True)
        self.proc.start()
        child.close()

    def expect(self, kind: str, timeout: float = DEADLINE) -> Any:
        if not self.conn.poll(timeout):
            raise RuntimeError(f"owner: no {kind!r} within {timeout} s")
        got, value = self.conn.recv()
        if got == "error":
            raise RuntimeError(f"owner: {value}")
        if got != kind:
            raise RuntimeError(f"owner: expected {kind!r}, got {got!r}")
        return value

    def close(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join()


# -- the reader's loop ----------------------------------------------------------------------


def _read_loop(
    rd: filechannel.ChannelReader, n: int, limit: int, poll: Callable[[], None] | None = None
) -> dict[str, Any]:
    """available() / read(limit=limit) / ack() until ``n`` events are read; checks order and bodies.

    The owner's bodies are random per run: the first transaction read is the template for the others.
    """
    bodies: list[bytes] = []
    got = 0
    loops = empty = 0
    clock = time.perf_counter
    spent = {"available": 0.0, "read": 0.0, "ack": 0.0, "idle": 0.0}
    t0 = clock()
    last_progress = t0
    while got < n:
        loops += 1
        a = clock()
        start, end = rd.available()
        b = clock()
        spent["available"] += b - a
        if end <= start:
            empty += 1
            if poll is not None:
                poll()
            if b - last_progress > DEADLINE:
                raise RuntimeError(f"reader: nothing new for {DEADLINE} s after {got} of {n} events")
            time.sleep(POLL_SLEEP)
            spent["idle"] += clock() - b
            continue
        evs = rd.read(start, end, limit=limit)
        c = clock()
        spent["read"] += c - b
        if not bodies:
            bodies = [ev.body for ev in evs[:BATCH]]
        first = evs[0]
        if first.position != got or first.body != bodies[got % BATCH]:
            raise RuntimeError(f"reader: event {got} out of order or damaged (position {first.position})")
        got += len(evs)
        c = clock()
        rd.ack(got)
        last_progress = clock()
        spent["ack"] += last_progress - c
    wall = clock() - t0
    acks = loops - empty
    return {
        "events": got,
        "events_per_s": got / wall,
        "empty_polls": empty,
        "loops": loops,
        # where the reader's wall time went (the rest: this loop's own checks)
        **{f"{k}_pct": 100 * v / wall for k, v in spent.items()},
        "available_us": 1e6 * spent["available"] / loops,
        "read_us_per_event": 1e6 * spent["read"] / got,
        "ack_us": 1e6 * spent["ack"] / acks,
    }


def follow(owner: Owner, d: str, n: int, size: int, fsync: str, limit: int) -> dict[str, dict[str, Any]]:
    """The owner puts n events while a reader in this process follows; both rates."""
    owner.conn.send((d, n, size, fsync, True, {}, 0))
    owner.expect("ready")
    rd = filechannel.ChannelReader(d, consumer="bench")
    put_s: list[float] = []

    def poll() -> None:
        if not put_s and owner.conn.poll():
            put_s.append(owner.expect("put"))

    try:
        rd.available()  # load and register before the clock starts
        owner.conn.send("go")
        reader = _read_loop(rd, n, limit, poll)
    finally:
        rd.close()
        if not put_s:
            put_s.append(owner.expect("put"))
        owner.conn.send("close")
        closed = owner.expect("closed")
    return {"reader": {**reader, **closed}, "owner": {"events": n, "events_per_s": n / put_s[0]}}


def put_alone(owner: Owner, d: str, n: int, size: int, fsync: str) -> dict[str, Any]:
    owner.conn.send((d, n, size, fsync, False, {}, 0))
    owner.expect("ready")
    owner.conn.send("go")
    put = owner.expect("put")
    owner.expect("closed")
    return {"events": n, "events_per_s": n / put}


def catch_up(d: str, n: int, limit: int) -> dict[str, Any]:
    """A reader reads and acks a closed channel of n events, then unregisters (the events stay queued)."""
    rd = filechannel.ChannelReader(d, consumer="catchup")
    try:
        rd.available()  # load and register before the clock starts
        out = _read_loop(rd, n, limit)
    finally:
        rd.close()
        ConsumerStore(DEFAULT_FS, d).remove("catchup")
    return out


def take(d: str, n: int, fsync: str) -> dict[str, Any]:
    with filechannel.open(d, fsync=fsync, **OWNER_OPTS) as ch:
        if ch.size != n:
            raise RuntimeError(f"take: {ch.size} events queued, expected {n}")
        t0 = time.perf_counter()
        got = 0
        while got < n:
            tx = ch.transaction()
            evs = tx.take_batch(BATCH)
            tx.commit()
            if not evs:
                raise RuntimeError(f"take: empty after {got} of {n}")
            got += len(evs)
        wall = time.perf_counter() - t0
    return {"events": got, "events_per_s": got / wall}


def follow_block(owner: Owner, fresh: Callable[[], str], n: int, size: int, fsync: str, rep: int, res: Results) -> None:
    """One repeat: put alone + catch-up + take on one channel; follow with acks per 100 and per 1000."""
    runs: dict[str, dict[str, Any]] = {}

    def base() -> None:
        d = fresh()
        runs["put"] = put_alone(owner, d, n, size, fsync)
        for limit in READ_LIMITS:
            runs[f"catch-up {limit}"] = catch_up(d, n, limit)
        runs["take"] = take(d, n, fsync)
        shutil.rmtree(d, ignore_errors=True)

    def live(limit: int) -> Callable[[], None]:
        def run() -> None:
            d = fresh()
            got = follow(owner, d, n, size, fsync, limit)
            runs[f"follow {limit}"], runs[f"owner {limit}"] = got["reader"], got["owner"]
            shutil.rmtree(d, ignore_errors=True)

        return run

    steps = [base] + [live(limit) for limit in READ_LIMITS]
    for step in steps if rep % 2 == 0 else steps[::-1]:
        step()
    res.add("put x100", size, "filechannel-owner, no reader", fsync, runs["put"])
    res.add("take x100", size, "filechannel-take", fsync, runs["take"])
    for limit in READ_LIMITS:
        reader = f"filechannel-reader, read/ack x{limit}"
        res.add("follow x100", size, f"filechannel-owner, reader acks x{limit}", fsync, runs[f"owner {limit}"])
        res.add("follow x100", size, reader, fsync, runs[f"follow {limit}"])
        res.add("catch-up", size, reader, fsync, runs[f"catch-up {limit}"])
    for limit in READ_LIMITS:
        res.ratio("follow x100", size, f"reader x{limit} / take x100", fsync, runs[f"follow {limit}"], runs["take"])
        res.ratio("follow x100", size, f"reader x{limit} / put alone", fsync, runs[f"follow {limit}"], runs["put"])
        res.ratio("catch-up", size, f"reader x{limit} / take x100", fsync, runs[f"catch-up {limit}"], runs["take"])
    print(
        f"# {size} B {fsync} repeat {rep + 1}: "
        + ", ".join(f"{k} {v['events_per_s']:.0f}/s" for k, v in runs.items() if "events_per_s" in v),
        file=sys.stderr,
    )


# -- parallel segments ----------------------------------------------------------------------


def _read_segments(segs: list[filechannel.Segment]) -> tuple[int, int, int, float]:
    """A pool worker: read the segments, return (events, bytes, pid, CPU seconds)."""
    c0 = time.process_time()
    n = b = 0
    for s in segs:
        evs = filechannel.read_segment(s)
        n += len(evs)
        b += sum(len(ev.body) for ev in evs)
    return n, b, os.getpid(), time.process_time() - c0


def _warm(_: int) -> int:
    time.sleep(0.2)  # long enough that each of the two tasks lands on its own worker
    return os.getpid()


def build_closed(d: str, n: int, size: int, **options: Any) -> None:
    body = os.urandom(size)
    with filechannel.open(d, fsync="interval", **{**OWNER_OPTS, **options}) as ch:
        for i in range(0, n, 1000):
            tx = ch.transaction()
            tx.put_many([body] * min(1000, n - i))
            tx.commit()


def parallel(d: str, n: int, pool: Any) -> dict[str, dict[str, Any]]:
    rd = filechannel.ChannelReader(d)  # a view: registers nothing
    s, e = rd.available()
    if e - s != n:
        raise RuntimeError(f"parallel: {e - s} events available, expected {n}")
    per_seg = len(rd.segments(s, e, SEGMENT_BYTES)[0])
    out: dict[str, dict[str, Any]] = {}

    c0, t0 = time.process_time(), time.perf_counter()
    got = nbytes = 0
    p = s
    while p < e:
        evs = rd.read(p, e, limit=per_seg)
        got += len(evs)
        nbytes += sum(len(ev.body) for ev in evs)
        p = evs[-1].position + 1  # type: ignore[operator]
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0
    out["read() x1 process"] = {"events": got, "events_per_s": got / wall, "cpu_us_per_event": 1e6 * cpu / got}

    c0, t0 = time.process_time(), time.perf_counter()
    segs = rd.segments(s, e, SEGMENT_BYTES)
    got = _read_segments(segs)[0]
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0
    out["read_segment x1 process"] = {
        "events": got,
        "events_per_s": got / wall,
        "segments": len(segs),
        "cpu_us_per_event": 1e6 * cpu / got,
    }

    ticks = _cpu_ticks()
    c0, t0 = time.process_time(), time.perf_counter()
    segs = rd.segments(s, e, SEGMENT_BYTES)
    half = (len(segs) + 1) // 2
    jobs = [pool.apply_async(_read_segments, (part,)) for part in (segs[:half], segs[half:])]
    res = [j.get(DEADLINE) for j in jobs]
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0  # planning and pickling in this process
    got = sum(r[0] for r in res)
    out["read_segment x2 processes"] = {
        "events": got,
        "events_per_s": got / wall,
        "segments": len(segs),
        "distinct_workers": len({r[2] for r in res}),
        # CPU the two workers got, as a share of two cores for the wall time (1.0: both ran all along)
        "cpu_share": sum(r[3] for r in res) / (2 * wall),
        "steal_pct": _steal_pct(ticks, _cpu_ticks()),
        "cpu_us_per_event": 1e6 * (cpu + sum(r[3] for r in res)) / got,
    }
    rd.close()
    for k, v in out.items():
        if v["events"] != n:
            raise RuntimeError(f"{k}: read {v['events']} of {n}")
    return out


# -- available() on an idle channel -----------------------------------------------------------


def build_idle(d: str, files: int) -> int:
    """A closed channel with ``files`` live data files (1: a thousand events in one file)."""
    if files <= 1:
        build_closed(d, 1000, 100)
    else:
        body = os.urandom(100)
        with filechannel.open(d, fsync="interval", max_file_size=IDLE_FILE_SIZE, **OWNER_OPTS) as ch:
            while _count_files(d) < files:
                tx = ch.transaction()
                tx.put_many([body] * 10)
                tx.commit()
    return _count_files(d)


def time_calls(fn: Callable[[], Any], calls: int) -> dict[str, Any]:
    for _ in range(min(1000, calls)):
        fn()
    clock = time.perf_counter_ns
    lat = []
    for _ in range(calls):
        a = clock()
        fn()
        lat.append(clock() - a)
    lat.sort()
    return {
        "us_per_call": lat[len(lat) // 2] / 1e3,
        "p99_us": lat[min(len(lat) - 1, int(0.99 * len(lat)))] / 1e3,
        "calls": calls,
    }


def available_cost(d: str, calls: int) -> dict[str, Any]:
    rd = filechannel.ChannelReader(d)  # a view: registers nothing
    rng = rd.available()
    m = time_calls(rd.available, calls)
    if rd.available() != rng:
        raise RuntimeError("available() changed on an idle channel")
    rd.close()
    return {**m, "files": _count_files(d)}


def idle(owner: Owner, fresh: Callable[[], str], calls: int, repeats: int, res: Results) -> None:
    """available() on idle channels, closed and with the owner open (idle), against stat and listdir."""
    for files in (1, IDLE_FILES):
        label = "1 file" if files == 1 else f"{files} files"
        closed, live = fresh(), fresh()
        build_idle(closed, files)
        opts = {"max_file_size": IDLE_FILE_SIZE} if files > 1 else {}
        owner.conn.send((live, 1000, 100, "commit", True, opts, files if files > 1 else 0))
        owner.expect("ready")
        owner.conn.send("go")
        owner.expect("put")
        try:
            data = os.path.join(live, "data")
            newest = os.path.join(data, max(n for n in os.listdir(data) if SEG_RE.match(n)))
            for _ in range(repeats):
                res.add(
                    "available() idle",
                    100,
                    f"filechannel-reader {label}, closed",
                    "none",
                    available_cost(closed, calls),
                )
                res.add(
                    "available() idle",
                    100,
                    f"filechannel-reader {label}, owner open",
                    "commit",
                    available_cost(live, calls),
                )
                if files == 1:
                    res.add(
                        "available() idle", 100, "phys-os.stat", "none", time_calls(partial(os.stat, newest), calls)
                    )
                else:
                    res.add(
                        "available() idle",
                        100,
                        f"phys-os.listdir {label}",
                        "none",
                        time_calls(partial(os.listdir, data), calls),
                    )
        finally:
            owner.conn.send("close")
            owner.expect("closed")
        print(f"# idle: {label} done", file=sys.stderr)


# -- results ----------------------------------------------------------------------------------


class Results:
    def __init__(self, machine: dict[str, Any]) -> None:
        self.machine = machine
        self.raw: dict[tuple[str, int, str, str], list[dict[str, Any]]] = {}
        self.order: list[tuple[str, int, str, str]] = []
        self.rows: list[dict[str, Any]] = []

    def add(self, workload: str, size: int, system: str, fsync: str, m: dict[str, Any]) -> None:
        key = (workload, size, system, fsync)
        if key not in self.raw:
            self.raw[key] = []
            self.order.append(key)
        self.raw[key].append(m)

    def ratio(self, workload: str, size: int, name: str, fsync: str, num: dict[str, Any], den: dict[str, Any]) -> None:
        self.add(workload, size, name, fsync, {"ratio": num["events_per_s"] / den["events_per_s"]})

    def emit_all(self) -> None:
        for key in self.order:
            workload, size, system, fsync = key
            runs = self.raw[key]
            metric = next(k for k in ("events_per_s", "us_per_call", "ratio") if k in runs[0])
            unit = {"events_per_s": "events/s", "us_per_call": "us", "ratio": "x"}[metric]
            rec = {
                "machine": self.machine,
                "bench": "reader",
                "workload": workload,
                "system": system,
                "event_size": size,
                "fsync": fsync,
                "metric": metric,
                "unit": unit,
                **spread(runs, metric),
            }
            self.rows.append(rec)
            print(json.dumps(rec), flush=True)


NOTES = (
    "p99_us",
    "empty_polls",
    "available_us",
    "ack_us",
    "read_us_per_event",
    "ack_pct",
    "segments",
    "cpu_share",
    "cpu_us_per_event",
)


def _fmt(v: float, unit: str) -> str:
    if unit == "x":
        return f"{v:.2f}x"
    if unit == "us":
        return f"{v:.1f} us"
    if v >= 1e6:
        return f"{v / 1e6:.2f}M"
    if v >= 1e3:
        return f"{v / 1e3:.1f}k"
    return f"{v:.0f}"


def summary(rows: list[dict[str, Any]]) -> str:
    lines = ["| workload | size | system | fsync | median | [min-max] | notes |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        u = r["unit"]
        notes = " ".join(f"{k}={v:.3g}" for k, v in r["extra"].items() if k in NOTES)
        lines.append(
            f"| {r['workload']} | {r['event_size']} | {r['system']} | {r['fsync']} | {_fmt(r['median'], u)} | "
            f"[{_fmt(r['min'], u)}-{_fmt(r['max'], u)}] | {notes} |"
        )
    return "\n".join(lines)


# -- main -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.reader", description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, help="events per run (default 50000, quick 1000)")
    ap.add_argument("--repeats", type=int, help="repeats per case (default 3, quick 1)")
    ap.add_argument("--calls", type=int, help="available() calls per repeat (default 20000, quick 2000)")
    ap.add_argument("--quick", action="store_true", help="a ~15 s smoke run: small n, one repeat")
    ap.add_argument("--data-dir", default=None, help="where channels are created (default: the temp dir)")
    args = ap.parse_args(argv)
    q = args.quick
    n = max(2 * BATCH, (args.n or (1000 if q else 50_000)) // BATCH * BATCH)
    repeats = args.repeats or (1 if q else 3)
    calls = args.calls or (2000 if q else 20_000)
    machine = machine_info(args.data_dir or tempfile.gettempdir())
    res = Results(machine)
    load_before = os.getloadavg()
    ticks = _cpu_ticks()
    root = tempfile.mkdtemp(prefix="fc-reader-", dir=args.data_dir)
    t_start = time.time()
    owner = Owner()
    ctx = multiprocessing.get_context("spawn")
    pool = ctx.Pool(2)
    try:
        # Start both workers and import filechannel in them before any timing.
        pool.map(_warm, range(2), chunksize=1)
        pool.apply(_read_segments, ([],))
        k = 0

        def fresh() -> str:
            nonlocal k
            k += 1
            return os.path.join(root, f"ch{k}")

        # 1. follow a live channel, against put alone, catch-up and take, interleaved.
        for size in SIZES:
            for fsync in FSYNCS:
                for rep in range(repeats):
                    follow_block(owner, fresh, n, size, fsync, rep, res)
        # 2. a closed channel read by 1 process and by 2 processes in parallel.
        for size in SIZES:
            d = fresh()
            build_closed(d, n, size)
            for _ in range(repeats):
                got = parallel(d, n, pool)
                for system, m in got.items():
                    res.add("read all", size, system, "none", m)
                one = got["read() x1 process"]
                two, seg1 = got["read_segment x2 processes"], got["read_segment x1 process"]
                res.ratio("read all", size, "speedup: read_segment x2 / read() x1", "none", two, one)
                res.ratio("read all", size, "speedup: read_segment x2 / read_segment x1", "none", two, seg1)
                res.ratio("read all", size, "read_segment x1 / read() x1", "none", seg1, one)
            shutil.rmtree(d, ignore_errors=True)
        # 3. available() on idle channels.
        idle(owner, fresh, calls, repeats, res)
    finally:
        pool.terminate()
        pool.join()
        owner.close()
        shutil.rmtree(root, ignore_errors=True)
    res.emit_all()
    cmd, run = run_record(
        "reader",
        argv,
        machine,
        t_start,
        load_before,
        n=n,
        repeats=repeats,
        calls=calls,
        steal_pct=_steal_pct(ticks, _cpu_ticks()),
    )
    print(
        f"\n`{cmd}`: n={n}, repeats={repeats}, {run['seconds']:.0f} s, load average "
        f"{load_before[0]:.2f} before, {run['loadavg_after'][0]:.2f} after (1 min), CPU steal "
        f"{run['steal_pct']:.0f} %\n\n{summary(res.rows)}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
