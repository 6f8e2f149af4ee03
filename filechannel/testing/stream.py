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
import logging
import os
import re
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from filechannel.errors import ConfigError
from filechannel.events import Event

from .checks import compare, identity_of, show
from .processes import AgentProcess, Child, ChildDied, StepFailed, kill_session, session_pids
from .steps import (
    ACTIONS,
    AddData,
    CheckAnswer,
    CheckExactlyOnce,
    CrashAgent,
    CrashDriver,
    CrashProducer,
    ExpectFailure,
    ProcessAllAvailable,
    StartStream,
    StopStream,
)

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
    "kill_session",
    "session_pids",
    "stream_test",
]

logger = logging.getLogger(__name__)

SHOW_ROWS = 20


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
        self.agent = AgentProcess(dirs["channel_dir"], work, timeout) if agent else None
        self.read_output = read_output
        self.dirs = dirs
        self.work = work
        self.timeout = timeout
        self.channel_options = channel_options
        self.spark_conf = spark_conf
        self.driver: Child | None = None
        self.producer: Child | None = None
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

    def ensure_driver(self) -> Child:
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
            self.driver = Child.start("driver", config, self.work / f"driver-{self.drivers_started}.log", self.timeout)
        return self.driver

    def ensure_producer(self) -> Child:
        if self.producer is None:
            self.producers_started += 1
            config = {"channel_dir": self.dirs["channel_dir"], "options": self.channel_options}
            log = self.work / f"producer-{self.producers_started}.log"
            self.producer = Child.start("producer", config, log, self.timeout)
        return self.producer

    def driver_call(self, op: str, extra_time: float = 0.0, **args: Any) -> dict[str, Any] | None:
        """Call the driver; None if the armed crash killed it meanwhile (the stream is then gone)."""
        d = self.ensure_driver()
        try:
            reply = d.call(op, self.timeout + extra_time, **args)
        except ChildDied as exc:
            self.driver = None
            self.streaming = False
            if exc.crashed is None:
                raise StepFailed(f"{exc}; its log ends:\n{d.tail()}") from None
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
                raise StepFailed(f"the query failed: {reply['error']}")
        elif isinstance(action, CrashDriver):
            self.crash_driver(action, index)
        elif isinstance(action, CrashProducer):
            self.crash_producer(action)
        elif isinstance(action, CrashAgent):
            self.crash_agent(action)
        elif isinstance(action, CheckAnswer):
            problem = _expected_matches(self.read(), list(action.rows))
            if problem:
                raise StepFailed(problem)
        elif isinstance(action, CheckExactlyOnce):
            rows = self.read()
            if action.key is None and rows and "body" not in rows[0]:
                raise StepFailed(f"the sink's rows have no 'body' column ({', '.join(rows[0])}): pass key=")
            pkey = action.produced_key if action.produced_key is not None else action.key
            try:
                p_ids = [identity_of(pkey)(e) for e in self.produced]
            except (KeyError, AttributeError, TypeError) as exc:
                raise StepFailed(
                    f"key {pkey!r} does not apply to an added Event ({exc!r}): pass produced_key="
                ) from None
            try:
                d_ids = [identity_of(action.key)(r) for r in rows]
            except (KeyError, AttributeError, TypeError) as exc:
                raise StepFailed(f"key {action.key!r} does not apply to the sink's rows ({exc!r})") from None
            report = compare(p_ids, d_ids)
            if report.missing or report.duplicated or report.unexpected:
                raise StepFailed(report.describe("not exactly once"))
        elif isinstance(action, ExpectFailure):
            self.expect_failure(action)

    def need_stream(self, what: str) -> None:
        if not self.streaming:
            raise StepFailed(f"{what}: no stream is running (add a StartStream() before it)")

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
                raise StepFailed(f"an event must be bytes, str or filechannel.Event, not {type(e).__name__}")
        p = self.ensure_producer()
        try:
            reply = p.call("put", self.timeout, events=[(e.body, dict(e.headers)) for e in events])
        except ChildDied as exc:
            self.producer = None
            raise StepFailed(f"{exc}; its log ends:\n{p.tail()}") from None
        if reply.get("error"):
            raise StepFailed(f"the put failed: {reply['error']}")
        self.produced.extend(events)

    def start(self, index: int, actions: Sequence[object]) -> None:
        if self.streaming:
            raise StepFailed("StartStream: the stream is already running (StopStream or CrashDriver first)")
        self.crashed_as_armed = False
        reply = self.driver_call("start")
        if reply is None:
            return  # started, and the armed crash already fired
        if reply.get("error"):
            if index < len(actions) and isinstance(actions[index], ExpectFailure):
                self.pending_failure = reply["error"]
                return
            raise StepFailed(f"the query did not start: {reply['error']}")
        self.streaming = True

    def crash_driver(self, action: CrashDriver, index: int) -> None:
        if action.at not in (None, "after_sink"):
            raise StepFailed(f"CrashDriver(at={action.at!r}): `at` is None or 'after_sink'")
        if action.at == "after_sink":
            self.armed, self.armed_step = True, index
            if self.driver is not None:
                reply = self.driver_call("arm")
                if reply is not None and reply.get("error"):
                    raise StepFailed(reply["error"])
            if self.streaming:
                # The stream runs: the step ends once the driver is dead, after the next batch's sink
                # (so that a StartStream can follow it at once).
                reply = self.driver_call("process")
                if reply is not None:
                    if reply.get("error"):
                        self.streaming = False
                        raise StepFailed(f"the query failed: {reply['error']}")
                    raise StepFailed(
                        "CrashDriver(at='after_sink'): no batch reached the sink, so the driver was not killed "
                        "(nothing new to read: add data with AddData before this step)"
                    )
            return
        if self.driver is None:
            raise StepFailed("CrashDriver(): no driver is running (StartStream first)")
        n = self.driver.kill()
        self.result.driver_crashes.append("now")
        self.result.log.append(f"  SIGKILL of the driver's session: {n} processes")
        self.driver = None
        self.streaming = False

    def crash_producer(self, action: CrashProducer) -> None:
        p = self.ensure_producer()
        try:
            p.call("open_transaction", self.timeout, events=[bytes(b) for b in action.uncommitted])
        except ChildDied as exc:
            self.producer = None
            raise StepFailed(f"{exc}; its log ends:\n{p.tail()}") from None
        p.kill()
        self.producer = None
        self.result.producer_crashes += 1

    def crash_agent(self, action: CrashAgent) -> None:
        if self.agent is None:
            raise StepFailed("CrashAgent(): no agent serves the channel (call stream_test(..., agent=True))")
        if not (isinstance(action.down, (int, float)) and action.down >= 0):
            raise StepFailed(f"CrashAgent(down={action.down!r}): down is a number of seconds >= 0")
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
                raise StepFailed("ExpectFailure: the driver crashed (as armed) instead of the query failing")
            self.streaming = False
            error = reply.get("error")
            if error is None:
                how = "stopped without an error" if reply.get("terminated") else "still runs"
                raise StepFailed(f"ExpectFailure: the query {how} after {self.timeout:.0f} s")
        if action.match is not None and not re.search(action.match, error):
            raise StepFailed(f"the query failed, but its error does not match {action.match!r}:\n{error}")
        self.result.log.append(f"  the query failed as expected: {error.splitlines()[0] if error else ''}")

    def read(self) -> list[dict[str, Any]]:
        for _ in range(3):  # the armed crash may kill the driver while it reads
            reply = self.driver_call("read")
            if reply is None:
                continue
            if reply.get("error"):
                raise StepFailed(f"reading the sink's output failed: {reply['error']}")
            self.rows = reply["rows"]
            return self.rows
        raise StepFailed("reading the sink's output: the driver kept crashing")

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
            except StepFailed as exc:
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
        with contextlib.suppress(StepFailed):
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
