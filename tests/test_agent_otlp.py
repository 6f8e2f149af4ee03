"""OTLP/HTTP logs (``POST /v1/logs`` on the agent's HTTP port): the SDK's exporter, JSON, gzip, refusals.

Each request is one transaction answered 200 after its commit; a full channel
is 503 with Retry-After (the exporter retries it); a bad payload 400 with a
``google.rpc.Status``; records over ``max_event_size`` are left out and
reported as a partial success. Events are read back through ChannelReader.
"""

from __future__ import annotations

import gzip
import json
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyarrow.flight")
pytest.importorskip("aiohttp")
pytest.importorskip("opentelemetry.sdk")
pytest.importorskip("opentelemetry.exporter.otlp.proto.http")

from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceResponse
from opentelemetry.sdk._logs import LoggerProvider, LoggingHandler
from opentelemetry.sdk._logs.export import SimpleLogRecordProcessor
from opentelemetry.sdk.resources import Resource
from test_agent import mtls_agent, pki  # noqa: F401  (pki is a fixture)
from test_agent_forward import drain, new_channel
from test_agent_http import request

from filechannel.agent import serve
from filechannel.testing.processes import restartable_port

OPTS: dict[str, Any] = {"minimum_required_space": 0}
PB = {"Content-Type": "application/x-protobuf"}


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[tuple[Any, str]]:
    d = new_channel(tmp_path / "c")
    a = serve([d], "grpc://127.0.0.1:0", writable=True, channel_options=OPTS, http="127.0.0.1:0")
    try:
        yield a, d
    finally:
        a.stop()


def sdk_logger(url: str, name: str, gzip: bool = False) -> tuple[logging.Logger, LoggerProvider]:
    from opentelemetry.exporter.otlp.proto.http import Compression

    provider = LoggerProvider(resource=Resource.create({"service.name": "shop", "deployment": "test"}))
    compression = Compression.Gzip if gzip else Compression.NoCompression
    exporter = OTLPLogExporter(endpoint=url + "/v1/logs", timeout=10, compression=compression)
    provider.add_log_record_processor(SimpleLogRecordProcessor(exporter))
    log = logging.getLogger(name)
    log.propagate = False
    log.setLevel(logging.INFO)
    log.addHandler(LoggingHandler(logger_provider=provider))
    return log, provider


@pytest.mark.parametrize("gzip", [False, True], ids=["plain", "gzip"])
def test_the_sdk_exporter_through_the_logging_bridge(agent: tuple[Any, str], gzip: bool) -> None:
    a, d = agent
    log, provider = sdk_logger(a.http.url, f"otlp.bridge.{gzip}", gzip)
    try:
        log.warning("payment %s failed", "p-1", extra={"order": 42, "retry": True})
        log.info("plain")
    finally:
        provider.shutdown()
    events = drain(d)
    assert [b for b, _ in events] == [b"payment p-1 failed", b"plain"]
    h = events[0][1]
    assert h["order"] == "42"
    assert h["retry"] == "true"
    assert h["resource.service.name"] == "shop"
    assert h["resource.deployment"] == "test"
    assert h["severity_text"] == "WARN"
    assert h["severity_number"] == "13"
    assert h["scope.name"] == f"otlp.bridge.{gzip}"
    assert int(h["time_unix_nano"]) > 1_600_000_000 * 10**9
    assert "trace_id" not in h  # not in a span: the zero ids are left out
    assert events[1][1]["severity_text"] == "INFO"
    text = a.http.metrics.render().decode()
    assert 'filechannel_source_events_total{channel="c",source="otlp"} 2.0' in text


def _json_request(*bodies: str, attrs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "resourceLogs": [
            {
                "resource": {"attributes": [{"key": "host", "value": {"stringValue": "h1"}}]},
                "scopeLogs": [
                    {
                        "scope": {"name": "s", "version": "2"},
                        "logRecords": [
                            {
                                "timeUnixNano": "1700000000000000001",
                                "severityNumber": 17,
                                "severityText": "ERROR",
                                "traceId": "5b8efff798038103d269b633813fc60c",
                                "spanId": "eee19b7ec3c1b174",
                                "body": {"stringValue": b},
                                "attributes": [
                                    {"key": k, "value": {"intValue": str(v)}} for k, v in (attrs or {}).items()
                                ],
                            }
                            for b in bodies
                        ],
                    }
                ],
            }
        ]
    }


