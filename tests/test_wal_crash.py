"""WriteAheadLog crash coverage: power cuts at every persistence point (SimFS), and SIGKILL.

The simulated workloads write records (single and batched), roll files by
size and by record time, and clean by time, on a :class:`SimFS` that
snapshots itself after every mutating call. Every snapshot is crashed in each
of the variants ``test_crash_points.py`` uses (unsynced writes dropped, kept,
a prefix, a subset, torn sectors, extended files) and the log reopened. The
oracle, with ``fsync="commit"``: every record whose ``write`` returned is
there once and in write order, and reads back by handle; a write in flight is
all or nothing; nothing else appears. The only records allowed to be missing
are those older than the threshold of a ``clean`` that had started. With
``fsync="interval"``: what comes back is a prefix of the write order that
holds every record made durable by ``sync()``. A recovered log takes a new
write, and a second recovery of the same state gives the same records.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from simfs import CRASH_VARIANTS, MUTATING_OPS, SimFS

import filechannel
from filechannel.wal import RecordHandle

D = "/sim/wal"
VARIANTS: list[tuple[str, int]] = list(CRASH_VARIANTS)
TOTALS = {"snapshots": 0, "recoveries": 0, "distinct": 0}


@dataclass(frozen=True)
class Rec:
    data: bytes
    time: float
    handle: RecordHandle | None = None


@dataclass(frozen=True)
class Snap:
    fs: SimFS
    acked: tuple[Rec, ...]
    inflight: tuple[Rec, ...]
    clean_from: float | None  # threshold of the first clean that had started (records older may be gone)
    durable_upto: int  # interval mode: acked[:n] were made durable by sync()
    op: str


class Driver:
    def __init__(self, fs: SimFS, opts: dict[str, object]) -> None:
        self.fs = fs
        self.acked: list[Rec] = []
        self.inflight: tuple[Rec, ...] = ()
        self.clean_from: float | None = None
        self.durable_upto = 0
        self.snaps: list[Snap] = [Snap(fs.snapshot(), (), (), None, 0, "start")]
        fs.on_op = self._hook
        self.w = filechannel.WriteAheadLog(D, fs=fs, **opts)  # type: ignore[arg-type]

    def _hook(self, op: str, path: str) -> None:
        if op in MUTATING_OPS:
            self.snaps.append(
                Snap(
                    self.fs.snapshot(),
                    tuple(self.acked),
                    self.inflight,
                    self.clean_from,
                    self.durable_upto,
                    f"{op} {path}",
                )
            )

    def write(self, data: bytes, t: float) -> None:
        self.inflight = (Rec(data, t),)
        h = self.w.write(data, time=t)
        self.acked.append(Rec(data, t, h))
        self.inflight = ()

    def write_many(self, items: list[bytes], t: float) -> None:
        self.inflight = tuple(Rec(d, t) for d in items)
        hs = self.w.write_many(items, time=t)
        self.acked.extend(Rec(d, t, h) for d, h in zip(items, hs, strict=True))
        self.inflight = ()

    def clean(self, thresh: float) -> None:
        if self.clean_from is None or thresh < self.clean_from:
            self.clean_from = thresh
        self.w.clean(thresh, wait_for_completion=True)

    def sync(self) -> None:
        self.w.sync()
        self.durable_upto = len(self.acked)

    def close(self) -> None:
        self.w.close()
        self.fs.on_op = None


def workload_commit(drv: Driver) -> None:
    drv.write(b"r0", 100)
    drv.write_many([b"r1", b"r2", b"r3"], 101)
    for i in range(4, 8):  # 4 KiB files: these roll by size (the files keep the first file's end, 110)
        drv.write(b"r%d|" % i + b"s" * 1200, 102 + i * 0.1)
    drv.write(b"r8", 111)  # past 110: rolls by time
    drv.clean(110.5)  # the files ending at 110 go
    drv.write_many([b"r9", b"r10"], 125)  # rolls by time again
    drv.close()


def workload_interval(drv: Driver) -> None:
    drv.write(b"r0", 100)
    drv.write_many([b"r1", b"r2"], 101)
    drv.sync()
    for i in range(3, 6):
        drv.write(b"r%d|" % i + b"s" * 1500, 102)
    drv.write(b"r6", 130)
    drv.sync()
    drv.write(b"r7", 131)
    drv.close()


def check(snap: Snap, got: list[bytes], handles_ok: Callable[[RecordHandle, bytes], bool], interval: bool) -> None:
    assert len(got) == len(set(got)), f"duplicates after {snap.op}: {got}"
    seq = list(snap.acked) + list(snap.inflight)
    order = {r.data: i for i, r in enumerate(seq)}
    assert all(x in order for x in got), f"unknown records after {snap.op}: {got}"
    idx = [order[x] for x in got]
    assert idx == sorted(idx), f"out of order after {snap.op}: {got}"

    def cleanable(r: Rec) -> bool:
        return snap.clean_from is not None and r.time < snap.clean_from

    present = set(got)
    inflight = [r.data in present for r in snap.inflight]
    assert all(inflight) or not any(inflight), f"write in flight partly there after {snap.op}: {got}"
    if interval:
        keep = [r.data for r in seq if not cleanable(r)]
        got_keep = [x for x in got if x in set(keep)]
        assert got_keep == keep[: len(got_keep)], f"not a prefix after {snap.op}: {got}"
        must = [r.data for r in snap.acked[: snap.durable_upto] if not cleanable(r)]
        assert all(x in present for x in must), f"synced records lost after {snap.op}: {got}"
    else:
        for r in snap.acked:
            if not cleanable(r):
                assert r.data in present, f"acknowledged {r.data!r} lost after {snap.op}: {got}"
                assert r.handle is not None
                assert handles_ok(r.handle, r.data), f"handle of {r.data!r} does not read back after {snap.op}"


@pytest.mark.parametrize(
    ("name", "workload", "opts"),
    [
        ("commit", workload_commit, {"rolling_interval": 10, "max_file_size": 4096}),
        ("interval", workload_interval, {"rolling_interval": 10, "max_file_size": 4096, "fsync": "interval"}),
        ("encrypted", workload_commit, {"rolling_interval": 10, "max_file_size": 4096, "encryption": "k"}),
    ],
)
def test_power_cut_at_every_persistence_point(
    name: str, workload: Callable[[Driver], None], opts: dict[str, object]
) -> None:
    if opts.get("encryption") is not None:
        pytest.importorskip("cryptography", reason="the crypto extra is not installed")
        from filechannel.crypto import Encryption

        opts = {**opts, "encryption": Encryption(keys={"k": bytes(range(32))})}
    drv = Driver(SimFS(), opts)
    workload(drv)
    assert drv.w.stats()["files_retired"] > 0 or name == "interval"
    if name == "encrypted":  # no record reached a file in plaintext
        assert all(b"s" * 64 not in data for data in drv.fs.files().values())
    interval = opts.get("fsync") == "interval"
    seen: dict[tuple[object, ...], list[bytes]] = {}
    for snap in drv.snaps:
        TOTALS["snapshots"] += 1
        for mode, seed in VARIANTS:
            crashed = snap.fs.crash(seed, mode)
            key = tuple(sorted(crashed.files().items()))
            if key in seen:
                continue
            TOTALS["distinct"] += 1
            pristine = crashed.snapshot()
            TOTALS["recoveries"] += 1
            with filechannel.WriteAheadLog(D, fs=crashed, **opts) as w:  # type: ignore[arg-type]
                got = list(w.read_all())

                def handle_ok(h: RecordHandle, data: bytes, w: filechannel.WriteAheadLog = w) -> bool:
                    return w.read(h) == data

                check(snap, got, handle_ok, interval)
                h = w.write(b"after", time=200)
                assert w.read(h) == b"after"
            seen[key] = got
            # Recovery is repeatable: the same crash state recovers to the same records.
            with filechannel.WriteAheadLog(D, fs=pristine, **opts) as w2:  # type: ignore[arg-type]
                assert list(w2.read_all()) == got
            with filechannel.WriteAheadLog(D, fs=crashed, **opts) as w3:  # type: ignore[arg-type]
                assert list(w3.read_all()) == [*got, b"after"]
    assert len(drv.snaps) > 30
    assert len(seen) > 30


def test_zz_report_totals() -> None:
    print(f"\nWAL crash states: {TOTALS}")
    assert TOTALS["recoveries"] == 0 or TOTALS["distinct"] > 0


# --------------------------------------------------------------------------
# SIGKILL of a writing process

_CHILD = r"""
import os, random, sys
import filechannel

