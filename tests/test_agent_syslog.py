"""The agent's syslog and RELP sources (``filechannel serve --writable --syslog ... --relp ...``).

Driven by real clients: util-linux ``logger`` (RFC 5424 with octet counting,
RFC 3164 with LF framing, UDP) and rsyslog (``omfwd`` over TCP, ``omrelp``
with a disk-assisted queue through agent SIGKILLs), plus raw sockets for
malformed input, limits, deadlines, a full channel and TLS. Events are read
back through ``ChannelReader``. ``scripts/clients.sh`` (run by
``scripts/test.sh``) installs the clients; a test skips only when its client
is missing, naming it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyarrow.flight")
pytest.importorskip("prometheus_client")
pytest.importorskip("aiohttp")

import test_agent_http
from helpers import agent_command, metric, run_cli
from test_agent import make_channel, pki  # noqa: F401  (pki is a fixture)
from test_agent_process import _env

import filechannel
from filechannel.agent import serve
from filechannel.agent.syslog_source import SyslogSettings, start_syslog
from filechannel.errors import ConfigError
from filechannel.reader import ChannelReader
from filechannel.testing.processes import restartable_port

OPTS: dict[str, Any] = {"minimum_required_space": 0}
ROOT = Path(__file__).resolve().parent.parent


def _omrelp() -> bool:
    return any(Path(p).exists() for p in ("/usr/lib/rsyslog/omrelp.so", "/usr/lib/x86_64-linux-gnu/rsyslog/omrelp.so"))


needs_logger = pytest.mark.skipif(shutil.which("logger") is None, reason="util-linux logger is not installed")
needs_rsyslog = pytest.mark.skipif(shutil.which("rsyslogd") is None, reason="rsyslogd is not installed")
needs_omrelp = pytest.mark.skipif(not _omrelp(), reason="rsyslog's omrelp (rsyslog-relp) is not installed")


def events(d: str) -> list[tuple[bytes, dict[str, str]]]:
    """Every event of the channel in ``d``, read through a ``ChannelReader`` (no consumer)."""
    with ChannelReader(d) as r:
        start, end = r.available()
        return [(e.body, dict(e.headers)) for e in r.read(start, end)]


def wait_for(d: str, n: int, timeout: float = 20.0) -> list[tuple[bytes, dict[str, str]]]:
    deadline = time.monotonic() + timeout
    while True:
        got = events(d)
        if len(got) >= n or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


# The fixtures of the HTTP source's tests: a channel and a writable agent serving it over HTTP too.
chan = test_agent_http.chan
agent = test_agent_http.agent


def metrics(a: Any) -> str:
    """The agent's Prometheus text (what ``GET /metrics`` answers)."""
    return str(a.metrics.render().decode())


def scrape(a: Any) -> str:
    with urllib.request.urlopen(f"{a.http.url}/metrics", timeout=10) as r:
        return str(r.read().decode())


def connect(port: int, timeout: float = 10.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=timeout)


# -- logger (util-linux) ----------------------------------------------------------------------------


@needs_logger
def test_logger_rfc5424_octet_counting_and_rfc3164_lf_framing(agent: Any, chan: str) -> None:
    src = start_syslog(agent, ["tcp://127.0.0.1:0"])
    try:
        port = str(src.ports[0])
        base = ["logger", "--tcp", "-n", "127.0.0.1", "-P", port, "-t", "billing", "--id=4242", "-p", "local3.warning"]
        subprocess.run(
            [
                *base,
                "--octet-count",
                "--rfc5424",
                "--msgid",
                "M7",
                "--sd-id",
                "ex@32473",
                "--sd-param",
                'k="v"',
                "héllo",
            ],
            check=True,
            timeout=30,
        )
        subprocess.run([*base, "--rfc3164", "old style"], check=True, timeout=30)
        got = wait_for(chan, 2)
    finally:
        src.stop()
    assert [b for b, _ in got] == ["héllo".encode(), b"old style"]
    h5424, h3164 = got[0][1], got[1][1]
    host = socket.gethostname().split(".")[0]
    assert h5424["facility"] == h3164["facility"] == "19"  # local3
    assert h5424["severity"] == h3164["severity"] == "4"  # warning
    assert h5424["appname"] == h3164["appname"] == "billing"
    assert h5424["procid"] == h3164["procid"] == "4242"
    assert h5424["msgid"] == "M7"
    assert 'ex@32473 k="v"' in h5424["structured_data"]
    assert h5424["hostname"].split(".")[0] == h3164["hostname"].split(".")[0] == host
    assert h5424["timestamp"][:4].isdigit()
    assert "T" in h5424["timestamp"]
    assert h3164["timestamp"][:3].isalpha()  # "Nov 28 13:40:01"
    assert "syslog.status" not in h5424
    assert "syslog.status" not in h3164