def test_json_and_gzip_one_transaction_per_request(agent: tuple[Any, str]) -> None:
    a, d = agent
    body = gzip.compress(json.dumps(_json_request("one", "two", attrs={"n": 7})).encode())
    status, _, answer = request(
        a.http.port, "POST", "/v1/logs", body, {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    )
    assert status == 200
    assert answer == {}
    events = drain(d)
    assert [b for b, _ in events] == [b"one", b"two"]
    assert events[0][1] == {
        "n": "7",
        "resource.host": "h1",
        "scope.name": "s",
        "scope.version": "2",
        "severity_text": "ERROR",
        "severity_number": "17",
        "time_unix_nano": "1700000000000000001",
        "trace_id": "5b8efff798038103d269b633813fc60c",
        "span_id": "eee19b7ec3c1b174",
    }


@pytest.mark.parametrize(
    ("body", "headers", "status"),
    [
        (b"\x0a\x05\x12", PB, 400),  # a length past the end
        (b"\xff\xff\xff", PB, 400),
        (b'{"resourceLogs": 3}', {"Content-Type": "application/json"}, 400),
        (b"{", {"Content-Type": "application/json"}, 400),
        (b"x", {"Content-Type": "text/plain"}, 415),
    ],
)
def test_bad_payloads_are_400_with_a_status_and_put_nothing(
    agent: tuple[Any, str], body: bytes, headers: dict[str, str], status: int
) -> None:
    a, d = agent
    got, _hdrs, answer = request(a.http.port, "POST", "/v1/logs", body, headers)
    assert got == status
    if headers["Content-Type"] == "application/json":
        assert answer["code"] == 3
        assert answer["message"]
    assert drain(d) == []


def test_records_over_max_event_size_are_a_partial_success(tmp_path: Path) -> None:
    d = new_channel(tmp_path / "c", max_event_size=300)
    a = serve(
        [d], "grpc://127.0.0.1:0", writable=True, channel_options={**OPTS, "max_event_size": 300}, http="127.0.0.1:0"
    )
    try:
        body = json.dumps(_json_request("small", "x" * 400)).encode()
        status, _, answer = request(a.http.port, "POST", "/v1/logs", body, {"Content-Type": "application/json"})
        assert status == 200
        assert answer["partialSuccess"]["rejectedLogRecords"] == "1"
        assert "max_event_size=300" in answer["partialSuccess"]["errorMessage"]
        assert [b for b, _ in drain(d)] == [b"small"]
        # the same as protobuf: an ExportLogsServiceResponse the official classes parse
        from google.protobuf.json_format import ParseDict
        from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest

        req = ExportLogsServiceRequest()
        doc = _json_request("small2", "y" * 400)
        for rec in doc["resourceLogs"][0]["scopeLogs"][0]["logRecords"]:
            rec.pop("traceId"), rec.pop("spanId")
        ParseDict(doc, req)
        status, _, raw = request(a.http.port, "POST", "/v1/logs", req.SerializeToString(), PB)
        resp = ExportLogsServiceResponse.FromString(raw if isinstance(raw, bytes) else raw.encode())
        assert status == 200
        assert resp.partial_success.rejected_log_records == 1
    finally:
        a.stop()


def test_the_channel_header_picks_a_channel(tmp_path: Path) -> None:
    d1, d2 = new_channel(tmp_path / "a"), new_channel(tmp_path / "b")
    a = serve([d1, d2], "grpc://127.0.0.1:0", writable=True, channel_options=OPTS, http="127.0.0.1:0")
    try:
        body = json.dumps(_json_request("to-b")).encode()
        ct = {"Content-Type": "application/json"}
        status, _, answer = request(a.http.port, "POST", "/v1/logs", body, ct)
        assert status == 400
        assert "X-Filechannel-Channel" in answer["message"]
        assert request(a.http.port, "POST", "/v1/logs", body, {**ct, "X-Filechannel-Channel": "nope"})[0] == 404
        assert request(a.http.port, "POST", "/v1/logs", body, {**ct, "X-Filechannel-Channel": "b"})[0] == 200
        assert drain(d1) == []
        assert [b for b, _ in drain(d2)] == [b"to-b"]
    finally:
        a.stop()


def test_a_full_channel_is_503_with_retry_after_and_the_exporter_retries(tmp_path: Path) -> None:
    small = {"capacity": 2, "transaction_capacity": 2}
    d = new_channel(tmp_path / "c", **small)
    a = serve(
        [d], "grpc://127.0.0.1:0", writable=True, channel_options={**OPTS, **small, "keep_alive": 0}, http="127.0.0.1:0"
    )
    try:
        body = json.dumps(_json_request("a", "b")).encode()
        ct = {"Content-Type": "application/json"}
        assert request(a.http.port, "POST", "/v1/logs", body, ct)[0] == 200
        status, hdrs, answer = request(a.http.port, "POST", "/v1/logs", body, ct)
        assert status == 503
        assert hdrs["retry-after"] == "1"
        assert answer["code"] == 14
        # the SDK's exporter, refused with 503, retries; room is made after its first refusal
        ch = a.channels[next(iter(a.channels))].channel

        def make_room() -> None:
            time.sleep(1.5)
            with ch.transaction() as tx:
                tx.take_batch(2)

        t = threading.Thread(target=make_room)
        t.start()
        log, provider = sdk_logger(a.http.url, "otlp.retry")
        try:
            log.error("after the retry")
        finally:
            provider.shutdown()
            t.join()
        assert [b for b, _ in drain(d)][-1] == b"after the retry"
        text = a.http.metrics.render().decode()
        assert 'filechannel_http_requests_total{channel="",endpoint="otlp",status="503"}' in text
    finally:
        a.stop()


def test_the_exporter_retries_through_agent_sigkills_at_least_once(tmp_path: Path) -> None:
    """The SDK's exporter logging while the agent is SIGKILLed twice: every record arrives at least once.

    A request whose commit landed just before the kill, its answer lost, is sent
    again: a duplicate. OTLP has no idempotency key, so each kill may duplicate
    at most the requests in flight then (one here: one exporter, one request at a
    time); docs/otlp.md says so.
    """
    from test_agent_process import AgentProcess

    d = new_channel(tmp_path / "c")
    port = restartable_port()  # the agent is restarted on it
    args = ("--writable", "--http", f"127.0.0.1:{port}")
    agent = AgentProcess([d], tmp_path / "port", *args)
    n, kills = 400, 2
    done = threading.Event()
    sent = [0]

    def produce() -> None:
        log, provider = sdk_logger(f"http://127.0.0.1:{port}", "otlp.kill")
        try:
            for i in range(n):
                log.info("line %d", i)
                sent[0] = i + 1
        finally:
            provider.shutdown()
            done.set()

    t = threading.Thread(target=produce)
    t.start()
    try:
        for k in range(kills):
            deadline = time.monotonic() + 60
            while sent[0] < 100 * (k + 1):  # kill while the exporter is busy: after 100, then 200 lines
                assert time.monotonic() < deadline, "the exporter made no progress"
                time.sleep(0.005)
            agent.proc.kill()
            agent.proc.communicate(timeout=30)
            time.sleep(0.3)
            agent = AgentProcess([d], tmp_path / "port", *args)
        assert done.wait(120), "the exporter did not finish"
        t.join()
    finally:
        agent.kill()
    bodies = [b.decode() for b, _ in drain(d)]
    assert set(bodies) == {f"line {i}" for i in range(n)}  # nothing lost
    assert len(bodies) - n <= kills  # duplicates bounded: one request in flight per kill


def test_mutual_tls_and_the_allow_lists_apply_to_otlp(
    tmp_path: Path,
    pki: dict[str, Any],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The SDK's exporter with a client certificate over HTTPS; a name --allow-writer does not list gets 403."""
    for var in ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"):  # requests lets these override the exporter's CA file
        monkeypatch.delenv(var, raising=False)
    d = new_channel(tmp_path / "c")
    with mtls_agent(pki, [d], writers={"spark-exec"}, writable=True, channel_options=OPTS, http="127.0.0.1:0") as a:
        url = f"https://localhost:{a.http.port}/v1/logs"
        ok = OTLPLogExporter(
            endpoint=url,
            certificate_file=pki["ca"],
            client_certificate_file=pki["client"][0],
            client_key_file=pki["client"][1],
            timeout=10,
        )
        provider = LoggerProvider()
        provider.add_log_record_processor(SimpleLogRecordProcessor(ok))
        log = logging.getLogger("otlp.mtls")
        log.propagate = False
        log.addHandler(LoggingHandler(logger_provider=provider))
        try:
            log.warning("from a writer")
        finally:
            provider.shutdown()
        import ssl

        other = ssl.create_default_context(cafile=pki["ca"])
        other.load_cert_chain(*pki["client2"])
        body = json.dumps(_json_request("from an intruder")).encode()
        status, _, answer = request(
            a.http.port, "POST", "/v1/logs", body, {"Content-Type": "application/json"}, context=other
        )
        assert status == 403
        assert answer["code"] == 7
        assert "'intruder' may not write" in answer["message"]
        assert [b for b, _ in drain(d)] == [b"from a writer"]
