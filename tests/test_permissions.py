"""Owner-only files by default (issue 23): the modes of what a channel creates, the group option, the open check.

The modes are checked on the real file system under several umasks, and on
the simulated one; the open check directly against
``permissions.check_channel_dir``; and, as root, what another user can do to
a channel's files (a subprocess that drops to uid/gid 65534).
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from simfs import SimFS

import filechannel
from filechannel import permissions
from filechannel._fs import OsFS
from filechannel.errors import ConfigError, UnsafePermissionsError
from filechannel.log import CHANNEL_FILE
from filechannel.permissions import check_channel_dir, fs_for
from filechannel.verify import verify_channel

OPTS = {"minimum_required_space": 0, "checkpoint_interval": 0, "ack_interval": 0, "max_file_size": 4096}
NOBODY = 65534
ROOT = os.geteuid() == 0


@pytest.fixture(params=[0o022, 0o000, 0o077], ids=lambda m: f"umask{m:03o}")
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def _modes(top: Path) -> dict[str, int]:
    """``{path relative to top: permission bits}`` of ``top`` and everything under it."""
    out = {".": stat.S_IMODE(top.stat().st_mode)}
    for dirpath, dirs, files in os.walk(top):
        for n in dirs + files:
            p = Path(dirpath, n)
            out[str(p.relative_to(top))] = stat.S_IMODE(p.lstat().st_mode)
    return out


def _session(d: Path, **options: object) -> None:
    """Puts, takes, a checkpoint, a consumer's registration and acknowledgement, a roll, a torn tail."""
    with filechannel.open(d, **OPTS, **options) as ch:  # type: ignore[arg-type]
        for i in range(40):
            with ch.transaction() as tx:
                tx.put(b"secret %d " % i * 20)
        with ch.transaction() as tx:
            assert len(tx.take_batch(5)) == 5
        ch.checkpoint()
    with filechannel.ChannelReader(d, consumer="q") as r:
        start, _end = r.available()
        r.ack(start + 3)
    with filechannel.open(d, **OPTS, **options) as ch:  # type: ignore[arg-type]
        ch.apply_acks()
        ch.checkpoint()
    newest = max(p for p in (d / "data").iterdir() if p.suffix == ".wal")
    with open(newest, "ab") as f:
        f.write(b"\x01\x00\x00\x00garbage of a half-written batch")
    with filechannel.open(d, **OPTS, **options) as ch:  # type: ignore[arg-type]
        assert ch.stats()["torn_tails_truncated"] == 1


def _expect(modes: dict[str, int], file_mode: int, dir_mode: int, top: Path) -> None:
    kinds = {".torn-": 0, "ckpt-": 0, ".ack": 0, "CHANNEL": 0, "DATA_DIRS": 0, "LOCK": 0, ".wal": 0}
    for rel, mode in modes.items():
        is_dir = (top / rel).is_dir()
        want = dir_mode if is_dir else (0o600 if rel.endswith("LOCK") else file_mode)
        assert mode == want, f"{rel}: {mode:04o}, expected {want:04o}"
        for k in kinds:
            if k in rel:
                kinds[k] += 1
    assert all(kinds.values()), kinds  # every kind of file was made and checked


def test_every_file_and_directory_a_channel_creates_is_owner_only(tmp_path: Path, umask: int) -> None:
    d = tmp_path / "a" / "ch"  # a missing parent is created owner-only too
    _session(d)
    modes = _modes(tmp_path / "a")
    assert {"ch/consumers", "ch/checkpoints", "ch/data"} <= set(modes)
    _expect(modes, 0o600, 0o700, tmp_path / "a")


def test_group_permissions_let_the_group_read_and_keep_the_lock_private(tmp_path: Path, umask: int) -> None:
    d = tmp_path / "ch"
    _session(d, permissions="group")
    _expect(_modes(d), 0o640, 0o750, d)


