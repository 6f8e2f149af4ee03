"""The soak: three writable agents, producers on every write path, Spark through the agents, and a fault schedule.

    .venv/bin/python -m bench.soak --minutes N --seed S [--workdir DIR] [--png FILE] [--disk-fault auto|on|off]
    scripts/soak.sh [same options]

On one machine, for N minutes of load:

* **three agents** (``filechannel serve CH --writable``, hosts ``h1..h3``), each
  with its own channel directory, on ``grpc+tls`` and HTTPS with **mutual TLS**
  (a throwaway CA from :mod:`filechannel.testing.pki`), each following a log
  directory with its tail source (``--tail``);
* **producers on all three write paths** per agent: HTTP posts with an
  ``Idempotency-Key`` retried until ``200``; Flight ``put_batch`` with a
  producer sequence retried until answered; a file writer appending fixed-size
  lines to ``app.log`` and rotating it by rename (the tail source puts them).
  The HTTP and Flight producers keep a ledger (``I k a b`` before a batch is
  sent, ``A k n`` once it is acknowledged); a restarted producer first resends
  its unacknowledged batch with the same key or sequence. The files are the
  tail path's ledger;
* a **Spark standalone master and worker** (``examples/cluster.py``; the worker
  in a mount namespace where the channels are not visible) and a driver whose
  query reads the three agents, through one **TCP fault proxy** per agent, into
  a Parquet table (restarted on its checkpoint when it fails);
* a **fault schedule** drawn from the seed: every kind once in a shuffled
  order, then random kinds: SIGKILL and SIGSTOP/SIGCONT of an agent, of the
  driver's session (its JVM and Python workers), of the executor JVM, of a
  producer; network faults between Spark and the agents at the proxy (added
  delay, every connection cut with a reset, a black hole for some seconds);
  and, where the channel turns a full disk into back-pressure (its config has
  ``DiskFullError``, a ``ChannelFullError``; ``--disk-fault on`` forces it), a disk filling up under
  ``h3``'s channel: a size-limited tmpfs mounted in a private mount namespace
  that the agent runs in, filled to the last 512 KiB (far under the channel's
  free-space floor, so its puts are refused while its other small writes
  still fit), then emptied.

At the end the producers stop (after finishing their batch), the query drains
every channel, everything is stopped, and the table is checked: every
acknowledged event of every producer is there exactly once and in the
producer's order (per file for the tail path, each line at its byte offset); an event whose
batch was sent but never acknowledged may be there once; nothing else is; no
process of the run is left. The agents' RSS and open descriptors are sampled
every 2 s; growth after warm-up (a fifth of the load, at least 60 s) is judged
on each agent's longest-lived process when that lived 60 s more (agent SIGKILLs
go to h2 and h3, so h1 lives the whole run): ``flat`` is RSS and descriptors
within 10 %; part of ``ok`` on runs of 10 minutes or more.

Prints one JSON summary on stdout (``ok`` true only if all holds) and writes a
PNG: throughput per path over time with the faults marked. Exit status 0 when
``ok``. Rates are modest on purpose (2 shared cores).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import logging
import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .spark import cluster_module

log = logging.getLogger("bench.soak")

HOSTS = ("h1", "h2", "h3")
PATHS = ("http", "flight", "tail")
CONSUMER = "soak"
EVENT_SIZE = 80  # body bytes of every event (a tail line is EVENT_SIZE bytes plus its newline)
KINDS = (
    "agent_kill",
    "agent_stop",
    "driver_kill",
    "driver_stop",
    "executor_kill",
    "executor_stop",
    "producer_kill",
    "producer_stop",
    "net_delay",
    "net_cut",
    "net_blackhole",
    "disk_full",
)
DISK_HOST = "h3"


# ------------------------------------------------------------------------------------------
# Events and ledgers


def body_of(producer: str, seq: int) -> bytes:
    """The body of ``producer``'s event ``seq``: its name, the number, then filler, EVENT_SIZE bytes."""
    head = f"{producer} {seq:010d} ".encode()
    fill = (b"%08x" % ((seq * 2654435761) & 0xFFFFFFFF)) * (EVENT_SIZE // 8 + 1)
    return (head + fill)[:EVENT_SIZE]


def parse_body(body: bytes) -> tuple[str, int] | None:
    """``(producer, seq)`` of a body made by :func:`body_of`, or None."""
    parts = body.split(b" ", 2)
    if len(parts) < 3 or not parts[1].isdigit():
        return None
    return parts[0].decode(errors="replace"), int(parts[1])


@dataclasses.dataclass
class Ledger:
    """A producer's ledger: batches sent (``I k a b``) and acknowledged (``A k n``)."""

    intents: dict[int, tuple[int, int]]
    acked: set[int]

    @classmethod
    def read(cls, path: Path) -> Ledger:
        """Parse ``path`` (a missing file is an empty ledger; a torn last line is ignored)."""
        intents: dict[int, tuple[int, int]] = {}
        acked: set[int] = set()
        if path.exists():
            for line in path.read_text().splitlines():
                f = line.split()
                if len(f) == 4 and f[0] == "I":
                    intents[int(f[1])] = (int(f[2]), int(f[3]))
                elif len(f) == 3 and f[0] == "A":
                    acked.add(int(f[1]))
        return cls(intents, acked)

    def acked_seqs(self) -> set[int]:
        """Every sequence number of an acknowledged batch."""
        out: set[int] = set()
        for k in self.acked:
            a, b = self.intents[k]
            out.update(range(a, b + 1))
        return out

    def doubtful_seqs(self) -> set[int]:
        """Sequence numbers of batches sent and never acknowledged (may be delivered once, or not)."""
        out: set[int] = set()
        for k, (a, b) in self.intents.items():
            if k not in self.acked:
                out.update(range(a, b + 1))
        return out


def _append(path: Path, line: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------------
# Producer processes (``--role http|flight|tail``)


class _Stopper:
    def __init__(self) -> None:
        self.stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: self.stop.set())


def _paced(stop: threading.Event, rate: float, batch: int, rng: random.Random) -> int:
    """Sleep so batches of mean size ``batch`` come at ``rate`` events/s; return the next batch size."""
    n = max(1, int(rng.uniform(0.5, 1.5) * batch))
    stop.wait(n / rate)
    return n


def _retry(attempt: Callable[[], bool]) -> None:
    """Call ``attempt`` until it returns True, 0.2 s apart at first, then up to 2 s."""
    delay = 0.2
    while not attempt():
        time.sleep(delay)
        delay = min(2.0, delay * 1.5)


def _produce(conf: dict[str, Any], name: str, rate: float, send: Callable[[int, int, int], None]) -> int:
    """Producer ``name``'s batches at ``rate`` events/s until SIGTERM, each ``send(k, a, b)`` (batch k, seqs a..b).

    Its ledger logs a batch (``I k a b``) before sending it and its acknowledgement (``A k n``)
    after; a restarted producer first resends its unacknowledged batch with the same k.
    """
    s = _Stopper()
    ledger_path = Path(conf["work"]) / "ledgers" / f"{name}.log"
    led = Ledger.read(ledger_path)
    k = max(led.intents, default=-1)
    seq = max((b for _, b in led.intents.values()), default=-1) + 1
    rng = random.Random(f"{name}-{k}")
    if k >= 0 and k not in led.acked:
        a, b = led.intents[k]
        send(k, a, b)
        _append(ledger_path, f"A {k} {b - a + 1}\n")
    print(f"{name} ready at seq {seq}", flush=True)
    while not s.stop.is_set():
        n = _paced(s.stop, rate, 10, rng)
        k += 1
        a, b = seq, seq + n - 1
        _append(ledger_path, f"I {k} {a} {b}\n")
        send(k, a, b)
        _append(ledger_path, f"A {k} {n}\n")
        seq = b + 1
    return 0


def run_http(conf: dict[str, Any], host: str, rate: float) -> int:
    """POST batches to the host's agent, each with an Idempotency-Key, retried until ``200``."""
    import http.client

    name = f"http-{host}"
    ctx = ssl.create_default_context(cafile=conf["ca"])
    ctx.load_cert_chain(conf["producer_cert"], conf["producer_key"])
    port = conf["agents"][host]["http"]
    url = f"/v1/channels/{conf['agents'][host]['name']}/events"

    def post(kk: int, a: int, b: int) -> None:
        events = [{"headers": {"p": name, "s": str(i)}, "body": body_of(name, i).decode()} for i in range(a, b + 1)]
        data = json.dumps(events).encode()

        def attempt() -> bool:
            conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=10)
            try:
                conn.request("POST", url, data, {"Content-Type": "application/json", "Idempotency-Key": f"{name}-{kk}"})
                r = conn.getresponse()
                r.read()
                if r.status == 200:
                    return True
                if r.status not in (503, 500, 408):
                    raise RuntimeError(f"{name}: POST answered {r.status}")
            except (OSError, http.client.HTTPException) as exc:
                print(f"{name}: batch {kk}: {type(exc).__name__}; retrying", flush=True)
            finally:
                conn.close()
            return False

        _retry(attempt)

    return _produce(conf, name, rate, post)


