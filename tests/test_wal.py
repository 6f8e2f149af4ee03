"""WriteAheadLog: round trips, handles, rolling and cleaning by time, threads, faults, damage.

Crash coverage lives in ``test_wal_crash.py`` (simulated power cuts at every
persistence point, and SIGKILL of a writing process).
"""

from __future__ import annotations

import errno
import os
import pickle
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from simfs import SimFS

import filechannel
from filechannel import format as fmt
from filechannel.cli import main as cli_main
from filechannel.wal import RecordHandle, dump_wal, verify_wal


def wal_dir(tmp_path: Path) -> str:
    return str(tmp_path / "wal")


def seg_files(d: str) -> list[str]:
    data = os.path.join(d, "data")
    return sorted(n for n in os.listdir(data) if n.startswith("seg-"))


# --------------------------------------------------------------------------
# round trips and handles


def test_round_trip_write_read_read_all(tmp_path: Path) -> None:
    d = wal_dir(tmp_path)
    with filechannel.WriteAheadLog(d) as w:
        h1 = w.write(b"first")
        hs = w.write_many([b"a", bytearray(b"bb"), memoryview(b"ccc")])
        h2 = w.write(b"")
        assert w.read(h1) == b"first"
        assert [w.read(h) for h in hs] == [b"a", b"bb", b"ccc"]
        assert w.read(h2) == b""
        assert list(w.read_all()) == [b"first", b"a", b"bb", b"ccc", b""]
        assert w.write_many([]) == []
    assert all(isinstance(h, RecordHandle) for h in [h1, h2, *hs])
    assert len({h.woid for h in [h1, h2, *hs]}) == 5


def test_write_many_costs_one_fsync(tmp_path: Path) -> None:
    with filechannel.WriteAheadLog(wal_dir(tmp_path)) as w:
        w.write(b"warm-up")  # the first write also creates the first file
        before = w.stats()["fsyncs"]
        w.write_many([b"x" * 100] * 50)
        assert w.stats()["fsyncs"] == before + 1
        before = w.stats()["fsyncs"]
        for _ in range(3):
            w.write(b"y")
        assert w.stats()["fsyncs"] == before + 3


def test_handles_survive_restart_and_pickling(tmp_path: Path) -> None:
    d = wal_dir(tmp_path)
    with filechannel.WriteAheadLog(d, max_file_size=8192) as w:
        handles = [w.write(b"record %d " % i + b"z" * (i * 37 % 500)) for i in range(60)]
    assert len(seg_files(d)) > 2  # rolled by size: handles point into several files
    blobs = [pickle.dumps(h) for h in handles]
    with filechannel.WriteAheadLog(d, max_file_size=8192) as w:
        for i, blob in enumerate(blobs):
            h = pickle.loads(blob)
            assert h == handles[i]
            assert hash(h) == hash(handles[i])
            assert w.read(h) == b"record %d " % i + b"z" * (i * 37 % 500)
        assert len(list(w.read_all())) == 60
        h_new = w.write(b"after restart")
        assert w.read(h_new) == b"after restart"
        assert h_new.file_id > max(h.file_id for h in handles)  # a restart never appends to an old file


def test_handle_is_frozen(tmp_path: Path) -> None:
    with filechannel.WriteAheadLog(wal_dir(tmp_path)) as w:
        h = w.write(b"x", time=5.0)
    assert h.time == 5.0
    with pytest.raises(AttributeError):
        h.offset = 0  # type: ignore[misc]


# --------------------------------------------------------------------------
# rolling by time and size, cleaning


def test_files_roll_by_record_time_spark_rule(tmp_path: Path) -> None:
    d = wal_dir(tmp_path)
    with filechannel.WriteAheadLog(d, rolling_interval=10) as w:
        a = w.write(b"a", time=100)  # file 1 covers up to 110
        b = w.write(b"b", time=110)  # not past the end: same file
        c = w.write(b"c", time=95)  # earlier times go to the current file too (as in Spark)
        e = w.write(b"e", time=110.5)  # past the end: a new file, covering up to 120.5
        f = w.write(b"f", time=120)
    assert a.file_id == b.file_id == c.file_id
    assert e.file_id == f.file_id == a.file_id + 1
    spans = [(r["file"], r["time"], r["end"]) for r in dump_wal(d) if r["kind"] == "span"]
    assert spans == [(a.file_id, 100.0, 110.0), (e.file_id, 110.5, 120.5)]


def test_size_roll_keeps_the_time_bound(tmp_path: Path) -> None:
    d = wal_dir(tmp_path)
    with filechannel.WriteAheadLog(d, rolling_interval=1000, max_file_size=4096) as w:
        hs = [w.write(b"r" * 300, time=50 + i) for i in range(30)]
    assert len({h.file_id for h in hs}) > 2
    spans = [r for r in dump_wal(d) if r["kind"] == "span"]
    assert {s["end"] for s in spans} == {1050.0}  # files rolled for size keep the first file's end
    rep = verify_wal(d)
    assert rep.ok
    assert rep.records == 30


