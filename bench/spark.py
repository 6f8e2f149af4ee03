"""Spark: channel to Parquet through the filechannel source, against Spark's rate source; the sink (issue 9).

    .venv/bin/python -m bench.spark [--n N] [--repeats R] [--quick]

One local SparkSession (``local[2]``, shuffle partitions 1, UI off, as in
tests/spark_session.py) for the whole run; its start-up is excluded from every rate.
Prints one JSON line per result on stdout and a summary on stderr. Ratios are
taken between cases of the same repeat, then summarised as median and min-max.

``source``: a channel pre-filled with N events (closed before the query starts)
is read by ``spark.readStream.format("filechannel")`` with
``maxEventsPerTrigger = N / BATCHES`` and ``trigger(availableNow=True)``, written
to a Parquet directory (``position``, ``body``). Steady state: the rows of
micro-batches 2..last over the sum of their ``triggerExecution`` times (from
``query.recentProgress``; the batches run back to back, so this is the time from
the start of the second to the end of the last batch). The first batch (source
and sink initialisation, the first Python worker start) is left out.

``rate``: the same query shape with ``format("rate-micro-batch")``
(``rowsPerBatch`` = the same batch size), ``value`` as ``position`` and a
constant body of the same size, into the same kind of Parquet sink, run with the
default trigger until as many batches as the source run had; measured the same
way. It is the ceiling of the Spark side; ``ratio`` = source / rate.

``sink``: a cached DataFrame of N rows (``body`` of the event size) written with
``df.write.format("filechannel")`` into a new channel (one transaction), wall
time; against ``df.write.parquet`` of the same DataFrame (``ratio`` = sink / parquet).
One untimed sink write of 1000 rows first (the session's first Python data-source
write starts the Python workers).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import filechannel

from .run import machine_info, spread

SIZES = (100, 1024)
BATCHES = 10  # micro-batches per streaming run
PUT_TX = 10_000


def _session(tmp: str) -> Any:
    from pyspark.sql import SparkSession

    import filechannel.spark

    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    spark = (
        SparkSession.builder.master("local[2]")
        .appName("filechannel-bench")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "1")
        .config("spark.driver.memory", "1g")
        .config("spark.local.dir", os.path.join(tmp, "local"))
        .config("spark.sql.warehouse.dir", os.path.join(tmp, "warehouse"))
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    filechannel.spark.register(spark)
    return spark


def _fill(path: str, n: int, size: int) -> None:
    body = os.urandom(size)
    cap = max(n * 2, 1000)
    opts = {"capacity": cap, "transaction_capacity": min(PUT_TX, cap)}
    with filechannel.open(path, **opts) as ch:
        done = 0
        while done < n:
            k = min(PUT_TX, n - done)
            with ch.transaction() as tx:
                tx.put_many([body] * k)
            done += k


def _steady(progress: list[Any]) -> dict[str, Any]:
    """Rows/s of micro-batches 2..last (those with rows) from a query's progress reports."""
    batches = [p for p in progress if p["numInputRows"] > 0]
    if len(batches) < 2:
        raise RuntimeError(f"need 2+ micro-batches with rows, got {len(batches)}")
    rest = batches[1:]
    rows = sum(p["numInputRows"] for p in rest)
    ms = sum(p["durationMs"]["triggerExecution"] for p in rest)
    return {
        "events_per_s": rows / (ms / 1000.0),
        "batches": len(batches),
        "first_batch_ms": batches[0]["durationMs"]["triggerExecution"],
        "batch_ms": statistics.median(p["durationMs"]["triggerExecution"] for p in rest),
        "rows_total": sum(p["numInputRows"] for p in batches),
        # Spark's phases of a steady micro-batch (medians, ms): where a batch's time goes
        **{
            f"phase_{k}_ms": statistics.median(p["durationMs"].get(k, 0) for p in rest)
            for k in sorted({k for p in rest for k in p["durationMs"]} - {"triggerExecution"})
        },
    }