@pytest.mark.parametrize("policy", ["owner", "group"])
def test_write_ahead_log_files(tmp_path: Path, umask: int, policy: str) -> None:
    d = tmp_path / "wal"
    with filechannel.WriteAheadLog(d, rolling_interval=1, max_file_size=4096, permissions=policy) as w:
        for i in range(20):
            w.write(b"record %d" % i * 30, time=100 + i)
    file_mode, dir_mode = permissions.MODES[policy]
    modes = _modes(d)
    assert any(k.endswith(".wal") for k in modes)
    assert "WAL" in modes
    assert "LOCK" in modes
    for rel, mode in modes.items():
        want = dir_mode if (d / rel).is_dir() else (0o600 if rel.endswith("LOCK") else file_mode)
        assert mode == want, f"{rel}: {mode:04o}, expected {want:04o}"


@pytest.mark.parametrize("policy", ["owner", "group"])
def test_spark_staged_files(tmp_path: Path, umask: int, policy: str) -> None:
    sink = pytest.importorskip("filechannel.spark.sink")
    staging = tmp_path / "ch" / "spark-sink" / "staging"
    fs = fs_for(OsFS(), policy)
    name, rows, _ = sink.stage_events(fs, str(staging), "part-0", [(b"row", None)] * 3, 1 << 20)
    assert rows == 3
    file_mode, dir_mode = permissions.MODES[policy]
    assert stat.S_IMODE((staging / str(name)).stat().st_mode) == file_mode
    for p in (staging, staging.parent, staging.parent.parent):
        assert stat.S_IMODE(p.stat().st_mode) == dir_mode


def test_os_fs_create_and_makedirs_are_exact_whatever_the_umask(tmp_path: Path, umask: int) -> None:
    fs = OsFS()
    fs.makedirs(str(tmp_path / "x" / "y"))
    fs.close(fs.create(str(tmp_path / "x" / "y" / "f")))
    assert stat.S_IMODE((tmp_path / "x").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "x" / "y").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "x" / "y" / "f").stat().st_mode) == 0o600


def test_lock_tightens_a_lock_file_left_wider(tmp_path: Path) -> None:
    lock = tmp_path / "LOCK"
    lock.touch()
    lock.chmod(0o644)  # as an older version left it
    fs = OsFS()
    fs.unlock(fs.lock(str(lock)))
    assert stat.S_IMODE(lock.stat().st_mode) == 0o600


def test_the_simulated_file_system_records_the_modes() -> None:
    sim = SimFS()
    with filechannel.open("/sim/ch", fs=sim, **OPTS) as ch:  # type: ignore[arg-type]
        with ch.transaction() as tx:
            tx.put(b"x")
        ch.checkpoint()
    assert sim.mode("/sim/ch") == sim.mode("/sim/ch/data") == 0o700
    files = list(sim.files("/sim/ch"))
    assert files
    assert all(sim.mode(p) == 0o600 for p in files)
    after = sim.crash(1, "keep")
    assert all(after.mode(p) == 0o600 for p in files if after.exists(p))
    g = SimFS()
    fs_for(g, "group")
    g.makedirs("/sim/g")
    g.close(g.create("/sim/g/f"))
    g.unlock(g.lock("/sim/g/LOCK"))
    assert (g.mode("/sim/g"), g.mode("/sim/g/f"), g.mode("/sim/g/LOCK")) == (0o750, 0o640, 0o600)


def test_the_option_is_checked() -> None:
    assert filechannel.ChannelConfig().permissions == "owner"
    with pytest.raises(ConfigError) as ei:
        filechannel.ChannelConfig(permissions="world")
    assert ei.value.option == "permissions"
    assert "'owner', 'group'" in str(ei.value)


# -- the check at open ----------------------------------------------------------------------------


def _dir(tmp_path: Path, mode: int, *, empty: bool = False) -> Path:
    d = tmp_path / "ch"
    d.mkdir()
    if not empty:
        (d / "CHANNEL").write_bytes(b"x")
    d.chmod(mode)
    return d


@pytest.mark.parametrize(("mode", "policy"), [(0o700, "owner"), (0o700, "group"), (0o750, "group"), (0o710, "group")])
def test_check_accepts_a_private_enough_directory(tmp_path: Path, mode: int, policy: str) -> None:
    check_channel_dir(OsFS(), str(_dir(tmp_path, mode)), policy)
    check_channel_dir(OsFS(), str(tmp_path / "missing"), policy)  # created with the right mode later