def test_clean_never_deletes_a_newer_record(tmp_path: Path) -> None:
    rng = random.Random(7)
    d = wal_dir(tmp_path)
    with filechannel.WriteAheadLog(d, rolling_interval=5, max_file_size=4096) as w:
        written: list[tuple[float, bytes, RecordHandle]] = []
        t = 1000.0
        for i in range(400):
            t += rng.random()
            tt = t - rng.random() * 8  # out of order times too
            data = b"%d:" % i + b"q" * rng.randint(0, 200)
            written.append((tt, data, w.write(data, time=tt)))
        files_before = w.stats()["files"]
        thresh = 1000.0 + 120
        w.clean(thresh, wait_for_completion=True)
        assert w.stats()["files"] < files_before  # something was deleted
        left = list(w.read_all())
        newer = [data for tt, data, _ in written if tt >= thresh]
        it = iter(left)
        assert all(x in it for x in newer)  # every newer record is there, in write order
        assert len(left) < len(written)
        order = {data: i for i, (_, data, _) in enumerate(written)}
        assert [order[x] for x in left] == sorted(order[x] for x in left)
        for tt, data, h in written:
            if tt >= thresh:
                assert w.read(h) == data
        cleaned = [h for tt, data, h in written if data not in set(left)]
        assert cleaned
        assert all(tt < thresh for tt, _, h in written if h in cleaned)
        with pytest.raises(filechannel.InvalidHandleError, match="clean"):
            w.read(cleaned[0])
    with filechannel.WriteAheadLog(d, rolling_interval=5) as w:
        assert list(w.read_all()) == left  # the deletion is durable and recovery agrees


def test_clean_keeps_the_file_being_written(tmp_path: Path) -> None:
    with filechannel.WriteAheadLog(wal_dir(tmp_path), rolling_interval=5) as w:
        w.write(b"old", time=10)
        w.clean(1e6, wait_for_completion=True)
        assert list(w.read_all()) == [b"old"]  # its file is still being written
        w.write(b"new", time=100)
        w.clean(50, wait_for_completion=True)
        assert list(w.read_all()) == [b"new"]


def test_clean_keeps_a_file_whose_span_ends_exactly_at_the_threshold(tmp_path: Path) -> None:
    # clean(t) keeps every record with time >= t: a file whose span ends at t may hold one.
    d = wal_dir(tmp_path)
    with filechannel.WriteAheadLog(d, rolling_interval=5) as w:
        w.write(b"at 10", time=10)  # the file's span is [10, 15]
        edge = w.write(b"at 15", time=15)  # not past the end: same file
        later = w.write(b"at 100", time=100)  # a new file
        assert edge.file_id != later.file_id
        w.clean(15, wait_for_completion=True)
        assert list(w.read_all()) == [b"at 10", b"at 15", b"at 100"]
        assert w.read(edge) == b"at 15"
        w.clean(15.000000001, wait_for_completion=True)  # now every record in it is older
        assert list(w.read_all()) == [b"at 100"]


def test_clean_refuses_a_threshold_in_milliseconds(tmp_path: Path) -> None:
    d = wal_dir(tmp_path)
    now = time.time()
    with filechannel.WriteAheadLog(d, rolling_interval=5) as w:
        w.write(b"an hour ago", time=now - 3600)
        w.write(b"now", time=now)  # a second file: the first one could be deleted
        for wait in (True, False):
            with pytest.raises(ValueError, match=r"seconds.*milliseconds"):
                w.clean(now * 1000, wait_for_completion=wait)  # what a Spark user passes
        w.close()  # waits for any background clean
    with filechannel.WriteAheadLog(d, rolling_interval=5) as w:
        assert list(w.read_all()) == [b"an hour ago", b"now"]  # nothing was deleted
        w.clean(now - 1, wait_for_completion=True)
        assert list(w.read_all()) == [b"now"]
        w.clean(now + 3600, wait_for_completion=True)  # within a day of now: a real threshold
        assert list(w.read_all()) == []


def test_clean_takes_a_threshold_after_records_written_in_the_future(tmp_path: Path) -> None:
    # A day past now is refused only when it is also a day past every record's time.
    with filechannel.WriteAheadLog(wal_dir(tmp_path), rolling_interval=5) as w:
        w.write(b"far", time=9e9)
        w.write(b"farther", time=9e9 + 100)
        w.clean(9e9 + 50, wait_for_completion=True)
        assert list(w.read_all()) == [b"farther"]
        with pytest.raises(ValueError, match="milliseconds"):
            w.clean(9e9 + 200 + 86_400, wait_for_completion=True)


