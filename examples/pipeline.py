"""The main job, end to end: a producer feeds a channel, Spark streams it into Parquet, both crash.

One command (``scripts/demo.sh``, or ``python examples/pipeline.py [WORKDIR]``)
runs, in separate processes:

1. a **producer** that puts numbered events into a channel at a steady rate, in
   transactions of varying size, rolling some back; after each commit returns
   it appends the committed sequence numbers to a ledger (``WORKDIR/ledger``);
2. a **Spark Structured Streaming query** (``local[2]``) in its own driver
   process, reading the channel with ``maxEventsPerTrigger`` into a Parquet
   table with a checkpoint (the file sink is exactly-once);
3. mid-stream, during a micro-batch, the driver and its JVM and Python workers
   are killed with SIGKILL (every process of its session) and a new driver is started
   on the same checkpoint; then the producer is killed with SIGKILL and restarted:
   it recovers the channel, settles the transaction it was committing from what
   the channel holds, and continues the sequence;
4. the producer stops; the driver stops its query and, in the same session (a
   JVM start saved), drains the rest with ``availableNow``; then the table is
   checked against the ledger and the run prints
   ``produced N, delivered N, duplicated 0, lost 0`` and shows the table through Spark.

The channel is encrypted at rest (AES-256-GCM; ``filechannel keygen`` makes
``WORKDIR/keys.json``, the producer encrypts with it and Spark's executors
decrypt with ``.option("keystore", ...)``); ``--plaintext`` turns that off.

The exit status is 0 only when nothing was lost, duplicated, or delivered that
was never committed (a rolled-back event), every body and header is byte for
byte what was put, none of the newest committed bodies or header names is
readable in the channel's files, and no process of the run is left behind.

The hidden option ``--role producer|query`` runs one of the child processes;
without it the orchestrator runs the scenario. Rates, sizes and durations are
options: ``python examples/pipeline.py --help``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import unquote, urlparse

from filechannel.testing.stream import kill_session, session_pids

REGIONS = ("eu-west", "us-east", "ap-south", "sa-east")
CONSUMER = "parquet-table"
LEDGER = "ledger"
KEYSTORE = "keys.json"
CHECK_FAILED = 3  # the final run's exit status when the check finds a problem


def _log(msg: str) -> None:
    print(f"[pipeline] {msg}", flush=True)


# ------------------------------------------------------------------------------------------
# The events: everything about event number `seq` follows from `seq`, so the check can
# compare every delivered body and header byte for byte.


def body_of(seq: int, size: int) -> bytes:
    """The body of event ``seq``: its number, then ``size`` bytes in all of a pattern drawn from it."""
    head = b"%012d|" % seq
    pad = hashlib.blake2b(seq.to_bytes(8, "little"), digest_size=32).hexdigest().encode()
    need = max(0, size - len(head))
    return head + (pad * (need // len(pad) + 1))[:need]


def region_of(seq: int) -> str:
    """The ``region`` header of event ``seq``."""
    return REGIONS[(seq * 2654435761 >> 7) % len(REGIONS)]


def seq_of(body: bytes) -> int:
    """The sequence number at the start of a body."""
    return int(body[:12])


# ------------------------------------------------------------------------------------------
# The ledger: what the producer committed, rolled back or could not settle, one line each.
#
#   S <next_position>            a producer started (the channel's next position after recovery)
#   B <first> <last>             about to commit (or roll back) events first..last
#   C <first> <last> <next_pos>  committed: commit() returned (next_pos: the channel's next position)
#   R <first> <last>             rolled back
#   X <first> <last>             a killed producer's B that the channel shows was not committed


class Ledger:
    """The parsed ledger: committed and not-committed ranges (inclusive), followed incrementally."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self.committed: list[tuple[int, int]] = []
        self.dropped: list[tuple[int, int]] = []  # rolled back, or never committed
        self.in_doubt: tuple[int, int] | None = None
        self.last_position = 0
        self.next_seq = 0
        self.produced = 0
        self.rollbacks = 0
        self.starts = 0
        self._offset = 0

    def poll(self) -> Ledger:
        """Read the lines appended since the last call (only whole lines)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return self
        end = data.rfind(b"\n") + 1
        self._offset += end
        for line in data[:end].decode("ascii", "replace").splitlines():
            self._apply(line.split())
        return self

    def _apply(self, parts: list[str]) -> None:
        if not parts or not all(p.isdigit() for p in parts[1:]):
            return
        kind, nums = parts[0], [int(p) for p in parts[1:]]
        if kind == "S" and len(nums) == 1:
            self.last_position = nums[0]
            self.starts += 1
        elif kind == "B" and len(nums) == 2:
            self.in_doubt = (nums[0], nums[1])
            self.next_seq = max(self.next_seq, nums[1] + 1)
        elif kind == "C" and len(nums) == 3:
            self.committed.append((nums[0], nums[1]))
            self.produced += nums[1] - nums[0] + 1
            self.last_position = nums[2]
            self.in_doubt = None
        elif kind in ("R", "X") and len(nums) == 2:
            self.dropped.append((nums[0], nums[1]))
            self.rollbacks += kind == "R"
            self.in_doubt = None


# ------------------------------------------------------------------------------------------
# The producer process.


def run_producer(args: argparse.Namespace) -> int:
    """Put events at ``args.rate`` per second until SIGTERM; log every outcome to the ledger."""
    import filechannel

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    _stop_when_orphaned(stop)
    work = Path(args.workdir)
    t0 = time.monotonic()
    ch = filechannel.open(
        work / "channel",
        max_file_size=args.file_size,
        checkpoint_interval=5.0,
        ack_interval=0.5,
        encryption=None if args.plaintext else filechannel.Encryption(keys=str(work / KEYSTORE)),
    )
    opened = time.monotonic() - t0
    ledger = Ledger(work / LEDGER).poll()
    st = ch.stats()
    pos = st["next_position"]
    with open(work / LEDGER, "a", encoding="ascii") as out:
        if ledger._offset != os.path.getsize(work / LEDGER):
            out.write("\n")  # a line cut short by a kill: end it, the parser skips it
        settled = "none"
        if ledger.in_doubt is not None:
            first, last = ledger.in_doubt
            # Only this producer puts: the transaction committed iff the channel's next
            # position moved past the one recorded after the previous commit, by its size.
            if pos == ledger.last_position + last - first + 1:
                out.write(f"C {first} {last} {pos}\n")
                settled = f"events {first}..{last} committed"
            elif pos == ledger.last_position:
                out.write(f"X {first} {last}\n")
                settled = f"events {first}..{last} not committed"
            else:
                raise RuntimeError(
                    f"cannot settle events {first}..{last}: the channel's next position is {pos}, "
                    f"{ledger.last_position} after the last commit in the ledger"
                )
        out.write(f"S {pos}\n")
        out.flush()
        print(
            f"recovered in {opened:.2f} s: {st['queue_size']} events queued, next position {pos}, "
            f"transaction in flight at the kill: {settled}; continuing at event {ledger.next_seq}",
            flush=True,
        )
        rng = random.Random(args.seed * 1000 + ledger.next_seq)
        seq = ledger.next_seq
        run = args.run
        put = 0
        start = time.monotonic()
        while not stop.is_set():
            n = rng.randint(max(1, args.batch // 2), args.batch * 3 // 2)
            rollback = rng.random() < args.rollback
            out.write(f"B {seq} {seq + n - 1}\n")
            out.flush()
            tx = ch.transaction()
            for s in range(seq, seq + n):
                tx.put(body_of(s, args.event_size), headers={"region": region_of(s), "producer": run})
                put += 1
                if put % 25 == 0:  # a steady rate: the transaction stays open while it fills
                    delay = start + put / args.rate - time.monotonic()
                    if delay > 0:
                        time.sleep(delay)
            if rollback:
                tx.rollback()
                out.write(f"R {seq} {seq + n - 1}\n")
            else:
                tx.commit()
                out.write(f"C {seq} {seq + n - 1} {ch.stats()['next_position']}\n")
            out.flush()
            seq += n
    ch.close()
    print(f"stopped at event {seq}", flush=True)
    return 0


def _stop_when_orphaned(stop: threading.Event) -> None:
    """Set ``stop`` if the orchestrator dies (even by SIGKILL): a child never outlives the run."""
    parent = os.getppid()

    def watch() -> None:
        while not stop.wait(0.5):
            if os.getppid() != parent:
                stop.set()

    threading.Thread(target=watch, daemon=True).start()


# ------------------------------------------------------------------------------------------
# The Spark driver processes.


def spark_session(app: str) -> Any:
    """A local[2] session (UI off, one shuffle partition) with the filechannel source registered."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # the workers need filechannel and pyarrow
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master("local[2]")
        .appName(app)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "1")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    import filechannel.spark

    filechannel.spark.register(spark)
    return spark