def run_source(spark: Any, root: str, n: int, size: int, tag: str) -> dict[str, Any]:
    chan = os.path.join(root, f"ch-{tag}")
    _fill(chan, n, size)
    q = (
        spark.readStream.format("filechannel")
        .option("consumer", "bench")
        .option("maxEventsPerTrigger", str(max(n // BATCHES, 1)))
        .load(chan)
        .select("position", "body")
        .writeStream.format("parquet")
        .option("path", os.path.join(root, f"pq-{tag}"))
        .option("checkpointLocation", os.path.join(root, f"ck-{tag}"))
        .trigger(availableNow=True)
        .start()
    )
    q.awaitTermination()
    r = _steady(q.recentProgress)
    if r["rows_total"] != n:
        raise RuntimeError(f"source query read {r['rows_total']} events, expected {n}")
    return r


def run_rate(spark: Any, root: str, n: int, size: int, tag: str) -> dict[str, Any]:
    from pyspark.sql import functions as F

    per = max(n // BATCHES, 1)
    q = (
        spark.readStream.format("rate-micro-batch")
        .option("rowsPerBatch", str(per))
        .option("numPartitions", "2")
        .load()
        .select(F.col("value").alias("position"), F.lit(os.urandom(size)).alias("body"))
        .writeStream.format("parquet")
        .option("path", os.path.join(root, f"rpq-{tag}"))
        .option("checkpointLocation", os.path.join(root, f"rck-{tag}"))
        .start()
    )
    try:
        deadline = time.monotonic() + 300
        while sum(1 for p in q.recentProgress if p["numInputRows"] > 0) < BATCHES:
            if time.monotonic() > deadline or q.exception() is not None:
                raise RuntimeError(f"rate query did not make {BATCHES} batches: {q.exception()}")
            time.sleep(0.05)
    finally:
        q.stop()
    progress = [p for p in q.recentProgress if p["numInputRows"] > 0][:BATCHES]
    return _steady(progress)


def run_sink(spark: Any, root: str, n: int, size: int, tag: str) -> tuple[dict[str, Any], dict[str, Any]]:
    from pyspark.sql import functions as F

    df = spark.range(n, numPartitions=2).select(F.lit(os.urandom(size)).alias("body")).cache()
    df.count()
    t0 = time.perf_counter()
    (
        df.write.format("filechannel")
        .option("channel.capacity", str(max(n * 2, 1000)))
        .option("channel.transaction_capacity", str(max(n, 1000)))
        .mode("append")
        .save(os.path.join(root, f"sink-{tag}"))
    )
    t_sink = time.perf_counter() - t0
    t0 = time.perf_counter()
    df.write.parquet(os.path.join(root, f"spq-{tag}"))
    t_pq = time.perf_counter() - t0
    df.unpersist()
    with filechannel.open(os.path.join(root, f"sink-{tag}")) as ch:
        got = ch.size() if callable(getattr(ch, "size", None)) else None
    if got is not None and got != n:
        raise RuntimeError(f"sink channel holds {got} events, expected {n}")
    return {"events_per_s": n / t_sink}, {"events_per_s": n / t_pq}


class Results:
    def __init__(self, machine: dict[str, Any]) -> None:
        self.machine = machine
        self.raw: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
        self.order: list[tuple[str, int, str]] = []
        self.rows: list[dict[str, Any]] = []

    def add(self, workload: str, size: int, system: str, m: dict[str, Any]) -> None:
        key = (workload, size, system)
        if key not in self.raw:
            self.raw[key] = []
            self.order.append(key)
        self.raw[key].append(m)

    def emit_all(self, quick: bool) -> None:
        for key in self.order:
            workload, size, system = key
            runs = self.raw[key]
            metric = "events_per_s" if "events_per_s" in runs[0] else "ratio"
            rec = {
                "machine": self.machine,
                "bench": "spark",
                "quick": quick,
                "workload": workload,
                "system": system,
                "event_size": size,
                "metric": metric,
                "unit": "events/s" if metric == "events_per_s" else "x",
                **spread(runs, metric),
            }
            self.rows.append(rec)
            print(json.dumps(rec), flush=True)


def summary(rows: list[dict[str, Any]]) -> str:
    out = [f"{'workload':<22} {'size':>5} {'system':<22} {'median':>12} {'min':>12} {'max':>12}"]
    for r in rows:
        fmt = "{:>12.2f}" if r["unit"] == "x" else "{:>12,.0f}"
        out.append(
            f"{r['workload']:<22} {r['event_size']:>5} {r['system']:<22} "
            + " ".join(fmt.format(r[k]) for k in ("median", "min", "max"))
            + f" {r['unit']}"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.spark", description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, help="events per run (default 200000, quick 5000)")
    ap.add_argument("--repeats", type=int, help="repeats per case (default 3, quick 1)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: small n, one repeat")
    ap.add_argument("--data-dir", default=None, help="where channels and tables are created (default: the temp dir)")
    args = ap.parse_args(argv)
    n = args.n or (5000 if args.quick else 200_000)
    repeats = args.repeats or (1 if args.quick else 3)
    machine = machine_info(args.data_dir or tempfile.gettempdir())
    res = Results(machine)
    root = tempfile.mkdtemp(prefix="fc-spark-", dir=args.data_dir)
    t_start = time.time()
    t0 = time.perf_counter()
    spark = _session(root)
    startup = time.perf_counter() - t0
    load_before = os.getloadavg()
    try:
        # Warm-up (untimed): the first sink write of a session starts its Python workers.
        run_sink(spark, root, 1000, 100, "warmup")
        for rep in range(repeats):
            for size in SIZES:
                tag = f"{size}-{rep}"
                src = run_source(spark, root, n, size, tag)
                rate = run_rate(spark, root, n, size, tag)
                res.add("to parquet", size, "filechannel source", src)
                res.add("to parquet", size, "rate-micro-batch", rate)
                res.add("to parquet", size, "source / rate", {"ratio": src["events_per_s"] / rate["events_per_s"]})
                sink, pq = run_sink(spark, root, n, size, tag)
                res.add("from DataFrame", size, "filechannel sink", sink)
                res.add("from DataFrame", size, "parquet write", pq)
                res.add("from DataFrame", size, "sink / parquet", {"ratio": sink["events_per_s"] / pq["events_per_s"]})
        res.emit_all(args.quick)
    finally:
        spark.stop()
        shutil.rmtree(root, ignore_errors=True)
    cmd = "python -m bench.spark" + (" --quick" if args.quick else "")
    run = {
        "type": "run",
        "bench": "spark",
        "quick": args.quick,
        "n": n,
        "repeats": repeats,
        "seconds": time.time() - t_start,
        "startup_s": startup,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
    }
    print(json.dumps(run), flush=True)
    print(
        f"\n`{cmd}`: n={n}, repeats={repeats}, {run['seconds']:.0f} s (session start-up {startup:.1f} s, excluded), "
        f"load average {load_before[0]:.2f} before, {run['loadavg_after'][0]:.2f} after (1 min)"
        + (" -- QUICK figures, not for the record" if args.quick else "")
        + f"\n\n{summary(res.rows)}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