def test_clean_in_background_while_writing(tmp_path: Path) -> None:
    d = wal_dir(tmp_path)
    handles: list[tuple[float, bytes, RecordHandle]] = []
    lock = threading.Lock()
    stop = threading.Event()
    with filechannel.WriteAheadLog(d, rolling_interval=1, max_file_size=4096) as w:

        def writer(k: int) -> None:
            i = 0
            while not stop.is_set():
                with lock:
                    t = 100.0 + len(handles) * 0.05
                data = b"%d.%d" % (k, i)
                h = w.write(data, time=t)
                with lock:
                    handles.append((t, data, h))
                i += 1

        threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
        for th in threads:
            th.start()
        threshes = []
        while len(handles) < 600:
            with lock:
                t_now = 100.0 + len(handles) * 0.05
            threshes.append(t_now - 3)
            w.clean(t_now - 3)  # background, not waited for
        stop.set()
        for th in threads:
            th.join()
        w.clean(max(threshes), wait_for_completion=True)
        left = set(w.read_all())
        thresh = max(threshes)
        for t, data, h in handles:
            if t >= thresh:
                assert data in left
                assert w.read(h) == data
        assert w.stats()["files_retired"] > 0
    rep = verify_wal(d)
    assert rep.ok, rep.problems


# --------------------------------------------------------------------------
# threads


def test_concurrent_writers_share_fsyncs(tmp_path: Path) -> None:
    d = wal_dir(tmp_path)
    n_threads, per = 16, 60
    out: dict[int, list[RecordHandle]] = {}
    with filechannel.WriteAheadLog(d, max_file_size=16384) as w:

        def run(k: int) -> None:
            out[k] = [w.write(b"%02d-%03d" % (k, i)) for i in range(per)]

        threads = [threading.Thread(target=run, args=(k,)) for k in range(n_threads)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        everything = list(w.read_all())
        for k, hs in out.items():
            assert [w.read(h) for h in hs] == [b"%02d-%03d" % (k, i) for i in range(per)]
        fsyncs = w.stats()["fsyncs"]
    assert sorted(everything) == sorted(b"%02d-%03d" % (k, i) for k in range(n_threads) for i in range(per))
    for k in range(n_threads):  # each thread's records in the order it wrote them
        mine = [x for x in everything if x.startswith(b"%02d-" % k)]
        assert mine == sorted(mine)
    woids = sorted(h.woid for hs in out.values() for h in hs)
    assert [w2 for w2 in woids] == sorted(set(woids))
    assert fsyncs > 0


# --------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize(
    ("kwargs", "option"),
    [
        ({"rolling_interval": 0}, "rolling_interval"),
        ({"rolling_interval": -1.0}, "rolling_interval"),
        ({"rolling_interval": float("nan")}, "rolling_interval"),
        ({"rolling_interval": "60"}, "rolling_interval"),
        ({"rolling_interval": True}, "rolling_interval"),
        ({"fsync": "never"}, "fsync"),
        ({"fsync_interval": 0}, "fsync_interval"),
        ({"max_file_size": 100}, "max_file_size"),
        ({"max_file_size": "big"}, "max_file_size"),
        ({"encryption": "some key"}, "encryption"),
        ({"on_corruption": "ignore"}, "on_corruption"),
    ],
)
def test_bad_options_name_the_option(tmp_path: Path, kwargs: dict[str, object], option: str) -> None:
    with pytest.raises(filechannel.ConfigError) as info:
        filechannel.WriteAheadLog(wal_dir(tmp_path), **kwargs)  # type: ignore[arg-type]
    assert info.value.option == option
    assert not os.path.exists(wal_dir(tmp_path))  # nothing created


def test_bad_records_and_times(tmp_path: Path) -> None:
    with filechannel.WriteAheadLog(wal_dir(tmp_path), max_file_size=8192) as w:
        with pytest.raises(TypeError, match="bytes-like"):
            w.write("text")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="sequence of records"):
            w.write_many(b"abc")
        with pytest.raises(TypeError, match="bytes-like"):
            w.write_many([b"ok", 3])  # type: ignore[list-item]
        for bad in ("now", float("inf"), float("nan"), True):
            with pytest.raises(TypeError, match="seconds"):
                w.write(b"x", time=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="out of range"):
            w.write(b"x", time=1e12)
        w2 = w.write(b"far", time=9e9)  # the file's end is capped at the largest time
        assert w.read(w2) == b"far"
        with pytest.raises(filechannel.EventTooLargeError) as info:
            w.write(b"x" * 8192)
        assert info.value.limit < 8192
        assert list(w.read_all()) == [b"far"]  # nothing of the refused writes was written
        with pytest.raises(TypeError, match="thresh_time"):
            w.clean("yesterday")  # type: ignore[arg-type]


