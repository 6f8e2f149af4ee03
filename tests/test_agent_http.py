"""The agent's HTTP source (``filechannel serve --writable --http``): statuses, limits, idempotency, TLS, token.

Each request is one transaction answered 200 after its durable commit; an
``Idempotency-Key`` makes retries exactly-once (also across agent SIGKILLs);
malformed input, wrong content types, huge bodies, slow clients and a full
channel get their own statuses and put nothing.
"""

from __future__ import annotations

import base64
import http.client
import json
import random
import signal
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyarrow.flight")
pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")

from test_agent import _write, cid_of, drain, make_channel, mtls_agent, pki  # noqa: F401  (pki is a fixture)
from test_agent_process import AgentProcess

import filechannel
from filechannel.agent import serve
from filechannel.agent.web import HttpSettings

OPTS: dict[str, Any] = {"minimum_required_space": 0}


def request(
    port: int,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    *,
    context: ssl.SSLContext | None = None,
    timeout: float = 10,
) -> tuple[int, dict[str, str], Any]:
    if context is not None:
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(
            "localhost", port, context=context, timeout=timeout
        )
    else:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        data = r.read()
        hdrs = {k.lower(): v for k, v in r.getheaders()}
        parsed = json.loads(data) if hdrs.get("content-type", "").startswith("application/json") else data
        return r.status, hdrs, parsed
    finally:
        conn.close()


def post_json(port: int, events: Any, key: str | None = None, name: str = "c", **kw: Any) -> tuple[int, dict, Any]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Idempotency-Key"] = key
    return request(port, "POST", f"/v1/channels/{name}/events", json.dumps(events).encode(), headers, **kw)


@pytest.fixture
def chan(tmp_path: Path) -> str:
    return make_channel(tmp_path / "c", 0)


@pytest.fixture
def agent(chan: str) -> Iterator[Any]:
    a = serve([chan], "grpc://127.0.0.1:0", writable=True, http="127.0.0.1:0", channel_options=OPTS)
    yield a
    a.stop()


def test_json_and_binary_events_commit_as_one_transaction_each(chan: str, agent: Any) -> None:
    port = agent.http.port
    events = [
        {"headers": {"host": "web-1"}, "body": "hello ✓"},
        {"body_base64": base64.b64encode(b"\x00\xff\x01").decode()},
    ]
    assert post_json(port, events)[0::2] == (200, {"channel": "c", "events": 2, "duplicate": False})
    status, _, ans = request(
        port, "POST", "/v1/channels/c/events", b"\x00raw\xff", {"Content-Type": "application/octet-stream"}
    )
    assert (status, ans["events"]) == (200, 1)
    status, _, listing = request(port, "GET", "/v1/channels")
    assert status == 200
    assert listing["channels"] == [{"name": "c", "channel": cid_of(chan), "start": 0, "end": 3, "writable": True}]
    ch = agent.channels[cid_of(chan)].channel
    assert ch.stats()["transactions_committed"] == 2
    agent.stop()
    assert drain(chan) == [("hello ✓".encode(), {"host": "web-1"}), (b"\x00\xff\x01", {}), (b"\x00raw\xff", {})]


def test_dir_equals_name_names_the_channel_in_urls(tmp_path: Path) -> None:
    d = make_channel(tmp_path / "dir-a", 0)
    with serve([d], "grpc://127.0.0.1:0", writable=True, http="127.0.0.1:0", names={d: "orders"}) as a:
        assert post_json(a.http.port, [{"body": "x"}], name="orders")[0] == 200
        status, _, ans = post_json(a.http.port, [{"body": "x"}], name="dir-a")
        assert status == 404
        assert "orders" in ans["error"]
    # Two directories of one base name need names.
    d2 = make_channel(tmp_path / "other" / "dir-a", 0)
    with pytest.raises(filechannel.ConfigError, match="DIR=NAME"):
        serve([d, d2], "grpc://127.0.0.1:0", http="127.0.0.1:0")


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"[{", "malformed JSON"),
        (b"\xff\xfe", "not UTF-8"),
        (b'{"body": "a"}', "JSON list of events"),
        (b"[1]", "not a JSON object"),
        (b'[{"body": 1}]', "body is a string"),
        (b'[{"body": "a", "body_base64": "YQ=="}]', "exactly one of"),
        (b'[{"headers": {}}]', "exactly one of"),
        (b'[{"body_base64": "!!"}]', "not valid base64"),
        (b'[{"body": "a", "headers": {"k": 1}}]', "string values"),
        (b'[{"body": "a", "headers": ["k"]}]', "string values"),
        (b'[{"body": "a", "extra": 1}]', "unknown fields"),
        (b'[{"body": "ok"}, {"body": null}]', "event 1"),
    ],
)
def test_malformed_json_gets_400_with_a_one_line_reason_and_puts_nothing(
    agent: Any, chan: str, body: bytes, reason: str
) -> None:
    status, _, ans = request(
        agent.http.port, "POST", "/v1/channels/c/events", body, {"Content-Type": "application/json"}
    )
    assert status == 400
    assert reason in ans["error"]
    assert "\n" not in ans["error"]
    assert agent.channels[cid_of(chan)].channel.size == 0


