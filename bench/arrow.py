"""The Arrow API against the per-event API it replaces (issue 26).

    .venv/bin/python -m bench.arrow [--n N] [--puts N] [--repeats R] [--quick] [--data-dir DIR]

Prints one JSON line per result on stdout and a summary table on stderr.

- **read**: one channel of ``--n`` events (default 1 000 000) of 100 B, filled
  once; per repeat, on a reader that has already loaded the channel,
  ``read_arrow(start, end)`` (the C path, and the pure-Python twin) against
  ``read(start, end)`` plus building the same RecordBatch from the Events
  (``filechannel.arrow.events_to_batch``). The two batches are checked equal.
- **put**: ``--puts`` events (default 100 000) of 100 B in one transaction
  into a fresh channel (``fsync="commit"``: the commit's fdatasync is timed
  too): ``put_arrow`` of a binary array against ``put_many`` of the same bodies
  as a list of bytes, and against ``to_pylist()`` + ``put_many`` (what code
  holding Arrow data does without ``put_arrow``).
- **take after put**: in the same channel, right after that commit, one
  transaction takes all the events back (``take_batch``, commit timed too):
  served by the take cache, which holds ``put_many``'s list of bodies and
  ``put_arrow``'s column (its events made by the first take that reaches it).
  The case ``put_arrow, no cache`` (``cache_bytes=0``) shows what takes would
  cost if the cache skipped Arrow puts (every event read back from disk).
- **put, steady state**: then two more such put transactions into the same
  channel (the median of the two): what a producer committing batch after
  batch sees, its process's memory and the data file already in use.

Within a repeat the cases run back to back, in reversed order every other
repeat; ratios (how many times faster) are taken within a repeat, then
summarised as median and min-max over the repeats. Targets (issue 26):
``read_arrow`` at least 5x read + arrays; ``put_arrow`` at least 3x ``put_many``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import pyarrow as pa

import filechannel
from filechannel import arrow
from filechannel import format as fmt

from .run import machine_info, spread

SIZE = 100
OPTS: dict[str, Any] = {
    "capacity": 4_000_000,
    "transaction_capacity": 1_000_000,
    "minimum_required_space": 0,
    "checkpoint_interval": 0,
}


def fill(d: str, n: int) -> None:
    """A channel of ``n`` events of 100 B (transactions of 10 000, ``fsync="interval"``)."""
    body = os.urandom(SIZE)
    bodies = [body[: i % 50] + body[i % 50 :] for i in range(10_000)]
    with filechannel.open(d, fsync="interval", **OPTS) as ch:
        left = n
        while left:
            k = min(left, len(bodies))
            with ch.transaction() as tx:
                tx.put_many(bodies[:k])
            left -= k


def read_cases(reader: filechannel.ChannelReader, start: int, end: int, order: list[str]) -> dict[str, float]:
    """Seconds per case; the batches checked equal."""
    out: dict[str, float] = {}
    got: dict[str, pa.RecordBatch] = {}
    for case in order:
        t0 = time.perf_counter()
        if case == "read_arrow":
            got[case] = reader.read_arrow(start, end)
        elif case == "read_arrow pure-python":
            sp = fmt.speedups
            fmt.speedups = None
            try:
                got[case] = reader.read_arrow(start, end)
            finally:
                fmt.speedups = sp
        else:
            got[case] = arrow.events_to_batch(reader.read(start, end))
        out[case] = time.perf_counter() - t0
    first = next(iter(got.values()))
    assert all(b.equals(first) for b in got.values()), "the cases returned different batches"
    return out


def put_case(d: str, case: str, column: pa.Array, bodies: list[bytes]) -> tuple[float, float, float]:
    """Seconds of the put transaction, of the one that takes its events back, and of a later put (median of 2)."""
    opts = dict(OPTS, cache_bytes=0) if case == "put_arrow, no cache" else OPTS
    with filechannel.open(d, fsync="commit", **opts) as ch:

        def put() -> float:
            t0 = time.perf_counter()
            with ch.transaction() as tx:
                if case.startswith("put_arrow"):
                    tx.put_arrow(column)
                elif case == "put_many":
                    tx.put_many(bodies)
                else:
                    tx.put_many(column.to_pylist())
            return time.perf_counter() - t0

        first = put()
        t1 = time.perf_counter()
        with ch.transaction() as tx:
            got = tx.take_batch(len(bodies))
        took = time.perf_counter() - t1
        assert len(got) == len(bodies), "the take returned fewer events"
        assert got[-1].body == bodies[-1], "the take returned other events"
        later = sorted([put(), put()])
        return first, took, (later[0] + later[1]) / 2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.arrow", description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, help="events in the read channel (default 1000000, quick 20000)")
    ap.add_argument("--puts", type=int, help="events per put transaction (default 100000, quick 5000)")
    ap.add_argument("--repeats", type=int, help="repeats (default 5, quick 1)")
    ap.add_argument("--quick", action="store_true", help="a few-second smoke run")
    ap.add_argument("--data-dir", default=None, help="where channels are created (default: the temp dir)")
    args = ap.parse_args(argv)
    n = args.n or (20_000 if args.quick else 1_000_000)
    n_puts = args.puts or (5_000 if args.quick else 100_000)
    repeats = args.repeats or (1 if args.quick else 5)
    root = tempfile.mkdtemp(prefix="fc-arrow-", dir=args.data_dir)
    machine = machine_info(root)
    load_before = os.getloadavg()
    t_start = time.time()
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    ratios: dict[tuple[str, str], list[dict[str, Any]]] = {}
    try:
        d = os.path.join(root, "read")
        t0 = time.perf_counter()
        fill(d, n)
        fill_s = time.perf_counter() - t0
        read_order = ["read_arrow", "read_arrow pure-python", "read + arrays"]
        with filechannel.ChannelReader(d) as reader:
            start, end = reader.available()
            for rep in range(repeats):
                order = read_order if rep % 2 == 0 else read_order[::-1]
                secs = read_cases(reader, start, end, order)
                for case, s in secs.items():
                    runs.setdefault(("read", case), []).append({"events_per_s": (end - start) / s, "seconds": s})
                base = secs["read + arrays"]
                for case in ("read_arrow", "read_arrow pure-python"):
                    ratios.setdefault(("read", f"{case} / read + arrays"), []).append({"ratio": base / secs[case]})
        shutil.rmtree(d, ignore_errors=True)
        body = os.urandom(SIZE)
        bodies = [body[: i % 50] + body[i % 50 :] for i in range(n_puts)]  # distinct objects, 100 B each
        column = pa.array(bodies, type=pa.binary())
        put_order = ["put_arrow", "put_many", "to_pylist + put_many", "put_arrow, no cache"]
        k = 0
        for rep in range(repeats):
            order = put_order if rep % 2 == 0 else put_order[::-1]
            secs = {}
            takes = {}
            steady = {}
            for case in order:
                k += 1
                d = os.path.join(root, f"put{k}")
                secs[case], takes[case], steady[case] = put_case(d, case, column, bodies)
                shutil.rmtree(d, ignore_errors=True)
            for case, s in secs.items():
                runs.setdefault(("put, one transaction", case), []).append({"events_per_s": n_puts / s, "seconds": s})
            for case, s in takes.items():
                runs.setdefault(("take after put", case), []).append({"events_per_s": n_puts / s, "seconds": s})
            for case, s in steady.items():
                runs.setdefault(("put, steady state", case), []).append({"events_per_s": n_puts / s, "seconds": s})
            for case in ("put_many", "to_pylist + put_many"):
                ratios.setdefault(("put, one transaction", f"put_arrow / {case}"), []).append(
                    {"ratio": secs[case] / secs["put_arrow"]}
                )
                ratios.setdefault(("put, steady state", f"put_arrow / {case}"), []).append(
                    {"ratio": steady[case] / steady["put_arrow"]}
                )
            ratios.setdefault(("take after put", "put_arrow / put_many"), []).append(
                {"ratio": takes["put_many"] / takes["put_arrow"]}
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = []
    for (workload, system), ms in runs.items():
        rec = {"machine": machine["host"], "event_size": SIZE, "workload": workload, "system": system}
        rec.update(metric="events_per_s", unit="events/s", **spread(ms, "events_per_s"))
        rows.append(rec)
    for (workload, system), ms in ratios.items():
        rec = {"machine": machine["host"], "event_size": SIZE, "workload": workload, "system": system}
        rec.update(metric="ratio", unit="x", **spread(ms, "ratio"))
        rows.append(rec)
    for rec in rows:
        print(json.dumps(rec), flush=True)
    targets = {
        ("read", "read_arrow / read + arrays"): (
            "read_arrow of a channel at 100 B is at least 5x read() + building the arrays",
            5,
        ),
        ("put, one transaction", "put_arrow / put_many"): (
            "put_arrow of 100 B events is at least 3x put_many of the same bodies",
            3,
        ),
        ("put, steady state", "put_arrow / put_many"): (
            "put_arrow of 100 B events is at least 3x put_many of the same bodies (steady state)",
            3,
        ),
    }
    for r in rows:
        key = (r["workload"], r["system"])
        if key in targets:
            what, need = targets[key]
            print(json.dumps({"type": "target", "what": what, "median": r["median"], "met": r["median"] >= need}))
    cmd = "python -m bench.arrow " + " ".join(argv if argv is not None else sys.argv[1:])
    run = {
        "machine": machine,
        "type": "run",
        "command": cmd,
        "n": n,
        "puts": n_puts,
        "repeats": repeats,
        "fill_seconds": round(fill_s, 1),
        "seconds": round(time.time() - t_start, 1),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
    }
    print(json.dumps(run), flush=True)
    lines = [f"`{cmd}`: n={n}, puts={n_puts}, repeats={repeats}, {run['seconds']:.0f} s", ""]
    lines.append("| workload | system | median | min | max |")
    lines.append("|---|---|---|---|---|")
    for r in rows:
        f = (lambda v: f"{v:.2f}") if r["unit"] == "x" else (lambda v: f"{v:,.0f}")
        lines.append(f"| {r['workload']} | {r['system']} | {f(r['median'])} | {f(r['min'])} | {f(r['max'])} |")
    print("\n".join(lines), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