def test_bad_handles(tmp_path: Path) -> None:
    with filechannel.WriteAheadLog(str(tmp_path / "other")) as other:
        foreign = other.write(b"elsewhere")
    with filechannel.WriteAheadLog(wal_dir(tmp_path)) as w:
        h = w.write(b"mine")
        h2 = w.write(b"other record")
        with pytest.raises(TypeError):
            w.read((h.file_id, h.offset))  # type: ignore[arg-type]
        with pytest.raises(filechannel.InvalidHandleError, match="another write-ahead log"):
            w.read(foreign)
        for bad in (
            RecordHandle(h.log_id, h.file_id, h.offset + 3, h.length, h.woid, h.time),
            RecordHandle(h.log_id, h.file_id, 0, h.length, h.woid, h.time),
            RecordHandle(h.log_id, h.file_id, h.offset, 8, h.woid, h.time),
        ):
            with pytest.raises(filechannel.InvalidHandleError, match="cannot describe"):
                w.read(bad)
        with pytest.raises(filechannel.InvalidHandleError, match="no data file"):
            w.read(RecordHandle(h.log_id, 999, h.offset, h.length, h.woid, h.time))
        # Fields that fit a record but not this one: never the wrong bytes, and no advice to
        # repair a log that is fine (issue 27: an InvalidHandleError, not a CorruptLogError).
        for bad, why in (
            (RecordHandle(h.log_id, h.file_id, h.offset, h.length, h2.woid, h.time), "write-order id"),
            (RecordHandle(h.log_id, h.file_id, h2.offset, h.length, h.woid, h.time), "bytes long"),
            (RecordHandle(h.log_id, h.file_id, h.offset + 4096, h.length, h.woid, h.time), "past the end"),
        ):
            with pytest.raises(filechannel.InvalidHandleError, match=why) as info:
                w.read(bad)
            assert not isinstance(info.value, filechannel.CorruptLogError)
        assert w.read(h) == b"mine"
    with pytest.raises(filechannel.ChannelClosedError):
        w.read(h)
    with pytest.raises(filechannel.ChannelClosedError):
        w.write(b"late")


def test_channel_and_wal_refuse_each_other(tmp_path: Path) -> None:
    ch_dir = str(tmp_path / "ch")
    with filechannel.open(ch_dir, minimum_required_space=0) as ch, ch.transaction() as tx:
        tx.put(b"event")
    with pytest.raises(filechannel.NotAChannelError, match=r"filechannel\.open"):
        filechannel.WriteAheadLog(ch_dir)
    d = wal_dir(tmp_path)
    filechannel.WriteAheadLog(d).close()
    with pytest.raises(filechannel.NotAChannelError, match="WriteAheadLog"):
        filechannel.open(d)
    with pytest.raises(filechannel.NotAChannelError, match="WriteAheadLog"):
        filechannel.ChannelReader(d).available()
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(filechannel.NotAChannelError):
        filechannel.WriteAheadLog(str(f))


def test_second_open_is_locked(tmp_path: Path) -> None:
    d = wal_dir(tmp_path)
    with filechannel.WriteAheadLog(d) as w:
        w.write(b"x")
        with pytest.raises(filechannel.ChannelLockedError):
            filechannel.WriteAheadLog(d)
        code = (
            "import filechannel, sys\n"
            "try:\n    filechannel.WriteAheadLog(sys.argv[1])\n"
            "except filechannel.ChannelLockedError:\n    sys.exit(3)\n"
        )
        r = subprocess.run([sys.executable, "-c", code, d], check=False, timeout=60)
        assert r.returncode == 3
    filechannel.WriteAheadLog(d).close()  # free again once closed


# --------------------------------------------------------------------------
# failed writes and fsyncs (SimFS)


def test_failed_fsync_fails_the_log(tmp_path: Path) -> None:
    fs = SimFS()
    d = "/sim/wal"
    w = filechannel.WriteAheadLog(d, fs=fs)
    ok = w.write(b"durable")
    fs.inject("fdatasync", 1, errno.EIO)
    with pytest.raises(OSError) as info:
        w.write(b"not acknowledged")
    assert info.value.errno == errno.EIO
    n = fs.count("fdatasync")
    for call in (lambda: w.write(b"again"), lambda: w.write_many([b"a"]), w.sync):
        with pytest.raises(filechannel.ChannelClosedError, match="reopen"):
            call()
    assert fs.count("fdatasync") == n  # never fsynced again as if the data were safe
    assert w.read(ok) == b"durable"  # reads still work
    w.close()
    with filechannel.WriteAheadLog(d, fs=fs.crash(0, "drop")) as w2:
        assert list(w2.read_all()) == [b"durable"]


def test_failed_write_surfaces_and_log_goes_on_after_enospc(tmp_path: Path) -> None:
    fs = SimFS()
    d = "/sim/wal"
    with filechannel.WriteAheadLog(d, fs=fs) as w:
        w.write(b"one")
        fs.inject("pwrite_all", 1, errno.ENOSPC, short=10, path="seg-")
        with pytest.raises(OSError) as info:
            w.write(b"two" * 50)
        assert info.value.errno == errno.ENOSPC
        w.write(b"three")
        assert list(w.read_all()) == [b"one", b"three"]
        fs.inject("pwrite_all", 1, errno.EIO, path="seg-")
        with pytest.raises(OSError):
            w.write(b"four")
        with pytest.raises(filechannel.ChannelClosedError):
            w.write(b"five")
    with filechannel.WriteAheadLog(d, fs=fs.crash(0, "drop")) as w:
        assert list(w.read_all()) == [b"one", b"three"]


