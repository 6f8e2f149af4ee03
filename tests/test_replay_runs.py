"""Full replay without an object per PUT (issue 14c): runs, their placement, the voucher check.

Recovery scans data files compactly (``Scanner.scan(compact=True)``): a verified
PUT is a row in its file's two int64 columns and a :class:`scan.PutRun` stands
for a stretch of one transaction's PUTs. These tests hold the pieces replay
builds on that to what the per-record path did: ``Log.replay()`` still yields
every PUT record, ``_place_runs`` places exactly what the COMMIT claims (or
hands the transaction back to the per-record path), and the check of a full
replay against the newest checkpoint finds exactly the positions missing.
(The C walk against its Python twin: tests/test_speedups.py.)
"""

from __future__ import annotations

import os
from array import array
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import filechannel
from filechannel import format as fmt
from filechannel import scan
from filechannel._runs import Located, RunQueue
from filechannel.log import Log
from filechannel.replay import _place_runs, replay_queue

FAST: dict[str, Any] = {"minimum_required_space": 0, "background": False}


def _workload(d: str, **kw: Any) -> list[bytes]:
    """Puts in transactions of several sizes, takes, a rollback; returns the bodies still queued."""
    bodies: list[bytes] = []
    with filechannel.open(d, max_file_size=16 * 1024, **FAST, **kw) as ch:
        for i in range(40):
            batch = [b"event %d.%d" % (i, j) * (1 + j % 3) for j in range(1 + i % 7)]
            with ch.transaction() as tx:
                tx.put_many(batch)
            bodies += batch
            if i % 9 == 8:
                with ch.transaction() as tx:
                    got = tx.take_batch(5)
                bodies = bodies[len(got) :]
            if i == 20:
                tx = ch.transaction()
                tx.put(b"rolled back")
                tx.rollback()
    return bodies


def _plain_records(d: str, data_dirs: tuple[str, ...] = ()) -> list[scan.LogRecord]:
    """Every verified record, scanned the per-record way (not compact), in write order."""
    out: list[scan.LogRecord] = []
    dirs = list(data_dirs) or [os.path.join(d, "data")]
    cfg = filechannel.ChannelConfig(data_dirs=data_dirs) if data_dirs else filechannel.ChannelConfig()
    log = Log(d, cfg, readonly=True)
    try:
        for dd in dirs:
            prev = 0
            for name in sorted(n for n in os.listdir(dd) if scan.SEG_RE.match(n)):
                path = os.path.join(dd, name)
                with open(path, "rb") as f:
                    buf = f.read()
                hdr = fmt.decode_file_header(buf)
                assert isinstance(hdr, fmt.FileHeader)
                s = scan.Scanner(log, path, hdr.file_id, buf, hdr).scan(True, prev)
                prev = s.last_woid
                out += s.plain()
    finally:
        log.close()
    return sorted(out, key=lambda r: r.woid)


@pytest.mark.parametrize("two_dirs", [False, True])
def test_log_replay_still_yields_every_put_record(tmp_path: Path, two_dirs: bool) -> None:
    """``Log.replay()`` (the CLI dump, the WAL, tests) expands the runs recovery kept: the same
    records, in the same order, as scanning every file the per-record way."""
    d = str(tmp_path / "ch")
    dirs = (str(tmp_path / "d1"), str(tmp_path / "d2")) if two_dirs else ()
    _workload(d, **({"data_dirs": dirs} if dirs else {}))
    cfg = filechannel.ChannelConfig(data_dirs=dirs) if dirs else filechannel.ChannelConfig()
    log = Log(d, cfg, readonly=True)
    try:
        scans = list(log.scans)
        assert all(s.compact for s in scans)
        runs = [r for s in scans for r in s.records if isinstance(r, scan.PutRun)]
        assert runs
        assert len(runs) < sum(r.count for r in runs)  # fewer objects than PUTs
        got = list(log.replay())
    finally:
        log.close()
    assert got == _plain_records(d, dirs)
    assert any(r.op == fmt.PUT for r in got)
    assert not any(isinstance(r, scan.PutRun) for r in got)


def test_plain_refuses_a_compact_scan(tmp_path: Path) -> None:
    d = str(tmp_path / "ch")
    _workload(d)
    log = Log(d, filechannel.ChannelConfig(), readonly=True)
    try:
        with pytest.raises(ValueError, match="compact"):
            log.scans[0].plain()
    finally:
        log.close()


@pytest.mark.parametrize("replay", ["full", "checkpoint"])
def test_full_replay_queue_matches_and_releases_the_voucher(tmp_path: Path, replay: str) -> None:
    d = str(tmp_path / "ch")
    bodies = _workload(d)
    with filechannel.open(d, replay=replay, **FAST) as ch:
        assert ch.stats()["recovery_source"] == replay
        assert ch._log.voucher is None  # replay is over: the checkpoint it checked against is not kept
        assert ch._log.base_snapshot is None
        assert ch._log.voucher_path is not None  # still named in messages
        tx = ch.transaction()
        got = [e.body for e in tx.take_batch(10_000)]
        tx.rollback()
    assert got == bodies