@needs_logger
def test_logger_over_udp(agent: Any, chan: str) -> None:
    src = start_syslog(agent, ["udp://127.0.0.1:0"])
    try:
        for i in range(3):
            subprocess.run(
                ["logger", "--udp", "-n", "127.0.0.1", "-P", str(src.ports[0]), "--rfc5424", "-t", "u", f"dgram {i}"],
                check=True,
                timeout=30,
            )
        got = wait_for(chan, 3)
    finally:
        src.stop()
    assert sorted(b for b, _ in got) == [b"dgram 0", b"dgram 1", b"dgram 2"]
    assert all(h["appname"] == "u" for _, h in got)


# -- raw sockets: malformed input, limits, deadlines, a full channel ----------------------------------


def test_invalid_frames_are_kept_and_too_large_ones_skipped_counted_and_the_connection_goes_on(
    tmp_path: Path,
) -> None:
    d = make_channel(tmp_path / "c", 0)
    with serve(
        [d], "grpc://127.0.0.1:0", writable=True, http="127.0.0.1:0", channel_options=OPTS | {"max_event_size": 4096}
    ) as a:
        src = start_syslog(a, ["tcp://127.0.0.1:0"])
        try:
            with connect(src.ports[0]) as s:
                big = b"<13>1 - - - - - - " + b"x" * 10_000
                s.sendall(
                    b"%d %s" % (len(big), big)
                    + b"8 \xffnot sys"
                    + b"20 <13>1 - - - - - - ok"
                    + b"x7 junk\n"
                    + b"16 <13>1 - - - - - - "[:10]
                )
                got = wait_for(d, 3)
                text = scrape(a)
                # The agent ends the connection while the sender is still on it: the cut frame was
                # never whole, so it is not kept (had the sender closed first, it would be, as invalid).
                src.stop()
        finally:
            src.stop()
        got = events(d)
    assert got == [
        (b"\xffnot sys", {"syslog.status": "invalid"}),
        (b"ok", {"facility": "1", "severity": "5"}),
        (b"x7 junk", {"syslog.status": "invalid"}),
    ]
    assert metric(text, "filechannel_source_refused_total", source="syslog", reason="too_large") == 1
    assert metric(text, "filechannel_source_invalid_events_total", source="syslog") == 2
    assert metric(text, "filechannel_source_events_total", channel="c", source="syslog") == 3
    assert (
        metric(
            text, "filechannel_source_connection_outcomes_total", source="syslog", transport="tcp", outcome="accepted"
        )
        == 1
    )
    assert metric(text, "filechannel_put_commit_seconds_count", channel="c", source="syslog") >= 1


def test_a_read_burst_is_one_transaction(agent: Any, chan: str) -> None:
    src = start_syslog(agent, ["tcp://127.0.0.1:0"])
    ch = next(iter(agent.channels.values())).channel
    before = ch.stats()["transactions_committed"]
    try:
        with connect(src.ports[0]) as s:
            s.sendall(b"".join(b"<13>line %d\n" % i for i in range(300)))  # ~4 KiB: one or two reads
            got = wait_for(chan, 300)
    finally:
        src.stop()
    assert [b for b, _ in got] == [b"line %d" % i for i in range(300)]
    assert ch.stats()["transactions_committed"] - before <= 3


