"""How the source cuts a micro-batch into tasks: about ``minPartitions`` of equal bytes (issue 26), without a JVM.

``ChannelReader.segments(parts=, min_bytes=)`` plans the runs; the stream and
batch readers and the data source choose ``parts``. The reader classes are plain
Python, driven here as Spark's runner would drive them.
"""

from __future__ import annotations

import itertools
import pickle
from collections.abc import Sequence
from pathlib import Path

import pytest

pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")

from pyspark import cloudpickle
from pyspark.sql.datasource import InputPartition
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows
from pyspark.sql.types import BinaryType, LongType, MapType, StringType, StructField, StructType

import filechannel
from filechannel import ChannelReader
from filechannel.errors import ConfigError
from filechannel.reader import Segment, read_segment
from filechannel.spark import source
from filechannel.spark.datasource import FileChannelDataSource, with_parallelism
from filechannel.spark.offsets import share_partitions as _parts
from filechannel.spark.source import (
    DEFAULT_MIN_PARTITIONS,
    MIN_SPLIT_BYTES,
    FileChannelBatchReader,
    FileChannelStreamReader,
    SegmentPartition,
    SourceOptions,
)

SCHEMA = StructType(
    [
        StructField("position", LongType()),
        StructField("body", BinaryType()),
        StructField("headers", MapType(StringType(), StringType())),
    ]
)
BODY = 1000