def run_flight(conf: dict[str, Any], host: str, rate: float) -> int:
    """``put_batch`` to the host's agent with a producer sequence, each batch retried until answered."""
    from filechannel.agent import AgentTimeoutError, AgentUnavailableError, connect
    from filechannel.errors import ChannelError

    name = f"flight-{host}"
    agent = conf["agents"][host]
    uri = f"grpc+tls://127.0.0.1:{agent['flight']}"
    client: Any = None

    def put(kk: int, a: int, b: int) -> None:
        bodies = [body_of(name, i) for i in range(a, b + 1)]
        headers = [{"p": name, "s": str(i)} for i in range(a, b + 1)]

        def attempt() -> bool:
            nonlocal client
            try:
                if client is None:
                    client = connect(
                        uri, tls_ca=conf["ca"], tls_cert=conf["producer_cert"], tls_key=conf["producer_key"], timeout=10
                    )
                client.put_batch(agent["channel"], bodies, headers, producer=name, sequence=kk)
                return True
            except (AgentUnavailableError, AgentTimeoutError) as exc:
                print(f"{name}: batch {kk}: {type(exc).__name__}; retrying", flush=True)
                if client is not None:
                    with contextlib.suppress(Exception):
                        client.close()
                    client = None
            except ChannelError as exc:  # full, or the disk under its floor: nothing was put
                print(f"{name}: batch {kk}: {type(exc).__name__}: {exc}; retrying", flush=True)
            return False

        _retry(attempt)

    return _produce(conf, name, rate, put)


def tail_lines(files: Path) -> dict[str, list[int]]:
    """Every file of a tail directory and the sequence numbers of its lines, in file order."""
    out: dict[str, list[int]] = {}
    for p in sorted(files.iterdir()) if files.is_dir() else []:
        seqs = []
        for line in p.read_bytes().split(b"\n")[:-1]:
            parsed = parse_body(line)
            seqs.append(parsed[1] if parsed else -1)
        out[p.name] = seqs
    return out