def start_query(spark: Any, args: argparse.Namespace, available_now: bool) -> Any:
    """Start the channel -> Parquet query on the run's checkpoint."""
    work = Path(args.workdir)
    reader = spark.readStream.format("filechannel").option("consumer", CONSUMER)
    if not args.plaintext:
        reader = reader.option("keystore", str(work / KEYSTORE))  # the executors decrypt
    events = reader.option("maxEventsPerTrigger", args.max_events).load(str(work / "channel"))
    w = (
        events.writeStream.format("parquet")
        .option("path", str(work / "table"))
        .option("checkpointLocation", str(work / "checkpoint"))
        .queryName("channel_to_parquet")
    )
    w = w.trigger(availableNow=True) if available_now else w.trigger(processingTime=f"{args.trigger} seconds")
    return w.start()


def run_query(args: argparse.Namespace) -> int:
    """Run the streaming query until a signal.

    SIGTERM: stop the query and the session. SIGUSR1: stop the query, then in
    the same session drain the rest with availableNow, check and show the table
    (:func:`drain_and_check`); that saves a JVM start.
    """
    # stdout (a pipe the orchestrator prints) is for the report only: everything else
    # writing to fd 1, the JVM included, writes to the log (fd 2).
    report = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    stop = threading.Event()
    drain = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGUSR1, lambda *_: (drain.set(), stop.set()))
    _stop_when_orphaned(stop)
    spark = spark_session("filechannel-pipeline")
    q = start_query(spark, args, available_now=False)
    print(f"query {q.id} started", file=sys.stderr, flush=True)
    while not stop.is_set():
        if q.awaitTermination(0.5):
            break  # the query failed (the exception is raised below)
    if q.exception() is not None:
        raise q.exception()
    q.stop()  # a micro-batch it interrupts is replayed by the next run, like after a crash
    rc = 0
    if drain.is_set():
        with contextlib.redirect_stdout(report):
            rc = drain_and_check(spark, args)
    spark.stop()
    return rc