@pytest.mark.parametrize(
    ("mode", "policy", "found", "fix"),
    [
        (0o755, "owner", "its group can read/enter and other users can read/enter", "chmod 700"),
        (0o750, "owner", "its group can read/enter", "chmod 700"),
        (0o770, "group", "its group can write", "chmod 750"),
        (0o701, "owner", "other users can enter", "chmod 700"),
        (0o777, "group", "its group can write and other users can read/write/enter", "chmod 750"),
    ],
)
def test_check_refuses_a_directory_open_to_others(tmp_path: Path, mode: int, policy: str, found: str, fix: str) -> None:
    d = _dir(tmp_path, mode)
    with pytest.raises(UnsafePermissionsError) as ei:
        check_channel_dir(OsFS(), str(d), policy)
    msg = str(ei.value)
    assert str(d) in msg
    assert f"mode is {mode:04o}" in msg
    assert found in msg
    assert f"`{fix} {d}`" in msg
    assert ("or open it with permissions='group'" in msg) == (mode == 0o750)  # offered only where it would do
    assert (ei.value.path, ei.value.mode) == (str(d), mode)
    assert stat.S_IMODE(d.stat().st_mode) == mode  # a channel's directory is never changed


def test_check_tightens_an_empty_directory_a_channel_is_created_in(tmp_path: Path) -> None:
    d = _dir(tmp_path, 0o777, empty=True)
    check_channel_dir(OsFS(), str(d), "owner")
    assert stat.S_IMODE(d.stat().st_mode) == 0o700


def test_check_leaves_a_directory_that_is_no_channel_to_the_caller(tmp_path: Path) -> None:
    d = tmp_path / "notes"
    d.mkdir()
    (d / "notes.txt").write_text("hi")
    d.chmod(0o755)
    check_channel_dir(OsFS(), str(d), "owner")  # not refused for its mode, and not changed
    assert stat.S_IMODE(d.stat().st_mode) == 0o755
    assert permissions._CHANNEL_FILE == CHANNEL_FILE


