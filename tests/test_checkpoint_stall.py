"""A checkpoint does not hold committers while the data files are synced (issue 34: put1 stalls).

The checkpoint reads the channel's lengths, counters and runs with the writers held
(no I/O), then makes the data files durable to those lengths through a second
descriptor while commits go on, and only then writes the checkpoint that vouches
for them.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from helpers import contents, put

import filechannel
from filechannel import _fs

OPTS: dict[str, Any] = {
    "fsync": "interval",
    "fsync_interval": 3600.0,  # no interval sync: what the commits wrote is not durable yet
    "checkpoint_interval": 0,
    "minimum_required_space": 0,
    "background": False,
}
WAIT = 10.0  # seconds: only ever waited out when the behaviour under test is missing


class _GatedFS(_fs.OsFS):
    """Real files; while ``armed``, the next fdatasync announces itself and waits for ``release``."""

    def __init__(self) -> None:
        self.armed = False
        self.entered = threading.Event()
        self.release = threading.Event()
        self.synced: list[int] = []

    def fdatasync(self, fd: int) -> None:
        if self.armed:
            self.armed = False
            self.entered.set()
            self.release.wait(WAIT)
        super().fdatasync(fd)
        self.synced.append(fd)


def test_a_commit_does_not_wait_for_the_fdatasync_a_checkpoint_makes(tmp_path: Path) -> None:
    fs = _GatedFS()
    d = str(tmp_path / "ch")
    ch = filechannel.open(d, fs=fs, **OPTS)
    put(ch, b"a", b"b")
    put(ch, b"c")  # written, not durable: the checkpoint must sync it before vouching for it
    fs.armed = True
    result: list[dict[str, Any]] = []
    ckpt = threading.Thread(target=lambda: result.append(ch.checkpoint()))
    ckpt.start()
    try:
        assert fs.entered.wait(WAIT), "the checkpoint made no fdatasync of the unsynced data file"
        committer = threading.Thread(target=put, args=(ch, b"d"))
        committer.start()
        committer.join(WAIT)
        assert not committer.is_alive(), "a one-event commit waited for the checkpoint's fdatasync"
        assert not result, "the checkpoint was written before its data file was durable"
    finally:
        fs.release.set()
        ckpt.join(WAIT)
    assert not ckpt.is_alive()
    info = result[0]
    assert info["events"] >= 3
    assert ch.stats()["checkpoints_written"] == 1
    ch.close()
    ch = filechannel.open(d, **OPTS)
    assert [b for _, b in contents(ch)] == [b"a", b"b", b"c", b"d"]
    ch.close()
