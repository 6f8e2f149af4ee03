"""Run every workload against every system, interleaved, and report.

Each block of cases (one workload, one event size, every system) is repeated
``--repeats`` times; within a repeat the systems run one after the other, in
reversed order every other repeat, so a noisy minute on a shared disk hits all
of them alike. Every case runs in a fresh directory that is deleted afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import phys
from .systems import QUEUES, SLOW, FileChannelCommit, FileChannelFullReplay, FileChannelPure, SqliteWalFull, System

THREADS = 16
BATCH = 100


@dataclass
class Params:
    n: int  # events per batched phase
    n_single: int  # events for single-event transactions
    seconds: float  # duration of the 16-thread and group-commit runs
    mixed_seconds: float
    deadline: float  # cap per phase; a capped phase reports its rate over what it did
    restart_sizes: list[int]
    repeats: int
    sizes: list[int]


@dataclass
class Case:
    system: str
    fsync: str
    fn: Callable[[str], list[tuple[str, dict[str, Any]]]]  # fresh dir -> [(workload, metrics)]


# -- workloads over queue systems ----------------------------------------------------


def _single(cls: type[System], size: int, n: int, deadline: float) -> Callable[[str], list[Any]]:
    def run(d: str) -> list[Any]:
        s = cls(d)
        s.open()
        body = os.urandom(size)
        try:
            t0 = time.perf_counter()
            stop = t0 + deadline
            done = 0
            while done < n:
                s.put_batch([body])
                done += 1
                if not done & 15 and time.perf_counter() > stop:
                    break
            wall = time.perf_counter() - t0
        finally:
            s.close()
        return [("put x1", {"events": done, "events_per_s": done / wall})]

    return run


def _threads(cls: type[System], size: int, seconds: float) -> Callable[[str], list[Any]]:
    def run(d: str) -> list[Any]:
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
            except BaseException as exc:
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
        if errors:
            raise errors[0]
        ev = sum(counts)
        return [(f"put x1 {THREADS} threads", {"events": ev, "events_per_s": ev / wall})]

    return run


def _batches(
    cls: type[System], size: int, n: int, batch: int, deadline: float, take: bool
) -> Callable[[str], list[Any]]:
    def run(d: str) -> list[Any]:
        s = cls(d)
        s.open()
        bodies = [i.to_bytes(8, "little") + os.urandom(size - 8) for i in range(batch)]
        out = []
        try:
            t0 = time.perf_counter()
            stop = t0 + deadline
            put = 0
            while put < n:
                s.put_batch(bodies)
                put += batch
                if time.perf_counter() > stop:
                    break
            wall = time.perf_counter() - t0
            out.append((f"put x{batch}", {"events": put, "events_per_s": put / wall, "MBps": put * size / wall / 1e6}))
            if take:
                t0 = time.perf_counter()
                stop = t0 + deadline
                got = 0
                while got < put:
                    evs = s.take_batch(batch)
                    s.ack()
                    if not evs:
                        raise RuntimeError(f"{cls.name}: queue empty after {got} of {put} takes")
                    if evs[0] != bodies[got % batch]:
                        raise RuntimeError(f"{cls.name}: event {got} out of order or damaged")
                    got += len(evs)
                    if time.perf_counter() > stop:
                        break
                wall = time.perf_counter() - t0
                out.append(
                    (f"take x{batch}", {"events": got, "events_per_s": got / wall, "MBps": got * size / wall / 1e6})
                )
        finally:
            s.close()
        return out

    return run


def _pct(sorted_vals: list[float], p: float) -> float:
    if not sorted_vals:
        return float("nan")
    return sorted_vals[min(len(sorted_vals) - 1, int(p * len(sorted_vals)))]


def _mixed(cls: type[System], size: int, seconds: float, depth: int) -> Callable[[str], list[Any]]:
    """A producer thread and a consumer (this thread), batches of 100, queue depth held near ``depth``."""

    def run(d: str) -> list[Any]:
        s = cls(d)
        s.open()
        bodies = [os.urandom(size) for _ in range(BATCH)]
        for _ in range(depth // BATCH):
            s.put_batch(bodies)
        state = {"put": depth, "taken": 0}
        stop = threading.Event()
        put_lat: list[float] = []
        take_lat: list[float] = []
        errors: list[BaseException] = []

        def produce() -> None:
            try:
                while not stop.is_set():
                    if state["put"] - state["taken"] > depth + depth // 2:
                        time.sleep(0.0005)
                        continue
                    a = time.perf_counter()
                    s.put_batch(bodies)
                    put_lat.append(time.perf_counter() - a)
                    state["put"] += BATCH
            except BaseException as exc:
                errors.append(exc)

        t = threading.Thread(target=produce)
        try:
            t0 = time.perf_counter()
            t.start()
            end = t0 + seconds
            while time.perf_counter() < end and not errors:
                if state["put"] - state["taken"] < depth // 2:
                    time.sleep(0.0005)
                    continue
                a = time.perf_counter()
                evs = s.take_batch(BATCH)
                s.ack()
                take_lat.append(time.perf_counter() - a)
                state["taken"] += len(evs)
            stop.set()
            t.join()
            wall = time.perf_counter() - t0
        finally:
            stop.set()
            s.close()
        if errors:
            raise errors[0]
        lat = sorted(put_lat + take_lat)
        pl, tl = sorted(put_lat), sorted(take_lat)
        return [
            (
                "mixed x100",
                {
                    "events": state["taken"],
                    "events_per_s": state["taken"] / wall,
                    "put_events_per_s": (state["put"] - depth) / wall,
                    "p50_ms": _pct(lat, 0.5) * 1e3,
                    "p99_ms": _pct(lat, 0.99) * 1e3,
                    "put_p50_ms": _pct(pl, 0.5) * 1e3,
                    "put_p99_ms": _pct(pl, 0.99) * 1e3,
                    "take_p50_ms": _pct(tl, 0.5) * 1e3,
                    "take_p99_ms": _pct(tl, 0.99) * 1e3,
                    "end_depth": state["put"] - state["taken"],
                },
            )
        ]

    return run


# -- physical limits as cases ----------------------------------------------------------------


def _phys(workload: str, fn: Callable[[str], dict[str, Any]]) -> Callable[[str], list[Any]]:
    return lambda d: [(workload, fn(d))]


# -- the runner --------------------------------------------------------------------------


class Runner:
    def __init__(self, args: argparse.Namespace, params: Params, machine: dict[str, Any]) -> None:
        self.args = args
        self.p = params
        self.machine = machine
        self.raw: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
        self.fsync: dict[str, str] = {}
        self.results: list[dict[str, Any]] = []
        self.jsonl = open(os.path.join(args.out, f"results-{args.stamp}.jsonl"), "w")  # noqa: SIM115

    def emit(self, rec: dict[str, Any]) -> None:
        line = json.dumps(rec, sort_keys=False)
        print(line, flush=True)
        self.jsonl.write(line + "\n")
        self.jsonl.flush()

    def block(self, size: int, cases: list[Case]) -> None:
        """Run ``cases`` ``repeats`` times, interleaved, then emit one result per (workload, system)."""
        keys: list[tuple[str, int, str]] = []
        for r in range(self.p.repeats):
            order = cases if r % 2 == 0 else cases[::-1]
            for c in order:
                d = tempfile.mkdtemp(prefix="fcbench-", dir=self.args.data_dir)
                try:
                    got = c.fn(d)
                except Exception as exc:
                    print(f"# {c.system}: {type(exc).__name__}: {exc}", file=sys.stderr)
                    got = []
                finally:
                    shutil.rmtree(d, ignore_errors=True)
                for workload, m in got:
                    key = (workload, size, c.system)
                    if key not in self.raw:
                        self.raw[key] = []
                        keys.append(key)
                    self.raw[key].append(m)
                    self.fsync[c.system] = c.fsync
        for key in keys:
            self.result(key)

    def result(self, key: tuple[str, int, str], metric: str | None = None) -> None:
        workload, size, system = key
        runs = self.raw[key]
        if metric is None:
            metric = next(k for k in ("events_per_s", "MBps", "seconds", "bytes_per_event") if k in runs[0])
        vals = [r[metric] for r in runs]
        rec: dict[str, Any] = {
            "machine": self.machine,
            "fsync": self.fsync.get(system, "?"),
            "event_size": size,
            "workload": workload,
            "system": system,
            "metric": metric,
            "median": statistics.median(vals),
            "min": min(vals),
            "max": max(vals),
            "repeats": len(vals),
        }
        extra = {}
        for k in runs[0]:
            if k != metric and isinstance(runs[0][k], (int, float)):
                extra[k] = statistics.median(r[k] for r in runs)
        rec["extra"] = extra
        self.results.append(rec)
        self.emit(rec)


def _queues(only: set[str] | None) -> list[type[System]]:
    out = []
    for cls in QUEUES:
        if only and cls.name not in only:
            continue
        if not cls.available():
            print(f"# {cls.name}: not installed, skipped (pip install -e '.[bench]')", file=sys.stderr)
            continue
        out.append(cls)
    return out


def run_all(r: Runner, only: set[str] | None) -> None:
    p = r.p
    qs = _queues(only)

    def n_for(cls: type[System], n: int) -> int:
        return max(BATCH, n // 20) if cls.name in SLOW else n

    # Physical bandwidth: its own block.
    r.block(
        64 << 10,
        [
            Case(
                "phys-seq-write+fdatasync/1MiB",
                "fdatasync",
                _phys("seq bandwidth", lambda d: phys.seq_bandwidth(d, max(p.n, 1000) * 4096, p.deadline)),
            )
        ],
    )
    for size in p.sizes:
        # single-event transactions, one thread
        cases = [
            Case(
                "phys-append+fdatasync",
                "fdatasync",
                _phys("put x1", lambda d, size=size: phys.append_fdatasync(d, p.n_single, size, p.deadline)),
            )
        ]
        cases += [Case(c.name, c.fsync, _single(c, size, n_for(c, p.n_single), p.deadline)) for c in qs]
        r.block(size, cases)
        # single-event transactions, 16 threads
        cases = [
            Case(
                "phys-group-commit",
                "fdatasync",
                _phys(f"put x1 {THREADS} threads", lambda d, size=size: phys.group_commit(d, THREADS, size, p.seconds)),
            )
        ]
        cases += [Case(c.name, c.fsync, _threads(c, size, p.seconds)) for c in qs if c.threadsafe]
        r.block(size, cases)
        # batches of 100: put, then take
        cases = [
            Case(
                "phys-append-batch+fdatasync",
                "fdatasync",
                _phys(
                    f"put x{BATCH}", lambda d, size=size: phys.append_batch_fdatasync(d, p.n, size, BATCH, p.deadline)
                ),
            ),
            Case(
                "phys-prealloc-batch+fdatasync",
                "fdatasync",
                _phys(
                    f"put x{BATCH}",
                    lambda d, size=size: phys.append_batch_fdatasync(d, p.n, size, BATCH, p.deadline, prealloc=True),
                ),
            ),
            Case(
                "phys-python-framing",
                "none",
                _phys(f"put x{BATCH}", lambda d, size=size: phys.python_framing(d, p.n, size, BATCH)),
            ),
        ]
        cases += [Case(c.name, c.fsync, _batches(c, size, n_for(c, p.n), BATCH, p.deadline, True)) for c in qs]
        r.block(size, cases)
    # batch-size sweep, 100 B
    fast = [c for c in qs if c.name not in SLOW]
    for b in (10, 1000):
        cases = [
            Case(
                "phys-append-batch+fdatasync",
                "fdatasync",
                _phys(f"put x{b}", lambda d, b=b: phys.append_batch_fdatasync(d, p.n, 100, b, p.deadline)),
            )
        ]
        cases += [Case(c.name, c.fsync, _batches(c, 100, p.n, b, p.deadline, False)) for c in fast]
        r.block(100, cases)
    # mixed steady state
    depth = max(BATCH * 10, min(10_000, p.n // 10))
    r.block(100, [Case(c.name, c.fsync, _mixed(c, 100, p.mixed_seconds, depth)) for c in qs])
    restart_systems = [c for c in qs if c in (FileChannelCommit, SqliteWalFull)]
    if FileChannelCommit in restart_systems:
        restart_systems.insert(1, FileChannelFullReplay)
    restart(r, restart_systems)


def restart(r: Runner, systems: list[type[System]]) -> None:
    """Time a reopen (to the first event readable) vs queue size; memory per event at the largest size."""
    p = r.p
    body = os.urandom(100)
    biggest = max(p.restart_sizes)
    for n in p.restart_sizes:
        dirs = {}
        for cls in systems:
            d = tempfile.mkdtemp(prefix="fcbench-", dir=r.args.data_dir)
            dirs[cls] = d
            s = cls(d)
            s.open()
            chunk = [body] * 1000
            for i in range(0, n, 1000):
                s.put_batch(chunk[: min(1000, n - i)])
            s.close()
        try:
            for rep in range(p.repeats):
                for cls in systems if rep % 2 == 0 else systems[::-1]:
                    s = cls(dirs[cls])
                    t0 = time.perf_counter()
                    s.open()
                    first = s.take_batch(1)
                    wall = time.perf_counter() - t0
                    s.close()
                    if not first or first[0] != body:
                        raise RuntimeError(f"{cls.name}: wrong first event after reopen")
                    key = ("restart", n, cls.name)
                    r.raw.setdefault(key, []).append({"seconds": wall, "queued": n})
                    r.fsync[cls.name] = cls.fsync
            for cls in systems:
                r.result(("restart", n, cls.name))
            for cls in (FileChannelCommit, FileChannelFullReplay):
                if n != biggest or cls not in dirs:
                    continue
                replay = cls.options.get("replay", "checkpoint")
                out = subprocess.run(
                    [sys.executable, "-m", "bench.memprobe", dirs[cls], str(n), replay],
                    capture_output=True,
                    text=True,
                    check=True,
                    cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                )
                m = json.loads(out.stdout)
                key = (f"memory at {n} queued", 100, cls.name)
                r.raw[key] = [m]
                r.fsync[cls.name] = cls.fsync
                r.result(key, "bytes_per_event")
        finally:
            for d in dirs.values():
                shutil.rmtree(d, ignore_errors=True)


# -- machine, summary, plot -------------------------------------------------------------------


def machine_info(data_dir: str) -> dict[str, Any]:
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    fs = "?"
    try:
        best = ""
        real = os.path.realpath(data_dir)
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, typ, opts = line.split()[:4]
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, fs = mnt, f"{typ} on {dev} ({opts})"
    except OSError:
        pass
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        ).stdout.strip()
    except OSError:
        commit = "?"
    return {
        "host": platform.node(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "sqlite": sqlite3.sqlite_version,
        "fs": fs,
        "commit": commit,
    }


def spread(runs: list[dict[str, Any]], metric: str) -> dict[str, Any]:
    """Median, min, max and repeats of ``metric`` over repeated runs; the other numbers' medians as ``extra``."""
    vals = [r[metric] for r in runs]
    extra = {
        k: statistics.median(r[k] for r in runs)
        for k in runs[0]
        if k != metric and isinstance(runs[0][k], (int, float))
    }
    return {
        "median": statistics.median(vals),
        "min": min(vals),
        "max": max(vals),
        "repeats": len(vals),
        "extra": extra,
    }


