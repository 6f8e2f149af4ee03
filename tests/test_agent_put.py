"""Exactly-once puts over Flight (``filechannel serve --writable``, ``AgentClient.put_batch``).

The agent commits a put's events and the producer's sequence number (the mark
``producer:<id>``) in one channel transaction, so a retry of a committed
(producer, sequence) is acknowledged without a second put: after a lost
answer, and after the agent was SIGKILLed at a random moment.
"""

from __future__ import annotations

import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyarrow.flight")

import pyarrow as pa
import pyarrow.flight as fl
from test_agent import cid_of, drain, make_channel
from test_agent_process import AgentProcess

import filechannel
from filechannel.agent import AgentError, AgentProtocolError, AgentUnavailableError, connect, serve
from filechannel.agent import protocol as proto
from filechannel.errors import ChannelFullError, EventTooLargeError, TransactionCapacityError

OPTS: dict[str, Any] = {"minimum_required_space": 0}


def test_a_put_commits_its_events_and_the_producer_sequence_once(tmp_path: Path) -> None:
    d = make_channel(tmp_path / "c", 0)
    cid = cid_of(d)
    with serve([d], "grpc://127.0.0.1:0", writable=True) as agent, connect(agent.location, timeout=10) as c:
        r = c.put_batch(cid, [b"a", b"b"], [{"k": "v"}, None], producer="web-1", sequence=1)
        assert r == filechannel.agent.PutResult(False, 1, 1, 2)
        assert agent.channels[cid].channel is not None
        assert agent.channels[cid].channel.mark("producer:web-1") == b"1"
        # A retry of a committed sequence, and an older one: acknowledged, nothing put.
        assert c.put_batch(cid, [b"a", b"b"], producer="web-1", sequence=1) == filechannel.agent.PutResult(
            True, 1, 1, 0
        )
        assert c.put_batch(cid, [b"zzz"], producer="web-1", sequence=0).duplicate
        # Another producer numbers its own batches; a gap in the numbers is fine.
        assert not c.put_batch(cid, [b"c"], producer="web-2", sequence=1).duplicate
        assert c.put_batch(cid, [b"d"], producer="web-1", sequence=5) == filechannel.agent.PutResult(False, 5, 5, 1)
        assert c.read(cid, 0, 4)[0].headers == {"k": "v"}  # readers keep working beside the owner
        assert [e.body for e in c.read(cid, 0, 4)] == [b"a", b"b", b"c", b"d"]
    assert drain(d) == [(b"a", {"k": "v"}), (b"b", {}), (b"c", {}), (b"d", {})]
    with filechannel.open(d, **OPTS) as ch:  # the sequence numbers survive the agent
        assert ch.marks() == {"producer:web-1": b"5", "producer:web-2": b"1"}


def test_refusals_are_clear(tmp_path: Path) -> None:
    d = make_channel(tmp_path / "c", 0)
    cid = cid_of(d)
    ro = make_channel(tmp_path / "ro", 0)
    opts = {"capacity": 3, "transaction_capacity": 2, "max_event_size": 64, "keep_alive": 0.2}
    with (
        serve([d], "grpc://127.0.0.1:0", writable=True, channel_options=opts) as agent,
        connect(agent.location, timeout=10) as c,
    ):
        with pytest.raises(EventTooLargeError):
            c.put_batch(cid, [b"x" * 100], producer="p", sequence=1)
        with pytest.raises(TransactionCapacityError):
            c.put_batch(cid, [b"x"] * 3, producer="p", sequence=1)
        for bad in ("", "a b", "x" * 101, "é"):
            with pytest.raises(ValueError, match="producer id"):
                c.put_batch(cid, [b"x"], producer=bad, sequence=1)
        with pytest.raises(ValueError, match="sequence"):
            c.put_batch(cid, [b"x"], producer="p", sequence=-1)
        c.put_batch(cid, [b"1", b"2"], producer="p", sequence=1)
        c.put_batch(cid, [b"3"], producer="p", sequence=2)
        with pytest.raises(ChannelFullError):  # retryable: nothing was put, the sequence is not committed
            c.put_batch(cid, [b"4"], producer="p", sequence=3)
        assert agent.channels[cid].channel.mark("producer:p") == b"2"  # type: ignore[union-attr]
        # A bad producer id sent past the client's check is refused by the agent too.
        cmd = json_command(cid, "bad id", 1)
        with pytest.raises(fl.FlightServerError, match="producer id"):
            raw_put(c, cmd)
    with (
        serve([ro], "grpc://127.0.0.1:0") as agent,
        connect(agent.location, timeout=10) as c,
        pytest.raises(AgentError, match="read-only"),
    ):
        c.put_batch(cid_of(ro), [b"x"], producer="p", sequence=1)
    assert isinstance(AgentProtocolError("", "x"), AgentError)


def raw_put(c: Any, cmd: bytes) -> None:
    w, r = c._flight().do_put(fl.FlightDescriptor.for_command(cmd), proto.put_schema(), c._options())
    try:
        w.write_table(pa.table({"body": [b"x"], "headers": [None]}, schema=proto.put_schema()))
        w.done_writing()
        r.read()
    finally:
        w.close()