@pytest.mark.parametrize(
    "headers",
    [
        {"Content-Type": "text/plain"},
        {"Content-Type": "application/x-www-form-urlencoded"},
        {"Content-Type": "application/json; charset=latin-1"},
        {},
    ],
)
def test_wrong_content_types_get_415(agent: Any, chan: str, headers: dict[str, str]) -> None:
    status, _, ans = request(agent.http.port, "POST", "/v1/channels/c/events", b'[{"body": "a"}]', headers)
    assert status == 415
    assert "application/json" in ans["error"] or "charset" in ans["error"]
    assert agent.channels[cid_of(chan)].channel.size == 0


def test_other_refusals(agent: Any, tmp_path: Path) -> None:
    port = agent.http.port
    assert request(port, "POST", "/v1/channels/nope/events", b"[]", {"Content-Type": "application/json"})[0] == 404
    assert request(port, "GET", "/v1/channels/c/events")[0] == 405
    assert request(port, "GET", "/nowhere")[0] == 404
    status, _, ans = post_json(port, [{"body": "a"}], key="has space")
    assert status == 400
    assert "Idempotency-Key" in ans["error"]
    ro = make_channel(tmp_path / "ro", 0)
    with serve([ro], "grpc://127.0.0.1:0", http="127.0.0.1:0") as a:
        status, _, ans = post_json(a.http.port, [{"body": "a"}], name="ro")
        assert status == 403
        assert "--writable" in ans["error"]
    with pytest.raises(filechannel.ConfigError, match="loopback"):
        serve([ro], "grpc://127.0.0.1:0", http="0.0.0.0:0")
    with pytest.raises(filechannel.ConfigError, match="HOST:PORT"):
        serve([ro], "grpc://127.0.0.1:0", http="8080")