@dataclass
class BenchStart:
    """What an events/s bench starts with: its options, its data directory, the machine and the clock."""

    n: int
    repeats: int
    root: str  # a new temporary directory for the channels (the bench removes it)
    machine: dict[str, Any]
    load_before: tuple[float, float, float]
    t_start: float


def bench_start(module: str, doc: str, argv: list[str] | None, quick_n: int) -> BenchStart:
    """Parse the options of an events/s bench (``--n``, ``--repeats``, ``--quick``, ``--data-dir``) and start it."""
    p = argparse.ArgumentParser(prog=f"python -m bench.{module}", description=doc.splitlines()[0])
    p.add_argument("--n", type=int, default=20_000, help="events per case (default 20 000)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help=f"n={quick_n}, one repeat")
    p.add_argument("--data-dir", help="where the channels go (default: a temporary directory)")
    args = p.parse_args(argv)
    n, repeats = (quick_n, 1) if args.quick else (args.n, args.repeats)
    root = tempfile.mkdtemp(prefix=f"bench-{module}-", dir=args.data_dir)
    return BenchStart(n, repeats, root, machine_info(root), os.getloadavg(), time.time())


def rate_rows(
    runs: dict[tuple[Any, ...], list[dict[str, Any]]],
    ratios: dict[tuple[Any, ...], list[dict[str, Any]]],
    key_fields: tuple[str, ...],
    **common: Any,
) -> list[dict[str, Any]]:
    """The records of events/s ``runs`` and their ``ratios``, each printed as a JSON line.

    A key of ``runs``/``ratios`` gives the fields ``key_fields`` (e.g. clients, system); ``common``
    the fields of every record (machine, fsync, workload, ...).
    """
    rows = [
        {**common, **dict(zip(key_fields, k, strict=True)), "metric": "events_per_s", "unit": "events/s"}
        | spread(ms, "events_per_s")
        for k, ms in runs.items()
    ]
    rows += [
        {**common, **dict(zip(key_fields, k, strict=True)), "metric": "ratio", "unit": "x"} | spread(ms, "ratio")
        for k, ms in ratios.items()
    ]
    for rec in rows:
        print(json.dumps(rec), flush=True)
    return rows


def table_head(cmd: str, run: dict[str, Any], columns: list[str]) -> list[str]:
    """The first lines of a bench's summary table on stderr: the command and run, the header, the rule."""
    return [
        f"`{cmd}`: n={run['n']}, repeats={run['repeats']}, {run['seconds']:.0f} s",
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
    ]


def spread_cells(r: dict[str, Any]) -> str:
    """A result's median, min and max as table cells."""
    return " | ".join(cell(r[k], r["unit"]) for k in ("median", "min", "max"))


def run_record(
    module: str, argv: list[str] | None, machine: dict[str, Any], t_start: float, load_before: Any, **fields: Any
) -> tuple[str, dict[str, Any]]:
    """Print the closing ``"type": "run"`` record of ``python -m bench.MODULE``: (its command, the record)."""
    cmd = f"python -m bench.{module} " + " ".join(argv if argv is not None else sys.argv[1:])
    run = {
        "machine": machine,
        "type": "run",
        "command": cmd,
        **fields,
        "seconds": round(time.time() - t_start, 1),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
    }
    print(json.dumps(run), flush=True)
    return cmd, run


def cell(value: float, unit: str) -> str:
    """A summary table's number: three decimals for ratios (``x``) and microseconds, else grouped thousands."""
    return f"{value:.3f}" if unit in ("x", "us") else f"{value:,.0f}"


def _fmt(v: float, metric: str) -> str:
    if metric == "seconds":
        return f"{v:.3f} s"
    if metric == "bytes_per_event":
        return f"{v:.1f} B"
    if metric == "MBps":
        return f"{v:.0f} MB/s"
    if v >= 1e6:
        return f"{v / 1e6:.2f}M"
    if v >= 1e3:
        return f"{v / 1e3:.1f}k"
    return f"{v:.0f}"


def summary(results: list[dict[str, Any]]) -> str:
    lines = [
        "| workload | size | system | fsync | median | [min-max] | notes |",
        "|---|---|---|---|---|---|---|",
    ]
    for rec in results:
        m = rec["metric"]
        notes = []
        ex = rec["extra"]
        for k in ("p50_ms", "p99_ms", "mean_batch", "MBps", "end_depth", "peak_bytes_per_event"):
            if k in ex and k != m:
                notes.append(f"{k}={ex[k]:.3g}")
        lines.append(
            f"| {rec['workload']} | {rec['event_size']} | {rec['system']} | {rec['fsync']} | "
            f"{_fmt(rec['median'], m)} | [{_fmt(rec['min'], m)}-{_fmt(rec['max'], m)}] | {' '.join(notes)} |"
        )
    return "\n".join(lines)


def targets(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets as ratios of medians from this run."""
    med = {(r["workload"], r["event_size"], r["system"]): r["median"] for r in results}
    fc = FileChannelCommit.name
    sq = SqliteWalFull.name
    out: list[dict[str, Any]] = []

    def ratio(name: str, a: tuple[str, int, str], b: tuple[str, int, str] | list[tuple[str, int, str]], need: float):
        bs = b if isinstance(b, list) else [b]
        den = [med[k] for k in bs if k in med]
        if a not in med or not den:
            return
        value = med[a] / max(den)
        out.append({"target": name, "ratio": value, "need": need, "met": value >= need})

    # Issue 14's targets; the pure-Python path (the C accelerator off) is reported beside them.
    for sys_name, label in ((fc, ""), (FileChannelPure.name, " (pure Python)")):
        for size, need in ((100, 1.5), (4096, 2.0)):
            ratio(f"put x100 {size} B vs SQLite{label}", ("put x100", size, sys_name), ("put x100", size, sq), need)
            ratio(f"take x100 {size} B vs SQLite{label}", ("take x100", size, sys_name), ("take x100", size, sq), 2.0)
        ratio(
            f"put x100 4096 B vs raw append+fdatasync per batch{label}",
            ("put x100", 4096, sys_name),
            ("put x100", 4096, "phys-append-batch+fdatasync"),
            0.6,
        )
    t16 = f"put x1 {THREADS} threads"
    ratio(f"{t16} 100 B vs group-commit limit", (t16, 100, fc), (t16, 100, "phys-group-commit"), 0.8)
    ratio(f"{t16} 100 B vs SQLite single-event", (t16, 100, fc), [("put x1", 100, sq), (t16, 100, sq)], 3.0)
    pq = [s for s in ("pq-sqlite-ack", "pq-file+fsync")]
    for (w, size, s), _v in sorted(med.items()):
        if s == fc and any((w, size, q) in med for q in pq):
            ratio(f"{w} {size} B vs persist-queue", (w, size, fc), [(w, size, q) for q in pq], 20.0)
    for r in results:
        if r["workload"].startswith("memory at"):
            out.append(
                {
                    "target": f"{r['workload']} ({r['system']}): bytes per queued event < 64",
                    "ratio": r["median"],
                    "need": 64,
                    "met": r["median"] < 64,
                }
            )
    return out


def plot(results: list[dict[str, Any]], path: str) -> bool:
    """Throughput of 100-event puts against event size, and of 100 B puts against batch size."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("# matplotlib not installed: no plot", file=sys.stderr)
        return False
    med = {(r["workload"], r["event_size"], r["system"]): r["median"] for r in results}
    queues = ("filechannel-commit", "filechannel-interval", "sqlite-wal-full", "pq-sqlite-ack", "pq-file+fsync")
    systems = [s for s in queues if any(r["system"] == s for r in results)]
    systems += ["phys-append-batch+fdatasync", "phys-prealloc-batch+fdatasync"]
    colors = dict(zip(systems, plt.get_cmap("tab10").colors, strict=False))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 4.2), dpi=72)
    for s in systems:
        style = {"color": colors[s], "marker": "o", "linestyle": "--" if s.startswith("phys") else "-"}
        xs = [z for z in (100, 4096) if ("put x100", z, s) in med]
        if xs:
            a1.plot(xs, [med[("put x100", z, s)] for z in xs], label=s, **style)
        single = "phys-append+fdatasync" if s == "phys-append-batch+fdatasync" else s
        pts = [(1, med[("put x1", 100, single)])] if ("put x1", 100, single) in med else []
        pts += [(b, med[(f"put x{b}", 100, s)]) for b in (10, 100, 1000) if (f"put x{b}", 100, s) in med]
        if pts:
            a2.plot([x for x, _ in pts], [y for _, y in pts], **style)
    for ax, title, xl in (
        (a1, "transactions of 100 puts: events/s vs event size", "event size (bytes)"),
        (a2, "100 B puts: events/s vs events per transaction", "events per transaction"),
    ):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel(xl, fontsize=8)
        ax.set_ylabel("events/s", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(True, which="both", alpha=0.3)
    fig.legend(loc="lower center", ncol=4, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path)
    plt.close(fig)
    return True


def replot(jsonl: str, path: str) -> int:
    """Redraw the plot from a results file (``--replot results-....jsonl``)."""
    with open(jsonl) as f:
        results = [r for r in map(json.loads, f) if "workload" in r]
    return 0 if plot(results, path) else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="a ~30 s smoke run (CI): small sizes, one repeat")
    ap.add_argument("--repeats", type=int, help="repeats per case (default 3, quick 1)")
    ap.add_argument("--n", type=int, help="events per batched phase (default 100000, quick 2000)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--data-dir", default=None, help="where channels are created (default: the temp dir)")
    ap.add_argument("--plot", default=None, help="also write the PNG here (e.g. docs/performance.png)")
    ap.add_argument("--only", default=None, help="comma-separated queue systems to run")
    ap.add_argument("--replot", default=None, metavar="JSONL", help="only redraw --plot from a results file")
    ap.add_argument(
        "--restart-sizes",
        default=None,
        help="queue sizes of the restart and memory blocks (default 10000,100000,1000000)",
    )
    args = ap.parse_args(argv)
    if args.replot:
        return replot(args.replot, args.plot or "throughput.png")
    q = args.quick
    n = args.n or (2000 if q else 100_000)
    params = Params(
        n=n,
        n_single=max(50, n // 10) if q else max(100, n // 30),
        seconds=0.5 if q else 2.0,
        mixed_seconds=1.0 if q else 4.0,
        deadline=2.0 if q else 5.0,
        restart_sizes=[int(x) for x in args.restart_sizes.split(",")]
        if args.restart_sizes
        else ([n] if q else [10_000, 100_000, 1_000_000]),
        repeats=args.repeats or (1 if q else 3),
        sizes=[100, 4096],
    )
    os.makedirs(args.out, exist_ok=True)
    args.stamp = time.strftime("%Y%m%d-%H%M%S")
    machine = machine_info(args.data_dir or tempfile.gettempdir())
    r = Runner(args, params, machine)
    t0 = time.time()
    only = set(args.only.split(",")) if args.only else None
    run_all(r, only)
    tg = targets(r.results)
    for t in tg:
        r.emit({"machine": machine, "type": "target", **t})
    table = summary(r.results)
    ttable = "\n".join(
        ["| target | ratio | need | met |", "|---|---|---|---|"]
        + [f"| {t['target']} | {t['ratio']:.2f} | {t['need']} | {'met' if t['met'] else 'NOT met'} |" for t in tg]
    )
    cmd = "python -m bench " + " ".join(argv if argv is not None else sys.argv[1:])
    text = (
        f"# bench {args.stamp}\n\n`{cmd}` on {json.dumps(machine)}, {time.time() - t0:.0f} s\n\n{table}\n\n{ttable}\n"
    )
    with open(os.path.join(args.out, f"summary-{args.stamp}.md"), "w") as f:
        f.write(text)
    png = os.path.join(args.out, f"throughput-{args.stamp}.png")
    if plot(r.results, png) and args.plot:
        shutil.copyfile(png, args.plot)
    r.jsonl.close()
    print(f"\n{table}\n\n{ttable}\n\n# {time.time() - t0:.0f} s; results in {args.out}", file=sys.stderr)
    return 0