def test_an_idle_connection_meets_the_read_deadline_and_connections_are_bounded(agent: Any) -> None:
    src = start_syslog(agent, ["tcp://127.0.0.1:0"], settings=SyslogSettings(read_timeout=0.5, max_connections=2))
    try:
        a, b = connect(src.ports[0]), connect(src.ports[0])
        time.sleep(0.1)
        with connect(src.ports[0]) as c:
            assert c.recv(10) == b""  # over the limit: closed at once
        t0 = time.monotonic()
        assert a.recv(10) == b""  # silent for 0.5 s: closed
        assert time.monotonic() - t0 < 5
        a.close()
        b.close()
        text = metrics(agent)
    finally:
        src.stop()
    assert metric(text, "filechannel_source_connection_outcomes_total", source="syslog", outcome="over_limit") == 1
    assert metric(text, "filechannel_source_connection_outcomes_total", source="syslog", outcome="timeout") >= 1


def test_a_full_channel_holds_the_connection_and_loses_nothing(tmp_path: Path) -> None:
    d = make_channel(tmp_path / "c", 0)
    with serve(
        [d],
        "grpc://127.0.0.1:0",
        writable=True,
        channel_options=OPTS | {"capacity": 10, "transaction_capacity": 10, "keep_alive": 0.1},
    ) as a:
        ch = next(iter(a.channels.values())).channel
        src = start_syslog(a, ["tcp://127.0.0.1:0"])
        try:
            with connect(src.ports[0]) as s:
                for i in range(25):
                    s.sendall(b"<13>m%d\n" % i)
                    time.sleep(0.01)
                taken: list[bytes] = []
                deadline = time.monotonic() + 30
                while len(taken) < 25 and time.monotonic() < deadline:
                    with ch.transaction() as tx:
                        taken += [e.body for e in tx.take_batch(4)]
                    time.sleep(0.1)
        finally:
            src.stop()
    assert taken == [b"m%d" % i for i in range(25)]


# -- RELP over raw sockets ------------------------------------------------------------------------


def relp_call(s: socket.socket, data: bytes, n: int) -> list[bytes]:
    """Send ``data`` and read ``n`` RELP answer frames (as raw lines)."""
    s.sendall(data)
    buf = b""
    while buf.count(b"\n") < n or _partial(buf):
        chunk = s.recv(65536)
        assert chunk, f"closed after {buf!r}"
        buf += chunk
    return _split(buf)


def _split(buf: bytes) -> list[bytes]:
    out = []
    while buf:
        txnr, cmd, rest = buf.split(b" ", 2)
        n_s, _, rest = rest.partition(b" ") if not rest.startswith(b"0\n") else (b"0", b"", rest[1:])
        n = int(n_s.strip())
        out.append(b"%s %s %s" % (txnr, cmd, rest[:n]))
        buf = rest[n + 1 :]
    return out


def _partial(buf: bytes) -> bool:
    try:
        _split(buf)
        return False
    except (ValueError, IndexError):
        return True