def body(i: int) -> bytes:
    return (b"%08d" % i) * (BODY // 8)


def channel(tmp_path: Path, n: int, name: str = "ch", max_file_size: int = 1 << 30) -> str:
    d = str(tmp_path / name)
    with filechannel.open(d, minimum_required_space=0, background=False, max_file_size=max_file_size) as ch:
        for lo in range(0, n, 500):
            with ch.transaction() as tx:
                tx.put_many([body(i) for i in range(lo, min(n, lo + 500))])
    return d


def spans(segments: list[Segment]) -> list[tuple[int, int]]:
    return [(s.start, s.end) for s in segments]


def contiguous(segments: list[Segment], start: int, end: int) -> None:
    """The segments cover ``[start, end)`` exactly, in order, and read back every event."""
    assert segments[0].start == start
    assert segments[-1].end == end
    assert all(a.end == b.start for a, b in itertools.pairwise(segments))
    got = [(e.position, e.body) for s in segments for e in read_segment(s)]
    assert got == [(i, body(i)) for i in range(start, end)]


def segs(parts: Sequence[InputPartition]) -> list[Segment]:
    out = []
    for p in parts:
        assert isinstance(p, SegmentPartition)
        out.append(p.segment)
    return out


def event_bytes(s: Segment) -> int:
    return sum(s.sizes)


# -- ChannelReader.segments ------------------------------------------------------------------


def test_parts_cut_a_range_into_runs_of_equal_bytes(tmp_path: Path) -> None:
    d = channel(tmp_path, 3000)
    with ChannelReader(d) as r:
        assert spans(r.segments(0, 3000, 16 << 20)) == [(0, 3000)]  # one file, under max_bytes: one run
        for parts in (2, 3, 7):
            segs = r.segments(0, 3000, 16 << 20, parts=parts)
            assert len(segs) == parts
            sizes = [event_bytes(s) for s in segs]
            assert max(sizes) - min(sizes) <= max(segs[0].sizes)  # equal to within one event
            contiguous(segs, 0, 3000)
            assert r.segments(0, 3000, 16 << 20, parts=parts) == segs  # the same call plans the same runs
        # a sub-range is planned on its own bytes
        segs = r.segments(1000, 1600, 16 << 20, parts=2)
        assert spans(segs) == [(1000, 1300), (1300, 1600)]


def test_parts_never_exceed_max_bytes_files_or_events(tmp_path: Path) -> None:
    d = channel(tmp_path, 3000, max_file_size=400_000)
    with ChannelReader(d) as r:
        files = {s.file_id for s in r.segments(0, 3000, 1 << 30)}
        assert len(files) > 2
        for parts in (1, 2, 5):
            segs = r.segments(0, 3000, 100_000, parts=parts)
            assert all(s.length <= 100_000 for s in segs)
            assert all(len({s.file_id}) == 1 for s in segs)  # a segment is one file's byte range
            assert len(segs) >= max(parts, len(files))
            contiguous(segs, 0, 3000)
        # more parts than events: one event each, never an empty segment
        assert spans(r.segments(10, 13, 1 << 30, parts=50)) == [(10, 11), (11, 12), (12, 13)]


def test_min_bytes_keeps_small_ranges_in_fewer_runs(tmp_path: Path) -> None:
    d = channel(tmp_path, 3000)
    with ChannelReader(d) as r:
        total = sum(event_bytes(s) for s in r.segments(0, 3000, 1 << 30))
        assert len(r.segments(0, 3000, 1 << 30, parts=8, min_bytes=total // 3)) == 3
        assert len(r.segments(0, 3000, 1 << 30, parts=8, min_bytes=total + 1)) == 1
        assert len(r.segments(0, 3000, 1 << 30, parts=2, min_bytes=1)) == 2


@pytest.mark.parametrize(
    ("kw", "exc"),
    [
        ({"parts": 0}, ValueError),
        ({"parts": 2.0}, TypeError),
        ({"parts": True}, TypeError),
        ({"min_bytes": -1}, ValueError),
        ({"min_bytes": "1"}, TypeError),
    ],
)
def test_bad_planning_arguments(tmp_path: Path, kw: dict[str, object], exc: type[Exception]) -> None:
    d = channel(tmp_path, 10)
    with ChannelReader(d) as r, pytest.raises(exc):
        r.segments(0, 10, 1 << 20, **kw)  # type: ignore[arg-type]


# -- the stream and batch readers ------------------------------------------------------------


def stream(d: str, consumer: str = "q", default: int | None = None, **opts: str) -> FileChannelStreamReader:
    source = FileChannelDataSource if default is None else with_parallelism(default)
    reader = source({"path": d, "consumer": consumer, **opts}).streamReader(SCHEMA)
    assert isinstance(reader, FileChannelStreamReader)
    return reader


@pytest.fixture
def small_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    """Split ranges from 64 KiB a part (the real floor, 4 MiB, would need channels of tens of MB here)."""
    monkeypatch.setattr(source, "MIN_SPLIT_BYTES", 64 << 10)


@pytest.mark.usefixtures("small_floor")
def test_a_micro_batch_gets_about_min_partitions_tasks(tmp_path: Path) -> None:
    d = channel(tmp_path, 3000)  # ~3 MB: under the old fixed 4 MiB, one task however many cores
    r = stream(d)
    start = r.initialOffset()
    end = r.latestOffset(start, ReadAllAvailable())
    parts = r.partitions(start, end)
    assert len(parts) == DEFAULT_MIN_PARTITIONS
    contiguous(segs(parts), 0, 3000)
    # a replayed micro-batch (a new runner, the same offsets and options) gets the same tasks
    again = stream(d).partitions(start, end)
    assert segs(again) == segs(parts)
    # the option, and the session's parallelism the registered class carries
    assert len(stream(d, "q3", minPartitions="3").partitions(start, end)) == 3
    assert len(stream(d, "q5", default=5).partitions(start, end)) == 5
    assert len(stream(d, "q4", default=5, minPartitions="4").partitions(start, end)) == 4
    # maxPartitionBytes still caps a task: more tasks than minPartitions for a large batch
    many = stream(d, "qm", maxPartitionBytes=str(500_000)).partitions(start, end)
    assert len(many) > 5
    assert all(s.length <= 500_000 for s in segs(many))
    contiguous(segs(many), 0, 3000)


def test_a_small_micro_batch_stays_one_task(tmp_path: Path) -> None:
    d = channel(tmp_path, 3000)
    r = stream(d, default=8)
    start = r.initialOffset()
    end = r.latestOffset(start, ReadAllAvailable())  # ~3 MB < 2 x MIN_SPLIT_BYTES: not worth two tasks
    assert 3000 * BODY < 2 * MIN_SPLIT_BYTES
    assert len(r.partitions(start, end)) == 1
    r = stream(d, "q2", default=8, maxEventsPerTrigger="100")
    assert len(r.partitions(start, r.latestOffset(start, ReadMaxRows(100)))) == 1


@pytest.mark.usefixtures("small_floor")
def test_channels_share_min_partitions(tmp_path: Path) -> None:
    a = channel(tmp_path, 3000, "a")
    b = channel(tmp_path, 1000, "b")
    r = stream(f"{a},{b}", default=4)
    start = r.initialOffset()
    end = r.latestOffset(start, ReadAllAvailable())
    got = r.partitions(start, end)
    by_path: dict[str, int] = {}
    for p in got:
        assert isinstance(p, SegmentPartition)
        assert p.channel is not None
        by_path[p.channel] = by_path.get(p.channel, 0) + 1
    assert by_path == {a: 3, b: 1}
    assert _parts({"x": 0, "y": 0}, 4) == {"x": 1, "y": 1}
    assert _parts({"x": 10, "y": 0}, 4) == {"x": 4, "y": 1}
    assert _parts({"x": 1, "y": 1000}, 2) == {"x": 1, "y": 2}


@pytest.mark.usefixtures("small_floor")
def test_a_snapshot_gets_about_min_partitions_tasks(tmp_path: Path) -> None:
    d = channel(tmp_path, 3000)
    read = with_parallelism(3)({"path": d}).reader(SCHEMA)
    assert isinstance(read, FileChannelBatchReader)
    parts = read.partitions()
    assert len(parts) == 3
    contiguous(segs(parts), 0, 3000)
    opts = SourceOptions.parse({"path": d, "minPartitions": "2"}, streaming=False, default_partitions=7)
    assert len(FileChannelBatchReader(opts, SCHEMA).partitions()) == 2


def test_min_partitions_option_and_default(tmp_path: Path) -> None:
    assert SourceOptions.parse({"path": str(tmp_path)}, streaming=False).min_partitions == DEFAULT_MIN_PARTITIONS
    assert SourceOptions.parse({"path": str(tmp_path)}, streaming=False, default_partitions=6).min_partitions == 6
    for bad in ("0", "-2", "two"):
        with pytest.raises(ConfigError, match="minPartitions"):
            SourceOptions.parse({"path": str(tmp_path), "minPartitions": bad}, streaming=False)


def test_the_registered_class_carries_the_parallelism_to_the_workers() -> None:
    assert with_parallelism(None) is FileChannelDataSource
    cls = with_parallelism(6)
    # Spark's cloudpickle sends it by value (a worker cannot ask the session), the number included
    back = pickle.loads(cloudpickle.dumps(cls))  # type: ignore[no-untyped-call]
    assert back.default_parallelism == 6
    assert back.name() == "filechannel"
    assert FileChannelDataSource.default_parallelism is None
