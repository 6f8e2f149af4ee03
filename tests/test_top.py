"""``filechannel top``: the model (rates, fsync quantiles, rows, table), ``--once --json``, agents, bad input."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
from helpers import run_cli

import filechannel
from filechannel.reader import ChannelReader
from filechannel.top import (
    ChannelReading,
    ConsumerReading,
    Sample,
    histogram_quantile,
    rate,
    rows,
    table,
)

INF = math.inf

# -- the model -------------------------------------------------------------------------------


def test_rate_is_the_movement_per_second_and_unknown_when_it_cannot_be_told() -> None:
    assert rate(100, 350, 2.0) == 125.0
    assert rate(7, 7, 0.5) == 0.0
    assert rate(None, 10, 1.0) is None  # no previous sample
    assert rate(10, 20, 0.0) is None  # no time passed
    assert rate(500, 20, 1.0) is None  # went back: a recreated channel, never a negative rate


def test_histogram_quantile_interpolates_within_the_bucket() -> None:
    # 10 at most 1 ms, 90 in (1 ms, 2 ms], 100 in (2 ms, 10 ms]
    h = [(0.001, 10.0), (0.002, 100.0), (0.01, 200.0), (INF, 200.0)]
    assert histogram_quantile(0.05, h) == pytest.approx(0.001)  # the 10th of 200: the top of the first bucket
    assert histogram_quantile(0.5, h) == pytest.approx(0.002)  # the 100th: the top of the second
    assert histogram_quantile(0.75, h) == pytest.approx(0.006)  # halfway through (2 ms, 10 ms]
    assert histogram_quantile(0.99, [(0.001, 1.0), (INF, 100.0)]) == 0.001  # in +Inf: the largest finite bound
    assert histogram_quantile(0.5, []) is None
    assert histogram_quantile(0.5, [(0.001, 0.0), (INF, 0.0)]) is None
    with pytest.raises(ValueError, match="q must be"):
        histogram_quantile(1.5, h)


def _sample(t: float, start: int, end: int, buckets: tuple[tuple[float, float], ...] = ()) -> Sample:
    c = ConsumerReading("spark", start + 2, end - start - 2, 99)
    return Sample("grpc://a:1", "agent", t, (ChannelReading("orders", start, end, 1000, 5 << 30, buckets, (c,)),))


def test_rows_give_rates_between_samples_and_fsync_quantiles_of_the_interval() -> None:
    first = _sample(10.0, 100, 150, ((0.001, 100.0), (0.01, 100.0), (INF, 100.0)))
    second = _sample(12.0, 160, 250, ((0.001, 100.0), (0.01, 110.0), (INF, 110.0)))
    (r,) = rows(first, second)
    assert r["depth_events"] == 90
    assert r["put_rate"] == 50.0  # end 150 -> 250 in 2 s
    assert r["take_rate"] == 30.0  # start 100 -> 160 in 2 s
    # the interval's 10 fsyncs all took (1 ms, 10 ms]: the 100 fast ones before it do not count
    assert r["fsync_window"] == "interval"
    assert r["fsync_p50_seconds"] == pytest.approx(0.0055)
    assert r["consumers"] == [{"name": "spark", "acked": 162, "lag_events": 88, "lag_bytes": 99}]
    # the first sample alone: no rates, the fsyncs since the channel opened
    (r0,) = rows(None, first)
    assert r0["put_rate"] is None
    assert r0["take_rate"] is None
    assert r0["fsync_window"] == "since_open"
    assert r0["fsync_p99_seconds"] == pytest.approx(0.001 * 0.99)
    # an interval without an fsync shows the ones since open rather than nothing
    (r1,) = rows(first, _sample(11.0, 100, 150, first.channels[0].fsync_buckets))
    assert r1["fsync_window"] == "since_open"
    assert r1["put_rate"] == 0.0


def test_an_unreachable_target_is_a_row_marked_unreachable() -> None:
    bad = Sample("grpc://b:2", "agent", 1.0, error="cannot reach the agent")
    (r,) = rows(None, bad)
    assert r["error"] == "cannot reach the agent"
    assert r["channel"] is None
    lines = table([*rows(None, _sample(1.0, 0, 5)), r])
    assert lines[0].split()[:3] == ["CHANNEL", "DEPTH", "BYTES"]
    assert "grpc://b:2 (agent)" in lines
    assert "  unreachable: cannot reach the agent" in lines
    assert any(line.split()[:2] == ["orders", "5"] for line in lines)
    assert "    consumer spark: acked 2, lag 3 events (99B)" in lines


# -- a channel directory -----------------------------------------------------------------------


def _channel(d: Path, n: int, taken: int) -> str:
    with filechannel.open(str(d), minimum_required_space=0, checkpoint_interval=0) as ch:
        with ch.transaction() as tx:
            for i in range(n):
                tx.put(b"event-%03d" % i)
        with ch.transaction() as tx:
            for _ in range(taken):
                tx.take()
    return str(d)


def test_once_json_reports_depth_bytes_and_each_consumers_lag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = _channel(tmp_path / "c", 10, 3)
    with ChannelReader(d, "behind") as r:  # acknowledges up to position 5: lag 5 of the 7 queued
        r.available()
        r.ack(5)
    with ChannelReader(d, "new") as r:  # registered at the head: lag 7
        r.available()
    code, out, err = run_cli(capsys, "stat", d, "--json")
    assert code == 0, err
    stat = json.loads(out)
    code, out, err = run_cli(capsys, "top", d, "--once", "--json", "--interval", "0.05")
    assert code == 0, err
    doc = json.loads(out)
    (row,) = doc["channels"]
    assert (row["target"], row["kind"], row["channel"], row["error"]) == (d, "dir", "c", None)
    assert (row["start"], row["end"], row["depth_events"]) == (3, 10, 7)
    lag = {c["name"]: c for c in stat["consumers"]}
    assert row["depth_bytes"] == lag["new"]["lag_bytes"] > 0  # every queued event's record bytes
    assert row["consumers"] == [
        {"name": "behind", "acked": 5, "lag_events": 5, "lag_bytes": lag["behind"]["lag_bytes"]},
        {"name": "new", "acked": 3, "lag_events": 7, "lag_bytes": lag["new"]["lag_bytes"]},
    ]
    assert row["put_rate"] == 0.0
    assert row["take_rate"] == 0.0
    assert row["disk_free_bytes"] > 0
    assert row["fsync_p50_seconds"] is None  # another process's fsyncs are not in the files
    assert row["connections"] is None


def test_a_channel_open_in_another_process_is_read_without_its_lock(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = _channel(tmp_path / "c", 4, 0)
    lock = os.path.join(d, "LOCK")
    with filechannel.open(d, minimum_required_space=0) as ch:
        before = os.stat(lock)
        with ch.transaction() as tx:
            tx.put(b"more")
        code, out, err = run_cli(capsys, "top", d, "--once", "--json", "--interval", "0.01")
        assert code == 0, err
        assert json.loads(out)["channels"][0]["depth_events"] == 5
        after = os.stat(lock)
        assert (before.st_mtime_ns, before.st_size) == (after.st_mtime_ns, after.st_size)
        with ch.transaction() as tx:
            tx.put(b"still the owner's")


def test_plain_lines_when_stdout_is_not_a_terminal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = _channel(tmp_path / "c", 6, 1)
    code, out, err = run_cli(capsys, "top", d, "--once", "--interval", "0.01")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split()[0] == "CHANNEL"
    assert lines[1] == f"{d} (dir)"
    assert lines[2].split()[:2] == ["c", "5"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["top", "{tmp}/missing"], "no such channel directory"),
        (["top", "{tmp}/plain"], "is not a filechannel directory: it is a file"),
        (["top", "{tmp}", "--once"], "is not a filechannel directory"),
        (["top", "{c}", "--interval", "0"], "--interval must be a number of seconds > 0"),
        (["top", "{c}", "--json"], "--json goes with --once"),
    ],
)
def test_bad_input_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    (tmp_path / "plain").write_text("x")
    c = _channel(tmp_path / "c", 1, 0)
    code, out, err = run_cli(capsys, *(a.format(tmp=tmp_path, c=c) for a in argv))
    assert code == 2
    assert out == ""
    assert len(err.splitlines()) == 1
    assert err.startswith("filechannel: error: ")
    assert message in err


# -- agents ----------------------------------------------------------------------------------


def _agent_row(doc: dict[str, Any], uri: str) -> dict[str, Any]:
    (row,) = [r for r in doc["channels"] if r["target"] == uri]
    return row


@pytest.mark.parametrize("via", ["flight", "metrics"])
def test_an_agent_shows_depth_bytes_lag_fsync_disk_and_connections(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], via: str
) -> None:
    pytest.importorskip("pyarrow.flight")
    pytest.importorskip("aiohttp")
    from filechannel.agent import connect, serve

    d = _channel(tmp_path / "orders", 0, 0)
    opts = {"minimum_required_space": 0}
    with serve([d], "grpc://127.0.0.1:0", writable=True, http="127.0.0.1:0", channel_options=opts) as a:
        uri = a.location if via == "flight" else f"http://127.0.0.1:{a.http.port}"
        with connect(a.location) as c:
            (cid,) = c.channels()
            for seq in range(1, 4):
                c.put_batch(cid, [b"x" * 40] * 5, producer="p", sequence=seq)
            c.register(cid, "spark")
            c.ack(cid, "spark", 10)
            code, out, err = run_cli(capsys, "top", uri, "--once", "--json", "--interval", "0.05")
            assert code == 0, err
            code, stat_out, err = run_cli(capsys, "stat", d, "--json")
            assert code == 0, err
        row = _agent_row(json.loads(out), uri)
        assert (row["kind"], row["channel"], row["depth_events"]) == ("agent", "orders", 15)
        (spark,) = row["consumers"]
        assert (spark["name"], spark["acked"], spark["lag_events"]) == ("spark", 10, 5)
        (lag,) = json.loads(stat_out)["consumers"]
        assert spark["lag_bytes"] == lag["lag_bytes"] > 5 * 40  # what `stat` counts for the same consumer
        assert row["depth_bytes"] > spark["lag_bytes"]
        assert row["fsync_p50_seconds"] is not None
        assert row["fsync_p99_seconds"] >= row["fsync_p50_seconds"]
        assert row["disk_free_bytes"] > 0
        assert row["connections"]["flight"] >= 1  # the test's client (and, over Flight, top's own)
        if via == "metrics":
            assert row["connections"]["http"] >= 2  # top's two requests (urllib: a connection each)


def test_several_targets_an_unreachable_agent_is_a_row_one_alone_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("pyarrow.flight")
    d = _channel(tmp_path / "c", 2, 0)
    dead = "grpc://127.0.0.1:9"  # the discard port: nothing listens
    dead_http = "http://127.0.0.1:9"
    argv = ["top", d, dead, dead_http, "--once", "--json", "--interval", "0.01", "--timeout", "2"]
    code, out, err = run_cli(capsys, *argv)
    assert code == 0, err
    doc = json.loads(out)
    assert _agent_row(doc, d)["depth_events"] == 2
    for uri in (dead, dead_http):
        bad = _agent_row(doc, uri)
        assert bad["channel"] is None
        assert "cannot reach the agent" in bad["error"]
    code, out, err = run_cli(capsys, "top", dead, "--once", "--timeout", "2")
    assert code == 2
    assert out == ""
    assert len(err.splitlines()) == 1
    assert "cannot reach the agent" in err