def test_minimum_required_space_refuses_writes_and_writes_nothing(tmp_path: Path) -> None:
    d = str(tmp_path / "wal")
    with filechannel.WriteAheadLog(d) as w:
        w.write(b"one")
    with filechannel.WriteAheadLog(d, minimum_required_space=1 << 62) as w:
        with pytest.raises(filechannel.DiskSpaceError) as info:
            w.write_many([b"two", b"three"])
        assert isinstance(info.value, filechannel.ChannelError)
        assert list(w.read_all()) == [b"one"]  # nothing of the refused write, and reads still work
    with filechannel.WriteAheadLog(d, minimum_required_space=1) as w:
        w.write(b"four")
        assert list(w.read_all()) == [b"one", b"four"]
    with pytest.raises(filechannel.ConfigError, match="minimum_required_space"):
        filechannel.WriteAheadLog(d, minimum_required_space=-1)


def test_interval_mode_syncs_in_background(tmp_path: Path) -> None:
    fs = SimFS()
    d = "/sim/wal"
    with filechannel.WriteAheadLog(d, fs=fs, fsync="interval", fsync_interval=0.05) as w:
        w.write(b"a")
        n = fs.count("fdatasync")
        hs = w.write_many([b"b", b"c"])
        assert fs.count("fdatasync") == n  # not synced by the write itself
        w.sync()
        crashed = fs.crash(0, "drop")
        assert [w.read(h) for h in hs] == [b"b", b"c"]
    with filechannel.WriteAheadLog(d, fs=crashed) as w:
        assert list(w.read_all()) == [b"a", b"b", b"c"]


# --------------------------------------------------------------------------
# damage


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def _records(d: str) -> list[dict[str, object]]:
    return [r for r in dump_wal(d) if r["kind"] == "record"]


def test_flipped_byte_in_a_sealed_file(tmp_path: Path) -> None:
    d = wal_dir(tmp_path)
    with filechannel.WriteAheadLog(d, max_file_size=4096) as w:
        hs = [w.write(b"rec%03d" % i + b"." * 200) for i in range(40)]
    victim = hs[3]
    path = os.path.join(d, "data", f"seg-{victim.file_id:016x}.wal")
    _flip(path, victim.offset + 40)  # inside the record's payload
    with pytest.raises(filechannel.CorruptLogError) as info:
        filechannel.WriteAheadLog(d, max_file_size=4096)
    assert info.value.path == path
    rep = verify_wal(d)
    assert not rep.ok
    assert any(path in p for p in rep.problems)
    with filechannel.WriteAheadLog(d, max_file_size=4096, on_corruption="skip") as w:
        got = list(w.read_all())
        assert got == [b"rec%03d" % i + b"." * 200 for i in range(40) if i != 3]  # exactly the damaged one is gone
        assert w.corruption
        assert any(path in c.path for c in w.corruption)
        with pytest.raises(filechannel.CorruptLogError):
            w.read(victim)
        assert w.read(hs[4]) == b"rec004" + b"." * 200
    assert cli_main(["wal", "verify", d]) == 1


def test_damage_after_open_is_caught_by_read_and_read_all(tmp_path: Path) -> None:
    d = wal_dir(tmp_path)
    with filechannel.WriteAheadLog(d) as w:
        hs = w.write_many([b"alpha" * 10, b"beta" * 10, b"gamma" * 10])
        path = os.path.join(d, "data", f"seg-{hs[1].file_id:016x}.wal")
        _flip(path, hs[1].offset + 50)
        assert w.read(hs[0]) == b"alpha" * 10
        with pytest.raises(filechannel.CorruptLogError, match="checksum"):
            w.read(hs[1])
        with pytest.raises(filechannel.CorruptLogError):
            list(w.read_all())


def test_truncated_sealed_file_is_corruption(tmp_path: Path) -> None:
    d = wal_dir(tmp_path)
    with filechannel.WriteAheadLog(d, max_file_size=4096) as w:
        hs = [w.write(b"x" * 300) for _ in range(30)]
    first = os.path.join(d, "data", f"seg-{hs[0].file_id:016x}.wal")
    size = os.path.getsize(first)
    os.truncate(first, size - 100)
    with pytest.raises(filechannel.CorruptLogError, match="sealed"):
        filechannel.WriteAheadLog(d, max_file_size=4096)
    assert cli_main(["wal", "verify", d]) == 1


