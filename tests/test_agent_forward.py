"""The forward source (``filechannel serve --writable --forward``): Fluent's forward protocol into a channel.

Real clients (``fluent-logger``'s sender) and crafted msgpack for the modes it
does not send (Forward, PackedForward, CompressedPackedForward, the ``chunk``
option); malformed input from raw sockets; chunk acknowledgements exactly once
through agent SIGKILLs; mutual TLS and the writer allow-list; the read deadline,
the connection limit and the one-line refusals of bad configuration.
"""

from __future__ import annotations

import gzip
import json
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyarrow.flight")
pytest.importorskip("aiohttp")
pytest.importorskip("msgpack")

import msgpack
from helpers import metric
from test_agent import mtls_agent, pki  # noqa: F401  (pki is a fixture)
from test_agent_process import AgentProcess, _env

import filechannel
from filechannel.agent import serve
from filechannel.agent.forward import ForwardSettings, start_forward
from filechannel.errors import ConfigError
from filechannel.testing.processes import restartable_port

OPTS: dict[str, Any] = {"minimum_required_space": 0}
EVENT_TIME = msgpack.ExtType(0, (1_700_000_000).to_bytes(4, "big") + (123_456_789).to_bytes(4, "big"))


def drain(d: str) -> list[tuple[bytes, dict[str, str]]]:
    """Every event of the channel in ``d`` (bodies and headers), read through a ChannelReader (no lock taken)."""
    r = filechannel.ChannelReader(d)
    try:
        start, end = r.available()
        return [(e.body, dict(e.headers)) for e in r.read(start, end)]
    finally:
        r.close()


def new_channel(d: Path, **options: Any) -> str:
    filechannel.open(str(d), **OPTS, **options).close()
    return str(d)


@pytest.fixture
def fwd(tmp_path: Path) -> Iterator[tuple[Any, Any, str]]:
    """A writable agent (HTTP for /metrics) with a forward source on a free loopback port."""
    d = new_channel(tmp_path / "c")
    settings = ForwardSettings(("tcp://127.0.0.1:0",), read_timeout=2.0, max_connections=4)
    agent = serve([d], "grpc://127.0.0.1:0", writable=True, channel_options=OPTS, http="127.0.0.1:0", forward=settings)
    with agent:
        yield agent, agent.forward, d


def connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    return s


def ack_of(s: socket.socket) -> Any:
    u = msgpack.Unpacker(raw=False)
    while True:
        data = s.recv(4096)
        if not data:
            return None
        u.feed(data)
        for obj in u:
            return obj


