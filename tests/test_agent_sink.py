"""The Spark sink through an agent, over Flight and with real processes (no JVM).

The protocol the writers run (``filechannel.spark.agent_sink``): executors stage
their partitions' rows at the agent (``DoPut`` op ``stage``), the driver asks it
to commit the staged files of a batch (``sink_commit``): one transaction per
(query, batch id) with the mark ``spark-sink:<query>``. Here: the agent
SIGKILLed at random moments between stages and commits and during them (a
retried commit, or a replay with new staged files, delivers each row once)
while a producer process puts through the same agent and a reader reads and
acknowledges; the driver SIGKILLed before or after its commit (the replay puts
each row once); ``serve``'s channel flags; the options of the sink.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyarrow.flight")

from test_agent import cid_of, make_channel
from test_agent_process import AgentProcess, _env

import filechannel
from filechannel import ChannelReader, cli
from filechannel.agent import AgentError, AgentUnavailableError, connect, serve
from filechannel.agent.staging import batch_mark
from filechannel.spark.agent_sink import AgentSinkOptions, AgentSinkTarget
from filechannel.spark.sink import HEADER_BATCH, SinkOptions

QUERY = "5d0c9a1e-0000-4000-8000-00000000abcd"

_PRODUCER = r"""
import sys, time
from pathlib import Path
from filechannel.agent import AgentError, connect
pf, cid, n = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
for seq in range(1, n + 1):
    while True:
        try:
            with connect(f"grpc://127.0.0.1:{int(pf.read_text())}", timeout=3) as c:
                c.put_batch(cid, [b"prod-%d" % seq], producer="prod", sequence=seq)
            break
        except (AgentError, OSError, ValueError):
            time.sleep(0.05)
    time.sleep(0.01)
print("done")
"""


def _uri(pf: Path) -> str:
    return f"grpc://127.0.0.1:{int(pf.read_text())}"


def _retry(pf: Path, fn: Any, deadline: float = 120.0) -> Any:
    """Call ``fn(client)`` against the agent of the port file until it answers (the agent may be restarting)."""
    end = time.monotonic() + deadline
    while True:
        assert time.monotonic() < end, "the agent never answered"
        try:
            with connect(_uri(pf), timeout=3) as c:
                return fn(c)
        except (AgentUnavailableError, OSError, ValueError):
            time.sleep(0.05)
        except AgentError as exc:  # a stage cut by a kill surfaces as another agent error
            if "stage" not in str(exc):
                raise
            time.sleep(0.05)


def _rows(batch: int, part: int) -> list[bytes]:
    return [b"b%d-p%d-%d" % (batch, part, i) for i in range(3)]


def test_agent_sigkilled_between_stage_and_commit_and_during_commit(tmp_path: Path) -> None:
    d = make_channel(tmp_path / "c", 0)
    cid = cid_of(d)
    pf = tmp_path / "port"
    n_batches, n_puts = 40, 150
    state: dict[str, Any] = {"agent": AgentProcess([d], pf, "--writable"), "kills": 0, "stop": False}
    lock = threading.Lock()
    producer = subprocess.Popen(
        [sys.executable, "-c", _PRODUCER, str(pf), cid, str(n_puts)], env=_env(), stdout=subprocess.PIPE, text=True
    )
    seen: list[filechannel.Event] = []
    errors: list[BaseException] = []

    def reader() -> None:  # reads what is durable and acknowledges it; the agent takes behind it
        try:
            with ChannelReader(d, consumer="reader") as r:
                while True:
                    stop = state["stop"]
                    start, end = r.available()
                    if end > start:
                        seen.extend(r.read(start, end))
                        r.ack(end)
                    if stop:
                        return
                    time.sleep(0.05)
        except BaseException as exc:  # raised below
            errors.append(exc)

    def killer() -> None:
        rng = random.Random(7)
        while not state["stop"]:
            time.sleep(rng.uniform(0.1, 0.5))
            with lock:
                if state["stop"]:
                    return
                a = state["agent"]
                a.proc.send_signal(signal.SIGKILL)
                a.proc.wait(timeout=30)
                state["kills"] += 1
                state["agent"] = AgentProcess([d], pf, "--writable")

    threads = [threading.Thread(target=reader), threading.Thread(target=killer)]
    for t in threads:
        t.start()
    outcomes = []
    try:
        for b in range(n_batches):
            files = []
            for part in range(2):  # a stage cut by a kill fails the task: Spark runs it again as a new attempt
                attempt = iter(range(1000))
                name, _, _ = _retry(
                    pf,
                    lambda c, b=b, part=part, attempt=attempt: c.sink_stage(
                        cid, [(x, None) for x in _rows(b, part)], partition=part, attempt=next(attempt),
                        query=QUERY, batch_id=b,
                    ),
                )  # fmt: skip
                files.append(name)
            # The driver's commit, retried until the agent answers (the mark makes retries safe).
            out = _retry(pf, lambda c, b=b, files=files: c.sink_commit(cid, files, rows=6, query=QUERY, batch_id=b))
            outcomes.append(out["reason"])
        assert producer.wait(timeout=300) == 0
    finally:
        state["stop"] = True
        for t in threads:
            t.join(120)
        state["agent"].kill()
        if producer.poll() is None:
            producer.kill()
    assert not errors, errors
    assert state["kills"] >= 5, state["kills"]
    with ChannelReader(d, consumer="reader") as r:  # what the reader had not reached yet
        start, end = r.available()
        seen.extend(r.read(start, end))
    bodies = [e.body for e in seen]
    assert len({e.position for e in seen}) == len(seen)  # the reader got each position once
    sink_rows = [x for x in bodies if x.startswith(b"b")]
    assert sink_rows == [x for b in range(n_batches) for p in range(2) for x in _rows(b, p)]  # once, in order
    assert [x for x in bodies if x.startswith(b"prod-")] == [b"prod-%d" % s for s in range(1, n_puts + 1)]
    assert all(e.headers[HEADER_BATCH] == e.body.split(b"-")[0][1:].decode() for e in seen if e.body[:1] == b"b")
    with filechannel.open(d, minimum_required_space=0) as ch:
        assert ch.mark(batch_mark(QUERY)) == b"%d" % (n_batches - 1)
    assert list((Path(d) / "spark-sink" / "staging").glob("*.stage")) == []
    print(f"\n{state['kills']} agent kills; commit outcomes: {sorted(set(outcomes))}")


_DRIVER = r"""
import sys
from filechannel.agent import connect
uri, cid, query, batch = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
with connect(uri, timeout=10) as c:
    files = []
    for part in range(2):
        rows = [b"b%d-p%d-%d" % (batch, part, i) for i in range(3)]
        files.append(c.sink_stage(cid, [(x, None) for x in rows], partition=part, attempt=0, query=query,
                                  batch_id=batch)[0])
    print("staged", flush=True)
    print(c.sink_commit(cid, files, rows=6, query=query, batch_id=batch)["reason"], flush=True)