def test_torn_tail_of_the_newest_file_is_cut_as_in_the_channel(tmp_path: Path) -> None:
    d = wal_dir(tmp_path)
    crashed = str(tmp_path / "crashed")
    with filechannel.WriteAheadLog(d) as w:
        w.write(b"kept")
        h = w.write(b"torn" * 100)
        shutil.copytree(d, crashed)  # the directory as a crash leaves it: no close, no checkpoint
    path = os.path.join(crashed, "data", f"seg-{h.file_id:016x}.wal")
    os.truncate(path, h.offset + 100)  # the last write, cut short (never acknowledged after a real crash)
    rep = verify_wal(crashed)
    assert rep.ok
    assert rep.notes
    assert "torn tail" in rep.notes[0]
    with filechannel.WriteAheadLog(crashed) as w:
        assert list(w.read_all()) == [b"kept"]
        assert w.stats()["torn_tails_truncated"] == 1
        with pytest.raises(filechannel.CorruptLogError):
            w.read(h)
        w.write(b"after")
        assert list(w.read_all()) == [b"kept", b"after"]


def test_after_a_clean_close_a_cut_last_write_is_loss_not_a_torn_tail(tmp_path: Path) -> None:
    d = wal_dir(tmp_path)
    with filechannel.WriteAheadLog(d) as w:
        w.write(b"kept")
        h = w.write(b"acknowledged" * 10)
    path = os.path.join(d, "data", f"seg-{h.file_id:016x}.wal")
    os.truncate(path, h.offset + 100)
    with pytest.raises(filechannel.CorruptLogError, match="shorter than the checkpoint"):
        filechannel.WriteAheadLog(d)
    rep = verify_wal(d)
    assert not rep.ok
    with filechannel.WriteAheadLog(d, on_corruption="skip") as w:
        assert list(w.read_all()) == [b"kept"]
        assert w.corruption