def wait_for(pred: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def closed(s: socket.socket) -> bool:
    """Whether the agent closed the connection (reads end; a reset counts)."""
    try:
        return s.recv(100) == b""
    except ConnectionResetError:
        return True


def test_fluent_logger_message_mode_events_have_tag_timestamp_and_json_body(fwd: tuple[Any, Any, str]) -> None:
    from fluent import sender

    _, src, d = fwd
    fl = sender.FluentSender("app", host="127.0.0.1", port=src.ports[0], nanosecond_precision=True)
    try:
        assert fl.emit_with_time("web", 1_700_000_000, {"msg": "hello", "n": 1, "ok": True})
        assert fl.emit_with_time("db", 1_700_000_001.25, {"msg": "ünïcode", "list": [1, "x"]})
    finally:
        fl.close()
    wait_for(lambda: src.counters["events"] == 2)
    events = drain(d)
    assert [json.loads(b) for b, _ in events] == [
        {"msg": "hello", "n": 1, "ok": True},
        {"msg": "ünïcode", "list": [1, "x"]},
    ]
    assert events[0][1] == {"tag": "app.web", "timestamp": "1700000000"}
    assert events[1][1] == {"tag": "app.db", "timestamp": "1700000001.250000000"}


def _packed(entries: list[tuple[Any, dict[str, Any]]]) -> bytes:
    return b"".join(msgpack.packb([t, r]) for t, r in entries)


def test_every_mode_and_chunk_acks_after_commit(fwd: tuple[Any, Any, str]) -> None:
    _, src, d = fwd
    entries = [(EVENT_TIME, {"i": i, "b": b"\xff\x00"}) for i in range(3)]
    s = connect(src.ports[0])
    with s:
        s.sendall(msgpack.packb(["t.forward", [[1, {"i": "f"}]], {"chunk": "c1"}]))
        assert ack_of(s) == {"ack": "c1"}
        s.sendall(msgpack.packb(["t.packed", _packed(entries), {"chunk": "c2", "size": 3}]))
        assert ack_of(s) == {"ack": "c2"}
        gz = gzip.compress(_packed(entries[:1])) + gzip.compress(_packed(entries[1:]))  # two gzip members
        s.sendall(msgpack.packb(["t.gz", gz, {"chunk": "c3", "compressed": "gzip"}]))
        assert ack_of(s) == {"ack": "c3"}
        s.sendall(msgpack.packb(["t.msg", 5, {"m": 1}, {"chunk": "c4"}]))
        assert ack_of(s) == {"ack": "c4"}
    events = drain(d)
    assert [h["tag"] for _, h in events] == ["t.forward"] + ["t.packed"] * 3 + ["t.gz"] * 3 + ["t.msg"]
    assert json.loads(events[1][0]) == {"i": 0, "b": {"$binary": "/wA="}}
    assert events[1][1]["timestamp"] == "1700000000.123456789"
    assert [json.loads(b)["i"] for b, _ in events[4:7]] == [0, 1, 2]
    assert src.counters["transactions"] == 4


def test_a_retried_chunk_is_acked_again_and_committed_once(fwd: tuple[Any, Any, str]) -> None:
    agent, src, d = fwd
    msg = msgpack.packb(["t", [[1, {"x": 1}], [2, {"x": 2}]], {"chunk": "Q2h1bmstMQ=="}])
    for _ in range(3):  # the answer was lost: the client sends the chunk again, on a new connection
        with connect(src.ports[0]) as s:
            s.sendall(msg)
            assert ack_of(s) == {"ack": "Q2h1bmstMQ=="}
    assert len(drain(d)) == 2
    assert src.counters["duplicates"] == 2
    # the same id with other entries is not acknowledged: the connection closes
    with connect(src.ports[0]) as s:
        s.sendall(msgpack.packb(["t", [[1, {"x": 99}]], {"chunk": "Q2h1bmstMQ=="}]))
        assert ack_of(s) is None
    assert len(drain(d)) == 2
    text = agent.http.metrics.render().decode()
    assert 'filechannel_source_duplicates_total{channel="c",source="forward"} 2.0' in text
    assert 'filechannel_source_refused_total{channel="c",reason="chunk_conflict",source="forward"} 1.0' in text
    assert 'filechannel_source_events_total{channel="c",source="forward"} 2.0' in text


@pytest.mark.parametrize(
    "junk",
    [
        b"\xc1",  # a byte msgpack never uses
        msgpack.packb({"not": "an array"}),
        msgpack.packb(["tag"]),
        msgpack.packb(["tag", 1, "not a map"]),
        msgpack.packb([b"\xff\xfe", 1, {}]),  # a tag that is not UTF-8
        msgpack.packb(["tag", [[1]]]),
        msgpack.packb(["tag", b"\x93\x01\x02"]),  # packed entries that are not [time, record]
        msgpack.packb(["tag", b"not gzip", {"compressed": "gzip"}]),
        msgpack.packb(["tag", b"", {"compressed": "zstd"}]),
        msgpack.packb(["tag", 1, {}, {"chunk": "has space"}]),
    ],
)
def test_malformed_input_closes_that_connection_only(fwd: tuple[Any, Any, str], junk: bytes) -> None:
    _, src, d = fwd
    with connect(src.ports[0]) as s:
        s.sendall(msgpack.packb(["ok", 1, {"before": 1}]) + junk)
        assert ack_of(s) is None  # closed, no answer
    with connect(src.ports[0]) as s:  # the source goes on
        s.sendall(msgpack.packb(["ok", 1, {"after": 1}, {"chunk": "k"}]))
        assert ack_of(s) == {"ack": "k"}
    bodies = [json.loads(b) for b, _ in drain(d)]
    assert {"after": 1} in bodies
    assert all(set(b) <= {"before", "after"} for b in bodies)
    assert src.counters["refused"] >= 1


def test_limits_message_size_read_deadline_and_connections(tmp_path: Path) -> None:
    d = new_channel(tmp_path / "c", max_event_size=200)
    agent = serve([d], "grpc://127.0.0.1:0", writable=True, channel_options={**OPTS, "max_event_size": 200})
    settings = ForwardSettings(("tcp://127.0.0.1:0",), read_timeout=0.5, max_message=4096, max_connections=2)
    src = start_forward(agent, settings)
    try:
        port = src.ports[0]
        # a message declaring 1 GiB is refused as soon as it passes max_message, never buffered whole
        with connect(port) as s:
            s.sendall(b"\x93\xa1t\x01\xdb\x40\x00\x00\x00" + b"x" * 8192)
            assert closed(s)
        # an entry over max_event_size is left out; the rest of its chunk commits and is acknowledged
        with connect(port) as s:
            s.sendall(msgpack.packb(["t", [[1, {"big": "x" * 500}], [2, {"small": 1}]], {"chunk": "k1"}]))
            assert ack_of(s) == {"ack": "k1"}
        assert [json.loads(b) for b, _ in drain(d)] == [{"small": 1}]
        assert src.counters["too_large"] == 1
        # a silent connection is closed after read_timeout
        with connect(port) as s:
            t0 = time.monotonic()
            assert closed(s)
            assert 0.3 < time.monotonic() - t0 < 5
        # at most max_connections at once: the third is closed at once
        a, b = connect(port), connect(port)
        try:
            time.sleep(0.2)
            with connect(port) as c:
                assert closed(c)
        finally:
            a.close()
            b.close()
        # the shared listener counts how each connection went, in the sources' one family (no --http needed)
        text = agent.metrics.render().decode()
        assert metric(text, "filechannel_source_connection_outcomes_total", source="forward", outcome="timeout") >= 1
        assert metric(text, "filechannel_source_connection_outcomes_total", source="forward", outcome="over_limit") == 1
        assert metric(text, "filechannel_source_refused_total", source="forward", reason="too_large") == 1
    finally:
        src.stop()
        agent.stop()


def test_more_entries_than_transaction_capacity_are_not_acknowledged(tmp_path: Path) -> None:
    d = new_channel(tmp_path / "c")
    agent = serve([d], "grpc://127.0.0.1:0", writable=True, channel_options={**OPTS, "transaction_capacity": 5})
    src = start_forward(agent, ["tcp://127.0.0.1:0"])
    try:
        with connect(src.ports[0]) as s:
            s.sendall(msgpack.packb(["t", [[i, {"i": i}] for i in range(6)], {"chunk": "k"}]))
            assert ack_of(s) is None
        assert drain(d) == []
    finally:
        src.stop()
        agent.stop()


def test_mutual_tls_and_the_writer_allow_list(tmp_path: Path, pki: dict[str, Any]) -> None:  # noqa: F811
    d = new_channel(tmp_path / "c")
    agent = mtls_agent(pki, [d], writable=True, channel_options=OPTS, writers={"spark-exec"})
    try:
        with pytest.raises(ConfigError, match="use tls://"):
            start_forward(agent, ["tcp://127.0.0.1:0"])
        src = start_forward(agent, ["tls://127.0.0.1:0"])
        try:

            def tls(who: str) -> ssl.SSLSocket:
                ctx = ssl.create_default_context(cafile=pki["ca"])
                ctx.load_cert_chain(*pki[who])
                return ctx.wrap_socket(connect(src.ports[0]), server_hostname="localhost")

            with tls("client") as s:  # spark-exec: a writer
                s.sendall(msgpack.packb(["t", 1, {"a": 1}, {"chunk": "w"}]))
                assert ack_of(s) == {"ack": "w"}
            with tls("client2") as s:  # intruder: signed by the CA, not a writer
                s.sendall(msgpack.packb(["t", 1, {"a": 2}, {"chunk": "x"}]))
                assert ack_of(s) is None
            assert [json.loads(b) for b, _ in drain(d)] == [{"a": 1}]
            text = agent.metrics.render().decode()
            refused = {"source": "forward", "transport": "tls", "outcome": "refused_certificate"}
            assert metric(text, "filechannel_source_connection_outcomes_total", **refused) == 1
        finally:
            src.stop()
    finally:
        agent.stop()


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "filechannel", "serve", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(),
    )