def test_relp_answers_200_after_commit_500_with_a_reason_and_handles_open_close(tmp_path: Path) -> None:
    d = make_channel(tmp_path / "c", 0)
    opts = OPTS | {"capacity": 3, "transaction_capacity": 3, "keep_alive": 0.05, "max_event_size": 1024}
    with serve([d], "grpc://127.0.0.1:0", writable=True, http="127.0.0.1:0", channel_options=opts) as a:
        src = start_syslog(a, relp=["tcp://127.0.0.1:0"], settings=SyslogSettings(relp_full_wait=0))
        try:
            with connect(src.ports[0]) as s:
                msg = b"<13>1 - h app - - - hello"
                ans = relp_call(s, b"1 syslog %d %s\n" % (len(msg), msg), 1)
                assert ans == [b"1 rsp 500 the session is not open (send open first)"]
                offers = b"relp_version=0\nrelp_software=test\ncommands=syslog"
                ans = relp_call(s, b"2 open %d %s\n" % (len(offers), offers), 1)
                assert ans[0].startswith(b"2 rsp 200 OK\nrelp_version=0\n")
                assert b"commands=syslog" in ans[0]
                ans = relp_call(s, b"3 syslog %d %s\n" % (len(msg), msg), 1)
                assert ans == [b"3 rsp 200 OK"]
                assert events(d) == [(b"hello", {"facility": "1", "severity": "5", "hostname": "h", "appname": "app"})]
                big = b"<13>" + b"x" * 2000
                ans = relp_call(s, b"4 syslog %d %s\n5 syslog %d %s\n" % (len(big), big, len(msg), msg), 2)
                assert ans[0].startswith(b"4 rsp 500 the message is over max_event_size=1024")
                assert ans[1] == b"5 rsp 200 OK"
                assert relp_call(s, b"6 syslog %d %s\n" % (len(msg), msg), 1) == [b"6 rsp 200 OK"]
                ans = relp_call(s, b"7 syslog %d %s\n" % (len(msg), msg), 1)
                assert ans[0].startswith(b"7 rsp 500 channel c is full")  # capacity 3
                ans = relp_call(s, b"8 close 0\n", 1)
                assert ans == [b"8 rsp "]
                assert s.recv(10) == b""  # closed after close
            with connect(src.ports[0]) as s:
                s.sendall(b"1 open 0\nnot relp\n")
                data = b""
                while chunk := s.recv(1000):
                    data += chunk
                assert data.endswith(b"0 serverclose 0\n")  # a broken frame: serverclose, then closed
            text = metrics(a)
        finally:
            src.stop()
        assert len(events(d)) == 3
    assert metric(text, "filechannel_source_responses_total", source="relp", channel="c", code="200") == 3
    assert metric(text, "filechannel_source_responses_total", source="relp", channel="c", code="500") == 2
    assert metric(text, "filechannel_source_refused_total", source="relp", reason="full") == 1
    assert (
        metric(
            text,
            "filechannel_source_connection_outcomes_total",
            source="relp",
            transport="tcp",
            outcome="protocol_error",
        )
        == 1
    )


def test_relp_holds_the_answer_while_the_channel_is_full_then_answers_200(tmp_path: Path) -> None:
    d = make_channel(tmp_path / "c", 0)
    opts = OPTS | {"capacity": 1, "transaction_capacity": 1, "keep_alive": 0.05}
    with serve([d], "grpc://127.0.0.1:0", writable=True, channel_options=opts) as a:
        ch = next(iter(a.channels.values())).channel
        src = start_syslog(a, relp=["tcp://127.0.0.1:0"], settings=SyslogSettings(relp_full_wait=30))
        try:
            with connect(src.ports[0]) as s:
                relp_call(s, b"1 open 0\n", 1)
                assert relp_call(s, b"2 syslog 6 <13>m1\n", 1) == [b"2 rsp 200 OK"]
                s.sendall(b"3 syslog 6 <13>m2\n")  # the channel is full: no answer yet
                s.settimeout(1.0)
                with pytest.raises(TimeoutError):
                    s.recv(100)
                with ch.transaction() as tx:
                    assert [e.body for e in tx.take_batch(1)] == [b"m1"]
                s.settimeout(10)
                assert relp_call(s, b"", 1) == [b"3 rsp 200 OK"]
        finally:
            src.stop()
        assert [b for b, _ in events(d)] == [b"m2"]


def test_relp_sessions_get_serverclose_when_the_agent_stops(agent: Any) -> None:
    src = start_syslog(agent, relp=["tcp://127.0.0.1:0"])
    with connect(src.ports[0]) as s:
        assert relp_call(s, b"1 open 0\n", 1)[0].startswith(b"1 rsp 200 OK")
        src.stop()
        data = b""
        while chunk := s.recv(1000):
            data += chunk
    assert data == b"0 serverclose 0\n"


# -- TLS, mutual TLS and the allow-lists -------------------------------------------------------------


def mutual_tls_agent(chan: str, pki: dict[str, Any], **kw: Any) -> Any:  # noqa: F811
    """A writable agent over mutual TLS (the test CA) whose allow-list names ``spark-exec`` only."""
    cert, key = pki["server"]
    return serve(
        [chan],
        "grpc+tls://127.0.0.1:0",
        tls_cert=cert,
        tls_key=key,
        client_ca=pki["ca"],
        allow={"*": {"spark-exec"}},
        writable=True,
        channel_options=OPTS,
        **kw,
    )


