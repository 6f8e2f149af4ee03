"""The Spark sink through an agent in real queries (the shared local session of tests/spark_session.py).

``writeStream.format("filechannel").option("agent", URI)``: executors stage at
the agent, the driver's commit makes one transaction per micro-batch there,
while the agent owns the channel and a reader reads it. A query restarted
after its ``commits/N`` entry was lost replays batch N, which the agent does
not put twice; the batch writer makes one transaction for the job.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyarrow.flight")
pytest.importorskip("pyspark")

from test_agent import cid_of, make_channel

from filechannel import ChannelReader
from filechannel.agent import serve
from filechannel.agent.staging import batch_mark
from filechannel.spark.sink import HEADER_BATCH, HEADER_QUERY

FORMAT = "filechannel"


def _json_input(d: Path, files: int, rows: int, first: int = 0) -> list[str]:
    d.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(first, first + files):
        path = d / f"part-{i:03d}.json"
        with open(path, "w") as f:
            for j in range(rows):
                body = f"row-{i:03d}-{j:03d}"
                out.append(body)
                f.write(json.dumps({"body": body}) + "\n")
        os.utime(path, (1_700_000_000 + i, 1_700_000_000 + i))
    return out


def _stream(spark: Any, src: Path, uri: str, ck: Path) -> Any:
    df = spark.readStream.schema("body string").option("maxFilesPerTrigger", 1).json(str(src)).repartition(2)
    w = df.writeStream.format(FORMAT).option("agent", uri).option("channel", "sink")
    return w.option("checkpointLocation", str(ck)).trigger(availableNow=True).start()


def _events(d: str) -> list[Any]:
    with ChannelReader(d) as v:
        start, end = v.available()
        return v.read(start, end)


@pytest.mark.spark
def test_spark_stream_through_an_agent_exactly_once_across_a_replay(spark: Any, tmp_path: Path) -> None:
    d, other = make_channel(tmp_path / "sink", 0), make_channel(tmp_path / "other", 0)
    src, ck = tmp_path / "in", tmp_path / "ck"
    rows = _json_input(src, 3, 4)
    with serve([d, other], "grpc://127.0.0.1:0", writable=True) as agent:
        q = _stream(spark, src, agent.location, ck)
        q.awaitTermination(180)
        assert q.exception() is None
        evs = _events(d)  # read while the agent owns the channel
        assert sorted(e.body.decode() for e in evs) == sorted(rows)
        assert [e.headers[HEADER_BATCH] for e in evs] == [str(i // 4) for i in range(12)]
        assert {e.headers[HEADER_QUERY] for e in evs} == {q.id}
        assert _events(other) == []
        # The driver "crashed" after the agent committed batch 2, before Spark logged commits/2.
        (ck / "commits" / "2").unlink()
        with contextlib.suppress(FileNotFoundError):
            (ck / "commits" / ".2.crc").unlink()
        more = _json_input(src, 1, 2, first=100)
        q2 = _stream(spark, src, agent.location, ck)
        q2.awaitTermination(180)
        assert q2.exception() is None
        assert [p["batchId"] for p in q2.recentProgress if p["numInputRows"]] == [2, 3]
        got = [e.body.decode() for e in _events(d)]
        assert sorted(got) == sorted(rows + more)  # batch 2 once
        assert agent.channels[cid_of(d)].channel.mark(batch_mark(q.id)) == b"3"  # type: ignore[union-attr]
        # The batch writer: one transaction for the job.
        df = spark.createDataFrame([(b"a",), (b"b",), (b"c",)], "body binary").repartition(2)
        df.write.format(FORMAT).mode("append").option("agent", agent.location).option("channel", "sink").save()
        assert sorted(e.body for e in _events(d)[-3:]) == [b"a", b"b", b"c"]
    assert list((Path(d) / "spark-sink" / "staging").glob("*")) == []
