"""``filechannel stat`` and ``filechannel consumers`` on a deep queue: right, and no list of every event.

The commands read the queue's runs (its size, head, tail, and each consumer's
lag in events and its oldest file) and walk the data files once, a chunk of
pointers at a time, for the lag in bytes. These tests compare what they print
with a drain of the channel, and check the peak of Python memory while they
run stays far below what one entry per queued event costs.
"""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import pytest
from helpers import run_cli

import filechannel
from filechannel import ChannelReader
from filechannel import format as fmt

N = 300_000
BATCH = 10_000
OPTIONS = {"fsync": "interval", "checkpoint_interval": 0, "max_file_size": 4 << 20, "capacity": 1 << 30}


def _record_size(body: bytes) -> int:
    n = len(fmt.encode_event(body, None))
    return fmt.RECORD_HEADER_LEN + n + (-n & 7)


@pytest.fixture(scope="module")
def deep(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[tuple[int, bytes]], str]:
    """A channel of N events (bodies of 1 to 200 bytes), 12 000 taken, two consumers; its drain."""
    d = str(tmp_path_factory.mktemp("deep") / "ch")
    with filechannel.open(d, **OPTIONS) as ch:
        for i in range(0, N, BATCH):
            with ch.transaction() as tx:
                tx.put_many([b"b" * (1 + k % 200) for k in range(i, i + BATCH)])
        for _ in range(2):
            with ch.transaction() as tx:
                tx.take_batch(6_000)
    ChannelReader(d, "early").ack(20_000)
    ChannelReader(d, "late").ack(254_321)
    # The drain: every queued event, from a copy (the channel itself stays as it is).
    copy = str(tmp_path_factory.mktemp("copy") / "ch")
    import shutil

    shutil.copytree(d, copy)
    for name in ("early", "late"):
        (Path(copy) / "consumers" / f"{name}.ack").unlink(missing_ok=True)
    drained: list[tuple[int, bytes]] = []
    with filechannel.open(copy, **OPTIONS) as ch:
        while True:
            with ch.transaction() as tx:
                got = tx.take_batch(BATCH)
            if not got:
                break
            drained += [(e.position or 0, e.body) for e in got]
    return d, drained, copy


def _expected(drained: list[tuple[int, bytes]], acked: int) -> tuple[int, int]:
    left = [b for p, b in drained if p >= acked]
    return len(left), sum(_record_size(b) for b in left)


def test_stat_and_consumers_at_depth_match_a_drain_without_a_list_of_every_event(
    deep: tuple[str, list[tuple[int, bytes]], str], capsys: pytest.CaptureFixture[str]
) -> None:
    d, drained, _ = deep
    assert len(drained) == N - 12_000
    tracemalloc.start()
    try:
        code, out, err = run_cli(capsys, "stat", d, "--json")
        _, stat_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        code2, out2, err2 = run_cli(capsys, "consumers", d, "--json")
        _, consumers_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert code == 0, err
    assert code2 == 0, err2
    info = json.loads(out)
    assert info["queue_size"] == len(drained)
    assert info["head_position"] == drained[0][0] == 12_000
    assert info["tail_position"] == drained[-1][0] == N - 1
    rows = {r["name"]: r for r in json.loads(out2)["consumers"]}
    assert {r["name"]: r for r in info["consumers"]} == rows
    for name, acked in (("early", 20_000), ("late", 254_321)):
        events, nbytes = _expected(drained, acked)
        assert (rows[name]["acked"], rows[name]["lag_events"], rows[name]["lag_bytes"]) == (acked, events, nbytes)
        assert rows[name]["oldest_file"] is not None
    # The file of a consumer's oldest queued event: where a reader finds that event.
    late_oldest = ChannelReader(d).segments(254_321, 254_322)[0].path
    assert rows["late"]["oldest_file"] == late_oldest
    # A list of one tuple per queued event costs about 150 B each (45 MB here): far above this.
    assert stat_peak < 20_000_000, stat_peak
    assert consumers_peak < 20_000_000, consumers_peak


def test_consumers_lag_beyond_the_tail_and_on_an_empty_queue(
    deep: tuple[str, list[tuple[int, bytes]], str], capsys: pytest.CaptureFixture[str]
) -> None:
    _, _, copy = deep  # drained: nothing queued
    ChannelReader(copy, "done").ack(N)
    code, out, err = run_cli(capsys, "consumers", copy, "--json")
    assert code == 0, err
    (row,) = json.loads(out)["consumers"]
    assert (row["lag_events"], row["lag_bytes"], row["oldest_file"]) == (0, 0, None)
    code, out, err = run_cli(capsys, "stat", copy, "--json")
    info = json.loads(out)
    assert (info["queue_size"], info["head_position"], info["tail_position"]) == (0, None, None)
