"""stat, dump and verify on a channel the user can only read: they work, and change nothing.

The channel is made read-only (files 0444, directories 0555) and readable by
others; the commands then run as ``nobody`` (uid/gid 65534) when the tests run
as root, or as the current user otherwise (who cannot write it either). The
directory listing, with modes, sizes and mtimes, must be the same afterwards.
As root, a read-only bind mount (a real EROFS, which root's privileges do not
bypass) checks that the commands open nothing for writing.

The commands run in a forked child that drops its privileges before calling
``cli.main``, not in a new interpreter: the interpreter may live where
``nobody`` cannot execute it (under ``/root``).
"""

from __future__ import annotations

import json
import locale  # noqa: F401 - imported before the fork: nobody may not be able to read the stdlib
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import filechannel
from filechannel import cli

ROOT = Path(__file__).resolve().parent.parent
NOBODY = 65534

Listing = dict[str, tuple[int, int, int]]


def _listing(top: str) -> Listing:
    """Every entry under ``top``: (mode, size, mtime_ns); sizes of directories excluded."""
    out: Listing = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in [*dirnames, *filenames, ""]:
            path = os.path.join(dirpath, name) if name else dirpath
            st = os.lstat(path)
            size = 0 if stat.S_ISDIR(st.st_mode) else st.st_size
            out[os.path.relpath(path, top)] = (st.st_mode, size, st.st_mtime_ns)
    return out


def _make_readonly(top: str) -> None:
    for dirpath, _dirnames, filenames in os.walk(top):
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), 0o444)
        os.chmod(dirpath, 0o555)


def _make_writable(top: str) -> None:
    for dirpath, _dirnames, filenames in os.walk(top):
        os.chmod(dirpath, 0o755)
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), 0o644)


def _run_unprivileged(*argv: str) -> tuple[int, str, str]:
    """Run ``cli.main(argv)`` in a forked child as nobody (or as this non-root user)."""
    cli.build_parser()  # argparse's lazy imports (gettext, locale) happen here, while the stdlib is readable
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 99
            try:
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
                if os.geteuid() == 0:
                    os.setgroups([])
                    os.setgid(NOBODY)
                    os.setuid(NOBODY)
                sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
                sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
                code = cli.main(list(argv))
            except BaseException as exc:
                os.write(2, f"child failed: {exc!r}\n".encode())
            finally:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(code)
        _, status = os.waitpid(pid, 0)
        out.seek(0)
        err.seek(0)
        return os.waitstatus_to_exitcode(status), out.read().decode(), err.read().decode()


@pytest.fixture
def readonly_channel() -> Iterator[str]:
    """A channel of 30 events (10 taken) in a directory others may read and traverse, but nobody may write."""
    base = tempfile.mkdtemp(prefix="fc-readonly-", dir="/tmp")
    os.chmod(base, 0o755)  # mkdtemp makes it 0700: nobody could not even reach the channel
    d = os.path.join(base, "ch")
    try:
        with filechannel.open(d, minimum_required_space=0) as ch:
            with ch.transaction() as tx:
                tx.put_many([b"%d" % i for i in range(30)])
            with ch.transaction() as tx:
                tx.take_batch(10)
        _make_readonly(d)
        yield d
    finally:
        _make_writable(base)
        shutil.rmtree(base)


def test_stat_dump_verify_work_on_a_channel_the_user_cannot_write(readonly_channel: str) -> None:
    d = readonly_channel
    before = _listing(d)
    code, out, err = _run_unprivileged("stat", d, "--json")
    assert code == 0, err
    info = json.loads(out)
    assert (info["queue_size"], info["head_position"], info["in_use"]) == (20, 10, False)
    code, out, err = _run_unprivileged("dump", d)
    assert code == 0, err
    assert sum(json.loads(line)["op"] == "put" for line in out.splitlines()) == 30
    code, out, err = _run_unprivileged("verify", d)
    assert code == 0, err
    assert "ok, 20 events queued" in out
    assert _listing(d) == before  # nothing created, written or touched
    # The read-only probe still sees a live owner's lock (a writable open needs the directory
    # owner-only again: one that others can read is refused).
    _make_writable(d)
    os.chmod(d, 0o700)
    with filechannel.open(d, minimum_required_space=0):
        r = subprocess.run(
            [sys.executable, "-m", "filechannel", "stat", d, "--json"], capture_output=True, text=True, timeout=120
        )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["in_use"] is True


def _unshare_ro(path: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` in a private mount namespace where ``path`` is a read-only bind mount."""
    script = 'mount --bind "$1" "$1" && mount -o remount,ro,bind "$1" "$1" && shift && exec "$@"'
    return subprocess.run(
        ["unshare", "-m", "sh", "-c", script, "sh", path, *argv],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


@pytest.mark.root
def test_readonly_commands_as_root_on_a_read_only_mount(readonly_channel: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (a read-only bind mount)")
    d = readonly_channel
    probe = _unshare_ro(d, "sh", "-c", 'touch "$0/probe"', d)
    if "Read-only file system" not in probe.stderr:
        pytest.skip(f"no read-only bind mount here: {probe.stderr.strip()}")
    before = _listing(d)
    for argv in (["stat", d, "--json"], ["dump", d], ["verify", d]):
        r = _unshare_ro(d, sys.executable, "-m", "filechannel", *argv)
        assert r.returncode == 0, (argv, r.stderr)
        assert r.stderr == "", (argv, r.stderr)
    assert _listing(d) == before