def test_a_record_salvaged_in_skip_mode_is_never_cut_by_a_later_open(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Issue 23: the last byte of a closed log is cut; skip mode salvages the last write
    # (its PUT and COMMIT verify, its BATCH_END does not) and returns it. Closing that
    # open must not turn the salvaged bytes into a "torn tail" that the next open cuts.
    d = wal_dir(tmp_path)
    with filechannel.WriteAheadLog(d) as w:
        hs = [w.write(b"record %d" % i) for i in range(3)]
    path = os.path.join(d, "data", f"seg-{hs[0].file_id:016x}.wal")
    os.truncate(path, os.path.getsize(path) - 1)
    for _ in range(2):  # a second skip open and close changes nothing either
        with filechannel.WriteAheadLog(d, on_corruption="skip") as w:
            assert list(w.read_all()) == [b"record 0", b"record 1", b"record 2"]
            assert w.read(hs[2]) == b"record 2"
            assert w.corruption
        rep = verify_wal(d)
        assert not rep.ok  # the damage is still there: a problem, not a torn tail
        assert not any("torn tail" in n for n in rep.notes), rep.notes
    caplog.clear()
    with pytest.raises(filechannel.CorruptLogError, match="checkpoint recorded as written"):
        filechannel.WriteAheadLog(d)  # the default open refuses, as before the skip open
    assert "torn tail" not in caplog.text
    assert not [n for n in os.listdir(os.path.dirname(path)) if "torn" in n]  # no copy set aside
    with filechannel.WriteAheadLog(d, on_corruption="skip") as w:
        assert list(w.read_all()) == [b"record 0", b"record 1", b"record 2"]


def test_verify_states_a_torn_tail_by_its_size(tmp_path: Path) -> None:
    d = wal_dir(tmp_path)
    crashed = str(tmp_path / "crashed")
    with filechannel.WriteAheadLog(d) as w:
        w.write(b"kept")
        h = w.write(b"torn" * 100)
        shutil.copytree(d, crashed)  # no close: no checkpoint vouches for the last write
    path = os.path.join(crashed, "data", f"seg-{h.file_id:016x}.wal")
    os.truncate(path, h.offset + 100)
    rep = verify_wal(crashed)
    assert rep.notes == [f"{path}: torn tail of {100} bytes from byte {h.offset} (never acknowledged)"]


def test_a_record_of_the_wrong_kind_is_never_returned(tmp_path: Path) -> None:
    d = wal_dir(tmp_path)
    with filechannel.WriteAheadLog(d) as w:
        h = w.write(b"data", time=10)
        span = next(r for r in dump_wal_open(w) if r.kind == fmt.WAL_SPAN)
        with pytest.raises(filechannel.CorruptLogError, match="not a data record"):
            w.read(RecordHandle(h.log_id, h.file_id, span.offset, span.length, span.woid, 10.0))


def dump_wal_open(w: filechannel.WriteAheadLog) -> list[object]:
    from filechannel.walread import ScanContext, entries

    log = w._log
    ctx = ScanContext(log.channel_id, log.crc_kind, log.max_payload, log.config)
    return list(entries(log, ctx, w._snapshot()))


# --------------------------------------------------------------------------
# the command line


def test_cli_wal_dump_and_verify(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = wal_dir(tmp_path)
    with filechannel.WriteAheadLog(d, rolling_interval=10) as w:
        w.write(b"hello", time=100)
        w.write_many([b"\xff\x00", b"x"], time=111)
    assert cli_main(["wal", "dump", d, "--data"]) == 0
    lines = capsys.readouterr().out.splitlines()
    import json

    recs = [json.loads(x) for x in lines]
    assert [r["kind"] for r in recs] == ["span", "record", "span", "record", "record"]
    assert [(r["data"], r["data_encoding"]) for r in recs if r["kind"] == "record"] == [
        ("hello", "utf-8"),
        ("/wA=", "base64"),
        ("x", "utf-8"),
    ]
    assert recs[0]["end"] == 110.0
    assert recs[2]["time"] == 111.0
    assert cli_main(["wal", "verify", d]) == 0
    assert "ok, 3 records" in capsys.readouterr().out
    assert cli_main(["wal", "verify", str(tmp_path / "nope")]) == 2
    assert "no such write-ahead log directory" in capsys.readouterr().err
    assert cli_main(["verify", d]) == 2
    assert "filechannel wal verify" in capsys.readouterr().err  # the verb that reads a write-ahead log


def test_readme_example_runs(tmp_path: Path) -> None:
    import contextlib
    import io
    import re

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    section = readme.split("## A plain write-ahead log", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(\w*)\n(.*?)```", section, flags=re.S)
    code = next(b for lang, b in blocks if lang == "python").replace("/var/lib/myapp/wal", str(tmp_path / "wal"))
    expected = next(b for lang, b in blocks if lang == "").splitlines()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
    assert out.getvalue().splitlines() == expected


@pytest.mark.parametrize(
    "stride", [pytest.param(1, marks=pytest.mark.slow, id="every-byte"), pytest.param(7, id="every-7th-byte")]
)
def test_flipped_bytes_are_caught_never_wrong_bytes(tmp_path: Path, stride: int) -> None:
    """Flip each byte (or each ``stride``-th) of every data file of a small log: never an altered record.

    The log was closed cleanly (its checkpoint vouches for every file's length),
    so with ``on_corruption="fail"`` an open raises ``CorruptLogError`` or gives
    every record unchanged (a flip in padding the checksums do not cover); with
    ``"skip"`` the records are a subsequence of the originals. Every handle reads
    back its own bytes or raises.
    """
    src = str(tmp_path / "src")
    records = [b"rec-%02d|" % i + bytes([65 + i]) * (i * 13 % 90) for i in range(12)]
    handles: list[RecordHandle] = []
    with filechannel.WriteAheadLog(src, rolling_interval=10, max_file_size=4096) as w:
        for i, r in enumerate(records[:6]):
            handles.append(w.write(r, time=100 + i))
        handles += w.write_many(records[6:9], time=112)  # a new file, by time
        for i, r in enumerate(records[9:]):
            handles.append(w.write(r, time=113 + i))
    files = seg_files(src)
    assert len(files) == 2
    checked = raised = 0
    for name in files:
        original = Path(src, "data", name).read_bytes()
        for off in range(0, len(original), stride):
            for policy in ("fail", "skip"):
                d = tmp_path / "case"
                if d.exists():
                    shutil.rmtree(d)
                shutil.copytree(src, d)
                p = d / "data" / name
                b = bytearray(original)
                b[off] ^= 0x5A
                p.write_bytes(bytes(b))
                checked += 1
                try:
                    w = filechannel.WriteAheadLog(str(d), rolling_interval=10, on_corruption=policy)
                except filechannel.CorruptLogError:
                    assert policy == "fail"
                    raised += 1
                    continue
                with w:
                    try:
                        got = list(w.read_all())
                    except filechannel.CorruptLogError:
                        assert policy == "fail"
                        raised += 1
                        continue
                    it = iter(records)
                    assert all(x in it for x in got), (name, off, policy, got)  # a subsequence, in order
                    if policy == "fail":
                        assert got == records, (name, off, got)
                    for h, r in zip(handles, records, strict=True):
                        try:
                            assert w.read(h) == r
                        except (filechannel.CorruptLogError, filechannel.InvalidHandleError):
                            pass
    assert checked > 5000 // stride
    assert raised > checked // 4
    print(f"\nflipped bytes: {checked} cases, {raised} refused")


@pytest.mark.parametrize("kind", ["channel", "wal"])
def test_skip_mode_full_replay_keeps_salvaged_records_of_the_newest_file(tmp_path: Path, kind: str) -> None:
    """Damage in a closed log's last write, skip mode, every file scanned: the intact records stay.

    (Before the fix in ``Log._recover_dir`` the newest file was cut back to its
    last verified batch, so the records salvaged from the damaged one were lost
    with it: reported, but lost although intact.)
    """
    d = str(tmp_path / kind)
    bodies = [b"alpha" * 20, b"beta" * 20, b"gamma" * 20]
    if kind == "channel":
        with filechannel.open(d, minimum_required_space=0) as ch, ch.transaction() as tx:
            tx.put_many(bodies)
    else:
        with filechannel.WriteAheadLog(d) as w:
            w.write_many(bodies)
    (f,) = [os.path.join(d, "data", n) for n in seg_files(d)]
    b = bytearray(Path(f).read_bytes())
    b[b.find(b"betabeta")] ^= 1
    Path(f).write_bytes(bytes(b))
    if kind == "channel":
        with filechannel.open(d, minimum_required_space=0, on_corruption="skip", replay="full") as ch:
            with ch.transaction() as tx:
                got = [e.body for e in tx.take_batch(10)]
            assert ch.stats()["lost_positions"] == [[1, 2]]
    else:
        with filechannel.WriteAheadLog(d, on_corruption="skip") as w:
            got = list(w.read_all())
            assert w.corruption
    assert got == [bodies[0], bodies[2]]


def test_damaged_file_header_in_skip_mode_loses_only_the_header(tmp_path: Path) -> None:
    d = wal_dir(tmp_path)
    with filechannel.WriteAheadLog(d, rolling_interval=10) as w:
        first = [w.write(b"old %d" % i, time=100) for i in range(5)]
        w.write(b"new", time=200)
    path = os.path.join(d, "data", f"seg-{first[0].file_id:016x}.wal")
    _flip(path, 20)  # inside the header's channel id: its checksum fails
    with pytest.raises(filechannel.CorruptLogError):
        filechannel.WriteAheadLog(d, rolling_interval=10)
    with filechannel.WriteAheadLog(d, rolling_interval=10, on_corruption="skip") as w:
        assert list(w.read_all()) == [b"old %d" % i for i in range(5)] + [b"new"]
        assert [w.read(h) for h in first] == [b"old %d" % i for i in range(5)]
        assert any("header" in c.reason for c in w.corruption)


def test_one_batch_of_writes_with_far_apart_times_rolls_inside_the_batch(tmp_path: Path) -> None:
    """Group commit hands the writer several writes at once: each still lands in a file whose end covers it."""
    from filechannel.wal import _NS, _WalItem

    d = wal_dir(tmp_path)
    with filechannel.WriteAheadLog(d, rolling_interval=10) as w:
        log = w._log
        items = [
            _WalItem(log.new_txn_id(), [fmt.encode_wal_payload(fmt.WAL_RECORD, t * _NS, b"t%d" % t)], t * _NS, 0)
            for t in (100, 200, 105, 300)
        ]
        writer = log._writers[0]
        with writer.io_lock:
            writer._write_batch_locked(items)  # one batch, as a leader writes concurrent commits
        assert list(w.read_all()) == [b"t100", b"t200", b"t105", b"t300"]
    rep = verify_wal(d)
    assert rep.ok, rep.problems  # verify checks every record's time against its file's end
    ends = {r["file"]: r["end"] for r in dump_wal(d) if r["kind"] == "span"}
    for r in dump_wal(d):
        if r["kind"] == "record":
            assert r["time"] <= ends[r["file"]]
    assert len(ends) == 3  # [100, 110], [200, 210] (also holding 105: not past its end), [300, 310]


def test_a_file_whose_first_write_failed_takes_the_next_records_span(tmp_path: Path) -> None:
    fs = SimFS()
    d = "/sim/wal"
    with filechannel.WriteAheadLog(d, fs=fs, rolling_interval=10) as w:
        fs.inject("pwrite_all", 2, errno.ENOSPC, path="seg-")  # the header is written, the first batch is not
        with pytest.raises(OSError):
            w.write(b"early", time=100)
        h = w.write(b"late", time=500)
        assert w.read(h) == b"late"
        w.clean(400, wait_for_completion=True)
        assert list(w.read_all()) == [b"late"]
    rep = verify_wal(d, fs=fs)
    assert rep.ok, rep.problems
    spans = [r for r in dump_wal(d, fs=fs) if r["kind"] == "span"]
    assert spans[0]["end"] >= 500


class _CountingFS(SimFS):
    """SimFS that fails the test on a second close of one descriptor (a real fd number may be reused)."""

    def __init__(self) -> None:
        super().__init__()
        self.closed: set[int] = set()

    def close(self, fd: int) -> None:
        assert fd not in self.closed, f"descriptor {fd} closed twice"
        self.closed.add(fd)
        super().close(fd)


def test_read_all_closes_what_it_opened_once(tmp_path: Path) -> None:
    fs = _CountingFS()
    with filechannel.WriteAheadLog("/sim/wal", fs=fs, rolling_interval=1) as w:
        for i in range(6):
            w.write(b"r%d" % i, time=100 + 5 * i)  # one file each
        base = fs.open_fds()
        it = w.read_all()
        assert next(it) == b"r0"
        assert fs.open_fds() > base  # every file is held open from the start (a clean cannot pull it away)
        it.close()  # stopped early: the rest are closed, each once
        assert fs.open_fds() == base
        assert list(w.read_all()) == [b"r%d" % i for i in range(6)]
        assert fs.open_fds() == base
        assert [r["data"] for r in dump_wal("/sim/wal", fs=fs) if r["kind"] == "record"][:1] == [b"r0"]
        assert fs.open_fds() == base
