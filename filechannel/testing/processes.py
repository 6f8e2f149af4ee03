"""The child processes of :func:`~filechannel.testing.stream_test`, both sides of their pipes.

The calling side: :class:`Child` starts a producer or a driver in a session of
its own (so a SIGKILL of its process group takes the driver's JVM and Python
workers too) and calls it over a pipe in length-prefixed pickles;
:class:`AgentProcess` runs ``filechannel serve`` for ``agent=True``;
:func:`session_pids` and :func:`kill_session` find and kill what a session
started; :func:`restartable_port` picks a port for a server that is killed and
restarted on it. The child side: :func:`child_main` serves one role's requests (the
producer commits events; the driver runs the user's query in a local
SparkSession, :func:`local_spark`, which the test plugin and benches use too, and
can kill itself right after a ``foreachBatch`` function returns). :class:`StepFailed`
and :class:`ChildDied` are how a call fails.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import pickle
import queue
import random
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

logger = logging.getLogger(__name__)

_LEN = struct.Struct("<I")


class StepFailed(Exception):
    """Internal: the current step failed for ``reason``."""


class ChildDied(Exception):
    """Internal: a child process ended while a call waited; ``crashed`` when it killed itself as armed."""

    def __init__(self, what: str, crashed: Any) -> None:
        super().__init__(what)
        self.crashed = crashed


# ------------------------------------------------------------------------------------------
# Child processes and the pipe protocol


def _send(f: IO[bytes], obj: object) -> None:
    data = pickle.dumps(obj)
    f.write(_LEN.pack(len(data)) + data)
    f.flush()


def _recv(f: IO[bytes]) -> Any:
    head = f.read(_LEN.size)
    if len(head) < _LEN.size:
        return None
    (n,) = _LEN.unpack(head)
    data = f.read(n)
    if len(data) < n:
        return None
    return pickle.loads(data)


def session_pids(sid: int) -> list[int]:
    """Every live process of session ``sid`` (Linux ``/proc``).

    What is left of a child started with ``start_new_session=True`` after it
    was killed: its JVM, its Python workers.
    """
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            out.append(int(d))
    return out


def kill_session(sid: int, timeout: float = 5.0) -> list[int]:
    """SIGKILL every process of session ``sid``, sweep after sweep until none is left; return those found first.

    Killing the process group alone is not a crash of the whole session: PySpark's worker
    daemon moves itself and its workers into a process group of their own, so after a
    ``killpg`` of the driver they run on (and can still write) until they notice the JVM is
    gone. Each process group is killed at one instant; called from inside the session, the
    caller's own group goes last.
    """
    first = session_pids(sid)
    mine = os.getpgrp()
    pids = first
    deadline = time.monotonic() + timeout
    while pids:
        groups = set()
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                groups.add(os.getpgid(p))
        for g in sorted(groups - {mine}):  # each process group at one instant, as killpg does
            with contextlib.suppress(ProcessLookupError):
                os.killpg(g, signal.SIGKILL)
        if mine in groups:
            os.killpg(mine, signal.SIGKILL)
        if time.monotonic() > deadline:
            break  # in uninterruptible sleep: the caller's reap waits for them
        time.sleep(0.01)
        pids = session_pids(sid)
    return first


_PORTS_GIVEN: set[int] = set()


def restartable_port(host: str = "127.0.0.1") -> int:
    """A free port for a server that is killed and then restarted on the same port.

    The kernel's choice for port 0 comes from the ephemeral range, which is also
    where every outgoing connection takes its local port: once the server is
    killed, one of them can hold that port for as long as it stays open, and the
    restart cannot bind. A port below that range is never handed out that way.
    """
    try:
        text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
        low = int(text.split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(500):
        port = rng.randrange(max(1024, low - 12000), low)
        if port in _PORTS_GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _PORTS_GIVEN.add(port)
        return port
    raise OSError(f"no free port below the ephemeral range (from {low})")


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [p or os.getcwd() for p in sys.path]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.setdefault("PYSPARK_PYTHON", sys.executable)
    env.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    env.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    return env


class Child:
    """A child process (driver or producer) in its own session, spoken to over two pipes."""

    def __init__(self, role: str, log: Path) -> None:
        self.role = role
        self.log = log
        r, w = os.pipe()
        code = "import sys; from filechannel.testing.processes import child_main as m; m(sys.argv[1], int(sys.argv[2]))"
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", code, role, str(w)],
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=out,
                pass_fds=(w,),
                start_new_session=True,
                env=_child_env(),
            )
        os.close(w)
        self._replies: queue.Queue[Any] = queue.Queue()
        self._reader = os.fdopen(r, "rb")
        self.crashed: Any = None  # the batch id after which the driver killed itself as armed
        threading.Thread(target=self._read, name=f"stream_test-{role}", daemon=True).start()
        assert self.proc.stdin is not None
        self._stdin: IO[bytes] = self.proc.stdin

    @classmethod
    def start(cls, role: str, config: dict[str, Any], log: Path, timeout: float) -> Child:
        """Start a child and hand it its configuration; raise StepFailed (the child killed) if it cannot start."""
        child = cls(role, log)
        try:
            child.call("config", timeout, config=config)
        except (StepFailed, ChildDied) as exc:
            child.kill()
            raise StepFailed(f"the {role} could not start: {exc}; its log ends:\n{child.tail()}") from None
        return child

    def _read(self) -> None:
        try:
            while True:
                msg = _recv(self._reader)
                self._replies.put(msg)
                if msg is None:
                    return
        except (OSError, ValueError, pickle.UnpicklingError, EOFError):
            self._replies.put(None)

    def call(self, op: str, timeout: float, **args: Any) -> dict[str, Any]:
        """Send one request and wait for its reply; raise ChildDied if the process ends first."""
        try:
            _send(self._stdin, {"op": op, **args})
        except (BrokenPipeError, OSError):
            pass  # it died; the reader sees the end of its replies
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = self._replies.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.kill()
                raise StepFailed(f"the {self.role} did not answer {op!r} within {timeout:.0f} s (killed)") from None
            if msg is None:
                self._replies.put(None)  # stays ended for later calls
                self.proc.wait()
                self.reap()
                raise ChildDied(f"the {self.role} process ended (exit status {self.proc.returncode})", self.crashed)
            if "crashed" in msg:
                self.crashed = msg["crashed"]
                continue
            if msg.get("error") is not None and msg.get("fatal"):
                raise StepFailed(msg["error"])
            return msg  # type: ignore[no-any-return]

    def kill(self) -> int:
        """SIGKILL every process of the child's session; wait until nothing of it is left; return the count killed."""
        n = len(kill_session(self.proc.pid))
        self.proc.wait()
        self.reap()
        return n

    def reap(self, timeout: float = 10.0) -> None:
        """Wait for every process of the session to end; SIGKILL stragglers."""
        deadline = time.monotonic() + timeout
        while session_pids(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        for p in session_pids(self.proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        with contextlib.suppress(OSError):
            self._stdin.close()

    def close(self, timeout: float) -> None:
        """Ask the child to exit cleanly; kill it if it does not within ``timeout``."""
        try:
            self.call("exit", timeout)
        except (ChildDied, StepFailed):
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        self.kill()

    def tail(self, lines: int = 15) -> str:
        """The end of the child's log."""
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


class AgentProcess:
    """``filechannel serve CHANNEL --listen grpc://127.0.0.1:PORT`` in its own session (same port on restarts)."""

    def __init__(self, channel_dir: str, work: Path, timeout: float) -> None:
        self.channel_dir = channel_dir
        self.work = work
        self.timeout = timeout
        self.port = restartable_port()
        self.starts = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def uri(self) -> str:
        """The agent's Flight address (its port stays the same across restarts)."""
        return f"grpc://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start the agent; return once it listens (raise StepFailed if it does not)."""
        self.starts += 1
        port_file = self.work / "agent.port"
        with contextlib.suppress(FileNotFoundError):
            port_file.unlink()
        log = self.work / f"agent-{self.starts}.log"
        cmd = [sys.executable, "-m", "filechannel", "serve", self.channel_dir]
        cmd += ["--listen", f"grpc://127.0.0.1:{self.port}", "--port-file", str(port_file)]
        deadline = time.monotonic() + self.timeout
        while True:
            with open(log, "ab") as out:
                self.proc = subprocess.Popen(
                    cmd, stdout=out, stderr=out, start_new_session=True, env=_child_env(), stdin=subprocess.DEVNULL
                )
            while not port_file.exists() and self.proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if port_file.exists():
                self.port = int(port_file.read_text().strip())
                return
            self.kill()
            if time.monotonic() >= deadline:
                tail = log.read_text(errors="replace").splitlines()[-10:]
                raise StepFailed("the agent did not start; its log ends:\n" + "\n".join(tail))
            time.sleep(0.2)  # the old port not free yet: try again until the step's timeout

    def kill(self) -> None:
        """SIGKILL the agent (its whole session) and reap it."""
        if self.proc is not None:
            kill_session(self.proc.pid)
            self.proc.wait()
            self.proc = None


def child_main(role: str, fd: int) -> None:
    """Entry point of a child process: serve requests from stdin until told to exit or stdin ends."""
    out = os.fdopen(fd, "wb")
    lock = threading.Lock()

    def reply(obj: dict[str, Any]) -> None:
        with lock:
            _send(out, obj)

    stdin = sys.stdin.buffer
    first = _recv(stdin)
    if first is None:
        return
    try:
        server: _DriverServer | _ProducerServer = (
            _DriverServer(first["config"], reply) if role == "driver" else _ProducerServer(first["config"])
        )
    except Exception as exc:  # noqa: BLE001 - any failure to start is reported to the parent, whole
        reply({"error": f"{type(exc).__name__}: {exc}", "fatal": True})
        return
    reply({"ok": True})
    while True:
        msg = _recv(stdin)
        if msg is None:
            break
        try:
            result = server.handle(msg)
        except Exception as exc:
            logger.exception("stream_test %s: %s failed", role, msg.get("op"))
            result = {"error": f"{type(exc).__name__}: {exc}"}
        reply(result)
        if msg["op"] == "exit":
            break
    out.close()


class _ProducerServer:
    """The producer: owns the channel and commits what it is sent."""

    def __init__(self, config: dict[str, Any]) -> None:
        import filechannel

        self.channel = filechannel.open(config["channel_dir"], **config["options"])
        self.open_tx: Any = None

    def handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        op = msg["op"]
        if op == "put":
            with self.channel.transaction() as tx:
                for body, headers in msg["events"]:
                    tx.put(body, headers=headers or None)
            return {"ok": True}
        if op == "open_transaction":
            self.open_tx = self.channel.transaction()
            for body in msg["events"]:
                self.open_tx.put(body)
            return {"ok": True}
        if op == "exit":
            self.channel.close()
            return {"ok": True}
        return {"error": f"unknown request {op!r}"}


def local_spark(app: str, work: Path, conf: Mapping[str, str] | None = None) -> Any:
    """A ``local[2]`` SparkSession for tests and benchmarks, the ``filechannel`` format registered.

    No UI, one shuffle partition, 1 GiB of driver memory, a streaming query's stop waited for
    at most 30 s, Spark's scratch space and warehouse under ``work``; then ``conf``. Imports PySpark.
    """
    from pyspark.sql import SparkSession

    import filechannel.spark

    builder = (
        SparkSession.builder.master("local[2]")
        .appName(app)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "1")
        .config("spark.driver.memory", "1g")
        .config("spark.local.dir", str(work / "spark-local"))
        .config("spark.sql.warehouse.dir", str(work / "warehouse"))
        .config("spark.sql.streaming.stopTimeout", "30s")
    )
    for k, v in (conf or {}).items():
        builder = builder.config(k, v)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    filechannel.spark.register(spark)
    return spark


class _DriverServer:
    """The driver: a SparkSession, the user's query, and the crash hooks."""

    def __init__(self, config: dict[str, Any], reply: Callable[[dict[str, Any]], None]) -> None:
        from pyspark.sql.streaming.readwriter import DataStreamWriter

        self.config = config
        self.reply = reply
        self.armed = bool(config["armed"])
        self.query: Any = None
        self.foreach_batch = False
        self.spark = local_spark("filechannel-stream-test", Path(config["work_dir"]), config["spark_conf"])
        self._patch(DataStreamWriter)
        self.function = self._load(config["query"])
        self.read_output = self._load(config["read_output"]) if config["read_output"] else None

    @staticmethod
    def _load(ref: str) -> Callable[..., Any]:
        mod, _, name = ref.partition(":")
        obj: Any = importlib.import_module(mod)
        for part in name.split("."):
            obj = getattr(obj, part)
        return obj  # type: ignore[no-any-return]

    def _patch(self, writer: Any) -> None:
        """Wrap foreachBatch (for the armed crash) and start (for the default checkpoint location)."""
        server = self
        orig_foreach, orig_option, orig_options, orig_start = (
            writer.foreachBatch,
            writer.option,
            writer.options,
            writer.start,
        )
        checkpoint = self.config["checkpoint_dir"]

        def foreachBatch(self: Any, func: Callable[[Any, int], None]) -> Any:
            server.foreach_batch = True

            def batch(df: Any, batch_id: int) -> None:
                func(df, batch_id)
                if server.armed:
                    server.reply({"crashed": batch_id})
                    kill_session(os.getsid(0))  # the JVM, the Python workers, then this process

            return orig_foreach(self, batch)

        def option(self: Any, key: str, value: Any) -> Any:
            if key.lower() == "checkpointlocation":
                self._fc_checkpoint = True
            return orig_option(self, key, value)

        def options(self: Any, **opts: Any) -> Any:
            if any(k.lower() == "checkpointlocation" for k in opts):
                self._fc_checkpoint = True
            return orig_options(self, **opts)

        def start(self: Any, *args: Any, **opts: Any) -> Any:
            if not getattr(self, "_fc_checkpoint", False) and not any(k.lower() == "checkpointlocation" for k in opts):
                orig_option(self, "checkpointLocation", checkpoint)
            return orig_start(self, *args, **opts)

        writer.foreachBatch, writer.option, writer.options, writer.start = foreachBatch, option, options, start

    def _not_foreach(self) -> str:
        return (
            "CrashDriver(at='after_sink') needs a foreachBatch sink: only there can the driver be killed after "
            "the sink wrote a batch and before Spark's commit log; this query's sink is not foreachBatch, "
            "so use CrashDriver() (a kill at any instant) instead"
        )

    def handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        op = msg["op"]
        if op == "start":
            self.foreach_batch = False
            q = self.function(self.spark, self.config["source"], self.config["output_dir"])
            if not hasattr(q, "processAllAvailable"):
                return {"error": f"{self.config['query']} returned {q!r}, not a started StreamingQuery"}
            self.query = q
            if self.armed and not self.foreach_batch:
                q.stop()
                self.query = None
                return {"error": self._not_foreach(), "fatal": True}
            return {"ok": True}
        if op == "arm":
            self.armed = True
            if self.query is not None and not self.foreach_batch:
                return {"error": self._not_foreach(), "fatal": True}
            return {"ok": True}
        if op == "stop":
            if self.query is not None:
                self.query.stop()
            self.query = None
            return {"ok": True}
        if op == "process":
            try:
                self.query.processAllAvailable()
            except Exception as exc:  # noqa: BLE001 - the query's failure is the answer
                self.query = None
                return {"error": f"{type(exc).__name__}: {exc}"}
            return {"ok": True}
        if op == "await_failure":
            try:
                terminated = self.query.awaitTermination(msg["wait"])
            except Exception as exc:  # noqa: BLE001 - the query's failure is the answer
                self.query = None
                return {"error": f"{type(exc).__name__}: {exc}"}
            return {"error": None, "terminated": bool(terminated)}
        if op == "read":
            return {"rows": self._read()}
        if op == "exit":
            if self.query is not None:
                with contextlib.suppress(Exception):
                    self.query.stop()
            self.spark.stop()
            return {"ok": True}
        return {"error": f"unknown request {op!r}"}

    def _read(self) -> list[dict[str, Any]]:
        out = self.config["output_dir"]
        if self.read_output is not None:
            got = self.read_output(self.spark, out)
            # A DataFrame, or rows already collected (Row objects or dicts).
            rows = got.collect() if hasattr(got, "collect") else list(got)
            return [r if isinstance(r, dict) else r.asDict(recursive=True) for r in rows]
        visible = [n for n in os.listdir(out) if not n.startswith((".", "_"))] if os.path.isdir(out) else []
        if not visible:
            return []
        df = self.spark.read.parquet(out)
        return [r.asDict(recursive=True) for r in df.collect()]
