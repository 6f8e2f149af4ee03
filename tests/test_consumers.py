"""External consumers: the registry (consumers.py), the owner applying acknowledgements, the mixing rule, the CLI.

The crash points of the ack file and of the owner's application of acks are in
test_crash_points.py (workload ``w_consumer_acks``).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import pytest
from simfs import SimFS

import filechannel
from filechannel import cli
from filechannel._fs import DEFAULT_FS
from filechannel.consumers import ConsumerState, ConsumerStore, validate_name
from filechannel.log import decode_meta, encode_meta

SIM_DIR = "/sim/ch"
OPTS = {"max_file_size": 4096, "minimum_required_space": 0, "background": False}


def _fill(ch: filechannel.FileChannel, n: int, size: int = 500) -> None:
    for i in range(n):
        with ch.transaction() as tx:
            tx.put(b"%04d:" % i + b"x" * (size - 5))


def _queued(ch: filechannel.FileChannel) -> list[int]:
    """Queued positions, read without a take (takes are refused while consumers are registered)."""
    with ch._lock:
        return [e[0] for e in ch._queue]


def _bodies(ch: filechannel.FileChannel) -> list[bytes]:
    from filechannel.replay import read_event

    with ch._lock:
        entries = list(ch._queue)
    return [read_event(ch._log, e)[0] for e in entries]


def _data_files(directory: str) -> set[str]:
    return {n for n in os.listdir(os.path.join(directory, "data")) if n.endswith(".wal")}


@pytest.fixture
def sim() -> SimFS:
    fs = SimFS()
    fs.makedirs(SIM_DIR)
    fs.fsync_dir("/sim")  # the channel directory exists durably
    fs.trace.clear()
    return fs


# --------------------------------------------------------------------------
# the registry


def test_register_round_trip(sim: SimFS) -> None:
    store = ConsumerStore(sim, SIM_DIR)
    assert store.list() == {}
    assert store.get("q") is None
    st = store.register("q", "query-1", 5)
    assert st == ConsumerState("q", "query-1", 5, st.registered_ns)
    assert st.registered_ns > 0
    assert store.get("q") == st
    assert store.list() == {"q": st}
    raw = decode_meta(sim.read(SIM_DIR + "/consumers/q.ack"), "ack")
    assert raw == {
        "name": "q", "identity": "query-1", "acked": 5, "registered_ns": st.registered_ns, "seq": 1, "version": 1
    }  # fmt: skip
    # Registering again returns the recorded state: start applies only to a new consumer.
    assert store.register("q", "query-1", 99) == st
    assert store.register("q", None, 99) == st
    # Another store (another process) sees the same.
    assert ConsumerStore(sim, SIM_DIR).list() == {"q": st}


def test_register_and_ack_are_durable_and_atomic(sim: SimFS) -> None:
    store = ConsumerStore(sim, SIM_DIR)
    store.register("q", None, 0)
    # The consumers directory's own entry was fsynced, then the file's.
    assert ("fsync_dir", SIM_DIR) in sim.trace
    assert ("fsync_dir", SIM_DIR + "/consumers") in sim.trace
    assert store.ack("q", None, 7) == 7
    after = ConsumerStore(sim.crash(0, "drop"), SIM_DIR)
    assert after.get("q") == ConsumerState("q", None, 7, store.get("q").registered_ns)  # type: ignore[union-attr]
    # Only temporary names are ever written: the .ack file is replaced, never written in place.
    writes = [p for op, p in sim.trace if op in ("create", "pwrite_all")]
    assert writes
    assert all(".tmp-" in p for p in writes)


def test_identity_rules(sim: SimFS) -> None:
    store = ConsumerStore(sim, SIM_DIR)
    store.register("q", "a", 3)
    with pytest.raises(filechannel.ConsumerIdentityError) as ei:
        store.register("q", "b", 0)
    err = ei.value
    assert isinstance(err, filechannel.ChannelError)
    assert (err.consumer, err.recorded, err.given) == ("q", "a", "b")
    assert "reset=True" in str(err)
    assert "filechannel consumers DIR --remove q" in str(err)
    with pytest.raises(filechannel.ConsumerIdentityError):
        store.ack("q", "b", 10)
    assert store.get("q").acked == 3  # type: ignore[union-attr]
    # reset: the identity is replaced, the acknowledged mark kept.
    st = store.register("q", "b", 0, reset=True)
    assert (st.identity, st.acked) == ("b", 3)
    assert store.ack("q", "b", 10) == 10
    with pytest.raises(filechannel.ConsumerIdentityError):
        store.ack("q", "a", 11)
    # None is never a conflict: it skips the check (and a consumer without one adopts the next).
    assert store.ack("q", None, 11) == 11
    store.register("r", None, 0)
    assert store.register("r", "x", 0).identity == "x"
    with pytest.raises(filechannel.ConsumerIdentityError):
        store.register("r", "y", 0)


def test_ack_is_monotone_and_idempotent(sim: SimFS) -> None:
    store = ConsumerStore(sim, SIM_DIR)
    store.register("q", "id", 10)
    assert store.ack("q", "id", 15) == 15
    writes = sim.count("replace")
    assert store.ack("q", "id", 15) == 15  # idempotent: nothing written
    assert store.ack("q", "id", 12) == 15  # lower: ignored
    assert store.ack("q", "id", 0) == 15
    assert sim.count("replace") == writes
    assert store.ack("q", "id", 16) == 16
    assert store.get("q").acked == 16  # type: ignore[union-attr]
    with pytest.raises(filechannel.ChannelError, match="not registered"):
        store.ack("nobody", None, 1)
    with pytest.raises(ValueError, match=">= 0"):
        store.ack("q", "id", -1)
    with pytest.raises(TypeError):
        store.ack("q", "id", True)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        store.register("z", 5, 0)  # type: ignore[arg-type]


def test_remove(sim: SimFS) -> None:
    store = ConsumerStore(sim, SIM_DIR)
    assert store.remove("q") is False
    store.register("q", None, 0)
    store.register("r", None, 0)
    assert store.remove("q") is True
    assert set(store.list()) == {"r"}
    assert ConsumerStore(sim.crash(0, "drop"), SIM_DIR).get("q") is None  # durable
    assert store.remove("q") is False


@pytest.mark.parametrize("flip", [0, 5, 30, -3])
def test_damaged_ack_file_is_corruption_naming_it(sim: SimFS, flip: int) -> None:
    store = ConsumerStore(sim, SIM_DIR)
    store.register("q", None, 0)
    store.register("ok", None, 0)
    path = SIM_DIR + "/consumers/q.ack"
    buf = bytearray(sim.read(path))
    buf[flip] ^= 0x20
    sim.write(path, bytes(buf))
    for call in (store.list, lambda: store.get("q"), store.cached_list):
        with pytest.raises(filechannel.CorruptLogError) as ei:
            call()
        assert ei.value.path == path
        assert "--remove q" in str(ei.value)
    assert store.get("ok") is not None
    assert store.remove("q") is True  # a damaged file can always be removed
    assert set(store.list()) == {"ok"}


def test_ack_file_with_wrong_fields_is_corruption(sim: SimFS) -> None:
    store = ConsumerStore(sim, SIM_DIR)
    store.register("q", None, 0)
    path = SIM_DIR + "/consumers/q.ack"
    good = {"name": "q", "identity": None, "acked": 1, "registered_ns": 1, "version": 1}
    for bad in ({"name": "other"}, {"acked": -1}, {"acked": "1"}, {"version": 2}, {"identity": 3}):
        sim.write(path, encode_meta({**good, **bad}))
        with pytest.raises(filechannel.CorruptLogError, match=r"q\.ack"):
            store.list()


def test_temporary_files_are_ignored_and_cleaned(sim: SimFS) -> None:
    store = ConsumerStore(sim, SIM_DIR)
    store.register("q", None, 0)
    sim.write(SIM_DIR + "/consumers/.r.ack.tmp-1-2", b"half written")
    sim.write(SIM_DIR + "/consumers/README", b"not a consumer")
    assert set(store.list()) == {"q"}
    store.register("r", None, 4)
    assert set(store.list()) == {"q", "r"}
    assert sorted(sim.listdir(SIM_DIR + "/consumers")) == ["README", "q.ack", "r.ack"]


def test_a_reregistration_deletes_stale_temporary_files_only(sim: SimFS) -> None:
    store = ConsumerStore(sim, SIM_DIR)
    store.register("q", "id", 0)
    old = f".q.ack.tmp-999999-{time.time_ns() - 61 * 10**9}"  # left by a process killed mid-ack
    young = f".q.ack.tmp-999998-{time.time_ns()}"  # another process's write in progress, maybe
    other = ".r.ack.tmp-999999-1"
    for n in (old, young, other):
        sim.write(f"{SIM_DIR}/consumers/{n}", b"{")
    assert store.register("q", "id", 0).acked == 0  # already registered: returns it, and cleans
    assert sorted(sim.listdir(SIM_DIR + "/consumers")) == sorted([young, other, "q.ack"])
    assert store.remove("q")  # removal deletes every temporary file of the name
    assert sim.listdir(SIM_DIR + "/consumers") == [other]


@pytest.mark.parametrize("name", ["q", "a.b_c-D9", "x" * 100, "-", "..."])
def test_valid_names(name: str) -> None:
    assert validate_name(name) == name


@pytest.mark.parametrize("name", ["", "a/b", "x" * 101, "é", "a b", "q.ack\n", 5, None, b"q"])
def test_invalid_names(sim: SimFS, name: object) -> None:
    with pytest.raises(filechannel.ConfigError) as ei:
        validate_name(name)
    assert ei.value.option == "consumer"
    store = ConsumerStore(sim, SIM_DIR)
    with pytest.raises(filechannel.ConfigError):
        store.register(name, None, 0)  # type: ignore[arg-type]
    with pytest.raises(filechannel.ConfigError):
        store.ack(name, None, 0)  # type: ignore[arg-type]
    with pytest.raises(filechannel.ConfigError):
        store.remove(name)  # type: ignore[arg-type]


def test_mtime_token_and_cache(sim: SimFS) -> None:
    store = ConsumerStore(sim, SIM_DIR)
    assert store.mtime_token() is None
    assert store.cached_list() == {}
    store.register("q", None, 0)
    t1 = store.mtime_token()
    assert t1 is not None
    assert store.mtime_token() == t1
    assert store.cached_list()["q"].acked == 0
    lists = sim.count("create")
    store.ack("q", None, 3)  # replaced
    t2 = store.mtime_token()
    assert t2 != t1
    assert store.cached_list()["q"].acked == 3
    assert sim.count("create") == lists + 1
    store.register("r", None, 0)  # added
    t3 = store.mtime_token()
    assert t3 not in (t1, t2)
    assert set(store.cached_list()) == {"q", "r"}
    store.remove("q")  # removed
    assert store.mtime_token() not in (t1, t2, t3)
    assert set(store.cached_list()) == {"r"}


class _CoarseClockFS(SimFS):
    """A file system whose directory timestamps do not move within a tick (the token stays equal)."""

    mtime_ns = 0

    def stat_token(self, path: str) -> tuple[int, int, int, int]:
        super().stat_token(path)
        return (1, 0, self.mtime_ns, self.mtime_ns)


def test_cache_distrusts_a_recent_token() -> None:
    fs = _CoarseClockFS()
    fs.makedirs(SIM_DIR)
    store = ConsumerStore(fs, SIM_DIR)
    writer = ConsumerStore(fs, SIM_DIR)
    fs.mtime_ns = time.time_ns()  # the last change was just now
    writer.register("a", None, 0)
    assert set(store.cached_list()) == {"a"}
    writer.register("b", None, 0)  # same tick: the token did not change
    assert set(store.cached_list()) == {"a", "b"}
    fs.mtime_ns = time.time_ns() - 10**10  # settled: the token is trusted, one stat only
    assert set(store.cached_list()) == {"a", "b"}
    writer.remove("a")  # (a real file system would move the token; this one shows the cache is used)
    assert set(store.cached_list()) == {"a", "b"}


def test_cache_on_a_real_directory_sees_a_change_in_the_same_clock_tick(tmp_path: Path) -> None:
    d = str(tmp_path)
    owner = ConsumerStore(DEFAULT_FS, d)
    other = ConsumerStore(DEFAULT_FS, d)
    other.register("a", None, 0)
    assert set(owner.cached_list()) == {"a"}
    for name in ("b", "c", "d"):  # each right after the owner cached the registry
        other.register(name, None, 0)
        assert name in owner.cached_list()
    other.remove("a")
    assert "a" not in owner.cached_list()


# --------------------------------------------------------------------------
# the owner applies acknowledgements


def test_apply_acks_takes_up_to_the_lowest_mark_and_files_retire(chan_dir: str) -> None:
    ch = filechannel.open(chan_dir, **OPTS)
    _fill(ch, 30)  # about 7 events per 4 KiB file
    files_before = _data_files(chan_dir)
    assert len(files_before) >= 4
    store = ConsumerStore(DEFAULT_FS, chan_dir)
    store.register("q", "qid", 0)
    store.register("r", None, 0)
    assert ch.apply_acks() == 0  # registered at 0: nothing acknowledged by both
    store.ack("q", "qid", 20)
    store.ack("r", None, 12)
    assert ch.apply_acks() == 12
    assert _queued(ch) == list(range(12, 30))
    assert ch.apply_acks() == 0  # idempotent
    st = ch.stats()
    assert st["acked_events_taken"] == 12
    assert st["takes_committed"] == 12
    assert st["consumers"]["q"]["acked"] == 20
    assert st["consumers"]["q"]["lag_events"] == 10
    assert st["consumers"]["q"]["identity"] == "qid"
    assert st["consumers"]["r"]["lag_events"] == 18
    assert st["consumers"]["r"]["oldest_file"] is not None
    assert st["consumers_problem"] is None
    # Files holding only positions below 12 are gone, as after an in-process take.
    assert st["files_retired"] >= 1
    assert len(_data_files(chan_dir)) < len(files_before)
    ch.close()
    ch = filechannel.open(chan_dir, **OPTS)
    try:
        assert _queued(ch) == list(range(12, 30))
        assert _bodies(ch)[0].startswith(b"0012:")
        store.ack("r", None, 25)  # now q (20) is the lowest
        assert ch.apply_acks() == 8
        assert _queued(ch) == list(range(20, 30))
    finally:
        ch.close()
    ch = filechannel.open(chan_dir, **OPTS)
    try:
        assert _queued(ch) == list(range(20, 30))
    finally:
        ch.close()


def test_acks_written_while_no_owner_runs_apply_at_the_next_open(chan_dir: str) -> None:
    with filechannel.open(chan_dir, **OPTS) as ch:
        _fill(ch, 10)
    store = ConsumerStore(DEFAULT_FS, chan_dir)
    store.register("q", None, 0)
    store.ack("q", None, 6)
    with filechannel.open(chan_dir, **OPTS) as ch:
        assert _queued(ch) == [6, 7, 8, 9]
        assert ch.stats()["acked_events_taken"] == 6
    with filechannel.open(chan_dir, **OPTS) as ch:
        assert _queued(ch) == [6, 7, 8, 9]
        assert ch.stats()["acked_events_taken"] == 0


def test_close_applies_acks(chan_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    ch = filechannel.open(chan_dir, **OPTS, ack_interval=0)
    _fill(ch, 10)
    store = ConsumerStore(DEFAULT_FS, chan_dir)
    store.register("q", None, 0)
    store.ack("q", None, 4)
    ch.close()
    # Read-only: what close left on disk, without another open applying anything.
    assert cli.main(["stat", chan_dir, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["queue_size"], info["head_position"]) == (6, 4)
    (q,) = info["consumers"]  # a list of objects, as `consumers --json` gives (issue 27)
    assert (q["name"], q["acked"], q["identity"], q["lag_events"]) == ("q", 4, None, 6)
    assert q["lag_bytes"] > 6 * 500  # bodies plus their encoded headers
    assert q["oldest_file"].startswith(os.path.join(chan_dir, "data", "seg-"))


def test_background_thread_applies_acks(chan_dir: str) -> None:
    ch = filechannel.open(chan_dir, max_file_size=4096, minimum_required_space=0, ack_interval=0.02)
    try:
        _fill(ch, 10)
        store = ConsumerStore(DEFAULT_FS, chan_dir)
        store.register("q", None, 0)
        store.ack("q", None, 7)
        deadline = time.monotonic() + 10
        while ch.size != 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _queued(ch) == [7, 8, 9]
        store.ack("q", None, 9)
        while ch.size != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _queued(ch) == [9]
    finally:
        ch.close()


def test_apply_acks_is_not_limited_by_transaction_capacity(chan_dir: str) -> None:
    with filechannel.open(chan_dir, capacity=5000, transaction_capacity=10, minimum_required_space=0) as ch:
        for _ in range(100):
            with ch.transaction() as tx:
                tx.put_many([b"e"] * 10)
        store = ConsumerStore(DEFAULT_FS, chan_dir)
        store.register("q", None, 0)
        store.ack("q", None, 1000)
        assert ch.apply_acks() == 1000
        assert ch.size == 0


def test_apply_acks_with_an_empty_or_lagging_queue(chan_dir: str) -> None:
    with filechannel.open(chan_dir, **OPTS) as ch:
        store = ConsumerStore(DEFAULT_FS, chan_dir)
        store.register("q", None, 0)
        store.ack("q", None, 50)  # ahead of the channel: only what exists is taken
        assert ch.apply_acks() == 0
        _fill(ch, 3)
        assert ch.apply_acks() == 3
        assert ch.size == 0
        assert ch.stats()["consumers"]["q"] == {"acked": 50, "lag_events": 0, "identity": None, "oldest_file": None}
    with pytest.raises(filechannel.ChannelClosedError):
        ch.apply_acks()


def test_an_acknowledged_position_is_never_assigned_again(chan_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    # What a power cut after a reader acknowledged a batch the owner had not synced leaves:
    # a durable mark above the recovered next position.
    with filechannel.open(chan_dir, **OPTS) as ch:
        _fill(ch, 5)
    store = ConsumerStore(DEFAULT_FS, chan_dir)
    store.register("q", None, 0)
    store.register("r", None, 0)
    store.ack("q", None, 9)
    store.ack("r", None, 5)
    with caplog.at_level(logging.WARNING, logger="filechannel"):
        ch = filechannel.open(chan_dir, **OPTS)
    try:
        assert "positions [5, 9) are skipped" in caplog.text
        assert ch.stats()["next_position"] == 9
        assert _queued(ch) == []  # r acknowledged all five
        _fill(ch, 2)
        assert _queued(ch) == [9, 10]
        assert ch.apply_acks() == 0  # nobody read the new events: nothing is taken
    finally:
        ch.close()
    with filechannel.open(chan_dir, **OPTS) as ch:
        assert _queued(ch) == [9, 10]
        assert _bodies(ch) == [b"0000:" + b"x" * 495, b"0001:" + b"x" * 495]


def test_without_consumers_nothing_changes(chan_dir: str) -> None:
    with filechannel.open(chan_dir, **OPTS) as ch:
        _fill(ch, 3)
        assert ch.apply_acks() == 0
        st = ch.stats()
        assert (st["consumers"], st["consumers_problem"], st["acked_events_taken"]) == ({}, None, 0)
        with ch.transaction() as tx:
            assert len(tx.take_batch(2)) == 2
    assert not os.path.exists(os.path.join(chan_dir, "consumers"))


# --------------------------------------------------------------------------
# the mixing rule


def test_in_process_take_is_refused_while_consumers_are_registered(chan_dir: str) -> None:
    with filechannel.open(chan_dir, **OPTS) as ch:
        _fill(ch, 5)
        with ch.transaction() as tx:  # fills the registry cache: no consumers
            assert tx.take() is not None
        store = ConsumerStore(DEFAULT_FS, chan_dir)
        store.register("spark-q1", None, 1)  # another process, right after
        tx = ch.transaction()
        with pytest.raises(filechannel.ConsumerConflictError) as ei:
            tx.take_batch(3)
        assert ei.value.consumers == ["spark-q1"]
        assert "spark-q1" in str(ei.value)
        assert "ChannelReader" in str(ei.value)
        assert f"filechannel consumers {chan_dir} --remove spark-q1" in str(ei.value)
        with pytest.raises(filechannel.ConsumerConflictError):
            tx.take()
        tx.rollback()
        assert ch.size == 4  # nothing was taken
        with ch.transaction() as tx:  # puts are not affected
            tx.put(b"more")
        store.remove("spark-q1")
        with ch.transaction() as tx:
            assert [e.position for e in tx.take_batch(10)] == [1, 2, 3, 4, 5]


def test_damaged_ack_file_at_open(chan_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    with filechannel.open(chan_dir, **OPTS) as ch:
        _fill(ch, 5)
    store = ConsumerStore(DEFAULT_FS, chan_dir)
    store.register("q", None, 0)
    store.ack("q", None, 3)
    path = os.path.join(chan_dir, "consumers", "q.ack")
    Path(path).write_bytes(Path(path).read_bytes().replace(b'"acked":3', b'"acked":4'))
    with caplog.at_level(logging.ERROR, logger="filechannel"):
        ch = filechannel.open(chan_dir, **OPTS)
    try:
        assert "consumer acknowledgements not applied" in caplog.text
        assert path in caplog.text
        assert ch.size == 5  # not applying acknowledgements loses nothing
        with pytest.raises(filechannel.CorruptLogError, match=r"q\.ack"):
            ch.apply_acks()
        with ch.transaction() as tx, pytest.raises(filechannel.CorruptLogError, match=r"q\.ack"):
            tx.take()
        assert path in ch.stats()["consumers_problem"]
        store.remove("q")
        assert ch.stats()["consumers_problem"] is None
    finally:
        ch.close()


def test_ack_interval_option() -> None:
    assert filechannel.ChannelConfig().ack_interval == 0.5
    assert filechannel.ChannelConfig(ack_interval=0).ack_interval == 0
    for bad in (-1, float("nan"), "1", True):
        with pytest.raises(filechannel.ConfigError, match="ack_interval"):
            filechannel.ChannelConfig(ack_interval=bad)  # type: ignore[arg-type]


def test_errors_are_exported() -> None:
    for name in ("ConsumerIdentityError", "ConsumerConflictError", "DataLossError"):
        assert issubclass(getattr(filechannel, name), filechannel.ChannelError)
        assert name in filechannel.__all__
    err = filechannel.DataLossError(3, 9, "retired after it was acknowledged")
    assert (err.start, err.end) == (3, 9)
    assert str(err) == "positions [3, 9) are gone: retired after it was acknowledged"


# --------------------------------------------------------------------------
# the command line


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = cli.main(list(argv))
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_consumers(chan_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    with filechannel.open(chan_dir, **OPTS) as ch:
        _fill(ch, 10)
    code, out, _ = _run(capsys, "consumers", chan_dir)
    assert (code, out) == (0, f"{chan_dir}: no consumers registered\n")
    store = ConsumerStore(DEFAULT_FS, chan_dir)
    store.register("q", "query-1", 0)
    store.register("r", None, 0)
    store.ack("q", "query-1", 4)
    store.ack("r", None, 7)
    code, out, _ = _run(capsys, "consumers", chan_dir)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["NAME", "ACKED", "LAG", "IDENTITY"]
    assert lines[1].split() == ["q", "4", "6", "query-1"]
    assert lines[2].split() == ["r", "7", "3", "-"]
    code, out, _ = _run(capsys, "consumers", chan_dir, "--json")
    info = json.loads(out)
    assert info["next_position"] == 10
    assert [(c["name"], c["acked"], c["lag_events"], c["identity"]) for c in info["consumers"]] == [
        ("q", 4, 6, "query-1"),
        ("r", 7, 3, None),
    ]
    # stat shows them too (read-only: nothing applied)
    code, out, _ = _run(capsys, "stat", chan_dir)
    assert code == 0
    assert "consumers: 2" in out
    assert "  q: acked 4, lag 6 events (" in out
    assert "identity query-1, oldest file " in out
    # take is refused while consumers are registered (the open applies their acks first)
    code, out, err = _run(capsys, "take", chan_dir)
    assert code == 2
    assert err.count("\n") == 1
    assert "registered external consumers ('q', 'r')" in err
    # remove
    code, out, err = _run(capsys, "consumers", chan_dir, "--remove", "zz")
    assert code == 2
    assert err == f"filechannel: error: {chan_dir}: no consumer named 'zz' (registered: q, r)\n"
    code, out, err = _run(capsys, "consumers", chan_dir, "--remove", "a/b")
    assert code == 2
    assert err.count("\n") == 1
    assert "--remove 'a/b'" in err
    code, out, _ = _run(capsys, "consumers", chan_dir, "--remove", "q")
    assert code == 0
    assert "removed consumer q" in out
    assert set(store.list()) == {"r"}
    code, out, _ = _run(capsys, "stat", chan_dir, "--json")
    info = json.loads(out)
    assert info["queue_size"] == 6  # the take's open applied q's (lower) ack: 4
    (r,) = info["consumers"]
    assert (r["name"], r["acked"], r["identity"], r["lag_events"]) == ("r", 7, None, 3)


def test_cli_consumers_damaged_file(chan_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    with filechannel.open(chan_dir, **OPTS):
        pass
    ConsumerStore(DEFAULT_FS, chan_dir).register("q", None, 0)
    path = os.path.join(chan_dir, "consumers", "q.ack")
    Path(path).write_bytes(b"garbage")
    code, _, err = _run(capsys, "consumers", chan_dir)
    assert code == 2
    assert path in err
    assert "--remove q" in err
    code, out, _ = _run(capsys, "stat", chan_dir, "--json")
    assert code == 0
    assert path in json.loads(out)["consumers_problem"]
    code, out, _ = _run(capsys, "consumers", chan_dir, "--remove", "q")
    assert code == 0
    assert not os.path.exists(path)


def test_cli_consumers_on_a_missing_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "consumers", str(tmp_path / "nope"))
    assert code == 2
    assert "no such channel directory" in err