def drain_and_check(spark: Any, args: argparse.Namespace) -> int:
    """Drain what is left with availableNow, check the table against the ledger, show it."""
    work = Path(args.workdir)
    t0 = time.monotonic()
    before = _commits(work / "checkpoint")
    q = start_query(spark, args, available_now=True)
    q.awaitTermination()
    if q.exception() is not None:
        raise q.exception()
    rows = sum(int(p["numInputRows"]) for p in q.recentProgress)
    batches = _commits(work / "checkpoint") - before
    _log(f"final drain (availableNow): {batches} micro-batches, {rows:,} events in {time.monotonic() - t0:.1f} s")
    result = verify(work)
    ok = report(result)
    ok = check_at_rest(work, args) and ok

    from pyspark.sql import functions as F

    table = spark.read.parquet(str(work / "table"))
    print("\nThe Parquet table through Spark, a few rows:", flush=True)
    body = F.expr("substring(cast(body as string), 1, 28)").alias("body")
    table.orderBy("position").select("position", body, "headers").show(5, truncate=False)
    runs = [f"run-{i}" for i in range(1, Ledger(work / LEDGER).poll().starts + 1)]
    counts = (
        table.select(F.col("headers")["region"].alias("region"), F.col("headers")["producer"].alias("producer"))
        .groupBy("region")
        .pivot("producer", runs)
        .count()
        .orderBy("region")
        .collect()
    )
    print("Events per region (header `region`) and producer run (header `producer`):", flush=True)
    print(f"  {'region':<10}" + "".join(f"{r:>10}" for r in runs) + f"{'all':>10}")
    n = 0
    for row in counts:
        cells = [row[r] or 0 for r in runs]
        n += sum(cells)
        print(f"  {row['region']:<10}" + "".join(f"{c:>10,}" for c in cells) + f"{sum(cells):>10,}")
    print(f"  {'all':<10}{'':>{10 * len(runs)}}{n:>10,}", flush=True)
    if n != result["rows"]:
        _log(f"FAIL: Spark reads {n:,} rows from the table, the check read {result['rows']:,}")
        ok = False
    return 0 if ok else CHECK_FAILED