def test_tls_and_mutual_tls_with_the_allow_list(chan: str, pki: dict[str, Any]) -> None:  # noqa: F811
    with mutual_tls_agent(chan, pki, http="127.0.0.1:0") as a:
        src = start_syslog(a, ["tls://127.0.0.1:0"], ["tls://127.0.0.1:0"])
        try:
            for who, port in (("client", src.ports[0]), ("client2", src.ports[1]), ("client2", src.ports[0])):
                ctx = ssl.create_default_context(cafile=pki["ca"])
                ctx.check_hostname = False
                ctx.load_cert_chain(*pki[who])
                with ctx.wrap_socket(connect(port), server_hostname="agent") as s:
                    s.sendall(b"<13>1 - - - - - - from %s\n" % who.encode())
                    if who == "client2":  # not on the allow-list: the agent closes the connection
                        assert s.recv(10) == b""
            # no client certificate at all: the handshake fails
            ctx = ssl.create_default_context(cafile=pki["ca"])
            ctx.check_hostname = False
            s = ctx.wrap_socket(connect(src.ports[0]), server_hostname="agent")
            try:
                s.sendall(b"<13>1 - - - - - - anonymous\n")
                answer = s.recv(10)
            except (ssl.SSLError, OSError):
                answer = b""  # the alert of the refused handshake
            finally:
                s.close()
            assert answer == b""
            got = wait_for(chan, 1, timeout=3)
            time.sleep(0.3)
            got = events(chan)
            text = metrics(a)
        finally:
            src.stop()
    assert got == [(b"from client", {"facility": "1", "severity": "5"})]
    assert (
        metric(
            text,
            "filechannel_source_connection_outcomes_total",
            source="syslog",
            transport="tls",
            outcome="refused_certificate",
        )
        == 1
    )
    assert (
        metric(
            text,
            "filechannel_source_connection_outcomes_total",
            source="relp",
            transport="tls",
            outcome="refused_certificate",
        )
        == 1
    )


def test_configuration_refusals(chan: str, agent: Any, pki: dict[str, Any], tmp_path: Path) -> None:  # noqa: F811
    for bad, why in (
        ("tcp://0.0.0.0:0", "reachable from other hosts and syslog clients are not authenticated"),
        ("tls://127.0.0.1:0", "tls:// needs the agent's --tls-cert"),
        ("http://127.0.0.1:0", "the scheme is one of tcp://, tls://, udp://"),
        ("tcp://127.0.0.1", "give HOST:PORT"),
        ("tcp://127.0.0.1:0=nope", "no channel named 'nope'"),
    ):
        with pytest.raises(ConfigError, match=why):
            start_syslog(agent, [bad])
    with pytest.raises(ConfigError, match="the scheme is one of tcp://, tls://"):
        start_syslog(agent, relp=["udp://127.0.0.1:0"])
    with pytest.raises(ConfigError, match="positive number of seconds"):
        start_syslog(agent, ["tcp://127.0.0.1:0"], settings=SyslogSettings(read_timeout=0))
    agent.stop()
    d2 = make_channel(tmp_path / "c2", 0)
    with serve([chan, d2], "grpc://127.0.0.1:0", writable=True, channel_options=OPTS | {"fsync": "interval"}) as a:
        with pytest.raises(ConfigError, match="several channels are served"):
            start_syslog(a, ["tcp://127.0.0.1:0"])
        with pytest.raises(ConfigError, match="RELP acknowledges durable commits only"):
            start_syslog(a, relp=["tcp://127.0.0.1:0=c2"])
    with serve([chan], "grpc://127.0.0.1:0") as a, pytest.raises(ConfigError, match="add --writable"):
        start_syslog(a, ["tcp://127.0.0.1:0"])
    # An agent that authenticates its clients: a plain listener (even on loopback) or TLS without a CA
    # would let anyone put; --insecure-allow-anyone is the way to want that.
    cert, key = pki["server"]
    tls = {"tls_cert": cert, "tls_key": key, "writable": True, "channel_options": OPTS}
    with serve([chan], "grpc+tls://127.0.0.1:0", client_ca=pki["ca"], **tls) as a:
        with pytest.raises(ConfigError, match="the agent authenticates its clients"):
            start_syslog(a, ["tcp://127.0.0.1:0"])
        start_syslog(a, ["tls://127.0.0.1:0"]).stop()
    with serve([chan], "grpc+tls://0.0.0.0:0", insecure_allow_anyone=True, **tls) as a:
        start_syslog(a, ["udp://0.0.0.0:0", "tls://0.0.0.0:0"]).stop()
    with (
        serve([chan], "grpc+tls://127.0.0.1:0", **tls) as a,
        pytest.raises(ConfigError, match="reachable from other hosts and syslog clients"),
    ):
        start_syslog(a, ["tls://0.0.0.0:0"])  # TLS without --client-ca authenticates no one