def json_command(cid: str, producer: str, sequence: int) -> bytes:
    import json

    return json.dumps({"v": 1, "op": "put", "channel": cid, "producer": producer, "sequence": sequence}).encode()


def test_a_retry_after_a_lost_answer_is_not_put_twice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent commits, then the answer is lost (the client sees an error): the retry is a duplicate."""
    d = make_channel(tmp_path / "c", 0)
    cid = cid_of(d)
    from filechannel.agent import server as srv

    plain = srv._FlightServer.do_put
    calls = {"n": 0}

    def lossy(self: Any, context: Any, descriptor: Any, reader: Any, writer: Any) -> None:
        plain(self, context, descriptor, reader, writer)  # committed durably here
        calls["n"] += 1
        if calls["n"] in (1, 3):  # the first attempt of sequences 1 and 2
            raise fl.FlightUnavailableError("the answer was lost on the way")

    monkeypatch.setattr(srv._FlightServer, "do_put", lossy)
    with serve([d], "grpc://127.0.0.1:0", writable=True) as agent, connect(agent.location, timeout=10) as c:
        for seq in (1, 2):
            with pytest.raises(AgentError):
                c.put_batch(cid, [b"batch-%d" % seq], producer="p", sequence=seq)
            assert c.put_batch(cid, [b"batch-%d" % seq], producer="p", sequence=seq).duplicate
        assert not c.put_batch(cid, [b"batch-3"], producer="p", sequence=3).duplicate
    assert [b for b, _ in drain(d)] == [b"batch-1", b"batch-2", b"batch-3"]


def test_concurrent_retries_of_one_sequence_commit_once(tmp_path: Path) -> None:
    d = make_channel(tmp_path / "c", 0)
    cid = cid_of(d)
    with serve([d], "grpc://127.0.0.1:0", writable=True) as agent:
        results: list[bool] = []

        def go() -> None:
            with connect(agent.location, timeout=10) as c:
                results.append(c.put_batch(cid, [b"once"], producer="p", sequence=7).duplicate)

        threads = [threading.Thread(target=go) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert sorted(results) == [False] + [True] * 5
    assert drain(d) == [(b"once", {})]


def test_an_agent_sigkilled_at_random_moments_puts_each_sequence_exactly_once(tmp_path: Path) -> None:
    """Two producers retry every batch until it is acknowledged while the agent is SIGKILLed and restarted.

    The channel then holds each (producer, sequence) exactly once, in sequence order per
    producer, and every acknowledged batch is there.
    """
    d = make_channel(tmp_path / "c", 0)
    cid = cid_of(d)
    pf = tmp_path / "port"
    rng = random.Random(25)
    n_batches = 150
    acked: dict[str, set[int]] = {"p1": set(), "p2": set()}
    state: dict[str, Any] = {"agent": AgentProcess([d], pf, "--writable"), "stop": False, "kills": 0}
    lock = threading.Lock()
    errors: list[BaseException] = []

    def producer(name: str) -> None:
        try:
            for seq in range(1, n_batches + 1):
                bodies = [b"%s-%d-%d" % (name.encode(), seq, i) for i in range(3)]
                deadline = time.monotonic() + 120
                while True:
                    assert time.monotonic() < deadline, f"{name} {seq} never acknowledged"
                    with lock:
                        uri = state["agent"].uri
                    try:
                        with connect(uri, timeout=3) as c:
                            c.put_batch(cid, bodies, producer=name, sequence=seq)
                        acked[name].add(seq)
                        time.sleep(0.02)  # pace the batches, so that kills land among them
                        break
                    except (AgentUnavailableError, AgentError):
                        time.sleep(0.05)  # the agent is down or restarting: retry the same sequence
        except BaseException as exc:  # raised below
            errors.append(exc)

    workers = [threading.Thread(target=producer, args=(p,)) for p in acked]
    for w in workers:
        w.start()
    try:
        while any(w.is_alive() for w in workers):
            time.sleep(rng.uniform(0.05, 0.5))
            with lock:
                a = state["agent"]
                a.proc.send_signal(signal.SIGKILL)
                a.proc.wait(timeout=30)
                state["kills"] += 1
                state["agent"] = AgentProcess([d], pf, "--writable")
    finally:
        for w in workers:
            w.join(180)
        state["agent"].kill()
    assert not errors, errors
    assert state["kills"] >= 3
    got = [b for b, _ in drain(d)]
    for name in acked:
        assert acked[name] == set(range(1, n_batches + 1))
        mine = [b for b in got if b.startswith(name.encode() + b"-")]
        want = [b"%s-%d-%d" % (name.encode(), s, i) for s in range(1, n_batches + 1) for i in range(3)]
        assert mine == want  # each (producer, sequence) once, whole, in order
    assert len(got) == 2 * 3 * n_batches
    with filechannel.open(d, **OPTS) as ch:
        assert ch.marks() == {"producer:p1": b"%d" % n_batches, "producer:p2": b"%d" % n_batches}
