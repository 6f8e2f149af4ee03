"""Spark: channel to Parquet through the filechannel source, against Spark's rate source; the sink (issue 9).

    .venv/bin/python -m bench.spark [--n N] [--repeats R] [--quick] [--source-only | --headers-only]
    .venv/bin/python -m bench.spark --agents [--n N] [--repeats R] [--quick]
    .venv/bin/python -m bench.spark --agent-decode [--n N] [--repeats R]

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
write starts the Python workers). The DataFrame's body is one constant, as the
issue measured it: Parquet dictionary-encodes it and writes almost none of its
bytes, while the sink writes (and fsyncs) every row. ``distinct bodies`` runs the
same pair on bodies that differ in every row and do not compress (concatenated
SHA-256 digests of the row id), so Parquet writes every byte too.

``headers map`` (issue 33): a cached DataFrame of N rows, ``body`` of the event
size and a two-entry ``headers`` map (``source`` a constant, ``row`` the row id,
so every row's headers differ), written by the sink with its headers and, as
``no headers``, its ``body`` column alone; each against the floor sink (a Python
Arrow writer that receives the same rows and keeps nothing: PySpark's own cost).
``sink / floor, headers`` and ``headers / no headers`` are the ratios.

``--agent-decode`` (issue 33, no Spark): an in-process agent on loopback serves a
channel of N events; one executor-side read of the whole range, as the agent
source did before (``read_raw``, an ``Event`` per row, ``pa.array`` of lists) and
as it does now (``AgentClient.read_arrow``), alternating, each repeat.

``--agents`` (issue 24): the same ``source`` measurement, three ways, per repeat:
today's source on ``local[2]`` reading a local channel; the agent source
(``option("agents", ...)``) on a Spark standalone cluster (a master and one
worker with 2 cores from ``spark-class``, the worker in a mount namespace that
hides the channels where ``unshare --mount`` is allowed; ``examples/cluster.py``)
reading one channel through one ``filechannel serve`` process; and the same
cluster reading three channels of N/3 events through three agents (fanned in).
``ratio`` = agent source / local source of the same repeat. Agent CPU per event:
the agents' user+system CPU time (``/proc``) during the run over its events.
``ack``: p50/p99 of 300 acknowledgements, each one position further, through
``AgentClient.ack`` (loopback Flight) against ``ChannelReader.ack`` (local).
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
from pathlib import Path
from typing import Any

import filechannel

from .run import machine_info, spread

SIZES = (100, 1024)
BATCHES = 10  # micro-batches per streaming run
PUT_TX = 10_000


def _session(tmp: str) -> Any:
    from filechannel.testing.processes import local_spark

    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    return local_spark("filechannel-bench", Path(tmp))


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


def run_source(
    spark: Any, root: str, n: int, size: int, tag: str, options: dict[str, str] | None = None
) -> dict[str, Any]:
    chan = os.path.join(root, f"ch-{tag}")
    _fill(chan, n, size)
    q = (
        spark.readStream.format("filechannel")
        .option("consumer", "bench")
        .option("maxEventsPerTrigger", str(max(n // BATCHES, 1)))
        .options(**(options or {}))
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


def _distinct_bodies(F: Any, size: int) -> Any:
    """A column of ``size``-byte bodies, different in every row and incompressible.

    Concatenated SHA-256 digests of ``(id, k)``: Parquet can neither dictionary-encode
    nor compress them, so it writes every byte, as the sink does.
    """
    parts = [
        F.unhex(F.sha2(F.concat_ws(":", F.col("id").cast("string"), F.lit(str(k))), 256)) for k in range(-(-size // 32))
    ]
    return F.substring(F.concat(*parts), 1, size)


def _sink(df: Any, n: int, path: str) -> None:
    """``df`` (n rows) written into a new channel at ``path`` by the sink, in one transaction."""
    (
        df.write.format("filechannel")
        .option("channel.capacity", str(max(n * 2, 1000)))
        .option("channel.transaction_capacity", str(max(n, 1000)))
        .mode("append")
        .save(path)
    )


def run_sink(
    spark: Any, root: str, n: int, size: int, tag: str, distinct: bool = False
) -> tuple[dict[str, Any], dict[str, Any]]:
    from pyspark.sql import functions as F

    body = _distinct_bodies(F, size) if distinct else F.lit(os.urandom(size))
    df = spark.range(n, numPartitions=2).select(body.alias("body")).cache()
    df.count()
    t0 = time.perf_counter()
    _sink(df, n, os.path.join(root, f"sink-{tag}"))
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


def _floor_source() -> Any:
    """The floor of PySpark's Python sink path: an Arrow writer that receives every row and keeps nothing.

    Made inside a function so that cloudpickle ships the classes by value (the
    Python workers need not import this module).
    """
    from pyspark.sql.datasource import DataSource, DataSourceArrowWriter, WriterCommitMessage

    class FloorWriter(DataSourceArrowWriter):  # type: ignore[misc]
        def write(self, iterator: Any) -> Any:
            for _ in iterator:
                pass
            return WriterCommitMessage()

    class FloorSink(DataSource):  # type: ignore[misc]
        @classmethod
        def name(cls) -> str:
            return "fcfloor"

        def writer(self, schema: Any, overwrite: bool) -> Any:
            return FloorWriter()

    return FloorSink


def run_sink_headers(spark: Any, root: str, n: int, size: int, tag: str) -> dict[str, dict[str, Any]]:
    """The sink with and without a two-entry ``headers`` map (one value differs per row), against the floor sink.

    One cached DataFrame of ``body`` and ``headers`` (``source`` = a constant,
    ``row`` = the row id); each case is one write of it (or of its ``body``
    column alone), wall time.
    """
    from pyspark.sql import functions as F

    headers = F.create_map(F.lit("source"), F.lit("bench"), F.lit("row"), F.col("id").cast("string"))
    df = spark.range(n, numPartitions=2).select(F.lit(os.urandom(size)).alias("body"), headers.alias("headers"))
    df = df.cache()
    df.count()
    out: dict[str, dict[str, Any]] = {}
    for case, frame in (("headers", df), ("no headers", df.select("body"))):
        t0 = time.perf_counter()
        _sink(frame, n, os.path.join(root, f"hsink-{case.replace(' ', '')}-{tag}"))
        out[f"filechannel sink, {case}"] = {"events_per_s": n / (time.perf_counter() - t0)}
        t0 = time.perf_counter()
        frame.write.format("fcfloor").mode("append").save()
        out[f"floor sink, {case}"] = {"events_per_s": n / (time.perf_counter() - t0)}
    df.unpersist()
    return out


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
            metric = next(m for m in ("events_per_s", "ratio", "us_per_event", "ms") if m in runs[0])
            rec = {
                "machine": self.machine,
                "bench": "spark",
                "quick": quick,
                "workload": workload,
                "system": system,
                "event_size": size,
                "metric": metric,
                "unit": {"events_per_s": "events/s", "ratio": "x", "us_per_event": "us/event", "ms": "ms"}[metric],
                **spread(runs, metric),
            }
            self.rows.append(rec)
            print(json.dumps(rec), flush=True)


def summary(rows: list[dict[str, Any]]) -> str:
    out = [f"{'workload':<22} {'size':>5} {'system':<22} {'median':>12} {'min':>12} {'max':>12}"]
    for r in rows:
        fmt = "{:>12,.0f}" if r["unit"] == "events/s" else "{:>12.3f}"
        out.append(
            f"{r['workload']:<22} {r['event_size']:>5} {r['system']:<22} "
            + " ".join(fmt.format(r[k]) for k in ("median", "min", "max"))
            + f" {r['unit']}"
        )
    return "\n".join(out)


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cluster_module() -> Any:
    """``examples/cluster.py`` as a module (its standalone cluster, agent and process helpers)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "cluster.py")
    spec = importlib.util.spec_from_file_location("fc_example_cluster", path)
    assert spec is not None
    assert spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _cluster_session(conf: dict[str, str]) -> Any:
    from pyspark.sql import SparkSession

    import filechannel.spark

    builder = SparkSession.builder.appName("filechannel-bench-agents")
    for k, v in conf.items():
        builder = builder.config(k, v)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    filechannel.spark.register(spark)
    return spark