def run_tail(conf: dict[str, Any], host: str, rate: float) -> int:
    """Append lines to ``app.log`` (one ``write`` per batch of whole lines); rotate it by rename every 10-20 s."""
    s = _Stopper()
    name = f"tail-{host}"
    files = Path(conf["work"]) / "hosts" / host / "files"
    files.mkdir(parents=True, exist_ok=True)
    seqs = [q for v in tail_lines(files).values() for q in v]
    seq = max(seqs, default=-1) + 1
    rotations = [int(p.name.rsplit(".", 1)[1]) for p in files.glob("app.log.*")]
    rot = max(rotations, default=0)
    rng = random.Random(f"{name}-{seq}")
    next_rotation = time.monotonic() + rng.uniform(10, 20)
    print(f"{name} ready at seq {seq}", flush=True)
    while not s.stop.is_set():
        n = _paced(s.stop, rate, 10, rng)
        data = b"".join(body_of(name, i) + b"\n" for i in range(seq, seq + n))
        fd = os.open(files / "app.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        seq += n
        if time.monotonic() > next_rotation:
            rot += 1
            os.rename(files / "app.log", files / f"app.log.{rot}")
            next_rotation = time.monotonic() + rng.uniform(10, 20)
    return 0


# ------------------------------------------------------------------------------------------
# The driver process (``--role driver``)


def run_driver(conf: dict[str, Any]) -> int:
    """Read the agents (through the proxies) into a Parquet table; restart the query when it fails."""
    options = {
        "agents": ",".join(f"grpc+tls://127.0.0.1:{a['proxy']}" for a in conf["agents"].values()),
        "tlsCa": conf["ca"],
        "tlsCert": conf["spark_cert"],
        "tlsKey": conf["spark_key"],
        "consumer": CONSUMER,
        "maxEventsPerTrigger": "20000",
        "maxEventsPerPartition": "5000",
        "agentTimeoutMs": "5000",
    }
    return int(cluster_module().drive("filechannel-soak", conf["session"], options, Path(conf["work"]), 2))


# ------------------------------------------------------------------------------------------
# The TCP fault proxy between Spark and an agent


class FaultProxy:
    """A loopback TCP proxy to ``127.0.0.1:target`` that can delay, cut and black-hole its connections."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.delay = 0.0
        self.blackhole_until = 0.0
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._closed = False
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.5)
        self.port = int(self._listener.getsockname()[1])
        self._thread = threading.Thread(target=self._accept, name=f"proxy-{self.port}", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                down, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            while time.monotonic() < self.blackhole_until and not self._closed:
                time.sleep(0.05)  # a black hole: the connection hangs, nothing reaches the agent
            try:
                up = socket.create_connection(("127.0.0.1", self.target), timeout=5)
            except OSError:
                down.close()
                continue
            up.settimeout(None)
            with self._lock:
                self._conns.update((down, up))
            for a, b in ((down, up), (up, down)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                while time.monotonic() < self.blackhole_until and not self._closed:
                    time.sleep(0.05)
                if self.delay:
                    time.sleep(self.delay)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                with self._lock:
                    self._conns.discard(s)
                with contextlib.suppress(OSError):
                    s.close()

    def cut(self) -> int:
        """Reset every open connection (both sides see a cut mid-stream); return how many there were."""
        with self._lock:
            conns = list(self._conns)
        for s in conns:
            with contextlib.suppress(OSError):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                s.shutdown(socket.SHUT_RDWR)
        return len(conns) // 2

    def close(self) -> None:
        """Stop accepting and close every connection."""
        self._closed = True
        self.blackhole_until = 0.0
        self.cut()
        self._listener.close()
        self._thread.join(5)


# ------------------------------------------------------------------------------------------
# The orchestrator


def disk_fault_supported() -> bool:
    """Whether the channel turns a full disk into back-pressure: a write out of space is ``DiskFullError``.

    Detected by the feature (the exception class and its place under ``ChannelFullError``), not a version.
    """
    import filechannel.errors as e

    full = getattr(e, "DiskFullError", None)
    return isinstance(full, type) and issubclass(full, e.ChannelFullError)


def _rss_fds(pid: int) -> tuple[int, int] | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration):
        return None
    return rss, fds


def _signal_all(pids: list[int], sig: int) -> None:
    for p in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, sig)


def growth(samples: list[tuple[float, int]]) -> dict[str, float]:
    """A series' growth: the median of its last quarter over that of its first, less 1; and a slope per minute."""
    vals = [v for _, v in samples]
    q = max(1, len(vals) // 4)
    first, last = sorted(vals[:q])[q // 2], sorted(vals[-q:])[q // 2]
    ts = [t for t, _ in samples]
    mt, mv = sum(ts) / len(ts), sum(vals) / len(vals)
    den = sum((t - mt) ** 2 for t in ts) or 1.0
    slope = sum((t - mt) * (v - mv) for t, v in samples) / den * 60
    return {"first": first, "last": last, "growth": (last - first) / first if first else 0.0, "slope_per_min": slope}


class Soak:
    """The soak run; every wait is bounded."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.cl = cluster_module()
        self.work = Path(args.workdir).resolve()
        self.rng = random.Random(args.seed + 1)  # the faults' targets and lengths
        self.conf: dict[str, Any] = {}
        self.procs: list[Any] = []  # every Proc started, for the final sweep
        self.agents: dict[str, Any] = {}
        self.agent_starts: dict[str, int] = dict.fromkeys(HOSTS, 0)
        self.producers: dict[str, Any] = {}
        self.producer_starts: dict[str, int] = {}
        self.proxies: dict[str, FaultProxy] = {}
        self.driver: Any = None
        self.drivers = 0
        self.cluster: Any = None
        self.holder: Any = None  # the process holding the disk-fault mount namespace
        self.stopped: dict[str, list[int]] = {}  # fault id -> pids SIGSTOPped
        self.faults: list[dict[str, Any]] = []
        self.samples: list[dict[str, Any]] = []
        self.resources: dict[str, list[tuple[float, int, int, int]]] = {h: [] for h in HOSTS}
        self.unexpected: list[str] = []
        self.t0 = time.monotonic()
        self.disk = False
        self.stopping = False  # the producers were told to stop: not restarted any more
        self.phases: dict[str, float] = {}

    # -- helpers -------------------------------------------------------------------------

    def now(self) -> float:
        return time.monotonic() - self.t0

    def proc(self, name: str, argv: list[str], logname: str) -> Any:
        p = self.cl.Proc(name, argv, self.work / "logs" / logname, self.cl._env())
        self.procs.append(p)
        return p

    def ns(self, argv: list[str]) -> list[str]:
        """``argv`` run in the disk-fault mount namespace."""
        assert self.holder is not None
        return ["nsenter", "-t", str(self.holder.pid), "-m", "--", *argv]

    # -- set-up --------------------------------------------------------------------------

    def setup(self) -> None:
        from filechannel.testing.pki import PKI
        from filechannel.testing.processes import restartable_port

        a = self.args
        if self.work.exists():
            shutil.rmtree(self.work)
        for d in ("logs", "ledgers", "hosts"):
            (self.work / d).mkdir(parents=True)
        pki = PKI(self.work / "pki")
        cert, key = pki.issue("localhost", server=True)
        pcert, pkey = pki.issue("producer")
        scert, skey = pki.issue("spark")
        want = a.disk_fault == "on" or (a.disk_fault == "auto" and disk_fault_supported())
        self.disk = want and self.cl.unshare_works() and shutil.which("nsenter") is not None
        if want and not self.disk:
            log.warning("the disk fault needs `unshare --mount` and nsenter (root): off")
        agents: dict[str, dict[str, Any]] = {}
        for h in HOSTS:
            base = self.work / "hosts" / h
            (base / "files").mkdir(parents=True)
            chan = base / "channel"
            if h == DISK_HOST and self.disk:
                disk = base / "disk"
                disk.mkdir()
                chan = disk / "channel"
                script = f'mount -t tmpfs -o size={a.disk_mib}m soak "$0" && echo mounted && exec sleep 100000'
                argv = ["unshare", "--mount", "sh", "-c", script, str(disk)]
                self.holder = self.proc("disk holder", argv, "disk.log")
                self.cl.wait_for(lambda: "mounted" in self.holder.log.read_text(), 30, "the tmpfs", self.holder)
            # the channel is made where its agent will see it (in the disk fault's namespace for h3)
            code = (
                "import filechannel, filechannel.reader, sys; "
                "filechannel.open(sys.argv[1], minimum_required_space=0, max_file_size=1 << 20).close(); "
                "print(filechannel.reader.channel_id_of(sys.argv[1]).hex())"
            )
            argv = [sys.executable, "-c", code, str(chan)]
            made = subprocess.run(
                self.ns(argv) if chan.parent.name == "disk" else argv,
                check=True,
                capture_output=True,
                text=True,
                timeout=120,
            )
            cid = made.stdout.strip()
            agents[h] = {
                "name": f"c{h[1:]}",
                "channel": cid,
                "dir": str(chan),
                "flight": restartable_port(),  # agents restart on their ports
                "http": restartable_port(),
            }
        self.conf = {
            "work": str(self.work),
            "ca": pki.ca,
            "server_cert": cert,
            "server_key": key,
            "producer_cert": pcert,
            "producer_key": pkey,
            "spark_cert": scert,
            "spark_key": skey,
            "agents": agents,
        }
        self.cluster = self.cl.StandaloneCluster(self.work / "spark", hide=self.work / "hosts")
        self.cluster.start()
        for p in (self.cluster.master, self.cluster.worker):
            self.procs.append(p)
        for h in HOSTS:
            self.start_agent(h)
            self.proxies[h] = FaultProxy(agents[h]["flight"])
            agents[h]["proxy"] = self.proxies[h].port
        session = self.cluster.session_conf(self.work / "spark" / "driver")
        session["spark.executor.memory"] = "768m"
        session["spark.driver.memory"] = "768m"
        session["spark.task.maxFailures"] = "8"  # tasks ride out an agent restart or a black hole
        self.conf["session"] = session
        (self.work / "soak.json").write_text(json.dumps(self.conf))

    def start_agent(self, h: str, timeout: float = 60.0) -> None:
        a = self.conf["agents"][h]
        self.agent_starts[h] += 1
        port_file = self.work / f"agent-{h}.port"
        with contextlib.suppress(FileNotFoundError):
            port_file.unlink()
        argv = [sys.executable, "-m", "filechannel", "serve", f"{a['dir']}={a['name']}", "--writable"]
        argv += ["--listen", f"grpc+tls://127.0.0.1:{a['flight']}", "--port-file", str(port_file)]
        argv += ["--tls-cert", self.conf["server_cert"], "--tls-key", self.conf["server_key"]]
        argv += ["--client-ca", self.conf["ca"], "--http", f"127.0.0.1:{a['http']}", "--log-level", "WARNING"]
        argv += ["--tail", str(self.work / "hosts" / h / "files" / "*.log")]
        if h == DISK_HOST and self.disk:
            argv = self.ns(argv)
        deadline = time.monotonic() + timeout
        while True:
            p = self.proc(f"agent {h}", argv, f"agent-{h}-{self.agent_starts[h]}.log")
            while not port_file.exists() and p.alive() and time.monotonic() < deadline:
                time.sleep(0.05)
            if port_file.exists():
                self.agents[h] = p
                return
            p.kill9()
            if time.monotonic() > deadline:
                raise RuntimeError(f"agent {h} did not start:\n{p.tail()}")
            time.sleep(0.5)  # the port is not free again yet

    def start_producer(self, key: str) -> None:
        path, h = key.split("-")
        n = self.producer_starts[key] = self.producer_starts.get(key, 0) + 1
        argv = [sys.executable, "-m", "bench.soak", "--role", path, "--host", h, "--workdir", str(self.work)]
        argv += ["--rate", str(self.args.rate)]
        self.producers[key] = self.proc(key, argv, f"{key}-{n}.log")

    def start_driver(self) -> None:
        self.drivers += 1
        argv = [sys.executable, "-m", "bench.soak", "--role", "driver", "--workdir", str(self.work)]
        self.driver = self.proc("driver", argv, f"driver-{self.drivers}.log")

    # -- sampling ------------------------------------------------------------------------

    def acked(self) -> dict[str, int]:
        out = dict.fromkeys(PATHS, 0)
        for p in (self.work / "ledgers").glob("*.log"):
            n = sum(int(line.split()[2]) for line in p.read_text().splitlines() if line.startswith("A "))
            out[p.name.split("-")[0]] += n
        for h in HOSTS:
            files = self.work / "hosts" / h / "files"
            out["tail"] += sum(f.stat().st_size for f in files.iterdir()) // (EVENT_SIZE + 1)
        return out

    def sample(self) -> None:
        c = self.cl.committed(self.work)
        row = {"t": self.now(), **self.acked(), "sink": sum(v for v in c.values())}
        self.samples.append(row)
        for h, p in self.agents.items():
            if p is not None and p.alive():
                r = _rss_fds(p.pid)
                if r is not None:
                    self.resources[h].append((self.now(), p.pid, r[0], r[1]))

    def supervise(self) -> None:
        """Restart what ended without a fault (and note it)."""
        busy = {f["target"] for f in self.faults if f.get("end") is None}
        for key, p in self.producers.items():
            if not p.alive() and key not in busy and not self.stopping:
                self.unexpected.append(f"{key} exited ({p.proc.returncode}): {p.tail(3)}")
                self.start_producer(key)
        for h, p in self.agents.items():
            if p is not None and not p.alive() and h not in busy:
                self.unexpected.append(f"agent {h} exited ({p.proc.returncode}): {p.tail(3)}")
                self.start_agent(h)
        if self.driver is not None and not self.driver.alive() and "driver" not in busy:
            self.unexpected.append(f"driver exited ({self.driver.proc.returncode}): {self.driver.tail(3)}")
            self.start_driver()

    # -- faults --------------------------------------------------------------------------

    def schedule(self, start: float, end: float) -> list[tuple[float, str]]:
        """The fault schedule of the seed from ``start`` to ``end``: every kind once (shuffled), then random kinds.

        The first round is spread over the window (at most 7 s apart on average), so a short soak
        still has every kind; then one every 6-16 s.
        """
        rng = random.Random(self.args.seed)
        kinds = [k for k in KINDS if k != "disk_full" or self.disk]
        order = kinds[:]
        rng.shuffle(order)
        step = min(7.0, (end - start) / len(order))
        out, t = [], start
        while t < end:
            kind = order.pop(0) if order else rng.choice(kinds)
            out.append((t, kind))
            t += step * rng.uniform(0.7, 1.0) if order else rng.uniform(6, 16)
        return out

    def inject(self, kind: str) -> dict[str, Any] | None:
        """Start a fault; return its record, or None when its target is not there now (try again later)."""
        rng = self.rng
        f: dict[str, Any] = {"kind": kind, "t": self.now(), "end": None}
        if kind in ("agent_kill", "agent_stop"):
            h = rng.choice(("h2", "h3") if kind == "agent_kill" else HOSTS)
            p = self.agents.get(h)
            if p is None or not p.alive():
                return None
            f["target"] = h
            if kind == "agent_kill":
                p.kill9()
                self.agents[h] = None
                f["restart_at"] = f["t"] + rng.uniform(1, 3)
            else:
                _signal_all([p.pid], signal.SIGSTOP)
                f["pids"] = [p.pid]
                f["resume_at"] = f["t"] + rng.uniform(2, 6)
        elif kind in ("driver_kill", "driver_stop"):
            if self.driver is None or not self.driver.alive():
                return None
            f["target"] = "driver"
            if kind == "driver_kill":
                f["processes"] = self.driver.kill9()
                f["restart_at"] = f["t"]
            else:
                f["pids"] = self.cl.session_pids(self.driver.pid)
                _signal_all(f["pids"], signal.SIGSTOP)
                f["resume_at"] = f["t"] + rng.uniform(2, 6)
        elif kind in ("executor_kill", "executor_stop"):
            pids = self.cluster.executor_pids()
            if not pids:
                return None
            f["target"] = "executor"
            _signal_all(pids, signal.SIGKILL if kind == "executor_kill" else signal.SIGSTOP)
            if kind == "executor_stop":
                f["pids"] = pids
                f["resume_at"] = f["t"] + rng.uniform(2, 6)
            else:
                f["end"] = f["t"]
        elif kind in ("producer_kill", "producer_stop"):
            key = rng.choice(sorted(self.producers))
            p = self.producers[key]
            if not p.alive():
                return None
            f["target"] = key
            if kind == "producer_kill":
                p.kill9()
                f["restart_at"] = f["t"] + rng.uniform(0.5, 2)
            else:
                _signal_all([p.pid], signal.SIGSTOP)
                f["pids"] = [p.pid]
                f["resume_at"] = f["t"] + rng.uniform(2, 6)
        elif kind in ("net_delay", "net_cut", "net_blackhole"):
            h = rng.choice(HOSTS)
            px = self.proxies[h]
            f["target"] = f"net {h}"
            if kind == "net_delay":
                px.delay = rng.uniform(0.05, 0.3)
                f["delay_ms"] = round(px.delay * 1000)
                f["resume_at"] = f["t"] + rng.uniform(5, 10)
            elif kind == "net_cut":
                f["connections"] = px.cut()
                f["end"] = f["t"]
            else:
                px.blackhole_until = time.monotonic() + rng.uniform(3, 8)
                f["resume_at"] = f["t"] + (px.blackhole_until - time.monotonic())
        elif kind == "disk_full":
            d = self.conf["agents"][DISK_HOST]["dir"]
            fill = str(Path(d).parent / "fill")
            script = 'a=$(df -B1 --output=avail "$0" | tail -n 1); fallocate -l $((a - 524288)) "$1"'
            r = subprocess.run(self.ns(["sh", "-c", script, d, fill]), capture_output=True, text=True, timeout=30)
            if r.returncode != 0:
                raise RuntimeError(f"filling the disk failed: {r.stderr.strip()}")
            f["target"] = f"disk {DISK_HOST}"
            f["fill"] = fill
            f["resume_at"] = f["t"] + rng.uniform(8, 15)
        return f

    def advance(self, f: dict[str, Any], force: bool = False, restart: bool = True) -> None:
        """Finish a fault whose time has come (or at once with ``force``; ``restart=False``: start nothing)."""
        if f["end"] is not None:
            return
        t = self.now()
        if "restart_at" in f and (force or t >= f["restart_at"]):
            if not restart:
                return
            tgt = f["target"]
            if f["kind"] == "agent_kill":
                self.start_agent(tgt)
            elif f["kind"] == "driver_kill":
                self.start_driver()
            elif f["kind"] == "producer_kill":
                self.start_producer(tgt)
            f["end"] = self.now()
        elif "resume_at" in f and (force or t >= f["resume_at"]):
            k = f["kind"]
            if "pids" in f:
                _signal_all(f["pids"], signal.SIGCONT)
            elif k == "net_delay":
                self.proxies[f["target"].split()[1]].delay = 0.0
            elif k == "net_blackhole":
                self.proxies[f["target"].split()[1]].blackhole_until = 0.0
            elif k == "disk_full":
                subprocess.run(self.ns(["rm", "-f", f["fill"]]), timeout=30, check=True)
            f["end"] = self.now()

    # -- the run -------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        a = self.args
        wall0 = time.monotonic()
        self.setup()
        self.t0 = time.monotonic()
        self.phases["setup"] = round(self.t0 - wall0, 1)
        for h in HOSTS:
            for path in PATHS:
                self.start_producer(f"{path}-{h}")
        self.start_driver()
        load = a.minutes * 60
        warm = min(30.0, load / 6)
        sched: list[tuple[float, str]] = []
        last_sample = -10.0
        while self.now() < load:
            t = self.now()
            if t - last_sample >= 2:
                self.sample()
                last_sample = t
            started = sum(self.cl.committed(self.work).values()) > 0 or t > load / 2
            if "faults" not in self.phases and t >= warm and started:
                # the faults begin once Spark committed its first events (at the latest half-way)
                self.phases["faults"] = round(t, 1)
                sched = self.schedule(t, load - 15)
                log.info("fault schedule: %s", [(round(x), k) for x, k in sched])
            for f in self.faults:
                self.advance(f)
            while sched and sched[0][0] <= t:
                _at, kind = sched.pop(0)
                rec = self.inject(kind)
                if rec is None:
                    if t < load - 10:
                        sched.insert(0, (t + 2, kind))  # its target is not there now: again in 2 s
                    break
                self.faults.append(rec)
                log.info("t=%.0f s fault %s on %s", rec["t"], kind, rec["target"])
            self.supervise()
            time.sleep(0.2)
        # the end: every fault undone, the producers finish their batch and stop
        for f in self.faults:
            self.advance(f, force=True)
        load_end = self.now()
        self.phases["load"] = round(load_end, 1)
        self.stopping = True
        for p in self.producers.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGTERM)
        for key, p in self.producers.items():
            try:
                p.proc.wait(90)
            except subprocess.TimeoutExpired:
                self.unexpected.append(f"{key} did not stop within 90 s")
            p.kill9()
        t = self.now()
        drained = self.drain()
        self.phases["drain"] = round(self.now() - t, 1)
        self.sample()
        self.driver.stop(60)
        self.cluster.stop()
        for p in self.agents.values():
            if p is not None:
                p.stop(30)
        for px in self.proxies.values():
            px.close()
        if self.holder is not None:
            self.holder.kill9()
        left = self.sweep()
        summary = self.verify()
        summary.update(
            {
                "seed": a.seed,
                "minutes": a.minutes,
                "wall_seconds": round(time.monotonic() - wall0, 1),
                "load_seconds": round(load_end, 1),
                "phase_seconds": self.phases,
                "drained": drained,
                "processes_left": left,
                "disk_fault": self.disk,
                "unexpected_exits": self.unexpected,
                "faults": {k: sum(f["kind"] == k for f in self.faults) for k in KINDS},
                "fault_kinds_missing": [
                    k for k in KINDS if (k != "disk_full" or self.disk) and not any(f["kind"] == k for f in self.faults)
                ],
                "restarts": {"drivers": self.drivers, "agents": dict(self.agent_starts)},
                "rates_per_s": self.rates(load_end),
                "resources": self.resource_report(max(60.0, load / 5)),
            }
        )
        summary["resources_flat"] = all(r.get("flat", True) for r in summary["resources"].values())
        summary["ok"] = (
            summary["lost"] == 0
            and summary["duplicated"] == 0
            and summary["unexpected_events"] == 0
            and summary["out_of_order"] == 0
            and summary["damaged"] == 0
            and summary["acked"] > 0
            and left == 0
            and drained
            and (summary["resources_flat"] or a.minutes < 10)  # judged on runs of 10 minutes or more
        )
        summary["log"] = [
            {k: (round(v, 2) if isinstance(v, float) else v) for k, v in f.items() if k not in ("pids",)}
            for f in self.faults
        ]
        (self.work / "samples.json").write_text(
            json.dumps({"samples": self.samples, "faults": summary["log"], "resources": self.resources})
        )
        if a.png:
            try:
                self.plot(Path(a.png), summary)
                summary["png"] = str(a.png)
            except ImportError as exc:  # the bench extra (matplotlib) is not installed
                summary["png"] = None
                summary["png_skipped"] = f"no picture: {exc} (pip install 'filechannel[bench]')"
        return summary

    def drain(self, stall: float = 240.0, cap: float = 3600.0) -> bool:
        """Wait until every channel's end stayed put for 6 s (the tail sources put every line) and was committed.

        Gives up when the table gained nothing for ``stall`` seconds, or after ``cap``.
        """
        from filechannel.agent import connect

        end_by = time.monotonic() + cap
        deadline = time.monotonic() + stall
        last: dict[str, int] = {}
        since = time.monotonic()
        progress = -1
        while time.monotonic() < min(deadline, end_by):
            self.supervise()
            ends: dict[str, int] = {}
            for h in HOSTS:
                a = self.conf["agents"][h]
                try:
                    with connect(
                        f"grpc+tls://127.0.0.1:{a['flight']}",
                        tls_ca=self.conf["ca"],
                        tls_cert=self.conf["spark_cert"],
                        tls_key=self.conf["spark_key"],
                        timeout=10,
                    ) as c:
                        ends[a["channel"]] = c.channels()[a["channel"]].end
                except Exception:
                    continue
            if ends != last or len(ends) < len(HOSTS):
                last, since = ends, time.monotonic()
            c = self.cl.committed(self.work)
            if time.monotonic() - since >= 6 and all(c.get(k, -1) >= e for k, e in ends.items()):
                return True
            if sum(c.values()) > progress:
                progress, deadline = sum(c.values()), time.monotonic() + stall
            self.sample()
            time.sleep(1)
        return False

    def sweep(self) -> int:
        """SIGKILL whatever of the run is left; return how many processes there were."""
        left = 0
        for p in self.procs:
            n = len(self.cl.session_pids(p.pid))
            if n:
                log.warning("left behind: %s (%d processes)", p.name, n)
                left += n
                p.kill9()
        return left

    def verify(self) -> dict[str, Any]:
        """The table against the ledgers and the tail files."""
        import pyarrow.parquet as pq

        rows: list[tuple[str, int, bytes, dict[str, str]]] = []
        for f in self.cl.pipeline.table_files(self.work / "table"):
            t = pq.read_table(f, columns=["channel", "position", "body", "headers"]).to_pydict()
            for ch, pos, body, hd in zip(t["channel"], t["position"], t["body"], t["headers"], strict=True):
                rows.append((ch, pos, body, dict(hd)))
        rows.sort(key=lambda r: (r[0], r[1]))
        by_producer: dict[str, list[tuple[int, dict[str, str]]]] = {}
        damaged = 0
        for _, _, body, hd in rows:
            parsed = parse_body(body)
            if parsed is None or body != body_of(*parsed):
                damaged += 1
                continue
            by_producer.setdefault(parsed[0], []).append((parsed[1], hd))
        per: dict[str, dict[str, int]] = {}
        lost = dup = unexpected = disorder = in_doubt = acked_total = 0
        for h in HOSTS:
            for path in PATHS:
                name = f"{path}-{h}"
                got = by_producer.pop(name, [])
                seqs = [s for s, _ in got]
                if path == "tail":
                    # the files are the ledger; order is checked per physical file (rotation reuses app.log's
                    # name, and the header keeps the name a file was first found under)
                    files = tail_lines(self.work / "hosts" / h / "files")
                    where = {q: (fname, i) for fname, v in files.items() for i, q in enumerate(v)}
                    acked = set(where)
                    doubtful: set[int] = set()
                    order = 0
                    last: dict[str, int] = {}
                    for q, hd in got:
                        if q not in where:
                            continue
                        fname, i = where[q]
                        order += last.get(fname, -1) >= i
                        last[fname] = i
                        damaged += hd.get("offset") != str(i * (EVENT_SIZE + 1))
                else:
                    led = Ledger.read(self.work / "ledgers" / f"{name}.log")
                    acked, doubtful = led.acked_seqs(), led.doubtful_seqs()
                    order = sum(1 for x, y in itertools.pairwise(seqs) if y <= x)
                seen = set(seqs)
                r = {
                    "acked": len(acked),
                    "delivered": len(seen & acked),
                    "lost": len(acked - seen),
                    "duplicated": len(seqs) - len(seen),
                    "unexpected": len(seen - acked - doubtful),
                    "in_doubt_delivered": len(seen & doubtful),
                    "out_of_order": order,
                }
                per[name] = r
                lost += r["lost"]
                dup += r["duplicated"]
                unexpected += r["unexpected"]
                disorder += order
                in_doubt += r["in_doubt_delivered"]
                acked_total += r["acked"]
        unexpected += sum(len(v) for v in by_producer.values())
        by_path = {p: {k: sum(per[f"{p}-{h}"][k] for h in HOSTS) for k in next(iter(per.values()))} for p in PATHS}
        return {
            "events": len(rows),
            "acked": acked_total,
            "lost": lost,
            "duplicated": dup,
            "unexpected_events": unexpected,
            "out_of_order": disorder,
            "in_doubt_delivered": in_doubt,
            "damaged": damaged,
            "paths": by_path,
            "producers": per,
        }

    def rates(self, load_end: float) -> dict[str, float]:
        """Mean events/s: acknowledged per path over the load, and into the table over the whole run."""
        last = next((s for s in reversed(self.samples) if s["t"] <= load_end + 2), self.samples[-1])
        out = {k: round(last[k] / max(1.0, last["t"]), 1) for k in PATHS}
        out["sink"] = round(self.samples[-1]["sink"] / max(1.0, self.samples[-1]["t"]), 1)
        return out

    def resource_report(self, warm: float) -> dict[str, Any]:
        """Per agent: RSS and open descriptors of its longest-lived process, after ``warm`` s of its life."""
        out: dict[str, Any] = {}
        for h, series in self.resources.items():
            by_pid: dict[int, list[tuple[float, int, int]]] = {}
            for t, pid, rss, fds in series:
                by_pid.setdefault(pid, []).append((t, rss, fds))
            if not by_pid:
                continue
            pid, s = max(by_pid.items(), key=lambda kv: kv[1][-1][0] - kv[1][0][0])
            born = s[0][0]
            s = [x for x in s if x[0] - born >= warm]
            span = (s[-1][0] - s[0][0]) if s else 0.0
            if span < 60:
                out[h] = {"judged": False, "seconds": round(span), "processes": len(by_pid)}
                continue
            rss = growth([(t, r) for t, r, _ in s])
            fds = growth([(t, f) for t, _, f in s])
            out[h] = {
                "judged": True,
                "seconds": round(span),
                "processes": len(by_pid),
                "rss_mib": [round(rss["first"] / 2**20, 1), round(rss["last"] / 2**20, 1)],
                "rss_growth": round(rss["growth"], 3),
                "rss_slope_kib_per_min": round(rss["slope_per_min"] / 1024, 1),
                "fds": [fds["first"], fds["last"]],
                "fd_growth": round(fds["growth"], 3),
                "fd_slope_per_min": round(fds["slope_per_min"], 2),
                "flat": rss["growth"] <= 0.10 and fds["growth"] <= 0.10,
            }
        return out

    def plot(self, png: Path, summary: dict[str, Any]) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax, cum, mem) = plt.subplots(3, 1, figsize=(12, 9), sharex=True, height_ratios=(3, 2, 2))
        ts = [x["t"] for x in self.samples]
        for key in (*PATHS, "sink"):
            vals = [x[key] for x in self.samples]
            if key != "sink":  # acknowledged events/s per path over 10 s, while the producers ran
                n = sum(1 for t in ts if t <= self.phases.get("load", ts[-1]))
                rate = [(vals[i] - vals[max(0, i - 5)]) / max(1e-6, ts[i] - ts[max(0, i - 5)]) for i in range(1, n)]
                ax.plot(ts[1:n], rate, label=f"{key}: acknowledged, events/s", linewidth=1.2)
            cum.plot(ts, vals, label=f"{key}: {'in the table' if key == 'sink' else 'acknowledged'}", linewidth=1.2)
        colors = plt.get_cmap("tab20")
        seen: set[str] = set()
        for f in self.faults:
            i = KINDS.index(f["kind"])
            end = f["end"] if f["end"] is not None and f["end"] > f["t"] + 0.5 else f["t"] + 0.5
            for axis in (ax, cum):
                axis.axvspan(
                    f["t"],
                    end,
                    color=colors(i),
                    alpha=0.35,
                    label=f["kind"] if f["kind"] not in seen and axis is ax else None,
                )
            seen.add(f["kind"])
        cum.set_ylabel("events (cumulative)")
        cum.legend(loc="upper left", fontsize=8)
        for h, series in self.resources.items():  # RSS per agent process (a gap: killed and restarted)
            by_pid: dict[int, list[tuple[float, int]]] = {}
            for t, pid, rss, _ in series:
                by_pid.setdefault(pid, []).append((t, rss))
            for j, pts in enumerate(by_pid.values()):
                mem.plot(
                    [t for t, _ in pts],
                    [r / 2**20 for _, r in pts],
                    color=f"C{HOSTS.index(h)}",
                    linewidth=1.0,
                    label=f"agent {h}" if j == 0 else None,
                )
        mem.set_ylabel("agent RSS (MiB)")
        mem.legend(loc="upper left", fontsize=8)
        mem.set_xlabel("seconds since the producers started")
        ax.set_ylabel("events per second")
        ax.set_title(
            f"soak seed {summary['seed']}: {summary['acked']} acknowledged events, lost {summary['lost']}, "
            f"duplicated {summary['duplicated']}, {len(self.faults)} faults"
        )
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
        fig.tight_layout()
        fig.savefig(png, dpi=100)
        plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=3.0, help="minutes of load (3)")
    p.add_argument("--seed", type=int, default=1, help="the fault schedule's seed (1)")
    p.add_argument("--workdir", default="soak-work", help="wiped first (default: ./soak-work)")
    p.add_argument("--png", default=None, help="the picture (default: WORKDIR/soak.png)")
    p.add_argument("--rate", type=float, default=30.0, help="events/s of each of the 9 producers (30)")
    p.add_argument(
        "--disk-fault",
        choices=("auto", "on", "off"),
        default="auto",
        help="fill h3's disk: auto = when a full disk is back-pressure (DiskFullError); needs root",
    )
    p.add_argument("--disk-mib", type=int, default=160, help="size of the disk-fault tmpfs, MiB (160)")
    p.add_argument("--role", choices=("http", "flight", "tail", "driver"), help=argparse.SUPPRESS)
    p.add_argument("--host", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[soak] %(message)s", stream=sys.stderr)
    if args.role is not None:
        conf = json.loads((Path(args.workdir) / "soak.json").read_text())
        if args.role == "driver":
            return run_driver(conf)
        run = {"http": run_http, "flight": run_flight, "tail": run_tail}[args.role]
        return run(conf, args.host, args.rate)
    if args.png is None:
        args.png = str(Path(args.workdir) / "soak.png")
    soak = Soak(args)

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    try:
        summary = soak.run()
    except (KeyboardInterrupt, RuntimeError) as exc:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the sweep short
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for f in soak.faults:
            with contextlib.suppress(Exception):
                soak.advance(f, force=True, restart=False)
        left = soak.sweep()
        print(json.dumps({"ok": False, "error": str(exc) or type(exc).__name__, "processes_left": left}))
        return 1
    print(json.dumps(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
