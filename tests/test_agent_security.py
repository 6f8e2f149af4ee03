"""The agent's security rules: one name per certificate, producer ids, open agents, consumer and channel lists.

Also the HTTP port's refusals that concern an attacker (deeply nested JSON, the
status table), the unix socket's mode, the early refusal of an oversized put,
``serve --check`` as a dry run, and ``serve``'s log lines (each once).
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
import signal
import ssl
import stat
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyarrow.flight")
pytest.importorskip("cryptography")
pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")

import pyarrow as pa
import pyarrow.flight as fl
from cryptography import x509
from test_agent import PKI, assert_not_consumer, cid_of, make_channel, mtls_agent, mtls_client
from test_agent_http import post_json, request
from test_agent_process import AgentProcess, _cli

import filechannel
from filechannel.agent import AgentAuthError, connect, serve
from filechannel.agent import protocol as proto
from filechannel.reader import ChannelReader

ROOT = Path(__file__).resolve().parent.parent
OPTS: dict[str, Any] = {"minimum_required_space": 0}


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    ca = PKI(tmp_path_factory.mktemp("pki") / "ca")
    return {
        "ca": ca.ca,
        "server": ca.issue("agent", server=True),
        "client": ca.issue("spark-exec"),
        "client2": ca.issue("intruder"),
        "mallory": ca.issue("mallory", san="alice"),  # CN=mallory, SAN=DNS:alice
        "spiffe": ca.issue("carol", san=[x509.UniformResourceIdentifier("spiffe://corp/dave"), x509.DNSName("erin")]),
        "ipv6": ca.issue("frank", san=[x509.IPAddress(ipaddress.ip_address("2001:db8::1")), x509.DNSName("gina")]),
    }


def https(pki: dict[str, Any], who: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=pki["ca"])
    ctx.load_cert_chain(*pki[who])
    return ctx


# -- item 3: one name per certificate, on both protocols ------------------------------------------------


@pytest.mark.parametrize(("allowed_name", "let_in"), [("alice", True), ("mallory", False)])
def test_a_certificate_goes_by_its_first_san_on_flight_and_http(
    pki: dict[str, Any], tmp_path: Path, allowed_name: str, let_in: bool
) -> None:
    d = make_channel(tmp_path / "c", 3)
    cid = cid_of(d)
    with mtls_agent(pki, [d], allow={"*": [allowed_name]}, writable=True, http="127.0.0.1:0") as agent:
        c = mtls_client(pki, agent, "mallory")
        status, _, answer = post_json(agent.http.port, [{"body": "x"}], context=https(pki, "mallory"))
        if let_in:  # the SAN (alice) is the name, on Flight and on HTTP alike
            assert list(c.channels()) == [cid]
            assert len(c.read(cid, 0, 3)) == 3
            assert status == 200, answer
        else:  # the CN (mallory) is not
            assert list(c.channels()) == []
            with pytest.raises(AgentAuthError, match="'alice' is not allowed"):
                c.read(cid, 0, 3)
            assert status == 403
            assert "'alice' is not allowed" in answer["error"]


@pytest.mark.parametrize(("who", "name"), [("spiffe", "spiffe://corp/dave"), ("ipv6", "2001:db8::1")])
def test_the_first_san_of_any_kind_names_a_certificate_on_both_protocols(
    pki: dict[str, Any], tmp_path: Path, who: str, name: str
) -> None:
    d = make_channel(tmp_path / "c", 1)
    with mtls_agent(pki, [d], allow={"*": [name]}, writable=True, http="127.0.0.1:0") as agent:
        assert list(mtls_client(pki, agent, who).channels()) == [cid_of(d)]
        status, _, answer = post_json(agent.http.port, [{"body": "x"}], context=https(pki, who))
        assert status == 200, answer


# -- item 4: producer ids belong to the certificate that first used them ---------------------------------


def test_a_writer_cannot_suppress_another_writers_producer(pki: dict[str, Any], tmp_path: Path) -> None:
    d = make_channel(tmp_path / "c", 0)
    cid = cid_of(d)
    with mtls_agent(pki, [d], writable=True) as agent:
        good, other = mtls_client(pki, agent), mtls_client(pki, agent, "client2")
        assert not good.put_batch(cid, [b"a-1"], producer="web-1", sequence=1).duplicate
        with pytest.raises(AgentAuthError, match="producer id 'web-1' belongs to another client certificate"):
            other.put_batch(cid, [b"evil"], producer="web-1", sequence=2**63 - 1)
        assert not good.put_batch(cid, [b"a-2"], producer="web-1", sequence=2).duplicate
        assert not other.put_batch(cid, [b"b-1"], producer="web-2", sequence=1).duplicate  # its own id
        assert agent.channels[cid].channel.mark("producer:web-1") == b"2 spark-exec"
    # The binding is in the channel (a mark committed with the events): it survives a restart.
    with mtls_agent(pki, [d], writable=True) as agent:
        good, other = mtls_client(pki, agent), mtls_client(pki, agent, "client2")
        with pytest.raises(AgentAuthError, match="belongs to another"):
            other.put_batch(cid, [b"evil"], producer="web-1", sequence=2**63 - 1)
        assert good.put_batch(cid, [b"a-2"], producer="web-1", sequence=2).duplicate  # a retry still is one
        assert not good.put_batch(cid, [b"a-3"], producer="web-1", sequence=3).duplicate
    with ChannelReader(d) as view:
        assert [e.body for e in view.read(0, 4)] == [b"a-1", b"a-2", b"b-1", b"a-3"]


def test_a_writer_cannot_suppress_another_writers_sink_batches_or_keys(pki: dict[str, Any], tmp_path: Path) -> None:
    """Spark sink query ids, job ids and HTTP Idempotency-Keys belong to the certificate that first committed them.

    Before, a writer who knew another's query id could commit a far batch id under
    it (so that query's next batches were skipped as "already committed"), and one
    who knew another's Idempotency-Key could take it first.
    """
    d = make_channel(tmp_path / "c", 0)
    cid = cid_of(d)
    query = "6f1b9c0e-0000-4000-8000-00000000aaaa"
    with mtls_agent(pki, [d], writable=True, http="127.0.0.1:0") as agent:
        good, other = mtls_client(pki, agent), mtls_client(pki, agent, "client2")

        def batch(c: Any, b: int, body: bytes) -> dict[str, Any]:
            name, rows, _ = c.sink_stage(cid, [(body, None)], partition=0, attempt=0, query=query, batch_id=b)
            return c.sink_commit(cid, [name], rows=rows, query=query, batch_id=b)  # type: ignore[no-any-return]

        assert batch(good, 0, b"q-0")["committed"]
        with pytest.raises(AgentAuthError, match=r"query id .* belongs to another client certificate"):
            batch(other, 1000, b"evil")
        assert batch(good, 1, b"q-1")["committed"]  # not skipped as "already committed"
        # A batch job's id: the other's job id never makes this one's a no-op.
        name, rows, _ = other.sink_stage(cid, [(b"j-evil", None)], partition=0, attempt=0, job="job1")
        assert other.sink_commit(cid, [name], rows=rows, job="job1")["committed"]
        name, rows, _ = good.sink_stage(cid, [(b"j-good", None)], partition=0, attempt=0, job="job1")
        assert good.sink_commit(cid, [name], rows=rows, job="job1")["committed"]
        # An Idempotency-Key: the other's request under it is refused, the owner's retry is still one.
        port = agent.http.port
        assert post_json(port, [{"body": "k-1"}], key="k1", context=https(pki, "client"))[0] == 200
        status, _, answer = post_json(port, [{"body": "k-1"}], key="k1", context=https(pki, "client2"))
        assert status == 403, answer
        assert "another client certificate" in answer["error"]
        assert post_json(port, [{"body": "k-1"}], key="k1", context=https(pki, "client"))[2]["duplicate"]
    # The bindings are in the channel (marks committed with the events): they survive a restart.
    with mtls_agent(pki, [d], writable=True, http="127.0.0.1:0") as agent:
        good, other = mtls_client(pki, agent), mtls_client(pki, agent, "client2")
        with pytest.raises(AgentAuthError, match="belongs to another"):
            batch(other, 1000, b"evil")
        assert batch(good, 2, b"q-2")["committed"]
        status, _, _ = post_json(agent.http.port, [{"body": "k-1"}], key="k1", context=https(pki, "client2"))
        assert status == 403
    with ChannelReader(d) as view:
        bodies = [e.body for e in view.read(0, view.available()[1])]
    assert bodies == [b"q-0", b"q-1", b"j-evil", b"j-good", b"k-1", b"q-2"]


# -- item 5: no agent open to other hosts without a word -------------------------------------------------


def test_an_agent_off_loopback_needs_client_authentication(pki: dict[str, Any], tmp_path: Path) -> None:
    d = make_channel(tmp_path / "c", 1)
    cert, key = pki["server"]
    with pytest.raises(
        filechannel.ConfigError, match=r"0\.0\.0\.0 is reachable from other hosts.*--insecure-allow-anyone"
    ):
        serve([d], "grpc+tls://0.0.0.0:0", tls_cert=cert, tls_key=key)
    with pytest.raises(filechannel.ConfigError, match=r"invalid option http: 0\.0\.0\.0 is reachable"):
        serve([d], "grpc+tls://127.0.0.1:0", tls_cert=cert, tls_key=key, http="0.0.0.0:0")
    with serve([d], "grpc+tls://0.0.0.0:0", tls_cert=cert, tls_key=key, insecure_allow_anyone=True):
        pass
    with mtls_agent(pki, [d]):  # loopback; and with a client CA it may listen anywhere
        pass
    with serve([d], "grpc+tls://0.0.0.0:0", tls_cert=cert, tls_key=key, client_ca=pki["ca"]):
        pass
    r = _cli("serve", d, "--listen", "grpc+tls://0.0.0.0:0", "--tls-cert", cert, "--tls-key", key, "--check")
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        "filechannel: error: --listen: 0.0.0.0 is reachable from other hosts and clients are not authenticated, "
        "so anyone who can connect could read, write and take over consumers: give --client-ca FILE or "
        "--token-file FILE (or, to run open on purpose, --insecure-allow-anyone)"
    ]
    args = ["--listen", "grpc+tls://0.0.0.0:0", "--tls-cert", cert, "--tls-key", key, "--insecure-allow-anyone"]
    r = _cli("serve", d, *args, "--check")
    assert r.returncode == 0, r.stderr


# -- item 6: an unlisted certificate may not use a listed certificate's consumers ------------------------


def test_an_unlisted_certificate_may_not_act_as_a_listed_ones_consumer(pki: dict[str, Any], tmp_path: Path) -> None:
    d = make_channel(tmp_path / "c", 5)
    cid = cid_of(d)
    with mtls_agent(pki, [d], consumers={"intruder": ["q-intruder"]}) as agent:
        owner, unlisted = mtls_client(pki, agent, "client2"), mtls_client(pki, agent)
        owner.register(cid, "q-intruder", "id-owner")
        assert owner.ack(cid, "q-intruder", 2, "id-owner") == 2
        assert_not_consumer(unlisted, "spark-exec", cid, "q-intruder", "id-owner", ack=5)
        unlisted.register(cid, "q-free", "id-free")  # a consumer no listed certificate owns
        assert unlisted.ack(cid, "q-free", 1, "id-free") == 1
        assert owner.available(cid, "q-intruder", "id-owner")[0] == 2  # untouched


# -- item 9: what a certificate sees over HTTP -----------------------------------------------------------


def test_http_listings_show_only_the_channels_a_certificate_may_use(pki: dict[str, Any], tmp_path: Path) -> None:
    a_dir, b_dir = make_channel(tmp_path / "a", 2), make_channel(tmp_path / "b", 3)
    a, b = cid_of(a_dir), cid_of(b_dir)
    allow = {a: ["spark-exec", "intruder"], b: ["spark-exec"]}
    with mtls_agent(pki, [a_dir, b_dir], allow=allow, writable=True, http="127.0.0.1:0") as agent:
        port = agent.http.port
        assert post_json(port, [{"body": "x"}], name="b", context=https(pki, "client"))[0] == 200
        for who, names in (("client", {"a", "b"}), ("client2", {"a"})):
            ctx = https(pki, who)
            status, _, listing = request(port, "GET", "/v1/channels", context=ctx)
            assert status == 200
            assert {c["name"] for c in listing["channels"]} == names
            status, _, ready = request(port, "GET", "/readyz", context=ctx)
            assert status == 200
            assert set(ready["channels"]) == names
            status, _, text = request(port, "GET", "/metrics", context=ctx)
            assert status == 200
            seen = set(re.findall(rb'channel="([^"?]+)"', text))
            assert seen == {n.encode() for n in names}, seen
            assert b"filechannel_agent_info" in text  # the agent's own series stay
            status, _, answer = post_json(port, [{"body": "x"}], name="nope", context=ctx)
            assert status == 404
            assert answer["error"].endswith(f"(served: {', '.join(sorted(names))})")
            if who == "client2":
                assert b.encode() not in text


# -- item 10: deeply nested JSON ------------------------------------------------------------------------


def test_deeply_nested_json_gets_400_in_one_line(tmp_path: Path) -> None:
    d = make_channel(tmp_path / "c", 0)
    with serve([d], "grpc://127.0.0.1:0", writable=True, http="127.0.0.1:0") as agent:
        body = b"[" * 200_000 + b"]" * 200_000
        status, _, answer = request(
            agent.http.port, "POST", "/v1/channels/c/events", body, {"Content-Type": "application/json"}
        )
        assert status == 400
        assert answer == {"error": "the JSON is nested too deeply: the body is a list of flat event objects"}
        assert agent.channels[cid_of(d)].channel.size == 0


# -- item 12: the unix socket's mode ---------------------------------------------------------------------


def test_a_unix_socket_is_mode_0600_whatever_the_umask(tmp_path: Path) -> None:
    d = make_channel(tmp_path / "c", 2)
    sock = tmp_path / "agent.sock"
    old = os.umask(0)
    try:
        agent = serve([d], f"grpc+unix://{sock}")
    finally:
        os.umask(old)
    with agent:
        st = os.lstat(sock)
        assert stat.S_ISSOCK(st.st_mode)
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert sorted(os.listdir(tmp_path)) == ["agent.sock", "c"]  # no private directory left behind
        with connect(agent.location, timeout=5) as c:
            assert len(c.read(cid_of(d), 0, 2)) == 2
    assert not sock.exists()


# -- item 13: an oversized put is refused at its first batch ---------------------------------------------


def test_an_oversized_put_is_refused_at_the_first_batch_over_the_limit(tmp_path: Path) -> None:
    d = make_channel(tmp_path / "c", 0)
    cid = cid_of(d)
    with serve([d], "grpc://127.0.0.1:0", writable=True, channel_options={"max_event_size": 1024, **OPTS}) as agent:
        client = fl.connect(agent.location)
        descriptor = fl.FlightDescriptor.for_command(proto.encode_put_command(cid, "p", 1))
        schema = pa.schema([("body", pa.binary())])
        options = fl.FlightCallOptions(timeout=15)
        writer, reader = client.do_put(descriptor, schema, options=options)
        t0 = time.monotonic()
        writer.write_batch(pa.record_batch([pa.array([b"x" * 4096], pa.binary())], schema=schema))

        # The stream stays open (more batches could follow), yet the agent refuses it now: the call
        # ends with the refusal, not with the deadline.
        def finish() -> None:
            assert reader.read() is None  # the stream's end: the agent stopped reading
            writer.close()

        with pytest.raises(fl.FlightError, match="exceeds max_event_size=1024"):
            finish()
        assert time.monotonic() - t0 < 10
        assert agent.channels[cid].channel.size == 0


# -- item 16: serve's log lines, each once ---------------------------------------------------------------


def test_serve_logs_each_line_once(tmp_path: Path) -> None:
    d = make_channel(tmp_path / "c", 1)
    agent = AgentProcess([d], tmp_path / "port", "--log-level", "INFO")
    agent.proc.send_signal(signal.SIGTERM)
    _, err = agent.proc.communicate(timeout=30)
    assert agent.proc.returncode == 0, err
    serving = [line for line in err.splitlines() if "serving 1 channel(s)" in line]
    assert len(serving) == 1, err
    assert serving[0].startswith("filechannel serve: INFO: serving")


# -- item 17: the status table -------------------------------------------------------------------------------


def test_every_status_the_http_port_answers_is_in_the_docs_table(tmp_path: Path) -> None:
    text = (ROOT / "docs" / "agents.md").read_text()
    documented = set(re.findall(r"^\| `(\d{3})`", text, flags=re.M))
    d = make_channel(tmp_path / "c", 0)
    with serve([d], "grpc://127.0.0.1:0", writable=True, http="127.0.0.1:0") as agent:
        status, headers, answer = request(agent.http.port, "GET", "/v1/channels/c/events")
        assert status == 405
        assert headers["allow"] == "POST"
        assert "error" in answer
    assert "405" in documented
    assert {"400", "401", "403", "404", "408", "413", "415", "422"} <= documented


# -- issue 37, item 3: serve --check is a dry run ------------------------------------------------------------


def _tree(root: str) -> dict[str, tuple[int, int, str]]:
    """Every file and directory under ``root``: its mode, mtime and content hash."""
    out: dict[str, tuple[int, int, str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            digest = hashlib.sha256(Path(p).read_bytes()).hexdigest() if stat.S_ISREG(st.st_mode) else ""
            out[os.path.relpath(p, root)] = (st.st_mode, st.st_mtime_ns, digest)
    return out


def test_check_touches_nothing_on_disk(tmp_path: Path) -> None:
    d = make_channel(tmp_path / "c", 100)
    cid = cid_of(d)
    with ChannelReader(d, "q", identity="i") as r:
        r.ack(50)  # an acknowledgement the owner has not applied yet
    before = _tree(str(tmp_path))
    r = _cli("serve", d, "--listen", "grpc://127.0.0.1:0", "--writable", "--check")
    assert r.returncode == 0, r.stderr
    assert f"channel {cid} {d}: positions [0, 100), consumers: q (acked 50)" in r.stdout
    assert _tree(str(tmp_path)) == before
    with ChannelReader(d) as view:
        assert view.available() == (0, 100)


def test_check_reports_what_the_start_refuses_one_line_each(tmp_path: Path) -> None:
    d = make_channel(tmp_path / "c", 1)
    token = tmp_path / "token"
    token.write_text("secret\n")
    os.chmod(token, 0o644)
    args = ["--listen", "grpc://127.0.0.1:0", "--writable", "--http", "0.0.0.0:0", "--token-file", str(token)]
    r = _cli("serve", d, *args, "--check")
    assert r.returncode == 2
    lines = r.stderr.splitlines()
    assert len(lines) == 2, r.stderr
    assert lines[0].startswith("filechannel: error: --http: 0.0.0.0:0: plain HTTP is for a loopback address only")
    assert lines[1].startswith(f"filechannel: error: --token-file: {token} has mode 0644")
    # The real start refuses the same, with the first of them.
    with pytest.raises(filechannel.ConfigError, match="plain HTTP is for a loopback address only"):
        serve([d], "grpc://127.0.0.1:0", writable=True, http="0.0.0.0:0", token_file=str(token))
    # A --tail spec the start would refuse (two channels served, the spec names none).
    d2 = make_channel(tmp_path / "c2", 1)
    r = _cli("serve", d, d2, "--listen", "grpc://127.0.0.1:0", "--writable", "--tail", "/x/*.log", "--check")
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        "filechannel: error: --tail: '/x/*.log': several channels are served (c, c2): give NAME=GLOB"
    ]
    # A channel another process owns: the check says so, without taking the lock.
    with filechannel.open(d, **OPTS):
        r = _cli("serve", d, "--listen", "grpc://127.0.0.1:0", "--writable", "--check")
    assert r.returncode == 2
    assert "is already open by another FileChannel" in r.stderr
    assert len(r.stderr.splitlines()) == 1