"""


def test_driver_sigkilled_before_or_after_its_commit_then_the_replay_puts_each_row_once(tmp_path: Path) -> None:
    d = make_channel(tmp_path / "c", 0)
    cid = cid_of(d)
    with serve([d], "grpc://127.0.0.1:0", writable=True) as agent, connect(agent.location, timeout=10) as c:
        landed = []
        for b, delay in enumerate([None, 0.0, 0.05, 0.2, 0.4, 0.6, 0.8, None]):
            p = subprocess.Popen(
                [sys.executable, "-c", _DRIVER, agent.location, cid, QUERY, str(b)],
                env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )  # fmt: skip
            if delay is not None:
                time.sleep(delay)
                p.send_signal(signal.SIGKILL)
            out, _ = p.communicate(timeout=60)
            landed.append(agent.channels[cid].channel.mark(batch_mark(QUERY)) == b"%d" % b)  # type: ignore[union-attr]
            # The restarted query replays batch b: its tasks stage again (new files), the driver commits.
            files = [
                c.sink_stage(cid, [(x, None) for x in _rows(b, part)], partition=part, attempt=0, query=QUERY,
                             batch_id=b)[0]
                for part in range(2)
            ]  # fmt: skip
            reason = c.sink_commit(cid, files, rows=6, query=QUERY, batch_id=b)["reason"]
            assert reason == ("already committed" if landed[-1] else "committed"), (b, out)
        assert True in landed  # some drivers died after their commit landed ...
        assert False in landed  # ... and some before
        assert [e.body for e in c.read(cid, 0, c.available(cid)[1])] == [
            x for b in range(8) for p in range(2) for x in _rows(b, p)
        ]
        assert list((Path(d) / "spark-sink" / "staging").glob("*.stage")) == []


def test_serve_takes_channel_options_with_writable(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = make_channel(tmp_path / "c", 0)
    cid = cid_of(d)
    assert cli.main(["serve", d, "--listen", "grpc://127.0.0.1:0", "--transaction-capacity", "3", "--check"]) != 0
    assert "--transaction-capacity applies to the channels an agent owns: add --writable" in capsys.readouterr().err
    a = AgentProcess([d], tmp_path / "port", "--writable", "--transaction-capacity", "4", "--max-event-size", "200")
    try:
        with connect(a.uri, timeout=10) as c:
            files = [c.sink_stage(cid, [(b"x", None)] * 3, partition=p, attempt=0, query=QUERY, batch_id=0)[0]
                     for p in range(2)]  # fmt: skip
            with pytest.raises(filechannel.TransactionCapacityError, match="transaction_capacity=4"):
                c.sink_commit(cid, files, rows=6, query=QUERY, batch_id=0)
            with pytest.raises(filechannel.EventTooLargeError):
                c.sink_stage(cid, [(b"y" * 300, None)], partition=0, attempt=1, query=QUERY, batch_id=0)
            assert c.sink_commit(cid, files[:1], rows=3, query=QUERY, batch_id=0)["committed"]
    finally:
        a.kill()


def test_sink_options_through_an_agent(tmp_path: Path) -> None:
    a_dir, b_dir = make_channel(tmp_path / "a", 0), make_channel(tmp_path / "b", 0)
    ro = make_channel(tmp_path / "ro", 0)
    with serve([a_dir, b_dir], "grpc://127.0.0.1:0", writable=True) as agent:
        o = SinkOptions.from_spark({"agent": agent.location, "Channel": "b", "agentTimeoutMs": "5000"})
        assert o.agent == AgentSinkOptions(agent.location, "b", timeout=5.0)
        assert AgentSinkTarget(o.agent).channel == cid_of(b_dir)  # by name
        assert AgentSinkTarget(AgentSinkOptions(agent.location, cid_of(a_dir).upper())).channel == cid_of(a_dir)
        with pytest.raises(filechannel.ConfigError, match="serves 2 channels") as ei:
            AgentSinkTarget(AgentSinkOptions(agent.location))
        assert ei.value.option == "channel"
        with pytest.raises(filechannel.ConfigError, match="is no channel of the agent"):
            AgentSinkTarget(AgentSinkOptions(agent.location, "nope"))
    for opts, option in [
        ({"agent": "grpc://127.0.0.1:1", "path": "/x"}, "path"),
        ({"agent": "grpc://127.0.0.1:1", "channel.capacity": "5"}, "channel.capacity"),
        ({"agent": "grpc://127.0.0.1:1", "keystore": "/k"}, "keystore"),
        ({"agent": "grpc://127.0.0.1:1", "agentTimeoutMs": "0"}, "agentTimeoutMs"),
        ({"agent": "grpc://10.0.0.1:1"}, "agent"),  # plain gRPC off loopback
        ({"agent": "grpc://127.0.0.1:1", "tlsCa": "/ca.pem"}, "tlsCa"),
        ({"agent": "grpc://127.0.0.1:1", "bogus": "1"}, "bogus"),
        ({"path": str(tmp_path / "x"), "tokenFile": "/t"}, "tokenfile"),
    ]:
        with pytest.raises(filechannel.ConfigError) as ei:
            SinkOptions.from_spark(opts)
        assert ei.value.option == option, (opts, ei.value)
    with serve([ro], "grpc://127.0.0.1:0") as agent, connect(agent.location, timeout=10) as c:
        with pytest.raises(AgentError, match="read-only"):
            c.sink_stage(cid_of(ro), [(b"x", None)], partition=0, attempt=0, query=QUERY, batch_id=0)
        with pytest.raises(AgentError, match="read-only"):
            c.sink_commit(cid_of(ro), [], query=QUERY, batch_id=0)


def test_agent_sigkilled_during_commit_then_the_retried_commit_delivers_once(tmp_path: Path) -> None:
    """SIGKILL the agent at increasing delays after a large commit was sent; restart; the driver retries."""
    d = make_channel(tmp_path / "c", 0)
    cid = cid_of(d)
    pf = tmp_path / "port"
    flags = ("--writable", "--transaction-capacity", "30000", "--capacity", "1000000")
    agent = AgentProcess([d], pf, *flags)
    reasons = []
    try:
        for b, delay in enumerate([0.0, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.8, 1.5]):
            rows = [[b"b%d-p%d-%05d-%s" % (b, p, i, b"x" * 64) for i in range(6000)] for p in range(3)]
            with connect(agent.uri, timeout=30) as c:
                files = [
                    c.sink_stage(cid, [(x, None) for x in rows[p]], partition=p, attempt=0, query=QUERY, batch_id=b)[0]
                    for p in range(3)
                ]
            sender = subprocess.Popen(  # the driver's commit call, in flight when the agent dies
                [sys.executable, "-c", _COMMIT, agent.uri, cid, QUERY, str(b), ",".join(f for f in files if f)],
                env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )  # fmt: skip
            assert sender.stdout is not None
            sender.stdout.readline()  # "go": the child is connected and sends the commit now
            time.sleep(delay)  # then the commit's progress
            agent.proc.send_signal(signal.SIGKILL)
            agent.proc.wait(timeout=30)
            sender.communicate(timeout=60)
            agent = AgentProcess([d], pf, *flags)
            out = _retry(pf, lambda c, b=b, files=files: c.sink_commit(cid, files, rows=18000, query=QUERY, batch_id=b))
            reasons.append(out["reason"])
    finally:
        agent.kill()
    assert "committed" in reasons  # the kill came before the transaction was durable ...
    assert "already committed" in reasons  # ... or after: the retry found the mark
    with ChannelReader(d) as v:
        start, end = v.available()
        got = [e.body for e in v.read(start, end)]
    want = [b"b%d-p%d-%05d-%s" % (b, p, i, b"x" * 64) for b in range(10) for p in range(3) for i in range(6000)]
    assert got == want
    print(f"\nretried commits after a kill: {reasons}")


_COMMIT = r"""
import sys
from filechannel.agent import connect
uri, cid, query, batch, files = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5].split(",")
with connect(uri, timeout=30) as c:
    c.channels()  # connected (the start-up is over): say so, then send the commit at once
    print("go", flush=True)
    print(c.sink_commit(cid, files, query=query, batch_id=batch)["reason"])
"""