def run_agent_source(spark: Any, root: str, uris: list[str], n: int, tag: str) -> dict[str, Any]:
    q = (
        spark.readStream.format("filechannel")
        .option("consumer", "bench")
        .option("agents", ",".join(uris))
        .option("maxEventsPerTrigger", str(max(n // BATCHES, 1)))
        .option("maxEventsPerPartition", str(max(n // BATCHES // 2, 1)))
        .load()
        .select("position", "body")
        .writeStream.format("parquet")
        .option("path", os.path.join(root, f"apq-{tag}"))
        .option("checkpointLocation", os.path.join(root, f"ack-{tag}"))
        .trigger(availableNow=True)
        .start()
    )
    q.awaitTermination()
    r = _steady(q.recentProgress)
    if r["rows_total"] != n:
        raise RuntimeError(f"agent source query read {r['rows_total']} events, expected {n}")
    return r


def ack_latencies(root: str, tag: str, k: int = 300) -> tuple[dict[str, Any], dict[str, Any]]:
    """p50/p99 (ms) of ``k`` acknowledgements (a new channel each) through an agent (loopback Flight) and locally."""
    from filechannel.agent import connect, serve

    out = []
    for mode in ("agent", "local"):
        d = os.path.join(root, f"acks-{mode}-{tag}")
        _fill(d, k + 1, 100)
        times = []
        if mode == "agent":
            with serve([d], "grpc://127.0.0.1:0") as agent, connect(agent.location, timeout=10) as c:
                cid = next(iter(c.channels()))
                c.register(cid, "bench", "bench")
                for end in range(1, k + 1):
                    t0 = time.perf_counter()
                    c.ack(cid, "bench", end, "bench")
                    times.append(time.perf_counter() - t0)
        else:
            with filechannel.ChannelReader(d, "bench", identity="bench") as r:
                for end in range(1, k + 1):
                    t0 = time.perf_counter()
                    r.ack(end)
                    times.append(time.perf_counter() - t0)
        times.sort()
        out.append({"p50_ms": times[len(times) // 2] * 1000, "p99_ms": times[int(len(times) * 0.99)] * 1000})
    return out[0], out[1]


def main_agents(args: argparse.Namespace, n: int, repeats: int) -> int:
    """``--agents``: the agent source on a standalone cluster against today's source on local[2]."""
    from pathlib import Path

    cluster_mod = cluster_module()
    machine = machine_info(args.data_dir or tempfile.gettempdir())
    res = Results(machine)
    root = tempfile.mkdtemp(prefix="fc-spark-agents-", dir=args.data_dir)
    hosts = os.path.join(root, "hosts")
    os.makedirs(hosts)
    t_start = time.time()
    load_before = os.getloadavg()
    cluster = cluster_mod.StandaloneCluster(Path(root) / "spark", hide=Path(hosts))
    agents: list[Any] = []
    try:
        cluster.start()
        for rep in range(repeats):
            chans: dict[str, list[str]] = {}
            for size in SIZES:
                one = os.path.join(hosts, f"one-{size}-{rep}", "ch")
                _fill(one, n, size)
                three = [os.path.join(hosts, f"three-{size}-{rep}-{i}", "ch") for i in range(3)]
                for i, d in enumerate(three):
                    _fill(d, n // 3 + (1 if i < n % 3 else 0), size)
                chans[f"one-{size}"] = [one]
                chans[f"three-{size}"] = three
            spark = _session(root)
            local = {size: run_source(spark, root, n, size, f"{size}-{rep}") for size in SIZES}
            spark.stop()
            for key, dirs in chans.items():
                for i, d in enumerate(dirs):
                    ag = cluster_mod.Agent(f"{key}-{rep}-{i}", Path(d), Path(root))
                    (Path(root) / "logs").mkdir(exist_ok=True)
                    ag.start()
                    agents.append((key, ag))
            spark = _cluster_session(cluster.session_conf(Path(root) / "driver"))
            for size in SIZES:
                for shape in ("one", "three"):
                    mine = [ag for k, ag in agents if k == f"{shape}-{size}"]
                    cpu0 = sum(_cpu_seconds(ag.proc.pid) for ag in mine)
                    r = run_agent_source(spark, root, [ag.uri for ag in mine], n, f"{shape}-{size}-{rep}")
                    cpu = sum(_cpu_seconds(ag.proc.pid) for ag in mine) - cpu0
                    system = "agent source, 1 agent" if shape == "one" else "agent source, 3 agents"
                    res.add("to parquet", size, system, r)
                    res.add(
                        "to parquet", size, system.replace("agent source", "agent CPU"), {"us_per_event": cpu / n * 1e6}
                    )
                    res.add(
                        "to parquet",
                        size,
                        system.replace("agent source", "agent / local"),
                        {"ratio": r["events_per_s"] / local[size]["events_per_s"]},
                    )
                res.add("to parquet", size, "filechannel source, local[2]", local[size])
            spark.stop()
            for _, ag in agents:
                ag.kill9()
            agents.clear()
            flight, loc = ack_latencies(root, str(rep))
            res.add("ack", 100, "over Flight p50", {"ms": flight["p50_ms"]})
            res.add("ack", 100, "over Flight p99", {"ms": flight["p99_ms"]})
            res.add("ack", 100, "local p50", {"ms": loc["p50_ms"]})
            res.add("ack", 100, "local p99", {"ms": loc["p99_ms"]})
        res.emit_all(args.quick)
    finally:
        for _, ag in agents:
            if ag.proc is not None:
                ag.kill9()
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
    cmd = "python -m bench.spark --agents" + (" --quick" if args.quick else "")
    run = {
        "type": "run",
        "bench": "spark-agents",
        "quick": args.quick,
        "n": n,
        "repeats": repeats,
        "hidden": cluster.hidden,
        "seconds": time.time() - t_start,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
    }
    print(json.dumps(run), flush=True)
    print(
        f"\n`{cmd}`: n={n}, repeats={repeats}, {run['seconds']:.0f} s (session and cluster start-ups excluded), "
        f"worker {'blind to the channel files (unshare --mount)' if cluster.hidden else 'NOT in a mount namespace'}, "
        f"load average {load_before[0]:.2f} before, {run['loadavg_after'][0]:.2f} after (1 min)"
        + (" -- QUICK figures, not for the record" if args.quick else "")
        + f"\n\n{summary(res.rows)}",
        file=sys.stderr,
    )
    return 0


def main_decode(args: argparse.Namespace, n: int, repeats: int) -> int:
    """``--agent-decode``: an executor's decode of one agent range, Events then arrays against ``read_arrow``."""
    import pyarrow as pa

    from filechannel.agent import connect, serve
    from filechannel.arrow import schema

    res = Results(machine_info(args.data_dir or tempfile.gettempdir()))
    root = tempfile.mkdtemp(prefix="fc-spark-decode-", dir=args.data_dir)
    headers = schema().field("headers").type

    def events_then_arrays(c: Any, cid: str) -> int:  # the agent source's decode before issue 33
        rows = 0
        for seg in c.read_raw(cid, 0, n):
            evs = seg.events(None)
            cols = [
                pa.array([e.position for e in evs], pa.int64()),
                pa.array([e.body for e in evs], pa.binary()),
                pa.array([list(e.headers.items()) for e in evs], headers),
            ]
            rows += pa.RecordBatch.from_arrays(cols, schema=schema()).num_rows
        return rows

    try:
        for size in SIZES:
            d = os.path.join(root, f"c{size}")
            _fill(d, n, size)
            with serve([d], "grpc://127.0.0.1:0") as agent, connect(agent.location, timeout=120) as c:
                cid = next(iter(c.channels()))
                for _ in range(repeats):
                    rates = {}
                    for system, fn in (
                        ("Events, then arrays", lambda c=c, cid=cid: events_then_arrays(c, cid)),
                        ("read_arrow", lambda c=c, cid=cid: c.read_arrow(cid, 0, n).num_rows),
                    ):
                        t0 = time.perf_counter()
                        if fn() != n:
                            raise RuntimeError(f"{system} read the wrong number of events")
                        rates[system] = n / (time.perf_counter() - t0)
                        res.add("agent decode", size, system, {"events_per_s": rates[system]})
                    ratio = rates["read_arrow"] / rates["Events, then arrays"]
                    res.add("agent decode", size, "read_arrow / before", {"ratio": ratio})
        res.emit_all(args.quick)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\n`python -m bench.spark --agent-decode`: n={n}\n\n{summary(res.rows)}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.spark", description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, help="events per run (default 200000, quick 5000)")
    ap.add_argument("--repeats", type=int, help="repeats per case (default 3, quick 1)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: small n, one repeat")
    ap.add_argument("--data-dir", default=None, help="where channels and tables are created (default: the temp dir)")
    ap.add_argument(
        "--agents", action="store_true", help="the agent source on a standalone cluster against local[2] (issue 24)"
    )
    ap.add_argument("--source-only", action="store_true", help="the source cases only (no sink runs)")
    ap.add_argument(
        "--agent-decode", action="store_true", help="an executor's decode of one agent range (no Spark, issue 33)"
    )
    ap.add_argument(
        "--headers-only", action="store_true", help="the sink's headers-map cases only (with and without, floor sink)"
    )
    args = ap.parse_args(argv)
    n = args.n or (5000 if args.quick else 200_000)
    repeats = args.repeats or (1 if args.quick else 3)
    if args.agents:
        return main_agents(args, n, repeats)
    if args.agent_decode:
        return main_decode(args, n, repeats)
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
        spark.dataSource.register(_floor_source())
        for rep in range(repeats):
            for size in SIZES:
                tag = f"{size}-{rep}"
                if not args.source_only:
                    h = run_sink_headers(spark, root, n, size, tag)
                    for system, m in h.items():
                        res.add("headers map", size, system, m)
                    with_h, without = h["filechannel sink, headers"], h["filechannel sink, no headers"]
                    res.add(
                        "headers map",
                        size,
                        "sink / floor, headers",
                        {"ratio": with_h["events_per_s"] / h["floor sink, headers"]["events_per_s"]},
                    )
                    res.add(
                        "headers map",
                        size,
                        "headers / no headers",
                        {"ratio": with_h["events_per_s"] / without["events_per_s"]},
                    )
                if args.headers_only:
                    continue
                src = run_source(spark, root, n, size, tag)
                rate = run_rate(spark, root, n, size, tag)
                res.add("to parquet", size, "filechannel source", src)
                res.add("to parquet", size, "rate-micro-batch", rate)
                res.add("to parquet", size, "source / rate", {"ratio": src["events_per_s"] / rate["events_per_s"]})
                if args.source_only:
                    continue
                sink, pq = run_sink(spark, root, n, size, tag)
                res.add("from DataFrame", size, "filechannel sink", sink)
                res.add("from DataFrame", size, "parquet write", pq)
                res.add("from DataFrame", size, "sink / parquet", {"ratio": sink["events_per_s"] / pq["events_per_s"]})
                sink, pq = run_sink(spark, root, n, size, tag + "-d", distinct=True)
                res.add("distinct bodies", size, "filechannel sink", sink)
                res.add("distinct bodies", size, "parquet write", pq)
                res.add("distinct bodies", size, "sink / parquet", {"ratio": sink["events_per_s"] / pq["events_per_s"]})
        res.emit_all(args.quick)
    finally:
        spark.stop()
        shutil.rmtree(root, ignore_errors=True)
    cmd = (
        "python -m bench.spark"
        + (" --quick" if args.quick else "")
        + (" --source-only" if args.source_only else "")
        + (" --headers-only" if args.headers_only else "")
    )
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