# ------------------------------------------------------------------------------------------
# The table as the file sink committed it: the files its _spark_metadata log lists (a
# batch killed mid-write may leave files it never committed; readers ignore them).


def table_files(table: Path) -> list[Path]:
    """The Parquet files of the committed batches (every file when there is no sink log)."""
    meta = table / "_spark_metadata"
    if not meta.is_dir():
        return sorted(table.glob("*.parquet")) if table.is_dir() else []
    logs: dict[int, Path] = {}
    compact = -1
    for p in meta.iterdir():
        name = p.name
        if name.startswith("."):
            continue
        stem = name.removesuffix(".compact")
        if not stem.isdigit():
            continue
        logs[int(stem)] = p
        if name.endswith(".compact"):
            compact = max(compact, int(stem))
    files: dict[str, None] = {}
    for batch in sorted(b for b in logs if b >= compact):
        lines = logs[batch].read_text().splitlines()
        for line in lines[1:]:
            entry = json.loads(line)
            path = unquote(urlparse(entry["path"]).path)
            if entry.get("action", "add") == "delete":
                files.pop(path, None)
            else:
                files[path] = None
    return [Path(p) for p in files]


def _commits(checkpoint: Path) -> int:
    d = checkpoint / "commits"
    return sum(1 for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else 0


def _batch_in_flight(checkpoint: Path) -> int | None:
    """The id of the micro-batch whose offsets the query logged and has not committed yet, if any."""

    def ids(d: Path) -> set[int]:
        return {int(p.name) for p in d.iterdir() if p.name.isdigit()} if d.is_dir() else set()

    offsets = ids(checkpoint / "offsets")
    if offsets and max(offsets) not in ids(checkpoint / "commits"):
        return max(offsets)
    return None


class Monitor:
    """Produced (from the ledger) and delivered (from the table) counts, followed incrementally."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.ledger = Ledger(workdir / LEDGER)
        self._rows: dict[Path, int] = {}
        self.delivered = 0
        self.phase = "starting"
        self.t0 = time.monotonic()
        self.lock = threading.Lock()

    def poll(self) -> None:
        """Refresh both counts."""
        import pyarrow.parquet as pq

        with self.lock:
            self.ledger.poll()
            total = 0
            for f in table_files(self.workdir / "table"):
                n = self._rows.get(f)
                if n is None:
                    try:
                        n = self._rows[f] = pq.read_metadata(f).num_rows
                    except (OSError, ValueError):
                        n = 0
                total += n
            self.delivered = total

    def line(self) -> str:
        """The progress line."""
        return (
            f"[{time.monotonic() - self.t0:5.1f}s] {self.phase:<34} produced {self.ledger.produced:>9,}  "
            f"delivered {self.delivered:>9,}  batches {_commits(self.workdir / 'checkpoint'):>4}"
        )


# ------------------------------------------------------------------------------------------
# The check.


def verify(workdir: str | os.PathLike[str]) -> dict[str, Any]:
    """Compare the committed table with the ledger, event by event."""
    import pyarrow.parquet as pq

    work = Path(workdir)
    ledger = Ledger(work / LEDGER).poll()
    args = json.loads((work / "options.json").read_text())
    produced: set[int] = set()
    for a, b in ledger.committed:
        produced.update(range(a, b + 1))
    seen: set[int] = set()
    positions: set[int] = set()
    dup = rows = bad = 0
    for f in table_files(work / "table"):
        t = pq.read_table(f, columns=["position", "body", "headers"])
        cols = (t.column("position").to_pylist(), t.column("body").to_pylist(), t.column("headers").to_pylist())
        for pos, body, headers in zip(*cols, strict=True):
            rows += 1
            seq = seq_of(body)
            if seq in seen:
                dup += 1
            seen.add(seq)
            positions.add(pos)
            hdrs = dict(headers)
            if body != body_of(seq, args["event_size"]) or hdrs.get("region") != region_of(seq):
                bad += 1
    dropped = sum(b - a + 1 for a, b in ledger.dropped)
    return {
        "produced": len(produced),
        "delivered": len(seen & produced),
        "rows": rows,
        "duplicated": dup,
        "lost": len(produced - seen),
        "never_committed": len(seen - produced),
        "same_position_twice": rows - len(positions) - dup,
        "damaged": bad,
        "rolled_back": dropped,
        "rollbacks": ledger.rollbacks,
    }


def check_at_rest(work: Path, args: argparse.Namespace) -> bool:
    """Look for the newest committed events' bodies and headers in the channel's files.

    Encrypted (the default), none may be there; with ``--plaintext`` the count
    shows what the search finds when nothing is encrypted.
    """
    ledger = Ledger(work / LEDGER).poll()
    recent = sorted(s for a, b in ledger.committed for s in range(a, b + 1))[-1000:]
    data = b"".join(
        p.read_bytes() for p in sorted((work / "channel").rglob("*")) if p.is_file() and p.name.startswith("seg-")
    )
    found = sum(body_of(s, args.event_size) in data for s in recent)
    files = sum(1 for p in (work / "channel").rglob("seg-*.wal"))
    marker = b"region"  # every event's header name
    if args.plaintext:
        _log(f"at rest, not encrypted: {found} of the {len(recent)} newest bodies readable in {files} data files")
        return True
    print(
        f"at rest: {files} data files, encrypted; {found} of the {len(recent)} newest committed bodies "
        f"and {data.count(marker)} header names readable",
        flush=True,
    )
    return found == 0 and marker not in data


def report(r: dict[str, Any]) -> bool:
    """Print the verdict; True when every count that must be 0 is 0."""
    print(
        f"produced {r['produced']}, delivered {r['delivered']}, duplicated {r['duplicated']}, lost {r['lost']}",
        flush=True,
    )
    _log(
        f"rolled back or never committed: {r['rolled_back']:,} events ({r['rollbacks']} rollbacks), "
        f"of which in the table: {r['never_committed']}; bodies or headers not as put: {r['damaged']}"
    )
    return not (r["duplicated"] or r["lost"] or r["never_committed"] or r["damaged"] or r["same_position_twice"])


# ------------------------------------------------------------------------------------------
# The orchestrator.


def _kind(pid: int) -> str:
    """What a process of the run is, from its command line."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return "gone"
    if argv and os.path.basename(argv[0]) == "java":
        return "JVM"
    if any("pyspark" in a for a in argv):
        return "Spark Python worker"
    if "producer" in argv:
        return "producer"
    return "Python driver" if "query" in argv else "other"


class Child:
    """A child process in its own session, with its output in a log file."""

    def __init__(self, name: str, argv: list[str], log: Path, stdout: TextIO | int | None = None) -> None:
        self.name = name
        self.log = log
        self._out = open(log, "w")  # noqa: SIM115 - closed in reap()
        self.proc = subprocess.Popen(
            argv,
            stdout=stdout or self._out,
            stderr=self._out,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            text=True,
        )
        self.pid = self.proc.pid
        self.relay: threading.Thread | None = None
        self.stragglers = 0  # processes still alive 10 s after their session was killed

    def kill9(self) -> str:
        """SIGKILL every process of the session at once, then wait until nothing of it is left."""
        kinds: dict[str, int] = {}
        for p in session_pids(self.pid):
            kind = _kind(p)
            kinds[kind] = kinds.get(kind, 0) + 1
        t = time.monotonic()
        kill_session(self.pid)  # every process at once: PySpark's workers sit in a process group of their own
        self.proc.wait()
        left = self.reap(10.0)
        what = ", ".join(f"{k} {n}" for k, n in sorted(kinds.items()))
        self.stragglers += left
        gone = f"all gone {time.monotonic() - t:.1f} s later" if not left else "stragglers killed one by one"
        return f"{sum(kinds.values())} processes ({what}); {gone}; left afterwards: {left}"

    def reap(self, timeout: float) -> int:
        """Wait for every process of the session to end; SIGKILL stragglers; return how many there were."""
        deadline = time.monotonic() + timeout
        while session_pids(self.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = session_pids(self.pid)
        for p in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        self._out.close()
        return len(left)

    def stop(self, timeout: float) -> int:
        """SIGTERM, wait (SIGKILL after ``timeout``); return the exit status."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            _log(f"{self.name} did not stop within {timeout:.0f} s: SIGKILL")
            os.killpg(self.pid, signal.SIGKILL)
            rc = self.proc.wait()
        self.reap(10.0)
        return rc

    def tail(self, lines: int = 30) -> str:
        """The end of the child's log."""
        self._out.flush()
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


class Orchestrator:
    """Runs the scenario; every wait is bounded and checks that the children are alive."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = Path(args.workdir).resolve()
        self.mon = Monitor(self.work)
        self.children: list[Child] = []
        self.producer_runs = 0
        self.driver_runs = 0
        self.tty = sys.stderr.isatty()
        self._stop_progress = threading.Event()
        self._progress_thread: threading.Thread | None = None
        self._say = threading.Lock()

    def say(self, msg: str, prefix: bool = True) -> None:
        """Print a line (over the progress line on a terminal)."""
        with self._say:
            if self.tty:
                sys.stderr.write("\r\x1b[K")
                sys.stderr.flush()
            print(f"[pipeline] {msg}" if prefix else msg, flush=True)

    # -- children -----------------------------------------------------------------------

    def _argv(self, role: str, *extra: str) -> list[str]:
        a = self.args
        return [
            sys.executable,
            os.path.abspath(__file__),
            str(self.work),
            *("--role", role),
            *("--rate", str(a.rate), "--batch", str(a.batch), "--rollback", str(a.rollback)),
            *("--event-size", str(a.event_size), "--file-size", str(a.file_size), "--seed", str(a.seed)),
            *("--max-events", str(a.max_events), "--trigger", str(a.trigger)),
            *(("--plaintext",) if a.plaintext else ()),
            *extra,
        ]

    def start_producer(self) -> Child:
        """Start the next producer run and wait until it has recovered the channel."""
        self.producer_runs += 1
        n = self.producer_runs
        log = self.work / "logs" / f"producer-{n}.log"
        c = Child(f"producer #{n}", self._argv("producer", "--run", f"run-{n}"), log)
        self.children.append(c)
        line = self.wait_for(lambda: _first_line(log, "recovered"), 60, f"producer #{n} to open the channel", c)
        self.say(f"producer #{n} (pid {c.pid}) {line}")
        return c

    def start_driver(self) -> Child:
        """Start the next Spark driver process on the run's checkpoint; print what it reports."""
        self.driver_runs += 1
        n = self.driver_runs
        c = Child(f"Spark driver #{n}", self._argv("query"), self.work / "logs" / f"driver-{n}.log", subprocess.PIPE)
        self.children.append(c)
        self.say(f"Spark driver #{n} started (pid {c.pid}): local[2], maxEventsPerTrigger={self.args.max_events}")

        def relay() -> None:
            assert c.proc.stdout is not None
            for line in c.proc.stdout:
                self.relay_line(line)

        c.relay = threading.Thread(target=relay, daemon=True)
        c.relay.start()
        return c

    def relay_line(self, line: str) -> None:
        """Print a line of the driver's output; its final report ends the progress lines first.

        The report (the check and the table) follows the final drain's line: no
        progress line may fall between its lines.
        """
        if line.startswith("[pipeline] final drain"):
            self.phase("checking the table")
            self.stop_progress()
        self.say(line.rstrip("\n"), prefix=False)

    def wait_for(self, cond: Any, timeout: float, what: str, *watch: Child) -> Any:
        """Poll ``cond`` until it is true; fail if a watched child exits or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while True:
            self.mon.poll()
            got = cond()
            if got:
                return got
            for c in watch:
                if c.proc.poll() is not None:
                    rc = c.proc.returncode
                    raise RuntimeError(f"{c.name} exited with {rc} while waiting for {what}:\n{c.tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(0.2)

    # -- progress -----------------------------------------------------------------------

    def _progress(self) -> None:
        every = 1.0 if self.tty else self.args.progress
        while not self._stop_progress.wait(every):
            self.mon.poll()
            line = self.mon.line()
            with self._say:
                if self._stop_progress.is_set():
                    break  # stopped while it polled: the report may have begun
                sys.stderr.write(f"\r{line}\x1b[K" if self.tty else line + "\n")
                sys.stderr.flush()

    def start_progress(self) -> None:
        """Start the progress line (stderr), every second on a terminal, else every ``--progress`` seconds."""
        self._progress_thread = threading.Thread(target=self._progress, daemon=True)
        self._progress_thread.start()

    def stop_progress(self) -> None:
        """Stop the progress line for good (on a terminal, erase it): what is printed next stands alone."""
        with self._say:
            self._stop_progress.set()
        t = self._progress_thread
        if t is not None and t is not threading.current_thread():
            t.join()
        if self.tty:
            with self._say:
                sys.stderr.write("\r\x1b[K")
                sys.stderr.flush()

    def phase(self, name: str) -> None:
        """Name what is happening, for the progress line."""
        self.mon.phase = name

    # -- the scenario -------------------------------------------------------------------

    def run(self) -> int:
        """Run the scenario in a fresh work directory; on any failure, kill every child."""
        a = self.args
        if self.work.exists() and any(self.work.iterdir()) and not (self.work / "options.json").exists():
            self.say(f"FAIL: {self.work} is not empty and holds no earlier run (no options.json): not wiping it")
            return 2
        shutil.rmtree(self.work, ignore_errors=True)
        (self.work / "logs").mkdir(parents=True)
        (self.work / "options.json").write_text(json.dumps(vars(a)))
        if not a.plaintext:
            from filechannel.cli import main as filechannel_cli

            # `filechannel keygen`: a keystore readable by its owner only; the producer
            # encrypts with its key, the Spark executors decrypt with it.
            if filechannel_cli(["keygen", str(self.work / KEYSTORE), "--id", "demo"]) != 0:
                raise RuntimeError("filechannel keygen failed")
        self.say(
            f"work directory {self.work}: channel/, table/ (Parquet), checkpoint/, ledger, logs/; "
            f"producer {a.rate:,} events/s of {a.event_size} B, ~{a.batch} per transaction, "
            f"{a.rollback:.0%} rolled back; "
            + ("not encrypted (--plaintext)" if a.plaintext else f"encrypted at rest (AES-256-GCM, {KEYSTORE})")
        )
        self.start_progress()
        try:
            rc = self.scenario()
        except (RuntimeError, OSError) as exc:
            self.stop_progress()
            self.say(f"FAIL: {exc}")
            rc = 1
        finally:
            self.stop_progress()
            for c in self.children:  # after a failure (or Ctrl-C): leave nothing running
                if session_pids(c.pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(c.pid, signal.SIGKILL)
                    c.reap(10.0)
        return rc

    def scenario(self) -> int:
        """Producer, driver, kill -9 of the driver, restart, kill -9 of the producer, drain, check."""
        a = self.args
        mon = self.mon
        self.phase("producer starting")
        producer = self.start_producer()

        self.phase("driver #1: JVM start, first batch")
        driver = self.start_driver()
        t = time.monotonic()
        self.wait_for(lambda: mon.delivered > 0, 180, "the first micro-batch", driver, producer)
        self.say(
            f"driver #1: first micro-batch committed {time.monotonic() - t:.0f} s after the start "
            f"(JVM, Python workers); {mon.delivered:,} events in the table"
        )
        t = time.monotonic()
        self.phase("driver #1: streaming")
        self.wait_for(lambda: time.monotonic() - t > a.phase_seconds, a.phase_seconds + 5, "streaming", driver)
        self.phase("driver #1: waiting for a batch")
        self.wait_for(
            lambda: (
                _batch_in_flight(self.work / "checkpoint") is not None or time.monotonic() - t > a.phase_seconds + 10
            ),
            30,
            "a micro-batch in flight",
            driver,
        )
        mid = _batch_in_flight(self.work / "checkpoint")
        before = mon.delivered
        what = driver.kill9()
        self.phase("driver killed")
        when = "between micro-batches" if mid is None else f"in the middle of micro-batch {mid}"
        self.say(f"SIGKILL to Spark driver #1's session {when} ({before:,} events delivered): {what}")

        self.phase("driver #2: JVM start, replay")
        driver = self.start_driver()
        t = time.monotonic()
        self.wait_for(lambda: mon.delivered > before, 180, "the restarted query's first batch", driver, producer)
        again = f"replayed micro-batch {mid} from the checkpoint" if mid is not None else "first micro-batch committed"
        self.say(
            f"driver #2: {again} {time.monotonic() - t:.0f} s after the start; {mon.delivered:,} events in the table"
        )
        t = time.monotonic()
        self.phase("driver #2: streaming")
        self.wait_for(lambda: time.monotonic() - t > a.phase_seconds / 2, a.phase_seconds, "streaming", driver)
        what = producer.kill9()
        self.phase("producer killed")
        mon.poll()
        self.say(f"SIGKILL to producer #1 ({mon.ledger.produced:,} events committed): {what}")
        producer = self.start_producer()
        t = time.monotonic()
        self.phase("driver #2: streaming")
        self.wait_for(lambda: time.monotonic() - t > a.phase_seconds / 2, a.phase_seconds, "streaming", driver)

        self.phase("stopping the producer")
        rc = producer.stop(30)
        mon.poll()
        self.say(f"producer #2 stopped (exit {rc}): {mon.ledger.produced:,} events committed in all")
        if rc != 0:
            raise RuntimeError(f"the producer failed:\n{producer.tail()}")
        self.phase("final drain (availableNow)")
        self.say(
            "SIGUSR1 to Spark driver #2: query.stop(), then in the same session a final drain with availableNow, "
            "the check and the table"
        )
        os.kill(driver.pid, signal.SIGUSR1)
        rc = driver.proc.wait()
        assert driver.relay is not None
        driver.relay.join()
        left = driver.reap(10.0)
        self.stop_progress()
        if rc not in (0, CHECK_FAILED):
            raise RuntimeError(f"Spark driver #2 exited with {rc}:\n{driver.tail()}")
        stray = sum(len(session_pids(c.pid)) + c.stragglers for c in self.children) + left
        if stray:
            self.say(f"FAIL: {stray} processes of the run outlived their process (group)")
            return 1
        total = time.monotonic() - mon.t0
        self.say(f"{'OK' if rc == 0 else 'FAIL'}: no process of the run left; {total:.0f} s in all")
        return 0 if rc == 0 else 1


def _first_line(path: Path, prefix: str) -> str | None:
    try:
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith(prefix):
                return line
    except FileNotFoundError:
        pass
    return None


# ------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (the same options for the orchestrator and its children)."""
    p = argparse.ArgumentParser(
        prog=os.environ.get("FILECHANNEL_DEMO_PROG"),  # scripts/demo.sh names itself; run directly: pipeline.py
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument(
        "workdir", nargs="?", default="demo-work", help="wiped first if it holds an earlier run (default: ./demo-work)"
    )
    p.add_argument("--rate", type=int, default=2500, help="events per second put by the producer (2500)")
    p.add_argument("--batch", type=int, default=200, help="mean events per transaction (200)")
    p.add_argument("--rollback", type=float, default=0.1, help="fraction of transactions rolled back (0.1)")
    p.add_argument("--event-size", type=int, default=100, help="body bytes (100)")
    p.add_argument("--file-size", type=int, default=4 << 20, help="channel data file size (4 MiB)")
    p.add_argument("--max-events", type=int, default=10000, help="maxEventsPerTrigger (10000)")
    p.add_argument("--trigger", type=float, default=1.0, help="processing-time trigger, seconds (1)")
    p.add_argument("--phase-seconds", type=float, default=8.0, help="seconds of streaming before each kill (8)")
    p.add_argument("--progress", type=float, default=5.0, help="seconds between progress lines off a terminal (5)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument(
        "--plaintext", action="store_true", help="do not encrypt the channel (default: AES-256-GCM, keys in keys.json)"
    )
    p.add_argument("--role", choices=("producer", "query"), help=argparse.SUPPRESS)
    p.add_argument("--run", default="run-1", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Dispatch to the orchestrator or one of its child processes."""
    args = parse_args(argv)
    if args.role == "producer":
        return run_producer(args)
    if args.role == "query":
        return run_query(args)

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, interrupt)
    try:
        return Orchestrator(args).run()
    except KeyboardInterrupt:  # every child was killed on the way out
        _log("interrupted")
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