def test_the_agent_starts_its_listeners_before_it_announces_itself(chan: str, tmp_path: Path) -> None:
    pf = tmp_path / "port"
    settings = SyslogSettings(syslog=("tcp://127.0.0.1:0",), relp=("tcp://127.0.0.1:0",))
    with serve(
        [chan], "grpc://127.0.0.1:0", writable=True, channel_options=OPTS, port_file=str(pf), syslog=settings
    ) as a:
        assert pf.exists()
        with connect(a.syslog.ports[0]) as s:
            s.sendall(b"<13>1 - - - - - - started\n")
            assert [b for b, _ in wait_for(chan, 1)] == [b"started"]
    assert not pf.exists()
    # one that cannot start (its port is taken) stops the agent: no port file
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = SyslogSettings(relp=(f"tcp://127.0.0.1:{busy.getsockname()[1]}",))
        with pytest.raises(filechannel.ChannelError, match="cannot listen"):
            serve([chan], "grpc://127.0.0.1:0", writable=True, channel_options=OPTS, port_file=str(pf), syslog=taken)
    assert not pf.exists()


def test_cli_flags_and_one_line_refusals(chan: str, capsys: pytest.CaptureFixture[str]) -> None:
    base = ("serve", chan, "--listen", "grpc://127.0.0.1:0")
    code, out, _ = run_cli(
        capsys, *base, "--writable", "--check", "--syslog", "udp://127.0.0.1:0=c", "--relp", "tcp://127.0.0.1:0"
    )
    assert code == 0
    assert "would take syslog on udp://127.0.0.1:0=c\nwould take relp on tcp://127.0.0.1:0\n" in out
    for argv, why in (
        ((*base, "--syslog", "tcp://127.0.0.1:0"), "--syslog puts into the channels: give --writable too"),
        ((*base, "--writable", "--relp", "udp://127.0.0.1:0"), "--relp: 'udp://127.0.0.1:0': the scheme is one of"),
        (
            (*base, "--writable", "--syslog", "tcp://10.1.2.3:514"),
            "--syslog: tcp://10.1.2.3:514: 10.1.2.3 is reachable from other hosts",
        ),
        (
            (*base, "--writable", "--syslog", "tcp://127.0.0.1:0", "--syslog-read-timeout", "-1"),
            "--syslog-read-timeout: must be a positive number",
        ),
    ):
        code, _, err = run_cli(capsys, *argv)
        assert code != 0
        lines = [x for x in err.splitlines() if x.startswith("filechannel")]
        assert len(lines) == 1, err  # refused before anything is served
        assert why in lines[0], err
    # --check runs the checks of a start on the listeners too: one line per problem, exit 2
    code, _, err = run_cli(capsys, *base, "--writable", "--fsync", "interval", "--check", "--relp", "tcp://127.0.0.1:0")
    assert code == 2
    assert "filechannel: error: --relp: tcp://127.0.0.1:0: RELP acknowledges durable commits only" in err
    code, _, err = run_cli(capsys, *base, "--writable", "--check", "--syslog", "tcp://127.0.0.1:0=other")
    assert code == 2
    assert "no channel named 'other'" in err


# -- rsyslog -----------------------------------------------------------------------------------------