def _raw(port: int, head: bytes, body: bytes = b"", timeout: float = 10) -> tuple[bytes, float]:
    """Send ``head`` and ``body`` on a socket; return what comes back until the server closes, and how long."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head + body)
        got = b""
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            got += chunk
    return got, time.monotonic() - t0


def test_a_huge_body_gets_413_without_being_read(tmp_path: Path) -> None:
    d = make_channel(tmp_path / "c", 0)
    opts = {**OPTS, "max_event_size": 1000, "transaction_capacity": 5, "capacity": 100}
    http = HttpSettings("127.0.0.1:0", max_body=4096)
    with serve([d], "grpc://127.0.0.1:0", writable=True, http=http, channel_options=opts) as a:
        port = a.http.port
        # A Content-Length of 10 GB with a few bytes sent: answered at once, the connection closed.
        head = (
            b"POST /v1/channels/c/events HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 10000000000\r\n\r\n"
        )
        got, took = _raw(port, head, b"[" * 100)
        assert got.startswith(b"HTTP/1.1 413")
        assert b"--http-max-body=4096" in got
        assert took < 5
        # A chunked body (no length) read in chunks, refused once it passes the cap.
        conn = http_client(port)
        conn.putrequest("POST", "/v1/channels/c/events")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Transfer-Encoding", "chunked")
        conn.endheaders()
        for _ in range(10):
            try:
                conn.send(b"400\r\n" + b" " * 0x400 + b"\r\n")
            except OSError:
                break  # the server answered and closed
        r = conn.getresponse()
        assert r.status == 413
        conn.close()
        # One binary event over max_event_size; a JSON event over it; more events than transaction_capacity.
        status, _, ans = request(
            port, "POST", "/v1/channels/c/events", b"x" * 1001, {"Content-Type": "application/octet-stream"}
        )
        assert status == 413
        assert "max_event_size=1000" in ans["error"]
        assert post_json(port, [{"body": "x" * 1001}])[0] == 413
        status, _, ans = post_json(port, [{"body": "x"}] * 6)
        assert status == 413
        assert "transaction_capacity=5" in ans["error"]
        assert a.channels[cid_of(d)].channel.size == 0
        assert post_json(port, [{"body": "x" * 900}])[0] == 200  # under the limits: taken


def http_client(port: int) -> http.client.HTTPConnection:
    return http.client.HTTPConnection("127.0.0.1", port, timeout=10)


def test_a_slow_client_gets_a_read_deadline(tmp_path: Path) -> None:
    d = make_channel(tmp_path / "c", 0)
    http = HttpSettings("127.0.0.1:0", read_timeout=0.5)
    with serve([d], "grpc://127.0.0.1:0", writable=True, http=http, channel_options=OPTS) as a:
        port = a.http.port
        # The body stalls after 10 of 100 bytes: 408 and the connection closed.
        head = (
            b"POST /v1/channels/c/events HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n"
        )
        got, took = _raw(port, head, b'[{"body":"')
        assert got.startswith(b"HTTP/1.1 408")
        assert took < 5
        # The headers stall: the connection is closed without an answer.
        got, took = _raw(port, b"POST /v1/channels/c/events HTTP/1.1\r\nHost: x\r\n")
        assert took < 5
        # A client that is merely quiet for less than the deadline is served.
        assert post_json(port, [{"body": "ok"}])[0] == 200
        assert a.channels[cid_of(d)].channel.size == 1


def test_a_full_channel_answers_503_with_retry_after(tmp_path: Path) -> None:
    d = make_channel(tmp_path / "c", 0)
    opts = {**OPTS, "capacity": 3, "transaction_capacity": 3, "keep_alive": 0.1}
    with serve([d], "grpc://127.0.0.1:0", writable=True, http="127.0.0.1:0", channel_options=opts) as a:
        port = a.http.port
        assert post_json(port, [{"body": "1"}, {"body": "2"}], key="k1")[0] == 200
        status, hdrs, ans = post_json(port, [{"body": "3"}, {"body": "4"}], key="k2")
        assert status == 503
        assert "full" in ans["error"]
        assert int(hdrs["retry-after"]) >= 1
        ch = a.channels[cid_of(d)].channel
        with ch.transaction() as tx:
            tx.take_batch(2)
        assert post_json(port, [{"body": "3"}, {"body": "4"}], key="k2")[0::2] == (
            200,
            {"channel": "c", "events": 2, "duplicate": False},
        )  # the key was not committed by the refused request


def test_concurrent_posters_each_commit_once(agent: Any, chan: str) -> None:
    port = agent.http.port
    results: list[int] = []
    lock = threading.Lock()

    def poster(w: int) -> None:
        for i in range(25):
            events = [{"body": f"{w}-{i}-{j}"} for j in range(4)]
            status = post_json(port, events, key=f"w{w}-{i}")[0]
            with lock:
                results.append(status)

    threads = [threading.Thread(target=poster, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [200] * 200
    agent.stop()
    got = [b.decode() for b, _ in drain(chan)]
    assert sorted(got) == sorted(f"{w}-{i}-{j}" for w in range(8) for i in range(25) for j in range(4))
    for w in range(8):  # each poster's requests in its order
        mine = [g for g in got if g.startswith(f"{w}-")]
        assert mine == [f"{w}-{i}-{j}" for i in range(25) for j in range(4)]


def test_idempotent_retries_put_once_and_the_key_ring_is_bounded(tmp_path: Path) -> None:
    d = make_channel(tmp_path / "c", 0)
    http = HttpSettings("127.0.0.1:0", idempotency_keys=3)
    with serve([d], "grpc://127.0.0.1:0", writable=True, http=http, channel_options=OPTS) as a:
        port = a.http.port
        assert post_json(port, [{"body": "a"}], key="k1")[2]["duplicate"] is False
        assert post_json(port, [{"body": "a"}], key="k1")[0::2] == (
            200,
            {"channel": "c", "events": 0, "duplicate": True},
        )
        status, _, ans = post_json(port, [{"body": "other"}], key="k1")
        assert status == 422
        assert "another body" in ans["error"]
        for k in ("k2", "k3"):
            assert post_json(port, [{"body": k}], key=k)[2]["duplicate"] is False
        assert a.channels[cid_of(d)].channel.size == 3
    # A restarted agent remembers the committed keys (they are marks of the channel).
    with serve([d], "grpc://127.0.0.1:0", writable=True, http=http, channel_options=OPTS) as a:
        port = a.http.port
        assert post_json(port, [{"body": "k2"}], key="k2")[2]["duplicate"] is True
        assert post_json(port, [{"body": "k4"}], key="k4")[2]["duplicate"] is False
        # k1 was the oldest of 3: k4 took its slot, so k1 is forgotten (the documented bound).
        assert post_json(port, [{"body": "a"}], key="k1")[2]["duplicate"] is False
        # k1 took the slot of k2 (then the oldest); k3 is still remembered.
        assert post_json(port, [{"body": "k3"}], key="k3")[2]["duplicate"] is True
        assert post_json(port, [{"body": "k2"}], key="k2")[2]["duplicate"] is False
        ch = a.channels[cid_of(d)].channel
        assert ch.size == 6
        assert sorted(ch.marks()) == ["http:0", "http:1", "http:2"]  # never more marks than the ring's slots


def test_a_retry_after_a_lost_answer_is_not_put_twice(agent: Any, chan: str) -> None:
    port = agent.http.port
    ch = agent.channels[cid_of(chan)].channel
    body = json.dumps([{"body": "once"}]).encode()
    head = (
        b"POST /v1/channels/c/events HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Idempotency-Key: lost-1\r\nContent-Length: %d\r\n\r\n" % len(body)
    )
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head + body)
        deadline = time.monotonic() + 10
        while ch.size == 0:  # committed; the client hangs up without reading the answer
            assert time.monotonic() < deadline
            time.sleep(0.01)
    assert post_json(port, [{"body": "once"}], key="lost-1")[0::2] == (
        200,
        {"channel": "c", "events": 0, "duplicate": True},
    )
    assert ch.size == 1


def test_the_bearer_token(chan: str, tmp_path: Path) -> None:
    token = _write(tmp_path / "token", b"s3cret-token\n", 0o600)
    with serve([chan], "grpc://127.0.0.1:0", writable=True, http="127.0.0.1:0", token_file=token) as a:
        port = a.http.port
        status, hdrs, ans = post_json(port, [{"body": "a"}])
        assert status == 401
        assert "bearer token" in ans["error"]
        assert hdrs["www-authenticate"].startswith("Bearer")
        events = json.dumps([{"body": "a"}]).encode()
        ct = {"Content-Type": "application/json"}
        wrong = {**ct, "Authorization": "Bearer nope"}
        status, _, ans = request(port, "POST", "/v1/channels/c/events", events, wrong)
        assert status == 401
        assert "s3cret" not in json.dumps(ans)
        assert request(port, "GET", "/metrics")[0] == 401
        assert request(port, "GET", "/v1/channels")[0] == 401
        right = {**ct, "Authorization": "Bearer s3cret-token"}
        assert request(port, "POST", "/v1/channels/c/events", events, right)[0] == 200
        assert request(port, "GET", "/metrics", headers={"Authorization": "Bearer s3cret-token"})[0] == 200
        assert request(port, "GET", "/healthz")[0] == 200  # health checks need no token
        assert a.channels[cid_of(chan)].channel.size == 1


def test_tls(chan: str, pki: dict[str, Any]) -> None:  # noqa: F811
    cert, key = pki["server"]
    with serve([chan], "grpc+tls://127.0.0.1:0", tls_cert=cert, tls_key=key, writable=True, http="127.0.0.1:0") as a:
        assert a.http.url.startswith("https://")
        ctx = ssl.create_default_context(cafile=pki["ca"])
        assert post_json(a.http.port, [{"body": "a"}], context=ctx)[0] == 200
        with pytest.raises((http.client.HTTPException, OSError)):
            request(a.http.port, "GET", "/healthz", timeout=5)  # plain HTTP to the TLS port
        with pytest.raises(ssl.SSLError):
            request(a.http.port, "GET", "/healthz", context=ssl.create_default_context())  # another CA
    # Mutual TLS: a client certificate of the CA is required; --allow narrows the names.
    client_cert, client_key = pki["client"]
    with mtls_agent(pki, [chan], allow={cid_of(chan): {"spark-exec"}}, writable=True, http="127.0.0.1:0") as a:
        ctx = ssl.create_default_context(cafile=pki["ca"])
        with pytest.raises((ssl.SSLError, OSError)):
            request(a.http.port, "GET", "/healthz", context=ctx)
        ctx.load_cert_chain(client_cert, client_key)
        assert post_json(a.http.port, [{"body": "b"}], context=ctx)[0] == 200
        other = ssl.create_default_context(cafile=pki["ca"])
        other.load_cert_chain(*pki["client2"])
        status, _, ans = post_json(a.http.port, [{"body": "c"}], context=other)
        assert status == 403
        assert "intruder" in ans["error"]
        assert a.channels[cid_of(chan)].channel.size == 2
    # --allow-writer: only these names may post; the others still get in (and may read).
    with mtls_agent(pki, [chan], writers={"spark-exec"}, writable=True, http="127.0.0.1:0") as a:
        ctx = ssl.create_default_context(cafile=pki["ca"])
        ctx.load_cert_chain(client_cert, client_key)
        assert post_json(a.http.port, [{"body": "d"}], context=ctx)[0] == 200
        other = ssl.create_default_context(cafile=pki["ca"])
        other.load_cert_chain(*pki["client2"])
        status, _, ans = post_json(a.http.port, [{"body": "e"}], context=other)
        assert status == 403
        assert "'intruder' may not write" in ans["error"]
        assert request(a.http.port, "GET", "/v1/channels", context=other)[0] == 200
        assert a.channels[cid_of(chan)].channel.size == 3


def test_an_agent_sigkilled_while_clients_retry_keeps_every_request_once(tmp_path: Path) -> None:
    """Three clients post with Idempotency-Key and retry until 200 while the agent is SIGKILLed and restarted.

    Every request's events are then in the channel exactly once, in order per
    client, and every request answered 200 is there.
    """
    d = make_channel(tmp_path / "c", 0)
    pf, hpf = tmp_path / "port", tmp_path / "http-port"
    extra = ("--writable", "--http", "127.0.0.1:0", "--http-port-file", str(hpf))
    rng = random.Random(2025)
    n_requests = 80
    ok: dict[str, set[int]] = {f"c{i}": set() for i in range(3)}
    state: dict[str, Any] = {"agent": AgentProcess([d], pf, *extra), "kills": 0, "duplicates": 0}
    lock = threading.Lock()
    errors: list[BaseException] = []

    def client(name: str) -> None:
        try:
            for i in range(n_requests):
                events = [{"body": f"{name}-{i}-{j}"} for j in range(3)]
                deadline = time.monotonic() + 120
                while True:
                    assert time.monotonic() < deadline, f"{name} {i} never answered 200"
                    with lock:
                        port = int(hpf.read_text()) if hpf.exists() else None
                    try:
                        if port is None:
                            raise ConnectionRefusedError
                        status, _, ans = post_json(port, events, key=f"{name}-{i}", timeout=5)
                    except (OSError, http.client.HTTPException):
                        time.sleep(0.05)  # down or restarting: retry the same request
                        continue
                    if status == 200:
                        ok[name].add(i)
                        if ans["duplicate"]:
                            with lock:
                                state["duplicates"] += 1
                        time.sleep(0.01)
                        break
                    assert status >= 500, (status, ans)
                    time.sleep(0.05)
        except BaseException as exc:  # raised below
            errors.append(exc)

    workers = [threading.Thread(target=client, args=(n,)) for n in ok]
    for w in workers:
        w.start()
    try:
        while any(w.is_alive() for w in workers):
            time.sleep(rng.uniform(0.05, 0.4))
            with lock:
                a = state["agent"]
                a.proc.send_signal(signal.SIGKILL)
                a.proc.wait(timeout=30)
                state["kills"] += 1
                if hpf.exists():
                    hpf.unlink()
                state["agent"] = AgentProcess([d], pf, *extra)
    finally:
        for w in workers:
            w.join(180)
        state["agent"].kill()
    assert not errors, errors
    assert state["kills"] >= 3
    got = [b.decode() for b, _ in drain(d)]
    for name in ok:
        assert ok[name] == set(range(n_requests))
        mine = [g for g in got if g.startswith(name + "-")]
        assert mine == [f"{name}-{i}-{j}" for i in range(n_requests) for j in range(3)]
    assert len(got) == 3 * 3 * n_requests
