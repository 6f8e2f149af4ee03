"""stream_test: a StreamTest for PySpark queries that read a channel, with crashes of the driver and the producer.

:func:`stream_test` runs a list of steps (:class:`AddData`, :class:`StartStream`,
:class:`StopStream`, :class:`ProcessAllAvailable`, :class:`CrashDriver`,
:class:`CrashProducer`, :class:`CheckAnswer`, :class:`CheckExactlyOnce`,
:class:`ExpectFailure`) against a user's streaming query. Two kinds of child
process do the work, each in its own session so that a SIGKILL of its process
group takes everything it started (the driver's JVM and Python workers too):

* the **producer** owns the channel and commits the events of each
  :class:`AddData`; :class:`CrashProducer` kills it with a transaction open;
* the **driver** creates a local SparkSession with the ``filechannel`` format
  registered and calls the user's ``module:function(spark, channel_dir,
  output_dir)``, which returns the started ``StreamingQuery``; it also reads the
  sink's output for the checks (``read_output(spark, output_dir)``);
* with ``agent=True``, an **agent** (``filechannel serve`` on a loopback port)
  serves the channel and the function gets the agent's URI instead of the
  directory (``.option("agents", uri)``); :class:`CrashAgent` SIGKILLs it and
  starts it again on the same port.

Both see the caller's ``sys.path`` (as ``PYTHONPATH``). They talk to this
process over pipes in length-prefixed pickles. ``CrashDriver(at="after_sink")``
wraps the function given to ``DataStreamWriter.foreachBatch`` (the driver patches
the method before calling the user's function): once armed, the driver kills its
session right after the user's batch function returns, that is after the
sink wrote the batch and before Spark wrote its commit log. Other sinks cannot
be cut there, and arming the crash for them is refused with a clear error.

Nothing here imports PySpark in the calling process.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import pickle
import queue
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from filechannel.errors import ConfigError
from filechannel.events import Event

from .checks import _identity, compare, show

__all__ = [
    "AddData",
    "CheckAnswer",
    "CheckExactlyOnce",
    "CrashAgent",
    "CrashDriver",
    "CrashProducer",
    "ExpectFailure",
    "ProcessAllAvailable",
    "StartStream",
    "StopStream",
    "StreamTestError",
    "StreamTestResult",
    "stream_test",
]

logger = logging.getLogger(__name__)

SHOW_ROWS = 20
_LEN = struct.Struct("<I")


# ------------------------------------------------------------------------------------------
# The steps


@dataclass(frozen=True)
class AddData:
    """Put ``events`` into the channel in one committed transaction (bytes, str as UTF-8, or Events)."""

    events: Sequence[bytes | str | Event]
    headers: Mapping[str, str] | None = None

    def __str__(self) -> str:
        return f"AddData({len(self.events)} events)"


@dataclass(frozen=True)
class StartStream:
    """Start the query (a driver process is started first if none runs)."""

    def __str__(self) -> str:
        return "StartStream()"


@dataclass(frozen=True)
class StopStream:
    """Stop the query cleanly (the driver process stays, ready for checks or a restart)."""

    def __str__(self) -> str:
        return "StopStream()"


@dataclass(frozen=True)
class ProcessAllAvailable:
    """Wait until the query has processed everything available (or the armed crash killed the driver)."""

    def __str__(self) -> str:
        return "ProcessAllAvailable()"


@dataclass(frozen=True)
class CrashDriver:
    """SIGKILL the driver with its JVM and workers: now, or with ``at="after_sink"`` after the next batch's sink.

    ``at="after_sink"`` kills the driver right after the ``foreachBatch`` function
    of the next batch returns (after the sink wrote, before Spark's commit log).
    With the stream running, the step returns once that happened (a StartStream
    can follow at once), or fails saying no batch came; before a StartStream it
    arms the crash, and that StartStream's first batch fires it.
    """

    at: str | None = None

    def __str__(self) -> str:
        return f"CrashDriver(at={self.at!r})" if self.at else "CrashDriver()"


@dataclass(frozen=True)
class CrashProducer:
    """SIGKILL the producer while a transaction holding ``uncommitted`` is open; the next AddData recovers."""

    uncommitted: Sequence[bytes] = (b"filechannel.testing: put in a transaction that never committed",)

    def __str__(self) -> str:
        return "CrashProducer()"


@dataclass(frozen=True)
class CrashAgent:
    """SIGKILL the agent serving the channel (``stream_test(..., agent=True)``), then start it again.

    ``down`` seconds pass before the restart (the query runs on meanwhile: its
    source holds the channel's position, or fails, as ``onAgentUnavailable``
    says). The new agent listens on the same port.
    """

    down: float = 0.0

    def __str__(self) -> str:
        return f"CrashAgent(down={self.down:g})" if self.down else "CrashAgent()"


@dataclass(frozen=True)
class CheckAnswer:
    """The sink holds exactly ``rows``, in any order.

    Each expected row is a mapping (compared with the row's columns), a tuple
    (compared with the row's values in column order), or a single value
    (for one-column output). bytes and bytearray compare equal.
    """

    rows: Sequence[Any]

    def __str__(self) -> str:
        return f"CheckAnswer({len(self.rows)} rows)"


@dataclass(frozen=True)
class CheckExactlyOnce:
    """Every event of every AddData is in the sink exactly once, and nothing else is.

    ``key`` picks a sink row's identity: a column name, a callable on the row
    (a dict), or ``None`` for the ``body`` column. ``produced_key`` picks an
    added event's identity (default: the same ``key`` applied to the Event,
    whose fields are ``body``, ``headers``, ``position``; with ``key=None``, its body).
    """

    key: str | Callable[[Any], Any] | None = None
    produced_key: Callable[[Event], Any] | None = None

    def __str__(self) -> str:
        return f"CheckExactlyOnce(key={self.key!r})" if self.key is not None else "CheckExactlyOnce()"


@dataclass(frozen=True)
class ExpectFailure:
    """The query fails (at its start or while running); its error matches the regular expression ``match``."""

    match: str | None = None

    def __str__(self) -> str:
        return f"ExpectFailure(match={self.match!r})"


ACTIONS = (
    AddData,
    StartStream,
    StopStream,
    ProcessAllAvailable,
    CrashDriver,
    CrashProducer,
    CrashAgent,
    CheckAnswer,
    CheckExactlyOnce,
    ExpectFailure,
)


class StreamTestError(AssertionError):
    """A step of :func:`stream_test` failed; the message says which, why, and what the sink held."""

    def __init__(self, message: str, step: int, action: object, rows: list[dict[str, Any]] | None) -> None:
        super().__init__(message)
        self.step = step
        self.action = action
        self.rows = rows


@dataclass
class StreamTestResult:
    """What a passing :func:`stream_test` saw: the events added, the sink's last rows, the crashes."""

    produced: list[Event]
    rows: list[dict[str, Any]] | None
    driver_crashes: list[str] = field(default_factory=list)
    producer_crashes: int = 0
    agent_crashes: int = 0
    log: list[str] = field(default_factory=list)


class _StepFailed(Exception):
    """Internal: the current step failed for ``reason``."""


class _ChildDied(Exception):
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


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [p or os.getcwd() for p in sys.path]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.setdefault("PYSPARK_PYTHON", sys.executable)
    env.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    env.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    return env


class _Child:
    """A child process (driver or producer) in its own session, spoken to over two pipes."""

    def __init__(self, role: str, log: Path) -> None:
        self.role = role
        self.log = log
        r, w = os.pipe()
        code = (
            "import sys; from filechannel.testing.stream import _child_main; _child_main(sys.argv[1], int(sys.argv[2]))"
        )
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
    def start(cls, role: str, config: dict[str, Any], log: Path, timeout: float) -> _Child:
        """Start a child and hand it its configuration; raise _StepFailed (the child killed) if it cannot start."""
        child = cls(role, log)
        try:
            child.call("config", timeout, config=config)
        except (_StepFailed, _ChildDied) as exc:
            child.kill()
            raise _StepFailed(f"the {role} could not start: {exc}; its log ends:\n{child.tail()}") from None
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
        """Send one request and wait for its reply; raise _ChildDied if the process ends first."""
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
                raise _StepFailed(f"the {self.role} did not answer {op!r} within {timeout:.0f} s (killed)") from None
            if msg is None:
                self._replies.put(None)  # stays ended for later calls
                self.proc.wait()
                self.reap()
                raise _ChildDied(f"the {self.role} process ended (exit status {self.proc.returncode})", self.crashed)
            if "crashed" in msg:
                self.crashed = msg["crashed"]
                continue
            if msg.get("error") is not None and msg.get("fatal"):
                raise _StepFailed(msg["error"])
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
        except (_ChildDied, _StepFailed):
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


class _AgentProcess:
    """``filechannel serve CHANNEL --listen grpc://127.0.0.1:PORT`` in its own session (same port on restarts)."""

    def __init__(self, channel_dir: str, work: Path, timeout: float) -> None:
        self.channel_dir = channel_dir
        self.work = work
        self.timeout = timeout
        self.port = 0
        self.starts = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def uri(self) -> str:
        return f"grpc://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start the agent; return once it listens (raise _StepFailed if it does not)."""
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
            if time.monotonic() >= deadline or self.port == 0:
                tail = log.read_text(errors="replace").splitlines()[-10:]
                raise _StepFailed("the agent did not start; its log ends:\n" + "\n".join(tail))
            time.sleep(0.2)  # the old port not free yet: try again until the step's timeout

    def kill(self) -> None:
        """SIGKILL the agent (its whole session) and reap it."""
        if self.proc is not None:
            kill_session(self.proc.pid)
            self.proc.wait()
            self.proc = None


# ------------------------------------------------------------------------------------------
# The calling side


def _importable(what: object, option: str) -> str:
    """``"module:function"`` for a string of that form or a module-level function."""
    if isinstance(what, str):
        if not re.fullmatch(r"[\w.]+:[\w.]+", what):
            raise ConfigError(option, f"{what!r} is not 'module:function'")
        return what
    mod, qual = getattr(what, "__module__", None), getattr(what, "__qualname__", None)
    if not callable(what) or not mod or not qual or "<" in qual or mod == "__main__":
        raise ConfigError(
            option,
            f"{what!r} cannot be imported by the driver subprocess: pass 'module:function' "
            "or a function defined at the top level of an importable module",
        )
    return f"{mod}:{qual}"


def _norm(v: Any) -> Any:
    if isinstance(v, (bytearray, memoryview)):
        return bytes(v)
    if isinstance(v, Mapping):
        return tuple(sorted((k, _norm(x)) for k, x in v.items()))
    if isinstance(v, (list, tuple)):
        return tuple(_norm(x) for x in v)
    return v


def _expected_matches(rows: list[dict[str, Any]], expected: Sequence[Any]) -> str | None:
    """None if the rows are the expected ones (any order), else what differs."""

    def want_form(e: Any) -> Any:
        if isinstance(e, Mapping):
            return _norm(dict(e))
        return ("__values__", _norm(tuple(e) if isinstance(e, (tuple, list)) else (e,)))

    remaining = Counter(want_form(e) for e in expected)
    extra = []
    for r in rows:
        # A row matches an expected mapping (by columns) or tuple (by values in column order).
        for form in (_norm(r), ("__values__", _norm(tuple(r.values())))):
            if remaining[form] > 0:
                remaining[form] -= 1
                break
        else:
            extra.append(r)
    missing = []
    for e in expected:
        if remaining[want_form(e)] > 0:
            remaining[want_form(e)] -= 1
            missing.append(e)
    if not missing and not extra:
        return None
    parts = [f"expected {len(expected)} rows, the sink holds {len(rows)}"]
    if missing:
        parts.append(f"{len(missing)} expected rows not in the sink, first: {', '.join(map(show, missing[:5]))}")
    if extra:
        parts.append(f"{len(extra)} rows not expected, first: {', '.join(map(show, extra[:5]))}")
    return "; ".join(parts)


class _Run:
    """The state of one stream_test run on the calling side."""

    def __init__(
        self,
        query: str,
        read_output: str | None,
        dirs: dict[str, str],
        work: Path,
        timeout: float,
        channel_options: dict[str, Any],
        spark_conf: dict[str, str],
        agent: bool = False,
    ) -> None:
        self.query = query
        self.agent = _AgentProcess(dirs["channel_dir"], work, timeout) if agent else None
        self.read_output = read_output
        self.dirs = dirs
        self.work = work
        self.timeout = timeout
        self.channel_options = channel_options
        self.spark_conf = spark_conf
        self.driver: _Child | None = None
        self.producer: _Child | None = None
        self.armed = False
        self.armed_step = 0
        self.streaming = False
        self.pending_failure: str | None = None
        self.produced: list[Event] = []
        self.rows: list[dict[str, Any]] | None = None
        self.result = StreamTestResult(produced=self.produced, rows=None)
        self.drivers_started = 0
        self.producers_started = 0
        self.crashed_as_armed = False  # since the last StartStream

    # -- children ------------------------------------------------------------------------

    def ensure_driver(self) -> _Child:
        if self.driver is None:
            self.drivers_started += 1
            if self.agent is not None and self.agent.proc is None:
                self.agent.start()
            config = {
                "query": self.query,
                "read_output": self.read_output,
                "armed": self.armed,
                "spark_conf": self.spark_conf,
                **self.dirs,
                "source": self.agent.uri if self.agent is not None else self.dirs["channel_dir"],
            }
            self.driver = _Child.start("driver", config, self.work / f"driver-{self.drivers_started}.log", self.timeout)
        return self.driver

    def ensure_producer(self) -> _Child:
        if self.producer is None:
            self.producers_started += 1
            config = {"channel_dir": self.dirs["channel_dir"], "options": self.channel_options}
            log = self.work / f"producer-{self.producers_started}.log"
            self.producer = _Child.start("producer", config, log, self.timeout)
        return self.producer

    def driver_call(self, op: str, extra_time: float = 0.0, **args: Any) -> dict[str, Any] | None:
        """Call the driver; None if the armed crash killed it meanwhile (the stream is then gone)."""
        d = self.ensure_driver()
        try:
            reply = d.call(op, self.timeout + extra_time, **args)
        except _ChildDied as exc:
            self.driver = None
            self.streaming = False
            if exc.crashed is None:
                raise _StepFailed(f"{exc}; its log ends:\n{d.tail()}") from None
            self.armed = False
            self.crashed_as_armed = True
            self.result.driver_crashes.append(f"after the sink wrote batch {exc.crashed}")
            self.result.log.append(f"  the driver crashed as armed, after the sink wrote batch {exc.crashed}")
            return None
        return reply

    # -- the steps -------------------------------------------------------------------------

    def run(self, action: object, index: int, actions: Sequence[object]) -> None:
        if isinstance(action, AddData):
            self.add(action)
        elif isinstance(action, StartStream):
            self.start(index, actions)
        elif isinstance(action, StopStream):
            if self.crashed_as_armed and not self.streaming:
                return  # the armed crash stopped it (maybe before StartStream could answer)
            self.need_stream("StopStream")
            if self.driver_call("stop") is not None:
                self.streaming = False
        elif isinstance(action, ProcessAllAvailable):
            if self.crashed_as_armed and not self.streaming:
                return  # the armed crash ended it (maybe before StartStream could answer)
            self.need_stream("ProcessAllAvailable")
            reply = self.driver_call("process")
            if reply is not None and reply.get("error"):
                self.streaming = False
                raise _StepFailed(f"the query failed: {reply['error']}")
        elif isinstance(action, CrashDriver):
            self.crash_driver(action, index)
        elif isinstance(action, CrashProducer):
            self.crash_producer(action)
        elif isinstance(action, CrashAgent):
            self.crash_agent(action)
        elif isinstance(action, CheckAnswer):
            problem = _expected_matches(self.read(), list(action.rows))
            if problem:
                raise _StepFailed(problem)
        elif isinstance(action, CheckExactlyOnce):
            rows = self.read()
            if action.key is None and rows and "body" not in rows[0]:
                raise _StepFailed(f"the sink's rows have no 'body' column ({', '.join(rows[0])}): pass key=")
            pkey = action.produced_key if action.produced_key is not None else action.key
            try:
                p_ids = [_identity(pkey)(e) for e in self.produced]
            except (KeyError, AttributeError, TypeError) as exc:
                raise _StepFailed(
                    f"key {pkey!r} does not apply to an added Event ({exc!r}): pass produced_key="
                ) from None
            try:
                d_ids = [_identity(action.key)(r) for r in rows]
            except (KeyError, AttributeError, TypeError) as exc:
                raise _StepFailed(f"key {action.key!r} does not apply to the sink's rows ({exc!r})") from None
            report = compare(p_ids, d_ids)
            if report.missing or report.duplicated or report.unexpected:
                raise _StepFailed(report.describe("not exactly once"))
        elif isinstance(action, ExpectFailure):
            self.expect_failure(action)

    def need_stream(self, what: str) -> None:
        if not self.streaming:
            raise _StepFailed(f"{what}: no stream is running (add a StartStream() before it)")

    def add(self, action: AddData) -> None:
        events = []
        for e in action.events:
            if isinstance(e, Event):
                events.append(Event(e.body, dict(e.headers) or dict(action.headers or {})))
            elif isinstance(e, str):
                events.append(Event(e.encode(), dict(action.headers or {})))
            elif isinstance(e, (bytes, bytearray, memoryview)):
                events.append(Event(bytes(e), dict(action.headers or {})))
            else:
                raise _StepFailed(f"an event must be bytes, str or filechannel.Event, not {type(e).__name__}")
        p = self.ensure_producer()
        try:
            reply = p.call("put", self.timeout, events=[(e.body, dict(e.headers)) for e in events])
        except _ChildDied as exc:
            self.producer = None
            raise _StepFailed(f"{exc}; its log ends:\n{p.tail()}") from None
        if reply.get("error"):
            raise _StepFailed(f"the put failed: {reply['error']}")
        self.produced.extend(events)

    def start(self, index: int, actions: Sequence[object]) -> None:
        if self.streaming:
            raise _StepFailed("StartStream: the stream is already running (StopStream or CrashDriver first)")
        self.crashed_as_armed = False
        reply = self.driver_call("start")
        if reply is None:
            return  # started, and the armed crash already fired
        if reply.get("error"):
            if index < len(actions) and isinstance(actions[index], ExpectFailure):
                self.pending_failure = reply["error"]
                return
            raise _StepFailed(f"the query did not start: {reply['error']}")
        self.streaming = True

    def crash_driver(self, action: CrashDriver, index: int) -> None:
        if action.at not in (None, "after_sink"):
            raise _StepFailed(f"CrashDriver(at={action.at!r}): `at` is None or 'after_sink'")
        if action.at == "after_sink":
            self.armed, self.armed_step = True, index
            if self.driver is not None:
                reply = self.driver_call("arm")
                if reply is not None and reply.get("error"):
                    raise _StepFailed(reply["error"])
            if self.streaming:
                # The stream runs: the step ends once the driver is dead, after the next batch's sink
                # (so that a StartStream can follow it at once).
                reply = self.driver_call("process")
                if reply is not None:
                    if reply.get("error"):
                        self.streaming = False
                        raise _StepFailed(f"the query failed: {reply['error']}")
                    raise _StepFailed(
                        "CrashDriver(at='after_sink'): no batch reached the sink, so the driver was not killed "
                        "(nothing new to read: add data with AddData before this step)"
                    )
            return
        if self.driver is None:
            raise _StepFailed("CrashDriver(): no driver is running (StartStream first)")
        n = self.driver.kill()
        self.result.driver_crashes.append("now")
        self.result.log.append(f"  SIGKILL of the driver's session: {n} processes")
        self.driver = None
        self.streaming = False

    def crash_producer(self, action: CrashProducer) -> None:
        p = self.ensure_producer()
        try:
            p.call("open_transaction", self.timeout, events=[bytes(b) for b in action.uncommitted])
        except _ChildDied as exc:
            self.producer = None
            raise _StepFailed(f"{exc}; its log ends:\n{p.tail()}") from None
        p.kill()
        self.producer = None
        self.result.producer_crashes += 1

    def crash_agent(self, action: CrashAgent) -> None:
        if self.agent is None:
            raise _StepFailed("CrashAgent(): no agent serves the channel (call stream_test(..., agent=True))")
        if not (isinstance(action.down, (int, float)) and action.down >= 0):
            raise _StepFailed(f"CrashAgent(down={action.down!r}): down is a number of seconds >= 0")
        if self.agent.proc is None:
            self.agent.start()
        self.agent.kill()
        self.result.agent_crashes += 1
        self.result.log.append(f"  SIGKILL of the agent; down for {action.down:g} s")
        time.sleep(action.down)
        self.agent.start()

    def expect_failure(self, action: ExpectFailure) -> None:
        error = self.pending_failure
        self.pending_failure = None
        if error is None:
            self.need_stream("ExpectFailure")
            reply = self.driver_call("await_failure", extra_time=60.0, wait=self.timeout)
            if reply is None:
                raise _StepFailed("ExpectFailure: the driver crashed (as armed) instead of the query failing")
            self.streaming = False
            error = reply.get("error")
            if error is None:
                how = "stopped without an error" if reply.get("terminated") else "still runs"
                raise _StepFailed(f"ExpectFailure: the query {how} after {self.timeout:.0f} s")
        if action.match is not None and not re.search(action.match, error):
            raise _StepFailed(f"the query failed, but its error does not match {action.match!r}:\n{error}")
        self.result.log.append(f"  the query failed as expected: {error.splitlines()[0] if error else ''}")

    def read(self) -> list[dict[str, Any]]:
        for _ in range(3):  # the armed crash may kill the driver while it reads
            reply = self.driver_call("read")
            if reply is None:
                continue
            if reply.get("error"):
                raise _StepFailed(f"reading the sink's output failed: {reply['error']}")
            self.rows = reply["rows"]
            return self.rows
        raise _StepFailed("reading the sink's output: the driver kept crashing")

    def shutdown(self) -> None:
        for child in (self.driver, self.producer):
            if child is not None:
                child.close(min(self.timeout, 60.0))
        self.driver = self.producer = None
        if self.agent is not None:
            self.agent.kill()


def stream_test(
    query: str | Callable[..., Any],
    actions: Sequence[object],
    *,
    channel_dir: str | os.PathLike[str] | None = None,
    output_dir: str | os.PathLike[str] | None = None,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    work_dir: str | os.PathLike[str] | None = None,
    read_output: str | Callable[..., Any] | None = None,
    timeout: float = 300.0,
    channel_options: Mapping[str, Any] | None = None,
    spark_conf: Mapping[str, str] | None = None,
    agent: bool = False,
) -> StreamTestResult:
    """Run ``actions`` against the streaming query ``query``; raise :class:`StreamTestError` at the first failing step.

    Args:
        query: ``"module:function"`` (or such a function): ``function(spark,
            channel_dir, output_dir)`` returns the started ``StreamingQuery``
            that reads the channel (``spark.readStream.format("filechannel")``)
            and writes under ``output_dir``.
        actions: The steps, run in order.
        channel_dir: The channel (created if missing). Default: a temporary directory.
        output_dir: Where the sink writes. Default: a temporary directory.
        checkpoint_dir: The query's checkpoint, set on the query unless the
            function sets ``checkpointLocation`` itself. Default: a temporary directory.
            All three stay the same across driver restarts.
        work_dir: Where the children's logs (and the directories not given)
            go. Default: a new temporary directory, removed when the test
            passes, kept (and named in the report) when it fails.
        read_output: ``"module:function"`` (or such a function) ``f(spark,
            output_dir)`` returning what the sink holds: a DataFrame, or a list of rows (``Row`` or dict).
            Default: ``spark.read.parquet(output_dir)`` (no rows while it is empty).
        timeout: Seconds each step may take (a driver start included).
        channel_options: Options of :func:`filechannel.open` for the producer.
        spark_conf: Extra settings of the driver's SparkSession.
        agent: Serve the channel through an agent (``filechannel serve`` on a
            loopback port, started with the first driver): ``function`` then
            gets the agent's URI instead of ``channel_dir`` (read it with
            ``.option("agents", uri)``), and :class:`CrashAgent` applies.

    Returns:
        A :class:`StreamTestResult`.
    """
    __tracebackhide__ = True
    query_ref = _importable(query, "query")
    read_ref = None if read_output is None else _importable(read_output, "read_output")
    for i, a in enumerate(actions, 1):
        if not isinstance(a, ACTIONS):
            raise ConfigError("actions", f"step {i} is {a!r}, not one of {', '.join(c.__name__ for c in ACTIONS)}")
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ConfigError("timeout", f"must be a positive number of seconds, not {timeout!r}")
    own_work = work_dir is None
    work = Path(tempfile.mkdtemp(prefix="fc-stream-test-")) if work_dir is None else Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    dirs = {
        "channel_dir": os.fspath(channel_dir) if channel_dir is not None else str(work / "channel"),
        "output_dir": os.fspath(output_dir) if output_dir is not None else str(work / "output"),
        "checkpoint_dir": os.fspath(checkpoint_dir) if checkpoint_dir is not None else str(work / "checkpoint"),
        "work_dir": str(work),
    }
    import filechannel

    filechannel.open(dirs["channel_dir"], **dict(channel_options or {})).close()
    run = _Run(
        query_ref,
        read_ref,
        dirs,
        work,
        float(timeout),
        dict(channel_options or {}),
        dict(spark_conf or {}),
        agent=bool(agent),
    )
    done: list[str] = []
    try:
        for i, action in enumerate(actions, 1):
            t0 = time.monotonic()
            try:
                run.run(action, i, actions)
            except _StepFailed as exc:
                run.result.log.append(f"{i:3} {action}  FAILED")
                raise StreamTestError(_report(run, i, actions, done, str(exc)), i, action, run.rows) from None
            done.append(f"{i:3} {action}  ok ({time.monotonic() - t0:.1f} s)")
            run.result.log.append(done[-1])
        if run.armed:
            msg = "the armed crash never fired: no batch reached the sink after it (add data and ProcessAllAvailable)"
            raise StreamTestError(
                _report(run, run.armed_step, actions, done, msg), run.armed_step, actions[run.armed_step - 1], run.rows
            )
    finally:
        run.shutdown()
    run.result.rows = run.rows
    if own_work:
        shutil.rmtree(work, ignore_errors=True)
    return run.result


def _report(run: _Run, step: int, actions: Sequence[object], done: list[str], reason: str) -> str:
    lines = [
        f"stream_test step {step} of {len(actions)} failed: {actions[step - 1]}",
        *("  " + x for x in reason.splitlines()),
    ]
    lines.append("steps:")
    lines += done
    lines.append(f"{step:3} {actions[step - 1]}  FAILED")
    lines += [f"{i:3} {a}  not run" for i, a in enumerate(actions[step:], step + 1)]
    rows = run.rows
    if rows is None and run.drivers_started and not isinstance(actions[step - 1], (CheckAnswer, CheckExactlyOnce)):
        with contextlib.suppress(_StepFailed):
            rows = run.read()
    if rows is None:
        lines.append(
            "the sink's output could not be read" if run.drivers_started else "no driver ran: the sink was not read"
        )
    else:
        lines.append(f"the sink held {len(rows)} rows ({run.dirs['output_dir']}){':' if rows else ''}")
        lines += [f"  {show(r, 200)}" for r in rows[:SHOW_ROWS]]
        if len(rows) > SHOW_ROWS:
            lines.append(f"  ... and {len(rows) - SHOW_ROWS} more")
    who = "driver, producer and agent" if run.agent is not None else "driver and producer"
    lines.append(f"logs of the {who} processes: {run.work}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------
# The child side


def _child_main(role: str, fd: int) -> None:
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


class _DriverServer:
    """The driver: a SparkSession, the user's query, and the crash hooks."""

    def __init__(self, config: dict[str, Any], reply: Callable[[dict[str, Any]], None]) -> None:
        from pyspark.sql import SparkSession
        from pyspark.sql.streaming.readwriter import DataStreamWriter

        import filechannel.spark

        self.config = config
        self.reply = reply
        self.armed = bool(config["armed"])
        self.query: Any = None
        self.foreach_batch = False
        work = Path(config["work_dir"])
        builder = (
            SparkSession.builder.master("local[2]")
            .appName("filechannel-stream-test")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.shuffle.partitions", "1")
            .config("spark.local.dir", str(work / "spark-local"))
            .config("spark.sql.warehouse.dir", str(work / "warehouse"))
            .config("spark.sql.streaming.stopTimeout", "30s")
        )
        for k, v in config["spark_conf"].items():
            builder = builder.config(k, v)
        self.spark = builder.getOrCreate()
        self.spark.sparkContext.setLogLevel("ERROR")
        filechannel.spark.register(self.spark)
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