def test_bad_configuration_is_refused_in_one_line(tmp_path: Path) -> None:
    d = new_channel(tmp_path / "c")
    e = new_channel(tmp_path / "e")
    cases = [
        ([d, "--listen", "grpc://127.0.0.1:0", "--forward", "tcp://127.0.0.1:0"], "--forward puts into the channels"),
        ([d, "--writable", "--listen", "grpc://127.0.0.1:0", "--forward", "127.0.0.1:24224"], "give tcp|tls://"),
        (
            [d, "--writable", "--listen", "grpc://127.0.0.1:0", "--forward", "tcp://10.1.2.3:0"],
            "plain tcp:// is for a loopback address only",
        ),
        ([d, "--writable", "--listen", "grpc://127.0.0.1:0", "--forward", "tls://127.0.0.1:0"], "--tls-cert"),
        (
            [d, e, "--writable", "--listen", "grpc://127.0.0.1:0", "--forward", "tcp://127.0.0.1:0"],
            "several channels are served",
        ),
        (
            [d, "--writable", "--listen", "grpc://127.0.0.1:0", "--forward", "tcp://127.0.0.1:0=nope"],
            "no channel named 'nope'",
        ),
    ]
    for args, message in cases:
        r = _serve(*args)
        assert r.returncode != 0, args
        errors = [line for line in r.stderr.splitlines() if "error" in line.lower()]
        assert len(errors) == 1, (args, r.stderr)
        assert message in errors[0], (args, r.stderr)
        assert "Traceback" not in r.stderr


