"""The Spark source reading agents (``option("agents", ...)``): in-process agents and the one local SparkSession.

Exactly once through a restart of the query; an agent stopped and restarted
mid-stream (its channel's position held while a local ``path`` channel of the
same query proceeds, then progress); a bad token; one channel id served twice;
the hold bound and ``onAgentUnavailable=fail``; ``retireChannels``; a channel
restored from an older copy; the batch source over TLS; and, without a JVM,
the partitions planned from the offsets alone, the pickled partitions holding
no secret, and the local-path source naming files an executor cannot see.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from test_agent import PKI

import filechannel
from filechannel import ChannelReader
from filechannel._fs import DEFAULT_FS
from filechannel.agent import serve
from filechannel.consumers import ConsumerStore
from filechannel.reader import channel_id_of

OPTS: dict[str, Any] = {"minimum_required_space": 0}


def cid(d: str) -> str:
    return channel_id_of(d).hex()


def put(ch: filechannel.FileChannel, tag: str, first: int, n: int) -> None:
    with ch.transaction() as tx:
        for i in range(first, first + n):
            tx.put(f"{tag}-{i:05d}".encode(), headers={"i": str(i), "tag": tag})


def expected(tag: str, positions: range) -> list[tuple[int, bytes, dict[str, str]]]:
    return [(i, f"{tag}-{i:05d}".encode(), {"i": str(i), "tag": tag}) for i in positions]


def stream(spark: Any, agents: str, consumer: str = "q", path: str | None = None, **options: Any) -> Any:
    r = spark.readStream.format("filechannel").option("consumer", consumer).option("agents", agents)
    for k, v in options.items():
        r = r.option(k, str(v))
    return r.load(path) if path else r.load()


def to_parquet(df: Any, base: Path, **trigger: Any) -> Any:
    return (
        df.writeStream.format("parquet")
        .option("path", str(base / "out"))
        .option("checkpointLocation", str(base / "ck"))
        .trigger(**(trigger or {"processingTime": "0.3 seconds"}))
        .start()
    )


def drain(q: Any) -> None:
    assert q.awaitTermination(180)
    assert q.exception() is None


def delivered(spark: Any, base: Path) -> dict[str, list[tuple[int, bytes, dict[str, str]]]]:
    """What the parquet sink committed, per ``channel`` column, in position order."""
    out: dict[str, list[tuple[int, bytes, dict[str, str]]]] = {}
    for r in spark.read.parquet(str(base / "out")).orderBy("channel", "position").collect():
        out.setdefault(r.channel, []).append((r.position, bytes(r.body), dict(r.headers)))
    return out


def offsets(base: Path) -> list[dict[str, Any]]:
    d = base / "ck" / "offsets"
    files = sorted((p for p in d.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    return [json.loads(p.read_text().splitlines()[-1]) for p in files]


def failure(q: Any) -> str:
    with pytest.raises(Exception) as info:  # StreamingQueryException
        q.awaitTermination(180)
    return str(info.value)


def wait_for(cond: Any, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def acked_at(d: str, consumer: str = "q") -> int:
    with ChannelReader(d, consumer) as r:
        return r.acked


# -- with Spark ------------------------------------------------------------------------------------


@pytest.mark.spark
def test_exactly_once_through_a_restart_of_the_query(spark: Any, tmp_path: Path) -> None:
    a_dir, b_dir = str(tmp_path / "a"), str(tmp_path / "b")
    a = filechannel.open(a_dir, background=False, **OPTS)
    b = filechannel.open(b_dir, background=False, **OPTS)
    with serve([a_dir], "grpc://127.0.0.1:0") as ag1, serve([b_dir], "grpc://127.0.0.1:0") as ag2:
        agents = f"{ag1.location},{ag2.location}"
        base = tmp_path / "q"
        put(a, "a", 0, 30)
        put(b, "b", 0, 7)
        drain(
            to_parquet(stream(spark, agents, maxEventsPerPartition=8, maxEventsPerTrigger=20), base, availableNow=True)
        )
        put(a, "a", 30, 5)
        put(b, "b", 7, 20)
        drain(to_parquet(stream(spark, agents, maxEventsPerPartition=8), base, availableNow=True))
        got = delivered(spark, base)
        assert got == {cid(a_dir): expected("a", range(35)), cid(b_dir): expected("b", range(27))}
        logged = offsets(base)
        assert {tuple(sorted(o["positions"])) for o in logged} == {tuple(sorted([cid(a_dir), cid(b_dir)]))}
        assert len({o["query"] for o in logged}) == 1
        assert logged[-1]["positions"] == {cid(a_dir): 35, cid(b_dir): 27}
        assert len(logged) >= 3  # maxEventsPerTrigger=20 split the first run
        # acknowledgements travelled to each agent: all but at most the last micro-batch
        assert 0 < acked_at(a_dir) <= 35
        assert 0 < acked_at(b_dir) <= 27
    a.close()
    b.close()


@pytest.mark.spark
def test_an_agent_stopped_mid_stream_holds_its_channel_while_a_path_channel_proceeds(
    spark: Any, tmp_path: Path
) -> None:
    a_dir, local_dir = str(tmp_path / "remote"), str(tmp_path / "local")
    a = filechannel.open(a_dir, background=False, **OPTS)
    loc = filechannel.open(local_dir, background=False, **OPTS)
    base = tmp_path / "q"
    agent = serve([a_dir], "grpc://127.0.0.1:0")
    port = agent.port
    uri = agent.location
    q = to_parquet(stream(spark, uri, path=local_dir, agentTimeoutMs=2000), base)
    try:
        put(a, "r", 0, 10)
        put(loc, "l", 0, 10)
        q.processAllAvailable()
        agent.stop()
        put(a, "r", 10, 10)  # the owner keeps writing; the agent is down
        put(loc, "l", 10, 10)
        wait_for(lambda: offsets(base)[-1]["positions"].get(cid(local_dir)) == 20)
        held = offsets(base)[-1]["positions"][cid(a_dir)]
        assert held == 10  # held, not skipped, while the path channel proceeded
        assert q.isActive
        agent = serve([a_dir], f"grpc://127.0.0.1:{port}")
        wait_for(lambda: offsets(base)[-1]["positions"][cid(a_dir)] == 20)
        q.processAllAvailable()
    finally:
        q.stop()
        agent.stop()
    got = delivered(spark, base)
    assert got[local_dir] == expected("l", range(20))
    assert got[cid(a_dir)] == expected("r", range(20))
    a.close()
    loc.close()


@pytest.mark.spark
def test_a_bad_token_is_refused_with_a_clear_error(spark: Any, tmp_path: Path) -> None:
    d = str(tmp_path / "c")
    ch = filechannel.open(d, background=False, **OPTS)
    put(ch, "t", 0, 5)
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.write_text("right-token\n")
    bad.write_text("wrong-token\n")
    for f in (good, bad):
        f.chmod(0o600)
    with serve([d], "grpc://127.0.0.1:0", token_file=str(good)) as agent:
        q = to_parquet(stream(spark, agent.location, tokenFile=bad), tmp_path / "q1", availableNow=True)
        msg = failure(q)
        assert "AgentAuthError" in msg
        assert "the bearer token is wrong" in msg
        assert agent.location in msg
        assert "wrong-token" not in msg
        drain(to_parquet(stream(spark, agent.location, tokenFile=good), tmp_path / "q2", availableNow=True))
        assert delivered(spark, tmp_path / "q2") == {cid(d): expected("t", range(5))}
    ch.close()


@pytest.mark.spark
def test_one_channel_id_served_twice_is_refused(spark: Any, tmp_path: Path) -> None:
    d = str(tmp_path / "c")
    filechannel.open(d, **OPTS).close()
    copy = str(tmp_path / "copy")
    shutil.copytree(d, copy)
    with serve([d], "grpc://127.0.0.1:0") as ag1, serve([copy], "grpc://127.0.0.1:0") as ag2:
        q = to_parquet(stream(spark, f"{ag1.location},{ag2.location}"), tmp_path / "q1", availableNow=True)
        msg = failure(q)
        assert f"channel {cid(d)} is served by {ag1.location} and by {ag2.location}" in msg
        q = to_parquet(stream(spark, ag1.location, path=d), tmp_path / "q2", availableNow=True)
        msg = failure(q)
        assert f"channel {cid(d)} is the local directory {d} and is served by {ag1.location}" in msg


@pytest.mark.spark
def test_an_unreachable_agent_fails_the_query_after_the_hold_or_at_once(spark: Any, tmp_path: Path) -> None:
    d = str(tmp_path / "c")
    ch = filechannel.open(d, background=False, **OPTS)
    put(ch, "h", 0, 5)
    agent = serve([d], "grpc://127.0.0.1:0")
    uri = agent.location
    for name in ("q1", "q2"):
        drain(to_parquet(stream(spark, uri, consumer=name), tmp_path / name, availableNow=True))
    agent.stop()
    t0 = time.monotonic()
    q = to_parquet(stream(spark, uri, consumer="q1", agentHoldMs=3000, agentTimeoutMs=1000), tmp_path / "q1")
    msg = failure(q)
    assert time.monotonic() - t0 >= 3
    assert "AgentUnavailableError" in msg
    assert f"agent {uri}" in msg
    assert f"channel {cid(d)} at position 5" in msg
    assert "agentHoldMs=3000" in msg
    q = to_parquet(stream(spark, uri, consumer="q2", onAgentUnavailable="fail", agentTimeoutMs=1000), tmp_path / "q2")
    msg = failure(q)
    assert "onAgentUnavailable=fail" in msg
    assert f"channel {cid(d)} at position 5" in msg
    ch.close()


@pytest.mark.spark
def test_a_channel_no_agent_serves_is_dropped_only_when_retired(spark: Any, tmp_path: Path) -> None:
    a_dir, b_dir = str(tmp_path / "a"), str(tmp_path / "b")
    a = filechannel.open(a_dir, background=False, **OPTS)
    b = filechannel.open(b_dir, background=False, **OPTS)
    put(a, "a", 0, 4)
    put(b, "b", 0, 4)
    base = tmp_path / "q"
    with serve([a_dir, b_dir], "grpc://127.0.0.1:0") as agent:
        drain(to_parquet(stream(spark, agent.location), base, availableNow=True))
    put(a, "a", 4, 3)
    with serve([a_dir], "grpc://127.0.0.1:0") as agent:  # b is served no more
        msg = failure(to_parquet(stream(spark, agent.location), base, availableNow=True))
        assert f"channel {cid(b_dir)} (at position 4 in this query's checkpoint) is served by none" in msg
        assert f"option('retireChannels', '{cid(b_dir)}')" in msg
        drain(to_parquet(stream(spark, agent.location, retireChannels=cid(b_dir)), base, availableNow=True))
    got = delivered(spark, base)
    assert got == {cid(a_dir): expected("a", range(7)), cid(b_dir): expected("b", range(4))}
    assert cid(b_dir) not in offsets(base)[-1]["positions"]
    a.close()
    b.close()


@pytest.mark.spark
def test_a_channel_restored_from_an_older_copy_is_data_loss_naming_the_agent(spark: Any, tmp_path: Path) -> None:
    d = str(tmp_path / "c")
    ch = filechannel.open(d, background=False, **OPTS)
    put(ch, "o", 0, 3)
    ch.close()
    old = str(tmp_path / "old")
    shutil.copytree(d, old)
    ch = filechannel.open(d, background=False, **OPTS)
    put(ch, "o", 3, 5)
    ch.close()
    base = tmp_path / "q"
    with serve([d], "grpc://127.0.0.1:0") as agent:
        drain(to_parquet(stream(spark, agent.location), base, availableNow=True))
    shutil.rmtree(d)
    shutil.copytree(old, d)
    with serve([d], "grpc://127.0.0.1:0") as agent:
        msg = failure(to_parquet(stream(spark, agent.location), base, availableNow=True))
        assert "DataLossError" in msg
        assert f"{cid(d)} at agent {agent.location}" in msg
        assert "restored from an older copy" in msg


@pytest.mark.spark
def test_the_batch_source_reads_agents_over_mutual_tls_and_acknowledges_nothing(spark: Any, tmp_path: Path) -> None:
    pki = PKI(tmp_path / "pki")
    cert, key = pki.issue("localhost", server=True)
    client_cert, client_key = pki.issue("spark-exec")
    d, local = str(tmp_path / "c"), str(tmp_path / "local")
    ch = filechannel.open(d, background=False, **OPTS)
    put(ch, "s", 0, 12)
    lc = filechannel.open(local, background=False, **OPTS)
    put(lc, "l", 0, 3)
    with serve([d], "grpc+tls://localhost:0", tls_cert=cert, tls_key=key, client_ca=pki.ca) as agent:
        df = (
            spark.read.format("filechannel")
            .option("agents", agent.location)
            .option("tlsCa", pki.ca)
            .option("tlsCert", client_cert)
            .option("tlsKey", client_key)
            .option("maxEventsPerPartition", "5")
            .load(local)
        )
        rows = df.orderBy("channel", "position").collect()
    got: dict[str, list[Any]] = {}
    for r in rows:
        got.setdefault(r.channel, []).append((r.position, bytes(r.body), dict(r.headers)))
    assert got == {cid(d): expected("s", range(12)), local: expected("l", range(3))}
    assert ConsumerStore(DEFAULT_FS, d).list() == {}  # a snapshot registers and acknowledges nothing
    ch.close()
    lc.close()


# -- without a JVM -------------------------------------------------------------------------------


def test_partitions_are_planned_from_the_offsets_alone_and_hold_no_secret(tmp_path: Path) -> None:
    from pyspark.sql.types import StructType

    from filechannel.spark.remote import AgentPartition, AgentStreamReader
    from filechannel.spark.source import SourceOptions

    token = tmp_path / "token"
    token.write_text("s3cret-token-value\n")
    token.chmod(0o600)
    options = SourceOptions.parse(
        {
            "agents": "grpc://127.0.0.1:1,grpc://127.0.0.1:2",  # nothing listens there
            "consumer": "q",
            "tokenFile": str(token),
            "maxEventsPerPartition": "4",
        },
        streaming=True,
    )
    reader = AgentStreamReader(options, StructType([]))
    start = {"positions": {"aa": 3, "bb": 0, "cc": 9}, "query": "t"}
    end = {"positions": {"aa": 12, "bb": 0, "cc": 9, "dd": 4}, "query": "t"}
    parts = reader.partitions(start, end)
    assert [(p.channel, p.start, p.end) for p in parts] == [("aa", 3, 7), ("aa", 7, 11), ("aa", 11, 12)]
    assert all(isinstance(p, AgentPartition) for p in parts)
    assert [(p.channel, p.start, p.end) for p in reader.partitions(start, end)] == [
        (p.channel, p.start, p.end) for p in parts
    ]
    blob = pickle.dumps(parts) + pickle.dumps(reader)
    assert b"s3cret-token-value" not in blob
    assert str(token).encode() in blob  # the path travels
    assert pickle.loads(pickle.dumps(parts[0])).agents == parts[0].agents


def test_the_local_path_source_names_files_an_executor_cannot_see(tmp_path: Path) -> None:
    from pyspark.sql.types import BinaryType, LongType, MapType, StringType, StructField, StructType

    from filechannel.spark.source import FilesNotVisibleError, SegmentPartition, _read

    d = str(tmp_path / "host-a" / "c")
    ch = filechannel.open(d, background=False, **OPTS)
    put(ch, "v", 0, 5)
    ch.close()
    with ChannelReader(d) as view:
        seg = view.segments(0, 5)[0]
    schema = StructType(
        [
            StructField("position", LongType()),
            StructField("body", BinaryType()),
            StructField("headers", MapType(StringType(), StringType())),
        ]
    )
    assert len(list(_read(SegmentPartition(seg, None), schema))) == 1
    os.rename(tmp_path / "host-a", tmp_path / "elsewhere")  # what an executor on another host sees
    with pytest.raises(FilesNotVisibleError, match=r"this executor .* cannot see the channel's files") as info:
        list(_read(SegmentPartition(seg, None), schema))
    assert "option('agents', URI)" in str(info.value)
    os.rename(tmp_path / "elsewhere", tmp_path / "host-a")
    os.unlink(seg.path)  # a file that is really gone stays data loss
    with pytest.raises(filechannel.DataLossError, match="is gone"):
        list(_read(SegmentPartition(seg, None), schema))


def test_agent_options_are_checked() -> None:
    from filechannel.errors import ConfigError
    from filechannel.spark.source import SourceOptions

    ok = SourceOptions.parse({"agents": "grpc://127.0.0.1:9", "consumer": "q"}, streaming=True)
    assert ok.multi
    assert ok.paths == ()
    assert ok.on_unavailable == "hold"
    assert ok.partition_events == 20_000
    for opts, match in (
        ({"agents": "http://h:1"}, "scheme"),
        ({"agents": "grpc://10.0.0.1:1"}, "loopback"),
        ({"agents": "grpc://127.0.0.1:1", "tlsCa": "/x"}, "grpc\\+tls"),
        ({"agents": "grpc+tls://h:1", "tlsCert": "/x"}, "together"),
        ({"path": "/x", "tokenFile": "/t"}, "agents only"),
        ({"agents": "grpc://127.0.0.1:1", "onAgentUnavailable": "skip"}, "hold or fail"),
        ({"agents": "grpc://127.0.0.1:1", "retireChannels": "zz"}, "not a channel id"),
        ({"agents": "grpc://127.0.0.1:1", "maxEventsPerPartition": "0"}, "positive"),
        ({"agents": "grpc://127.0.0.1:1,grpc://127.0.0.1:1"}, "twice"),
    ):
        with pytest.raises(ConfigError, match=match):
            SourceOptions.parse({"consumer": "q", **opts}, streaming=True)


def test_the_runner_protocol_without_spark_holds_defers_acks_and_bounds_the_hold(tmp_path: Path) -> None:
    from pyspark.sql.streaming.datasource import ReadAllAvailable
    from pyspark.sql.types import BinaryType, LongType, StringType, StructField, StructType

    from filechannel.errors import AgentUnavailableError
    from filechannel.spark.remote import AgentStreamReader, agent_batches
    from filechannel.spark.source import SourceOptions

    d = str(tmp_path / "c")
    ch = filechannel.open(d, background=False, **OPTS)
    put(ch, "p", 0, 10)
    agent = serve([d], "grpc://127.0.0.1:0")
    port, uri = agent.port, agent.location
    opts = {"agents": uri, "consumer": "q", "agentTimeoutMs": "2000", "agentHoldMs": "1500"}
    schema = StructType(
        [StructField("position", LongType()), StructField("body", BinaryType()), StructField("channel", StringType())]
    )
    reader = AgentStreamReader(SourceOptions.parse(opts, streaming=True), schema)
    start = reader.initialOffset()
    assert start["positions"] == {cid(d): 0}
    end = reader.latestOffset(start, ReadAllAvailable())
    assert end["positions"] == {cid(d): 10}
    parts = reader.partitions(start, end)
    rows = [r for p in parts for b in agent_batches(p, schema) for r in b.to_pylist()]
    assert [(r["position"], r["body"], r["channel"]) for r in rows] == [
        (i, f"p-{i:05d}".encode(), cid(d)) for i in range(10)
    ]
    agent.stop()
    put(ch, "p", 10, 5)
    reader.commit(end)  # the agent is down: deferred, not failed
    assert acked_at(d) == 0
    assert reader.latestOffset(end, ReadAllAvailable())["positions"] == {cid(d): 10}  # held
    agent = serve([d], f"grpc://127.0.0.1:{port}")
    try:
        nxt = reader.latestOffset(end, ReadAllAvailable())
        assert nxt["positions"] == {cid(d): 15}
        assert acked_at(d) == 10  # the deferred acknowledgement was delivered
    finally:
        agent.stop()
    reader.latestOffset(end, ReadAllAvailable())  # down again: held, within agentHoldMs
    time.sleep(1.6)
    with pytest.raises(AgentUnavailableError, match=rf"agentHoldMs=1500\) with channel {cid(d)} at position 10 "):
        reader.latestOffset(end, ReadAllAvailable())
    reader.stop()
    ch.close()


def test_min_events_per_trigger_waits_through_agents_then_gives_up_after_the_delay(tmp_path: Path) -> None:
    from pyspark.sql.streaming.datasource import ReadAllAvailable
    from pyspark.sql.types import BinaryType, LongType, StringType, StructField, StructType

    from filechannel.spark.remote import AgentStreamReader
    from filechannel.spark.source import SourceOptions

    d, d2 = str(tmp_path / "a"), str(tmp_path / "b")
    ch, ch2 = filechannel.open(d, background=False, **OPTS), filechannel.open(d2, background=False, **OPTS)
    put(ch, "a", 0, 2)
    put(ch2, "b", 0, 1)
    agent = serve([d, d2], "grpc://127.0.0.1:0")
    schema = StructType(
        [StructField("position", LongType()), StructField("body", BinaryType()), StructField("channel", StringType())]
    )
    opts = {"agents": agent.location, "consumer": "q", "minEventsPerTrigger": "5", "maxTriggerDelay": "400ms"}
    reader = AgentStreamReader(SourceOptions.parse(opts, streaming=True), schema)
    try:
        start = reader.initialOffset()
        limit = reader.getDefaultReadLimit()  # what Spark passes, except under trigger(once=True)
        assert start["positions"] == {cid(d): 0, cid(d2): 0}
        # 3 events in all, fewer than 5: no micro-batch yet, on either channel.
        assert reader.latestOffset(start, limit)["positions"] == {cid(d): 0, cid(d2): 0}
        put(ch2, "b", 1, 1)
        assert reader.latestOffset(start, limit)["positions"] == {cid(d): 0, cid(d2): 0}
        time.sleep(0.45)  # waited maxTriggerDelay since events first waited: go with what there is
        end = reader.latestOffset(start, limit)
        assert end["positions"] == {cid(d): 2, cid(d2): 2}
        put(ch, "a", 2, 6)
        assert reader.latestOffset(end, limit)["positions"] == {cid(d): 8, cid(d2): 2}  # 6 >= 5: at once
        put(ch, "a", 8, 1)
        # trigger(once=True): Spark passes ReadAllAvailable, and the remainder below the minimum goes at once.
        assert reader.latestOffset(end, ReadAllAvailable())["positions"] == {cid(d): 9, cid(d2): 2}
    finally:
        reader.stop()
        agent.stop()
        ch.close()
        ch2.close()


def test_starting_and_ending_positions_through_agents(tmp_path: Path) -> None:
    from pyspark.sql.streaming.datasource import ReadAllAvailable
    from pyspark.sql.types import BinaryType, LongType, StringType, StructField, StructType

    from filechannel.errors import ConfigError
    from filechannel.spark.remote import AgentStreamReader, agent_batches, snapshot_partitions
    from filechannel.spark.source import SourceOptions

    d = str(tmp_path / "c")
    ch = filechannel.open(d, background=False, **OPTS)
    put(ch, "p", 0, 10)
    agent = serve([d], "grpc://127.0.0.1:0")
    schema = StructType(
        [StructField("position", LongType()), StructField("body", BinaryType()), StructField("channel", StringType())]
    )

    def snapshot(**opts: str) -> list[int]:
        parsed = SourceOptions.parse({"agents": agent.location, **opts}, streaming=False)
        parts = snapshot_partitions(parsed, {})
        return [r["position"] for p in parts for b in agent_batches(p, schema) for r in b.to_pylist()]

    try:
        assert snapshot() == list(range(10))
        assert snapshot(startingPosition="3", endingPosition="6") == [3, 4, 5]
        assert snapshot(startingPosition=json.dumps({cid(d): 8})) == [8, 9]
        assert snapshot(startingPosition="latest") == []
        with pytest.raises(ConfigError, match=f"endingPosition.*'0123'.*it reads {cid(d)} \\(agent "):
            snapshot(endingPosition='{"0123": 5}')  # a key naming no channel read: refused, not ignored
        with pytest.raises(ConfigError, match="beyond what channel"):
            snapshot(endingPosition="11")
        with pytest.raises(ConfigError, match="before startingPosition"):
            snapshot(startingPosition="5", endingPosition="4")
        # A stream's new consumer starts at startingPosition: what it skips is acknowledged for it.
        opts = {"agents": agent.location, "consumer": "q", "startingPosition": "7"}
        reader = AgentStreamReader(SourceOptions.parse(opts, streaming=True), schema)
        start = reader.initialOffset()
        assert start["positions"] == {cid(d): 7}
        assert acked_at(d) == 7
        end = reader.latestOffset(start, ReadAllAvailable())
        rows = [
            r["position"]
            for p in reader.partitions(start, end)
            for b in agent_batches(p, schema)
            for r in b.to_pylist()
        ]
        assert rows == [7, 8, 9]
        reader.stop()
        typo = {**opts, "consumer": "typo", "startingPosition": json.dumps({cid(d)[:-1] + "x": 8})}
        with pytest.raises(ConfigError, match=r"startingPosition.*not one this query reads"):
            AgentStreamReader(SourceOptions.parse(typo, streaming=True), schema).initialOffset()
        assert "typo" not in ConsumerStore(DEFAULT_FS, d).list()  # refused before registering anything
        # A known consumer keeps its own position: the option is for new ones only.
        again = AgentStreamReader(SourceOptions.parse({**opts, "startingPosition": "earliest"}, streaming=True), schema)
        assert again.initialOffset()["positions"] == {cid(d): 7}
        again.stop()
    finally:
        agent.stop()
        ch.close()
