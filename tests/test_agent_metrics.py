"""``/metrics`` (parsed with prometheus_client's parser; values match ``stats()``), health, ``stat --prometheus``."""

from __future__ import annotations

import http.client
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyarrow.flight")
pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families
from test_agent import cid_of, make_channel
from test_agent_http import post_json, request

import filechannel
from filechannel.agent import connect, serve
from filechannel.agent.metrics import CHANNEL_METRICS
from filechannel.cli import main as cli_main
from filechannel.errors import DataLossError
from filechannel.reader import ChannelReader

OPTS: dict[str, Any] = {"minimum_required_space": 0}


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    status, hdrs, body = request(port, "GET", "/metrics")
    assert status == 200
    assert hdrs["content-type"].startswith("text/plain")
    return parse(body.decode())


def parse(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_channel_metrics_match_stats(tmp_path: Path) -> None:
    d = make_channel(tmp_path / "c", 20)
    opts = {**OPTS, "capacity": 1000, "transaction_capacity": 100, "checkpoint_interval": 0}
    with serve([d], "grpc://127.0.0.1:0", writable=True, http="127.0.0.1:0", channel_options=opts) as a:
        port = a.http.port
        ch = a.channels[cid_of(d)].channel
        assert ch is not None
        for i in range(3):
            assert post_json(port, [{"body": "x" * 50}] * 5, key=f"k{i}")[0] == 200
        with ChannelReader(d, "q") as r:  # a consumer 10 events behind the end... after the takes below
            r.available()
            r.ack(25)
        with ch.transaction() as tx:
            tx.rollback()
        ch.checkpoint()
        got = scrape(port)
        st = ch.stats()
    assert st["queue_size"] == 35
    seen = 0
    for name, kind, _help, key, _flume in CHANNEL_METRICS:
        sample = f"filechannel_{name}_total" if kind == "counter" else f"filechannel_{name}"
        if not key:
            continue
        want = st[key]
        if key == "lost_positions":
            want = 0
        if want is None:
            assert (sample, (("channel", "c"),)) not in got
            continue
        assert got[(sample, (("channel", "c"),))] == pytest.approx(float(want)), name
        seen += 1
    assert seen >= 25
    assert got[("filechannel_channel_fill_ratio", (("channel", "c"),))] == pytest.approx(35 / 1000)
    assert got[("filechannel_event_put_success_total", (("channel", "c"),))] == 15  # this process's puts
    assert got[("filechannel_checkpoints_written_total", (("channel", "c"),))] >= 1
    labels = (("channel", "c"), ("consumer", "q"))
    assert got[("filechannel_consumer_acked_position", labels)] == 25
    assert got[("filechannel_consumer_lag_events", labels)] == st["consumers"]["q"]["lag_events"] == 10
    # Lag in bytes: what `filechannel stat` counts for the same consumer.
    assert got[("filechannel_consumer_lag_bytes", labels)] == stat_json(d)["consumers"][0]["lag_bytes"] > 0
    # The commits' fdatasyncs as a histogram: one per durable commit (3 posts), buckets cumulative.
    ch_label = (("channel", "c"),)
    count = got[("filechannel_fsync_seconds_count", ch_label)]
    assert count == dict(st["fsync_seconds_buckets"])["+Inf"] >= 3
    assert got[("filechannel_fsync_seconds_sum", ch_label)] == pytest.approx(st["fsync_seconds"], abs=1e-6)
    assert got[("filechannel_fsync_seconds_bucket", (("channel", "c"), ("le", "+Inf")))] == count


def stat_json(d: str) -> dict[str, Any]:
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli_main(["stat", "--json", d]) == 0
    info: dict[str, Any] = json.loads(buf.getvalue())
    return info


def test_http_requests_flight_calls_and_commit_latency_are_counted(tmp_path: Path) -> None:
    d = make_channel(tmp_path / "c", 5)
    cid = cid_of(d)
    with serve([d], "grpc://127.0.0.1:0", writable=True, http="127.0.0.1:0", channel_options=OPTS) as a:
        port = a.http.port
        assert post_json(port, [{"body": "a"}], key="k")[0] == 200
        assert post_json(port, [{"body": "a"}], key="k")[0] == 200  # a duplicate
        assert request(port, "POST", "/v1/channels/c/events", b"[", {"Content-Type": "application/json"})[0] == 400
        assert request(port, "POST", "/v1/channels/c/events", b"[]", {"Content-Type": "text/plain"})[0] == 415
        assert post_json(port, [], name="nope")[0] == 404
        with connect(a.location, timeout=10) as c:
            c.put_batch(cid, [b"f1", b"f2"], producer="p", sequence=1)
            c.read(cid, 0, 3)
            with pytest.raises(DataLossError):
                c.read(cid, 0, 1000)
        got = scrape(port)

    def req(status: str, channel: str = "c") -> float:
        key = ("filechannel_http_requests_total", (("channel", channel), ("endpoint", "events"), ("status", status)))
        return got.get(key, 0.0)

    assert (req("200"), req("400"), req("415"), req("404", "?")) == (2, 1, 1, 1)
    assert got[("filechannel_http_events_total", (("channel", "c"),))] == 1
    assert got[("filechannel_http_duplicate_requests_total", (("channel", "c"),))] == 1
    assert got[("filechannel_flight_calls_total", (("call", "do_put"), ("outcome", "ok")))] == 1
    assert got[("filechannel_flight_calls_total", (("call", "do_get"), ("outcome", "ok")))] == 1
    assert got[("filechannel_flight_calls_total", (("call", "do_get"), ("outcome", "refused")))] == 1
    for source in ("http", "flight"):
        labels = (("channel", "c"), ("source", source))
        assert got[("filechannel_put_commit_seconds_count", labels)] == 1
        assert got[("filechannel_put_commit_seconds_sum", labels)] > 0


def test_health_endpoints(tmp_path: Path) -> None:
    d = make_channel(tmp_path / "c", 0)
    opts = {**OPTS, "capacity": 2, "transaction_capacity": 2, "keep_alive": 0.1}
    with serve([d], "grpc://127.0.0.1:0", writable=True, http="127.0.0.1:0", channel_options=opts) as a:
        port = a.http.port
        assert request(port, "GET", "/healthz")[0::2] == (200, {"status": "ok"})
        status, _, body = request(port, "GET", "/readyz")
        assert (status, body["ready"], body["channels"]["c"]["problems"]) == (200, True, [])
        assert post_json(port, [{"body": "1"}, {"body": "2"}])[0] == 200
        status, _, body = request(port, "GET", "/readyz")
        assert status == 503
        assert body["ready"] is False
        assert body["channels"]["c"]["problems"] == ["the channel is full (2 of 2 events)"]
        a.channels[cid_of(d)].channel.close()
        status, _, body = request(port, "GET", "/readyz")
        assert status == 503
        assert body["channels"]["c"]["problems"] == ["the channel is closed"]
        assert request(port, "GET", "/healthz")[0] == 200  # alive all the same
    # Disk space under minimum_required_space: not ready, and puts answer 503 with Retry-After.
    d2 = make_channel(tmp_path / "d", 0)
    opts = {"minimum_required_space": 1 << 60}
    with serve([d2], "grpc://127.0.0.1:0", writable=True, http="127.0.0.1:0", channel_options=opts) as a:
        port = a.http.port
        status, _, body = request(port, "GET", "/readyz")
        assert status == 503
        assert "minimum_required_space" in body["channels"]["d"]["problems"][0]
        status, hdrs, ans = post_json(port, [{"body": "x"}], name="d")
        assert status == 503
        assert "retry-after" in hdrs
        assert "minimum_required_space" in ans["error"]


def test_a_read_only_agent_reports_sizes_and_lag_from_its_view(tmp_path: Path) -> None:
    d = make_channel(tmp_path / "c", 12)
    with ChannelReader(d, "q") as r:
        r.available()
        r.ack(4)
    with serve([d], "grpc://127.0.0.1:0", http="127.0.0.1:0") as a:
        got = scrape(a.http.port)
        status, _, body = request(a.http.port, "GET", "/readyz")
    assert got[("filechannel_channel_size", (("channel", "c"),))] == 12
    labels = (("channel", "c"), ("consumer", "q"))
    assert got[("filechannel_consumer_lag_events", labels)] == 8
    assert got[("filechannel_consumer_lag_bytes", labels)] == stat_json(d)["consumers"][0]["lag_bytes"]
    assert (status, body["ready"]) == (200, True)


def test_stat_prometheus_prints_the_same_metrics_without_an_agent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = make_channel(tmp_path / "c", 30)
    with filechannel.open(d, **OPTS) as ch:
        ch.checkpoint()
    with ChannelReader(d, "q") as r:
        r.available()
        r.ack(10)
    info = stat_json(d)
    capsys.readouterr()
    assert cli_main(["stat", "--prometheus", d]) == 0
    got = parse(capsys.readouterr().out)
    c = (("channel", "c"),)
    assert got[("filechannel_channel_size", c)] == info["queue_size"] == 30
    assert got[("filechannel_next_position", c)] == info["next_position"]
    assert got[("filechannel_disk_bytes", c)] == info["disk_bytes"]
    assert got[("filechannel_data_files", c)] == len(info["files"])
    assert got[("filechannel_last_checkpoint_bytes", c)] == info["checkpoint"]["bytes"]
    labels = (("channel", "c"), ("consumer", "q"))
    assert got[("filechannel_consumer_lag_events", labels)] == info["consumers"][0]["lag_events"] == 20
    assert got[("filechannel_consumer_lag_bytes", labels)] == info["consumers"][0]["lag_bytes"]
    assert cli_main(["stat", "--prometheus", "--json", d]) == 2  # a usage error


def test_metrics_need_the_token_health_does_not(tmp_path: Path) -> None:
    from test_agent import _write

    d = make_channel(tmp_path / "c", 0)
    token = _write(tmp_path / "t", b"tok\n", 0o600)
    with serve([d], "grpc://127.0.0.1:0", http="127.0.0.1:0", token_file=token) as a:
        assert request(a.http.port, "GET", "/metrics")[0] == 401
        assert request(a.http.port, "GET", "/readyz")[0] == 200
        conn = http.client.HTTPConnection("127.0.0.1", a.http.port, timeout=10)
        conn.request("GET", "/metrics", headers={"Authorization": "Bearer tok"})
        r = conn.getresponse()
        assert r.status == 200
        assert b"filechannel_agent_info" in r.read()
        conn.close()


def test_metrics_at_depth_count_the_runs_not_read_yet_from_their_extent(tmp_path: Path) -> None:
    # A deep queue the agent's reader has never walked: the scrape counts the queued bytes and a
    # consumer's lag from the runs' extents in the data files (ChannelReader.record_bytes), so it
    # reads no data file in proportion to the depth, and the numbers stay within 0.1% of stat's.
    d = str(tmp_path / "c")
    n, body = 60_000, b"y" * 100
    with filechannel.open(d, **OPTS, capacity=1 << 20, checkpoint_interval=0, max_file_size=2 << 20) as ch:
        for _ in range(0, n, 10_000):
            with ch.transaction() as tx:
                tx.put_many([body] * 10_000)
    with ChannelReader(d, "q") as r:
        r.available()
        r.ack(25_000)
    info = stat_json(d)
    exact = info["consumers"][0]["lag_bytes"]
    size = exact // (n - 25_000)
    with serve([d], "grpc://127.0.0.1:0", http="127.0.0.1:0") as a:
        got = scrape(a.http.port)
    c = (("channel", "c"),)
    labels = (("channel", "c"), ("consumer", "q"))
    assert got[("filechannel_channel_size", c)] == n
    assert n * size <= got[("filechannel_channel_bytes", c)] <= n * size * 1.001
    assert got[("filechannel_consumer_lag_events", labels)] == n - 25_000
    assert exact <= got[("filechannel_consumer_lag_bytes", labels)] <= exact * 1.001