def test_forward_without_msgpack_says_which_extra(tmp_path: Path) -> None:
    d = new_channel(tmp_path / "c")
    code = (
        "import sys\n"
        "class Missing:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'msgpack':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Missing())\n"
        "from filechannel.cli import main\n"
        f"sys.exit(main(['serve', {d!r}, '--writable', '--listen', 'grpc://127.0.0.1:0',"
        " '--forward', 'tcp://127.0.0.1:0']))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=_env())
    assert r.returncode != 0
    assert "pip install '.[sources]' in filechannel's clone" in r.stderr
    assert "Traceback" not in r.stderr


def test_chunks_are_committed_exactly_once_through_agent_sigkills(tmp_path: Path) -> None:
    """A client resending each chunk until acknowledged, through two SIGKILLs: every entry once."""
    d = new_channel(tmp_path / "c")
    port = restartable_port()  # the agent is restarted on it
    args = ("--writable", "--forward", f"tcp://127.0.0.1:{port}", "--capacity", "100000")
    agent = AgentProcess([d], tmp_path / "port", *args)
    chunks = 60
    kills = {20, 40}
    s: socket.socket | None = None
    try:
        for n in range(chunks):
            msg = msgpack.packb(["t", [[n, {"chunk": n, "i": i}] for i in range(5)], {"chunk": f"chunk-{n}"}])
            if n in kills:
                # the chunk goes out, the agent dies before (or after) its commit, then comes back
                if s is not None:
                    try:
                        s.sendall(msg)
                    except OSError:
                        pass
                agent.proc.kill()
                agent.proc.communicate(timeout=30)
                agent = AgentProcess([d], tmp_path / "port", *args)
            deadline = time.monotonic() + 30
            while True:
                try:
                    if s is None:
                        s = connect(port)
                    s.sendall(msg)
                    if ack_of(s) == {"ack": f"chunk-{n}"}:
                        break
                except OSError:
                    pass
                if s is not None:
                    s.close()
                s = None
                assert time.monotonic() < deadline, f"chunk {n} was never acknowledged"
                time.sleep(0.05)
    finally:
        if s is not None:
            s.close()
        agent.kill()
    got = [(json.loads(b)["chunk"], json.loads(b)["i"]) for b, _ in drain(d)]
    assert sorted(got) == [(n, i) for n in range(chunks) for i in range(5)]  # each once, none lost


def test_check_names_the_forward_addresses_and_refuses_bad_ones(tmp_path: Path) -> None:
    d = new_channel(tmp_path / "c")
    r = _serve(
        f"{d}=logs", "--writable", "--listen", "grpc://127.0.0.1:0", "--forward", "tcp://127.0.0.1:24224", "--check"
    )
    assert r.returncode == 0, r.stderr
    assert "would take the forward protocol on tcp://127.0.0.1:24224 into logs" in r.stdout
    r = _serve(d, "--writable", "--listen", "grpc://127.0.0.1:0", "--forward", "tcp://127.0.0.1:1=other", "--check")
    assert r.returncode != 0
    assert "no channel named 'other'" in r.stderr


def test_an_agent_whose_forward_address_cannot_be_bound_does_not_start(tmp_path: Path) -> None:
    d = new_channel(tmp_path / "c")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        pf = tmp_path / "port"
        with pytest.raises(filechannel.ChannelError, match="cannot listen for forward"):
            serve(
                [d],
                "grpc://127.0.0.1:0",
                writable=True,
                channel_options=OPTS,
                port_file=str(pf),
                forward=[f"tcp://127.0.0.1:{port}"],
            )
        assert not pf.exists()  # nothing announced
    with filechannel.open(d, **OPTS):  # the agent let the channel go
        pass


def test_a_reachable_forward_address_needs_client_certificates(tmp_path: Path, pki: dict[str, Any]) -> None:  # noqa: F811
    d = new_channel(tmp_path / "c")
    cert, key = pki["server"]
    opts: dict[str, Any] = {"writable": True, "channel_options": OPTS, "tls_cert": cert, "tls_key": key}
    with pytest.raises(ConfigError, match="forward clients are not authenticated"):
        serve([d], "grpc+tls://127.0.0.1:0", forward=["tls://0.0.0.0:0"], **opts)
    with serve([d], "grpc+tls://127.0.0.1:0", forward=["tls://0.0.0.0:0"], insecure_allow_anyone=True, **opts) as a:
        assert a.forward.ports[0] > 0  # open on purpose