def _run(txn: int, fid: int, woid: int, offs: list[int], col: tuple[array[int], array[int]]) -> scan.PutRun:
    o, z = col
    start = len(o)
    o.extend(offs)
    z.extend([100 + x for x in offs])
    return scan.PutRun(scan.PUT_RUN, woid, txn, fid, start, len(offs), o, z)


def _no_locate(fid: int, offset: int, lo: int, hi: int, want: int) -> Located:
    raise AssertionError("a queue whose runs hold their pointers never scans")


def test_place_runs_places_run_by_run_or_hands_back() -> None:
    col1: tuple[array[int], array[int]] = (array("q", [1, 2]), array("q", [3, 4]))  # rows of other runs first
    col2: tuple[array[int], array[int]] = (array("q"), array("q"))
    a = _run(7, 1, 10, [64, 128, 192], col1)
    b = _run(7, 2, 14, [40, 80], col2)  # the same transaction, continued in the next file
    q = RunQueue(_no_locate)
    assert _place_runs(q, 100, 5, [a, b])
    assert list(q) == [
        (100, 1, 64, 164),
        (101, 1, 128, 228),
        (102, 1, 192, 292),
        (103, 2, 40, 140),
        (104, 2, 80, 180),
    ]
    q = RunQueue(_no_locate)
    assert _place_runs(q, 0, 0, [])
    assert not list(q)
    # A count the COMMIT does not claim, or a salvaged record among them: nothing placed.
    assert not _place_runs(q, 0, 4, [a])
    rec = scan.LogRecord(fmt.PUT, 13, 7, 1, 256, 72, b"", True)
    assert not _place_runs(q, 0, 4, [a, rec])
    assert not list(q)


def test_replay_queue_after_salvage_places_runs_and_records(tmp_path: Path) -> None:
    """Skip mode: a damaged PUT of a transaction whose other PUTs verified in runs. The
    COMMIT's puts are placed by write-order id; the damaged one is reported lost, exactly."""
    d = str(tmp_path / "ch")
    with filechannel.open(d, **FAST) as ch:
        for i in range(3):
            with ch.transaction() as tx:
                tx.put_many([b"txn %d event %d" % (i, j) for j in range(4)])
    log = Log(d, filechannel.ChannelConfig(), readonly=True)
    try:
        puts = [r for r in log.replay() if r.op == fmt.PUT]
        path = log.file_path(puts[0].file_id)
    finally:
        log.close()
    victim = puts[5]  # the second event of the second transaction (position 5)
    with open(path, "r+b") as f:
        f.seek(victim.offset + fmt.RECORD_HEADER_LEN + 2)
        f.write(b"\xff")
    with filechannel.open(d, on_corruption="skip", replay="full", **FAST) as ch:
        lost = ch.stats()["lost_positions"]
        tx = ch.transaction()
        got = [e.body for e in tx.take_batch(100)]
        tx.rollback()
    assert got == [b"txn %d event %d" % (i, j) for i in range(3) for j in range(4) if (i, j) != (1, 1)]
    assert lost == [[5, 6]]


@settings(deadline=None, max_examples=60)
@given(
    queued=st.sets(st.integers(0, 3000), max_size=400),
    extra=st.sets(st.integers(0, 3000), max_size=100),
    returned=st.sets(st.integers(0, 3000), max_size=5),
    shuffle=st.randoms(use_true_random=False),
)
def test_queue_missing_is_a_set_difference(queued: set[int], extra: set[int], returned: set[int], shuffle: Any) -> None:
    q = RunQueue(_no_locate)
    ret = returned - queued
    for p in sorted(queued):
        q.append(p, 1, p * 8, 8)
    q.push_back([(p, 1, p * 8, 8) for p in sorted(ret)])  # rolled-back takes, held beside the runs
    want = list(queued | extra | ret)
    shuffle.shuffle(want)  # a checkpoint's positions need not be sorted for this
    positions = array("q", want)
    expected = set(want) - queued - ret
    assert q.missing(positions) == expected


def test_trim_heap_on_both_paths() -> None:
    """glibc's malloc_trim through the accelerator, or through ctypes on the pure-Python path."""
    import platform

    from filechannel import _accel

    glibc = platform.libc_ver()[0] == "glibc"
    if fmt.speedups is not None:
        assert fmt.speedups.trim_heap() in (True, False)
    assert _accel.trim_heap(fmt.speedups) in (True, False)
    assert _accel.trim_heap(None) in (True, False)
    if not glibc:
        assert _accel.trim_heap(None) is False


def test_replay_queue_is_unchanged_by_the_accelerator(tmp_path: Path) -> None:
    """The queue a full replay builds on the pure-Python path equals the C path's."""
    d = str(tmp_path / "ch")
    _workload(d)
    queues = []
    saved = fmt.speedups
    for accel in (True, False):
        fmt.speedups = saved if accel else None
        try:
            log = Log(d, filechannel.ChannelConfig(replay="full"), readonly=True)
            try:
                q, targets, taken = replay_queue(log, log.base_snapshot)
            finally:
                log.close()
        finally:
            fmt.speedups = saved
        queues.append((list(q), targets, taken))
    assert queues[0] == queues[1]
    assert queues[0][0]