def test_a_read_only_inspection_is_not_refused_but_warned(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    d = _dir(tmp_path, 0o777)
    with caplog.at_level(logging.WARNING, logger="filechannel"):
        check_channel_dir(OsFS(), str(d), "owner", readonly=True)
    (rec,) = caplog.records
    assert str(d) in rec.getMessage()
    assert "0777" in rec.getMessage()
    assert stat.S_IMODE(d.stat().st_mode) == 0o777


def test_check_on_the_simulated_file_system() -> None:
    sim = SimFS()
    sim.makedirs("/sim/ch/data")
    sim.write("/sim/ch/CHANNEL", b"x")
    check_channel_dir(sim, "/sim/ch")
    sim.chmod("/sim/ch", 0o750)
    with pytest.raises(UnsafePermissionsError, match="chmod 700 /sim/ch"):
        check_channel_dir(sim, "/sim/ch")
    check_channel_dir(sim, "/sim/ch", "group")
    sim.chown("/sim/ch", NOBODY)
    with pytest.raises(UnsafePermissionsError, match=f"owned by uid {NOBODY}"):
        check_channel_dir(sim, "/sim/ch", "group")
    check_channel_dir(sim, "/sim/ch", "group", readonly=True)


def test_check_refuses_a_directory_owned_by_another_user(tmp_path: Path) -> None:
    if not ROOT:
        pytest.skip("needs root (chown)")
    d = _dir(tmp_path, 0o700)
    os.chown(d, NOBODY, NOBODY)
    with pytest.raises(UnsafePermissionsError) as ei:
        check_channel_dir(OsFS(), str(d), "owner")
    msg = str(ei.value)
    assert str(d) in msg
    assert f"uid {NOBODY} (nobody)" in msg
    assert "uid 0 (root)" in msg
    assert f"`chown -R root {d}`" in msg
    assert ei.value.uid == NOBODY
    check_channel_dir(OsFS(), str(d), "owner", readonly=True)  # an inspection still may


def test_open_refuses_a_channel_directory_open_to_others(tmp_path: Path) -> None:
    d = tmp_path / "ch"
    with filechannel.open(d, **OPTS) as ch, ch.transaction() as tx:  # type: ignore[arg-type]
        tx.put(b"x")
    d.chmod(0o755)
    with pytest.raises(UnsafePermissionsError, match=f"chmod 700 {d}"):
        filechannel.open(d, **OPTS)  # type: ignore[arg-type]
    # Read-only inspections are not refused.
    assert not verify_channel(str(d)).reports
    with filechannel.ChannelReader(d) as r:
        assert [e.body for e in r.read(*r.available())] == [b"x"]
    d.chmod(0o750)
    filechannel.open(d, permissions="group", **OPTS).close()  # type: ignore[arg-type]


def test_a_write_ahead_log_open_to_others_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "wal"
    filechannel.WriteAheadLog(d).close()
    d.chmod(0o705)
    with pytest.raises(UnsafePermissionsError, match="other users can read/enter"):
        filechannel.WriteAheadLog(d)


# -- another user ------------------------------------------------------------------------------------


def _probe(paths: list[str]) -> str:
    out = []
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except PermissionError:
            out.append("denied")
            continue
        if os.path.isdir(path):
            out.append("read-dir")
        elif path.endswith("LOCK"):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                out.append("locked")
            except OSError:
                out.append("held")
        else:
            out.append(f"read {len(os.read(fd, 1 << 20))}")
        os.close(fd)
    return ",".join(out)


def _as_nobody(*paths: Path, run: Callable[[list[str]], str] | None = None) -> list[str]:
    """What uid/gid 65534 gets from ``run(paths)`` (default: opening each read-only, flocking a LOCK).

    A forked child drops to that user (forked rather than run: nobody may not
    be allowed to execute this interpreter).
    """
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            try:
                out = (run or _probe)([str(p) for p in paths])
            except Exception as exc:
                out = f"{type(exc).__name__}: {exc}"
            os.write(w, out.encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        out = f.read()
    os.waitpid(pid, 0)
    assert out, "the child reported nothing"
    return out.split(",")


def _view(paths: list[str]) -> str:
    with filechannel.ChannelReader(paths[0]) as r:
        return ",".join(e.body.decode() for e in r.read(*r.available()))


@pytest.fixture
def open_path() -> Iterator[Path]:
    """A directory every user can reach (pytest's own temporary directories are private to root)."""
    if not ROOT:
        pytest.skip("needs root (to run a process as another user)")
    d = Path(tempfile.mkdtemp(prefix="fc-perms-"))
    d.chmod(0o755)
    assert _as_nobody(d) == ["read-dir"]  # the path down to it is open: only the channel's modes protect it
    try:
        yield d
    finally:
        shutil.rmtree(d)


def _first_data_file(d: Path) -> Path:
    return next(p for p in (d / "data").iterdir() if p.suffix == ".wal")


def test_another_user_can_neither_read_the_events_nor_take_the_lock(open_path: Path, umask: int) -> None:
    d = open_path / "ch"
    with filechannel.open(d, **OPTS) as ch:  # type: ignore[arg-type]
        with ch.transaction() as tx:
            tx.put(b"secret")
        data, lock = _first_data_file(d), d / "LOCK"
        assert _as_nobody(data, lock, d / "CHANNEL") == ["denied", "denied", "denied"]
    # Even with the directory opened up by hand, the files themselves stay private.
    d.chmod(0o755)
    (d / "data").chmod(0o755)
    assert _as_nobody(data, lock) == ["denied", "denied"]


def test_the_group_reads_but_cannot_take_the_lock(open_path: Path) -> None:
    d = open_path / "ch"
    with filechannel.open(d, permissions="group", **OPTS) as ch:  # type: ignore[arg-type]
        with ch.transaction() as tx:
            tx.put(b"shared")
        for dirpath, dirs, files in os.walk(d):
            for n in [".", *dirs, *files]:
                os.chown(os.path.join(dirpath, n), 0, NOBODY)  # nobody's group is the channel's group
        data = _first_data_file(d)
        words = _as_nobody(data, d / "LOCK")
        assert words[0].startswith("read ")
        assert int(words[0].split()[1]) > 0
        assert words[1] == "denied"
        assert _as_nobody(d, run=_view) == ["shared"]  # a reader's view, as a member of the group
