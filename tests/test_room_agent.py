"""``max_bytes`` through an agent: Flight's ``ChannelFullError`` names the limit, HTTP answers 503 + Retry-After,
``/readyz`` says why, and ``/metrics`` shows the bytes held, the limit and the free space."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("pyarrow.flight")
pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families
from test_agent import cid_of, make_channel
from test_agent_http import request

import filechannel
from filechannel.agent import connect, serve
from filechannel.errors import ChannelFullError

OPTS = {"max_file_size": 4096, "max_bytes": 3 * 4096, "minimum_required_space": 0, "keep_alive": 0.2}


def test_max_bytes_through_flight_and_http(tmp_path: Path) -> None:
    d = make_channel(tmp_path / "c", 0)
    with filechannel.open(d, max_file_size=4096, minimum_required_space=0) as ch0:
        for _ in range(40):
            with ch0.transaction() as tx:
                tx.put(b"x" * 500)  # ~21 KB of data files: over the agent's max_bytes
    cid = cid_of(d)
    with (
        serve([d], "grpc://127.0.0.1:0", writable=True, http="127.0.0.1:0", channel_options=OPTS) as agent,
        connect(agent.location, timeout=10) as c,
    ):
        with pytest.raises(ChannelFullError) as ei:
            c.put_batch(cid, [b"x" * 500], producer="p", sequence=1)
        assert ei.value.reason == "max_bytes"
        assert "max_bytes=12288" in str(ei.value)
        ch = agent.channels[cid].channel
        assert ch is not None
        assert ch.mark("producer:p") is None  # the refused batch was not recorded
        port = agent.http.port
        status, hdrs, body = request(
            port, "POST", "/v1/channels/c/events", b"y" * 500, {"Content-Type": "application/octet-stream"}
        )
        assert status == 503
        assert hdrs["retry-after"]
        assert "max_bytes" in body["error"]
        status, _, ready = request(port, "GET", "/readyz")
        assert status == 503
        assert any("max_bytes=12288" in p for p in ready["channels"]["c"]["problems"])
        status, _, text = request(port, "GET", "/metrics")
        assert status == 200
        values = {
            s.name: s.value
            for fam in text_string_to_metric_families(text.decode())
            for s in fam.samples
            if s.labels.get("channel") == "c"
        }
        st = ch.stats()
        assert values["filechannel_max_bytes"] == 3 * 4096
        assert values["filechannel_data_bytes"] == st["data_bytes"] > 3 * 4096
        assert values["filechannel_disk_free_bytes"] > 0
        assert values["filechannel_space_refusals_total"] >= 2
        # takes make room; the same producer goes on with its next sequence number
        while True:
            with ch.transaction() as tx:
                if not tx.take_batch(100):
                    break
        ch.retire_files()
        assert c.put_batch(cid, [b"z"], producer="p", sequence=1).duplicate is False
        status, _, _ = request(
            port, "POST", "/v1/channels/c/events", b"w", {"Content-Type": "application/octet-stream"}
        )
        assert status == 200
