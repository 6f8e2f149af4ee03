"""Many hosts, one Spark query: three producers with their own channel and agent, a standalone cluster, kills.

``scripts/demo.sh --cluster`` (or ``python examples/cluster.py [WORKDIR]``) runs,
on one machine, three "hosts" (``WORKDIR/hosts/h1..h3``), each with

1. a **producer** (``examples/pipeline.py --role producer``: steady puts with
   rollbacks, a ledger of what it committed) owning its channel, and
2. an **agent** (``filechannel serve``) serving that channel on a loopback port,
   over mutual TLS: its own certificate (``WORKDIR/pki/agent-hN.crt``), client
   certificates of the run's CA only, the allow-list ``--allow spark`` and
   ``--allow-consumer spark=cluster-table`` (the query's certificate name may read,
   and only as its consumer), and a bearer token (``--insecure``: plain
   ``grpc://127.0.0.1`` instead, no certificates);

and a **Spark standalone master and worker** started from the pyspark
package's ``bin/spark-class`` (UIs off). The worker runs under ``unshare
--mount`` with an empty tmpfs over ``WORKDIR/hosts``, so its executors cannot
see a channel file (without ``unshare`` it runs plainly, and says so). The
**driver** reads the three agents with ``option("agents", ...)`` into a Parquet
table. Mid-stream, during micro-batches: an agent is SIGKILLed (restarted 2 s
later on its port; the query's tasks fail and the query is restarted on its
checkpoint), then the driver with its JVM, then a producer. Then the producers
stop, the query drains, and each channel is checked against its producer's
ledger: every committed event once, byte for byte with its headers, no
rolled-back event, nothing lost; and no process of the run is left.

Exit status 0 only if all of that holds. Options: ``--help``. The hidden
``--role query`` runs the driver process.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pipeline  # examples/pipeline.py: the producer, its ledger, the bodies

from filechannel.testing.processes import restartable_port
from filechannel.testing.stream import kill_session, session_pids

ROOT = Path(__file__).resolve().parent.parent
HOSTS = ("h1", "h2", "h3")
CONSUMER = "cluster-table"


def _log(msg: str) -> None:
    print(f"[cluster] {msg}", flush=True)


def free_port() -> int:
    """A free loopback port (the kernel's choice)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spark_home() -> str:
    """The pyspark package's directory (it holds ``bin/spark-class`` and the jars)."""
    import pyspark

    return os.path.dirname(os.path.abspath(pyspark.__file__))


def unshare_works() -> bool:
    """Whether this user may run ``unshare --mount`` (and mount a tmpfs in it)."""
    if shutil.which("unshare") is None:
        return False
    try:
        r = subprocess.run(
            ["unshare", "--mount", "sh", "-c", "mount -t tmpfs none /mnt 2>/dev/null || exit 1"],
            capture_output=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return r.returncode == 0


class Proc:
    """A child process in its own session (so a SIGKILL of the session takes all it started)."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.argv = argv
        self.log = log
        self.env = env
        self._out = open(log, "ab")  # noqa: SIM115 - closed in reap()
        self.proc = subprocess.Popen(
            argv, stdout=self._out, stderr=self._out, stdin=subprocess.DEVNULL, start_new_session=True, env=env
        )
        self.pid = self.proc.pid

    def alive(self) -> bool:
        """Whether the process runs."""
        return self.proc.poll() is None

    def kill9(self) -> int:
        """SIGKILL every process of the session; return how many there were."""
        n = len(kill_session(self.pid))
        self.proc.wait()
        self.reap()
        return n

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM, wait up to ``timeout``, then SIGKILL whatever of the session is left."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        self.kill9()

    def reap(self, timeout: float = 10.0) -> None:
        """Wait for the session to end; SIGKILL stragglers."""
        deadline = time.monotonic() + timeout
        while session_pids(self.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if session_pids(self.pid):
            kill_session(self.pid)
        self._out.close()

    def tail(self, n: int = 20) -> str:
        """The end of the log."""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["PYSPARK_PYTHON"] = sys.executable
    env["SPARK_LOCAL_IP"] = "127.0.0.1"
    env.setdefault("SPARK_HOME", spark_home())
    return env


class StandaloneCluster:
    """A Spark standalone master and one worker (``spark-class``), on loopback, UIs off.

    ``hide``: a directory the worker (and so its executors) must not see: with
    ``unshare --mount`` an empty tmpfs is mounted over it in the worker's own
    mount namespace. ``self.hidden`` says whether that was possible.
    """

    def __init__(self, work: Path, *, cores: int = 2, memory: str = "2g", hide: Path | None = None) -> None:
        self.work = work
        self.cores = cores
        self.memory = memory
        self.hide = hide
        self.hidden = False
        self.master: Proc | None = None
        self.worker: Proc | None = None
        self.url = ""

    def __enter__(self) -> StandaloneCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 120.0) -> None:
        """Start the master, then the worker; return once the worker registered."""
        (self.work / "logs").mkdir(parents=True, exist_ok=True)
        cls = os.path.join(spark_home(), "bin", "spark-class")
        env = _env()
        env["SPARK_WORKER_DIR"] = str(self.work / "worker")
        env["SPARK_LOCAL_DIRS"] = str(self.work / "local")
        port = free_port()
        self.url = f"spark://127.0.0.1:{port}"
        master_log = self.work / "logs" / "master.log"
        self.master = Proc(
            "master",
            [
                cls,
                "org.apache.spark.deploy.master.Master",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                *("--webui-port", "0"),
            ],
            master_log,
            env,
        )
        self._wait(master_log, "I have been elected leader", timeout, self.master)
        worker = [cls, "org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1", "--webui-port", "0"]
        worker += ["--cores", str(self.cores), "--memory", self.memory, "--work-dir", str(self.work / "worker")]
        worker.append(self.url)
        if self.hide is not None and unshare_works():
            script = 'mount -t tmpfs -o size=1m,mode=0755 none "$0" && exec "$@"'
            worker = ["unshare", "--mount", "sh", "-c", script, str(self.hide), *worker]
            self.hidden = True
        worker_log = self.work / "logs" / "worker.log"
        self.worker = Proc("worker", worker, worker_log, env)
        self._wait(worker_log, "Successfully registered with master", timeout, self.worker)

    def _wait(self, log: Path, text: str, timeout: float, proc: Proc) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if log.exists() and text in log.read_text(errors="replace"):
                return
            if not proc.alive():
                raise RuntimeError(f"the Spark {proc.name} ended; its log ends:\n{proc.tail()}")
            time.sleep(0.2)
        raise RuntimeError(f"the Spark {proc.name} did not start within {timeout:.0f} s:\n{proc.tail()}")

    def executor_pids(self) -> list[int]:
        """The executor JVMs the worker started (``CoarseGrainedExecutorBackend``, in the worker's session)."""
        if self.worker is None:
            return []
        out = []
        for pid in session_pids(self.worker.pid):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"CoarseGrainedExecutorBackend" in cmd:
                out.append(pid)
        return out

    def stop(self) -> None:
        """SIGKILL the worker (its executors with it) and the master; nothing of them is left."""
        for p in (self.worker, self.master):
            if p is not None:
                p.kill9()
        self.worker = self.master = None

    def session_conf(self, local_dir: Path) -> dict[str, str]:
        """The settings of a driver's SparkSession on this cluster."""
        return {
            "spark.master": self.url,
            "spark.ui.enabled": "false",
            "spark.ui.showConsoleProgress": "false",
            "spark.driver.host": "127.0.0.1",
            "spark.driver.bindAddress": "127.0.0.1",
            "spark.executor.cores": str(self.cores),
            "spark.cores.max": str(self.cores),
            "spark.executor.memory": "1g",
            "spark.driver.memory": "1g",
            "spark.sql.shuffle.partitions": "2",
            "spark.pyspark.python": sys.executable,
            "spark.executorEnv.PYTHONPATH": str(ROOT),
            "spark.local.dir": str(local_dir),
            "spark.sql.streaming.stopTimeout": "30s",
        }


CLIENT_NAME = "spark"  # the query's certificate name (the agents' allow-list)


def make_pki(where: Path, hosts: tuple[str, ...]) -> dict[str, str]:
    """A CA of this run, a certificate per agent (for ``localhost``), the query's client certificate, a token.

    File paths by role: ``ca``, ``agent-HOST.crt`` / ``.key``, ``client.crt`` / ``.key``, ``token``
    (keys and token mode 0600). Made with ``filechannel.testing.pki`` (the ``cryptography``
    package, the crypto extra); the same files as docs/agents.md's ``openssl`` recipe.
    """
    import secrets

    from filechannel.testing.pki import PKI, write_file

    pki = PKI(where, "filechannel cluster demo CA", ca_file="ca")
    out = {"ca": pki.ca}
    for h in hosts:
        out[f"agent-{h}.crt"], out[f"agent-{h}.key"] = pki.issue(f"agent-{h}", server=True)
    out["client.crt"], out["client.key"] = pki.issue(CLIENT_NAME, stem="client")
    out["token"] = write_file(where / "token", secrets.token_hex(32).encode(), 0o600)
    return out


class Agent:
    """``filechannel serve DIR --listen grpc+tls://127.0.0.1:PORT`` with mutual TLS (restarted on the same port).

    ``pki`` None (``--insecure``): plain ``grpc://127.0.0.1:PORT``, no certificates or token.
    """

    def __init__(self, host: str, channel: Path, work: Path, pki: dict[str, str] | None) -> None:
        self.host = host
        self.channel = channel
        self.work = work
        self.pki = pki
        self.port = restartable_port()
        self.proc: Proc | None = None
        self.starts = 0

    @property
    def uri(self) -> str:
        """The agent's address (``localhost``, the name in its certificate, under TLS)."""
        if self.pki is None:
            return f"grpc://127.0.0.1:{self.port}"
        return f"grpc+tls://localhost:{self.port}"

    def _listen(self) -> list[str]:
        if self.pki is None:
            return ["--listen", self.uri]
        p = self.pki
        return [
            *("--listen", f"grpc+tls://127.0.0.1:{self.port}"),
            *("--tls-cert", p[f"agent-{self.host}.crt"], "--tls-key", p[f"agent-{self.host}.key"]),
            *("--client-ca", p["ca"], "--token-file", p["token"]),
            *("--allow", CLIENT_NAME, "--allow-consumer", f"{CLIENT_NAME}={CONSUMER}"),
        ]

    def start(self, timeout: float = 60.0) -> None:
        """Start the agent on its port; return once it listens."""
        self.starts += 1
        port_file = self.work / f"agent-{self.host}.port"
        with contextlib.suppress(FileNotFoundError):
            port_file.unlink()
        argv = [sys.executable, "-m", "filechannel", "serve", str(self.channel), *self._listen()]
        argv += ["--port-file", str(port_file)]
        deadline = time.monotonic() + timeout
        while True:
            log = self.work / "logs" / f"agent-{self.host}-{self.starts}.log"
            self.proc = Proc(f"agent {self.host}", argv, log, _env())
            while not port_file.exists() and self.proc.alive() and time.monotonic() < deadline:
                time.sleep(0.05)
            if port_file.exists():
                return
            self.proc.kill9()
            if time.monotonic() > deadline:
                raise RuntimeError(f"agent {self.host} did not start:\n{self.proc.tail()}")
            time.sleep(0.3)  # the port is not free again yet

    def kill9(self) -> int:
        """SIGKILL the agent's session; return how many processes there were."""
        assert self.proc is not None
        n = self.proc.kill9()
        self.proc = None
        return n


# ------------------------------------------------------------------------------------------
# The driver process


def drive(app: str, session: dict[str, str], options: dict[str, str], work: Path, trigger: float) -> int:
    """A driver: read with ``options`` into the Parquet table ``work/table``; restart the query when it fails.

    ``session`` is the Spark session's config; the query's checkpoint is ``work/checkpoint``
    and its micro-batches come every ``trigger`` seconds. Stops on SIGTERM.
    """
    from pyspark.sql import SparkSession

    import filechannel.spark

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    builder = SparkSession.builder.appName(app)
    for k, v in session.items():
        builder = builder.config(k, v)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    filechannel.spark.register(spark)
    runs = 0
    while not stop.is_set():
        runs += 1
        q = (
            spark.readStream.format("filechannel")
            .options(**options)
            .load()
            .writeStream.format("parquet")
            .option("path", str(work / "table"))
            .option("checkpointLocation", str(work / "checkpoint"))
            .trigger(processingTime=f"{trigger} seconds")
            .start()
        )
        print(f"query run {runs} started", flush=True)
        while not stop.is_set() and q.isActive:
            time.sleep(0.2)
        if stop.is_set():
            q.stop()
            break
        err = q.exception()
        print(f"query run {runs} failed: {str(err).splitlines()[0] if err else 'stopped'}; restarting", flush=True)
        time.sleep(1.0)
    spark.stop()
    return 0


def run_query(args: argparse.Namespace) -> int:
    """The driver: read the agents into a Parquet table; restart the query when it fails; stop on SIGTERM."""
    work = Path(args.workdir)
    options = {
        "agents": (work / "agents").read_text().strip(),
        "consumer": CONSUMER,
        "maxEventsPerTrigger": str(args.max_events),
        "maxEventsPerPartition": str(max(1, args.max_events // 4)),
        "agentTimeoutMs": "3000",
        # The query's TLS files (paths: the executors read them on the worker), unless --insecure.
        **json.loads((work / "tls.json").read_text()),
    }
    return drive("filechannel-cluster", json.loads((work / "session.json").read_text()), options, work, args.trigger)


# ------------------------------------------------------------------------------------------
# The orchestrator


def committed(work: Path) -> dict[str, int]:
    """The positions of the last micro-batch Spark committed (``commits/N`` written)."""
    ck = work / "checkpoint"
    done = [int(p.name) for p in (ck / "commits").glob("[0-9]*")] if (ck / "commits").is_dir() else []
    if not done:
        return {}
    text = (ck / "offsets" / str(max(done))).read_text().splitlines()[-1]
    return dict(json.loads(text)["positions"])


def in_flight(work: Path) -> bool:
    """Whether a micro-batch is logged and not yet committed."""
    ck = work / "checkpoint"
    if not (ck / "offsets").is_dir():
        return False
    offs = {int(p.name) for p in (ck / "offsets").glob("[0-9]*")}
    done = {int(p.name) for p in (ck / "commits").glob("[0-9]*")} if (ck / "commits").is_dir() else set()
    return bool(offs) and max(offs) not in done


def wait_for(cond: Any, timeout: float, what: str, *watch: Proc) -> Any:
    """Poll ``cond`` until true (return it); fail if a watched process ends or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        for p in watch:
            if not p.alive():
                raise RuntimeError(f"{p.name} ended while waiting for {what}:\n{p.tail()}")
        time.sleep(0.1)
    raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")


def verify(work: Path, ids: dict[str, str], event_size: int) -> dict[str, dict[str, int]]:
    """Per channel: the table against that host's ledger (every committed event once, byte for byte)."""
    import pyarrow.parquet as pq

    by_channel: dict[str, list[tuple[int, bytes, dict[str, str]]]] = {}
    for f in pipeline.table_files(work / "table"):
        t = pq.read_table(f, columns=["channel", "position", "body", "headers"]).to_pydict()
        for ch, pos, body, headers in zip(t["channel"], t["position"], t["body"], t["headers"], strict=True):
            by_channel.setdefault(ch, []).append((pos, body, dict(headers)))
    out: dict[str, dict[str, int]] = {}
    for host, cid in ids.items():
        ledger = pipeline.Ledger(work / "hosts" / host / pipeline.LEDGER).poll()
        produced: set[int] = set()
        for a, b in ledger.committed:
            produced.update(range(a, b + 1))
        seen: set[int] = set()
        dup = bad = 0
        rows = by_channel.pop(cid, [])
        positions = [p for p, _, _ in rows]
        for _, body, headers in rows:
            seq = pipeline.seq_of(body)
            dup += seq in seen
            seen.add(seq)
            if (
                body != pipeline.body_of(seq, event_size)
                or headers.get("region") != pipeline.region_of(seq)
                or not headers.get("producer", "").startswith("run-")
            ):
                bad += 1
        out[host] = {
            "produced": len(produced),
            "delivered": len(seen & produced),
            "duplicated": dup,
            "lost": len(produced - seen),
            "never_committed": len(seen - produced),
            "same_position_twice": len(positions) - len(set(positions)),
            "damaged": bad,
            "rolled_back": sum(b - a + 1 for a, b in ledger.dropped),
        }
    if by_channel:
        out["(unknown channels)"] = {"rows": sum(len(v) for v in by_channel.values())}
    return out


class Run:
    """The scenario; every wait is bounded."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = Path(args.workdir).resolve()
        self.procs: list[Proc] = []
        self.cluster: StandaloneCluster | None = None
        self.agents: dict[str, Agent] = {}
        self.producers: dict[str, Proc] = {}
        self.producer_runs: dict[str, int] = dict.fromkeys(HOSTS, 0)
        self.driver: Proc | None = None
        self.drivers = 0

    def producer_argv(self, host: str) -> list[str]:
        """The command line of the next producer run of ``host``."""
        a = self.args
        self.producer_runs[host] += 1
        return [
            sys.executable,
            str(ROOT / "examples" / "pipeline.py"),
            str(self.work / "hosts" / host),
            *("--role", "producer", "--plaintext", "--run", f"run-{self.producer_runs[host]}"),
            *("--rate", str(a.rate), "--batch", str(a.batch), "--rollback", "0.1"),
            *("--event-size", str(a.event_size), "--file-size", str(1 << 20), "--seed", str(HOSTS.index(host) + 1)),
        ]

    def start_producer(self, host: str) -> None:
        """Start ``host``'s producer; return once it recovered the channel."""
        log = self.work / "logs" / f"producer-{host}-{self.producer_runs[host] + 1}.log"
        p = Proc(f"producer {host}", self.producer_argv(host), log, _env())
        self.procs.append(p)
        self.producers[host] = p
        wait_for(lambda: log.exists() and "recovered" in log.read_text(errors="replace"), 60, f"producer {host}", p)

    def start_driver(self) -> None:
        """Start a driver process (a new SparkSession on the cluster)."""
        self.drivers += 1
        log = self.work / "logs" / f"driver-{self.drivers}.log"
        argv = [sys.executable, os.path.abspath(__file__), str(self.work), "--role", "query"]
        argv += ["--max-events", str(self.args.max_events), "--trigger", str(self.args.trigger)]
        self.driver = Proc("driver", argv, log, _env())
        self.procs.append(self.driver)

    def batches(self) -> int:
        """How many micro-batches Spark committed."""
        d = self.work / "checkpoint" / "commits"
        return len(list(d.glob("[0-9]*"))) if d.is_dir() else 0

    def run(self) -> int:
        """Run the scenario in a fresh work directory; return the exit status."""
        if self.work.exists():
            shutil.rmtree(self.work)
        (self.work / "logs").mkdir(parents=True)
        hosts = self.work / "hosts"
        try:
            return self.scenario(hosts)
        finally:
            self.cleanup()

    def scenario(self, hosts: Path) -> int:
        """Set up, kill, drain, check."""
        import filechannel

        a = self.args
        t0 = time.monotonic()
        ids: dict[str, str] = {}
        for h in HOSTS:
            filechannel.open(hosts / h / "channel", minimum_required_space=0, max_file_size=1 << 20).close()
            ids[h] = filechannel.reader.channel_id_of(hosts / h / "channel").hex()
        self.cluster = StandaloneCluster(self.work / "spark", hide=hosts)
        self.cluster.start()
        _log(
            f"standalone master {self.cluster.url} and a worker "
            + (
                f"in its own mount namespace: {hosts} is an empty tmpfs there (executors cannot see the channels)"
                if self.cluster.hidden
                else "WITHOUT a mount namespace (`unshare --mount` is not allowed here): executors could see the files"
            )
        )
        pki = None if a.insecure else make_pki(self.work / "pki", HOSTS)
        tls = (
            {}
            if pki is None
            else {
                "tlsCa": pki["ca"],
                "tlsCert": pki["client.crt"],
                "tlsKey": pki["client.key"],
                "tokenFile": pki["token"],
            }
        )
        (self.work / "tls.json").write_text(json.dumps(tls))
        _log(
            "agents: plain grpc on loopback (--insecure): no certificates, no token"
            if pki is None
            else f"agents: mutual TLS with the run's CA ({self.work / 'pki'}), a certificate per agent, "
            f"--allow {CLIENT_NAME} --allow-consumer {CLIENT_NAME}={CONSUMER}, a bearer token"
        )
        for h in HOSTS:
            self.agents[h] = Agent(h, hosts / h / "channel", self.work, pki)
            self.agents[h].start()
            self.start_producer(h)
            _log(f"host {h}: channel {ids[h]}, producer pid {self.producers[h].pid}, agent {self.agents[h].uri}")
        (self.work / "agents").write_text(",".join(ag.uri for ag in self.agents.values()))
        (self.work / "session.json").write_text(json.dumps(self.cluster.session_conf(self.work / "spark" / "driver")))
        self.start_driver()
        assert self.driver is not None
        wait_for(lambda: self.batches() >= 2, 240, "the first micro-batches", self.driver)
        _log(f"streaming: {self.batches()} micro-batches committed")

        # 1. SIGKILL an agent while a micro-batch is in flight; it comes back 2 s later on its port
        wait_for(lambda: in_flight(self.work), 120, "a micro-batch in flight", self.driver)
        n = self.agents["h2"].kill9()
        _log(f"SIGKILL of agent h2 mid-batch ({n} process); restarting it in 2 s")
        time.sleep(2.0)
        self.agents["h2"].start()
        before = self.batches()
        wait_for(lambda: self.batches() >= before + 2, 240, "progress after the agent came back", self.driver)
        _log(f"agent h2 back; {self.batches()} micro-batches committed")

        # 2. SIGKILL the driver (its JVM and Python workers) mid-batch; a new driver resumes the checkpoint
        wait_for(lambda: in_flight(self.work), 120, "a micro-batch in flight", self.driver)
        n = self.driver.kill9()
        _log(f"SIGKILL of the driver's session mid-batch ({n} processes)")
        self.start_driver()
        before = self.batches()
        wait_for(lambda: self.batches() >= before + 2, 240, "progress after the driver restart", self.driver)
        _log(f"new driver streaming; {self.batches()} micro-batches committed")

        # 2b. SIGKILL the executor JVM mid-batch; the worker starts a new one and Spark retries the tasks
        wait_for(lambda: in_flight(self.work), 120, "a micro-batch in flight", self.driver)
        pids = self.cluster.executor_pids()
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        _log(f"SIGKILL of the executor JVM mid-batch ({len(pids)} process)")
        before = self.batches()
        wait_for(lambda: self.batches() >= before + 2, 240, "progress after the executor was killed", self.driver)
        _log(f"a new executor runs the tasks; {self.batches()} micro-batches committed")

        # 3. SIGKILL a producer (a transaction open or committing); a new one recovers the channel
        n = self.producers["h3"].kill9()
        _log(f"SIGKILL of producer h3 ({n} process)")
        self.start_producer("h3")
        time.sleep(a.phase_seconds)

        # 4. stop the producers; wait until Spark committed each channel's end; stop the driver
        for h in HOSTS:
            self.producers[h].stop()
        ends = {}
        for h in HOSTS:
            ledger = pipeline.Ledger(hosts / h / pipeline.LEDGER).poll()
            ends[ids[h]] = ledger.last_position
        _log(f"producers stopped; draining to {ends}")
        wait_for(
            lambda: all(committed(self.work).get(c, -1) >= e for c, e in ends.items()),
            300,
            "the query to drain every channel",
            self.driver,
        )
        self.driver.stop(60)
        self.cluster.stop()
        for ag in self.agents.values():
            ag.kill9()

        # 5. the check, per channel
        results = verify(self.work, ids, a.event_size)
        ok = True
        for host, r in results.items():
            good = (
                r.get("lost") == 0
                and r.get("duplicated") == 0
                and r.get("never_committed") == 0
                and r.get("damaged") == 0
                and r.get("same_position_twice") == 0
                and r.get("produced", 0) > 0
            )
            ok &= good
            _log(
                f"channel {host}: produced {r.get('produced')}, delivered {r.get('delivered')}, "
                f"duplicated {r.get('duplicated')}, lost {r.get('lost')}, rolled back and absent "
                f"{r.get('rolled_back')}, never committed {r.get('never_committed')}, damaged {r.get('damaged')}"
                + ("" if good else "  <-- FAILED")
            )
        left = self.cleanup()
        _log(f"processes left behind: {left}")
        ok &= left == 0
        _log(f"{'OK' if ok else 'FAILED'}: exactly once per channel, in {time.monotonic() - t0:.0f} s")
        return 0 if ok else pipeline.CHECK_FAILED

    def cleanup(self) -> int:
        """Kill whatever of the run is still alive; return how many processes there were."""
        left = 0
        for p in self.procs:
            left += len(session_pids(p.pid))
            if p.alive() or session_pids(p.pid):
                p.kill9()
        for ag in self.agents.values():
            if ag.proc is not None:
                left += len(session_pids(ag.proc.pid))
                ag.kill9()
        if self.cluster is not None:
            for p in (self.cluster.master, self.cluster.worker):
                if p is not None:
                    left += len(session_pids(p.pid))
            self.cluster.stop()
        return left


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(prog=os.environ.get("FILECHANNEL_DEMO_PROG"), description=__doc__.split("\n\n")[0])
    p.add_argument("workdir", nargs="?", default="demo-cluster", help="wiped first (default: ./demo-cluster)")
    p.add_argument("--rate", type=int, default=1000, help="events per second per producer (1000)")
    p.add_argument("--batch", type=int, default=100, help="mean events per transaction (100)")
    p.add_argument("--event-size", type=int, default=100, help="body bytes (100)")
    p.add_argument("--max-events", type=int, default=6000, help="maxEventsPerTrigger (6000)")
    p.add_argument("--trigger", type=float, default=1.0, help="processing-time trigger, seconds (1)")
    p.add_argument("--phase-seconds", type=float, default=5.0, help="seconds of streaming after the last kill (5)")
    p.add_argument(
        "--insecure",
        action="store_true",
        help="agents on plain grpc://127.0.0.1 without certificates or token (default: mutual TLS)",
    )
    p.add_argument("--role", choices=("query",), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the scenario, or the driver (``--role query``)."""
    args = parse_args(argv)
    if args.role == "query":
        return run_query(args)

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    try:
        return Run(args).run()
    except KeyboardInterrupt:
        _log("interrupted")
        return 130
    except RuntimeError as exc:
        _log(f"FAILED: {exc}")
        return 1


@contextlib.contextmanager
def standalone_cluster(work: Path, hide: Path | None = None, cores: int = 2) -> Iterator[StandaloneCluster]:
    """A :class:`StandaloneCluster` for the length of a ``with`` block (bench and tests use it)."""
    c = StandaloneCluster(work, cores=cores, hide=hide)
    try:
        c.start()
        yield c
    finally:
        c.stop()


if __name__ == "__main__":
    raise SystemExit(main())