d, run = sys.argv[1], int(sys.argv[2])
w = filechannel.WriteAheadLog(d, rolling_interval=0.5, max_file_size=16 * 1024)
rng = random.Random(run)
i = 0
while True:
    t = (10 - run) * 1000 + i * 0.01  # later runs write older times: a clean never reaches an earlier run
    if rng.random() < 0.3:
        k = rng.randint(2, 6)
        w.write_many([b"%d:%d|" % (run, i + j) + b"x" * rng.randint(0, 400) for j in range(k)], time=t)
    else:
        k = 1
        w.write(b"%d:%d|" % (run, i) + b"x" * rng.randint(0, 400), time=t)
    i += k
    os.write(1, b"%d\n" % i)  # records below i are acknowledged
    if run % 2 and i > 50 and rng.random() < 0.05:
        w.clean(t - 0.2, wait_for_completion=rng.random() < 0.5)
"""


def test_read_all_after_sigkill_of_a_writer(tmp_path: Path) -> None:
    d = str(tmp_path / "wal")
    rng = random.Random(11)
    acked: dict[int, int] = {}
    cleaned_runs: set[int] = set()
    for run in range(4):
        proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, d, str(run)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        assert proc.stdout is not None
        deadline = time.monotonic() + 30
        n = 0
        target = rng.randint(30, 300)
        while n < target and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            n = int(line)
        time.sleep(rng.random() * 0.05)
        proc.send_signal(signal.SIGKILL)
        out, err = proc.communicate()
        for line in out.split():
            n = max(n, int(line))
        assert n > 0, err.decode()
        acked[run] = n
        if run % 2:
            cleaned_runs.add(run)
        with filechannel.WriteAheadLog(d) as w:
            got = [x.split(b"|")[0].decode() for x in w.read_all()]
        labels = [(int(a), int(b)) for a, b in (x.split(":") for x in got)]
        assert labels == sorted(labels), "records out of write order"
        assert len(labels) == len(set(labels)), "a record came back twice"
        for r in range(run + 1):
            mine = [i for rr, i in labels if rr == r]
            if r in cleaned_runs:
                # clean(t - 0.2) may drop a prefix of the run that cleans, never a record after it.
                assert mine, f"run {r}: everything gone, even its file being written"
                assert mine == list(range(mine[0], mine[0] + len(mine)))
                assert mine[-1] + 1 >= acked[r], f"run {r}: acknowledged records lost"
            else:
                # Every acknowledged record is there once; beyond it, at most the write in flight.
                assert mine[: acked[r]] == list(range(acked[r])), f"run {r}: acknowledged records lost"
                assert mine == list(range(len(mine)))
    assert os.path.exists(os.path.join(d, "WAL"))
