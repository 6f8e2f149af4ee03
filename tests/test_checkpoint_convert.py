"""Channels whose newest checkpoint is of an earlier version (2, 3, 4: one entry per queued event).

They open from that checkpoint (its entries become runs, no full replay), serve
the same events at the same positions, and their next checkpoint is of runs
(version 6), which opens again the same.
"""

from __future__ import annotations

import os
import struct
from array import array
from pathlib import Path
from typing import Any

import pytest

import filechannel
from filechannel import checkpoint as ckpt
from filechannel._fs import DEFAULT_FS


def _version(path: str) -> int:
    return int(struct.unpack_from("<H", Path(path).read_bytes(), 8)[0])


def _newest(d: str) -> str:
    cdir = os.path.join(d, ckpt.CHECKPOINT_DIR)
    return os.path.join(cdir, max(n for n in os.listdir(cdir) if n.endswith(".ckpt")))


def _contents(ch: filechannel.FileChannel) -> list[tuple[int | None, bytes]]:
    tx = ch.transaction()
    try:
        return [(e.position, e.body) for e in tx.take_batch(10_000)]
    finally:
        tx.rollback()


@pytest.mark.parametrize("version", [2, 3, 4])
def test_an_earlier_checkpoint_opens_and_is_converted_on_the_next_checkpoint(tmp_path: Path, version: int) -> None:
    d = str(tmp_path / "ch")
    opts: dict[str, Any] = {"minimum_required_space": 0, "checkpoint_interval": 0, "max_file_size": 1 << 16}
    if version == 4:
        pytest.importorskip("cryptography")
        opts["encryption"] = filechannel.Encryption(keys={"k": bytes(range(32))})
    ch = filechannel.open(d, **opts)
    for t in range(40):
        with ch.transaction() as tx:
            tx.put_many([b"t%d-e%d-" % (t, i) + b"x" * 200 for i in range(t % 5 + 1)])
            if version >= 3 and t % 7 == 0:
                tx.mark("producer", b"%d" % t)
    with ch.transaction() as tx:
        tx.take_batch(7)  # the head moves: the queue starts mid-file
    want = _contents(ch)
    entries = list(ch._queue)  # every queued event's record pointer
    mac = ch._log.meta_mac
    kind, cid = ch._log.crc_kind, ch._log.channel_id
    ch.close()
    # Rewrite the newest checkpoint as its earlier version would hold it: an entry per event.
    path = _newest(d)
    store = ckpt.CheckpointStore(DEFAULT_FS, os.path.dirname(path))
    (found,) = [c for c in store.list() if c.path == path]
    snap = store.load(found, kind, cid, mac, required=mac is not None)
    assert snap.runs is not None
    assert len(snap.runs) < len(entries)
    if version == 2:
        snap.marks = []
    snap.runs, snap.holes = None, []
    snap.positions, snap.file_ids, snap.offsets, snap.sizes = (array("q", [e[i] for e in entries]) for i in range(4))
    store.write(snap, kind, mac=mac)
    assert _version(path) == version
    with filechannel.open(d, **opts) as ch:
        assert ch.stats()["recovery_source"] == "checkpoint"
        assert ch.stats()["checkpoint_fallbacks"] == 0
        assert _contents(ch) == want
        if version >= 3:
            assert ch.mark("producer") == b"35"
        ch.checkpoint()
        assert _version(_newest(d)) == ckpt.RUNS_VERSION
    with filechannel.open(d, **opts) as ch:
        assert ch.stats()["recovery_source"] == "checkpoint"
        assert _contents(ch) == want