class Rsyslog:
    """``rsyslogd -n`` with its own config and work directory, reading ``in.log`` (imfile) and forwarding."""

    def __init__(self, root: Path, actions: str) -> None:
        self.root = root
        self.input = root / "in.log"
        work = root / "work"
        work.mkdir(parents=True, exist_ok=True)
        self.input.touch()
        conf = root / "rsyslog.conf"
        conf.write_text(
            f'global(workDirectory="{work}")\n'
            'module(load="imfile" mode="polling" PollingInterval="1")\n'
            f'input(type="imfile" File="{self.input}" Tag="app" Ruleset="fwd")\n'
            'module(load="omrelp")\n'
            f'ruleset(name="fwd") {{\n{actions}\n}}\n'
        )
        check = subprocess.run(["rsyslogd", "-N1", "-f", str(conf)], capture_output=True, text=True, timeout=60)
        assert check.returncode == 0, check.stderr
        self.proc = subprocess.Popen(
            ["rsyslogd", "-n", "-f", str(conf), "-i", str(root / "rsyslogd.pid")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )

    def write(self, lines: list[str]) -> None:
        with open(self.input, "a") as f:
            f.write("".join(x + "\n" for x in lines))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stderr is not None:
            self.proc.stderr.close()


FORMAT = 'template="RSYSLOG_SyslogProtocol23Format"'


@needs_rsyslog
def test_rsyslog_omfwd_over_tcp(agent: Any, chan: str, tmp_path: Path) -> None:
    src = start_syslog(agent, ["tcp://127.0.0.1:0"])
    rs = Rsyslog(
        tmp_path / "rs",
        f'action(type="omfwd" target="127.0.0.1" port="{src.ports[0]}" protocol="tcp" '
        f'TCP_Framing="octet-counted" {FORMAT})',
    )
    try:
        rs.write([f"fwd {i}" for i in range(200)])
        got = wait_for(chan, 200, timeout=30)
    finally:
        rs.stop()
        src.stop()
    assert [b for b, _ in got] == [b"fwd %d" % i for i in range(200)]
    assert all(h["appname"] == "app" and h["facility"] == "16" for _, h in got)  # imfile: local0.notice


@needs_rsyslog
@needs_omrelp
def test_rsyslog_omrelp_through_a_full_channel_loses_nothing(tmp_path: Path) -> None:
    """A channel of 10 events, drained slowly: omrelp waits for its answers and every line arrives once."""
    d = make_channel(tmp_path / "c", 0)
    opts = OPTS | {"capacity": 10, "transaction_capacity": 10, "keep_alive": 0.05}
    with serve([d], "grpc://127.0.0.1:0", writable=True, channel_options=opts) as a:
        ch = next(iter(a.channels.values())).channel
        src = start_syslog(a, relp=["tcp://127.0.0.1:0"])
        rs = Rsyslog(
            tmp_path / "rs",
            f'action(type="omrelp" target="127.0.0.1" port="{src.ports[0]}" {FORMAT} '
            'action.resumeRetryCount="-1" action.resumeInterval="1")',
        )
        taken: list[bytes] = []
        try:
            rs.write([f"full {i}" for i in range(60)])
            deadline = time.monotonic() + 60
            while len(taken) < 60 and time.monotonic() < deadline:
                time.sleep(0.2)
                with ch.transaction() as tx:
                    taken += [e.body for e in tx.take_batch(7)]
        finally:
            rs.stop()
            src.stop()
    assert taken == [b"full %d" % i for i in range(60)]


@needs_rsyslog
@needs_omrelp
def test_rsyslog_omrelp_over_mutual_tls(chan: str, tmp_path: Path, pki: dict[str, Any]) -> None:  # noqa: F811
    """librelp's TLS (GnuTLS) with a client certificate the agent's CA signed and its allow-list names."""
    ccert, ckey = pki["client"]
    with mutual_tls_agent(chan, pki, syslog=SyslogSettings(relp=("tls://127.0.0.1:0",))) as a:
        assert a.syslog is not None
        rs = Rsyslog(
            tmp_path / "rs",
            f'action(type="omrelp" target="127.0.0.1" port="{a.syslog.ports[0]}" {FORMAT} '
            f'tls="on" tls.caCert="{pki["ca"]}" tls.myCert="{ccert}" tls.myPrivKey="{ckey}" '
            'tls.authMode="name" tls.permittedPeer=["agent"] '
            'action.resumeRetryCount="-1" action.resumeInterval="1")',
        )
        try:
            rs.write([f"tls {i}" for i in range(20)])
            got = wait_for(chan, 20, timeout=30)
        finally:
            rs.stop()
        text = metrics(a)
    assert [b for b, _ in got] == [b"tls %d" % i for i in range(20)]
    assert (
        metric(text, "filechannel_source_connection_outcomes_total", source="relp", transport="tls", outcome="accepted")
        >= 1
    )
    assert metric(text, "filechannel_source_responses_total", source="relp", code="200") == 20


def _agent_cmd(d: str, tmp_path: Path, relp_port: int) -> list[str]:
    return agent_command([d], tmp_path / "port", "--writable", "--relp", f"tcp://127.0.0.1:{relp_port}")


@pytest.mark.slow
@needs_rsyslog
@needs_omrelp
def test_rsyslog_omrelp_with_a_disk_assisted_queue_through_agent_sigkills(tmp_path: Path) -> None:
    """Lines go file -> rsyslog (imfile) -> omrelp (disk-assisted queue) -> agent, killed -9 again and again.

    Every line arrives; a line appears twice only when the agent committed it and
    was killed before rsyslog read its ``rsp 200`` (RELP retransmits what it had
    no answer for): at most omrelp's window (128) per kill, at least once overall.
    """
    d = make_channel(tmp_path / "c", 0)
    port = restartable_port()  # the agent is restarted on it
    rs = Rsyslog(
        tmp_path / "rs",
        f'action(type="omrelp" target="127.0.0.1" port="{port}" {FORMAT} windowSize="128" '
        f'queue.type="LinkedList" queue.filename="relpq" queue.saveOnShutdown="on" '
        f'action.resumeRetryCount="-1" action.resumeInterval="1" action.resumeIntervalMax="2")',
    )
    env = _env()
    kills, n = 0, 0
    proc: subprocess.Popen[bytes] | None = None
    try:
        deadline = time.monotonic() + 40
        while kills < 5 and time.monotonic() < deadline:
            (tmp_path / "port").unlink(missing_ok=True)
            proc = subprocess.Popen(_agent_cmd(d, tmp_path, port), env=env, stderr=subprocess.DEVNULL, cwd=ROOT)
            while not (tmp_path / "port").exists():
                assert proc.poll() is None, "the agent exited"
                time.sleep(0.05)
            until = time.monotonic() + 1.5
            while time.monotonic() < until:
                rs.write([f"relp {n + i}" for i in range(50)])
                n += 50
                time.sleep(0.05)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            kills += 1
        rs.write([f"relp {n + i}" for i in range(50)])
        n += 50
        proc = subprocess.Popen(_agent_cmd(d, tmp_path, port), env=env, stderr=subprocess.DEVNULL, cwd=ROOT)
        want = {b"relp %d" % i for i in range(n)}
        # rsyslog lengthens its retry interval after repeated failures (capped above at 2 s); on a
        # loaded machine imfile and the disk-assisted queue take a while to hand everything over.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if os.path.exists(tmp_path / "port"):
                got = [b for b, _ in events(d)]
                if want <= set(got):
                    break
            time.sleep(0.3)
        time.sleep(1.0)  # anything still on its way
        got = [b for b, _ in events(d)]
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
        rs.stop()
    assert kills == 5
    missing = want - set(got)
    assert not missing, f"{len(missing)} lines lost, e.g. {sorted(missing)[:5]}"
    assert set(got) == want
    dups = sum(c - 1 for c in Counter(got).values())
    assert dups <= kills * 128, dups
    print(f"\nomrelp through {kills} agent SIGKILLs: {n} lines, all delivered, {dups} delivered twice")


def test_pipelined_relp_frames_are_each_answered_after_their_commit(tmp_path: Path) -> None:
    """A window of 100 frames in one send: 100 answers 200, in order, and 100 events in the channel."""
    d = make_channel(tmp_path / "c", 0)
    with serve([d], "grpc://127.0.0.1:0", writable=True, channel_options=OPTS) as a:
        src = start_syslog(a, relp=["tcp://127.0.0.1:0"])
        with connect(src.ports[0]) as s:
            relp_call(s, b"1 open 0\n", 1)
            msgs = b"".join(b"%d syslog 10 <13>m%05d\n" % (i + 2, i) for i in range(100))
            ans = relp_call(s, msgs, 100)
        src.stop()
        assert ans == [b"%d rsp 200 OK" % (i + 2) for i in range(100)]
    with filechannel.open(d, **OPTS) as ch:
        assert ch.size == 100
