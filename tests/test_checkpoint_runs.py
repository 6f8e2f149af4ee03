"""Checkpoint version 6: a queue of runs, its size independent of depth; earlier versions still read."""

from __future__ import annotations

import struct
from array import array
from pathlib import Path

import pytest

from filechannel import checkpoint as ckpt
from filechannel import format as fmt
from filechannel._fs import DEFAULT_FS
from filechannel._runs import StoredRun
from filechannel.errors import FormatError

CID = bytes(range(16))
KIND = fmt.default_crc_kind()
FILES = {3: 4 << 30, 4: 2 << 30}  # room for the PUT records of 60 M and 40 M events


def _snap(
    runs: list[StoredRun], holes: list[int] | None = None, entries: tuple[tuple[int, int, int, int], ...] = ()
) -> ckpt.Snapshot:
    cols = [array("q", (e[i] for e in entries)) for i in range(4)]
    return ckpt.Snapshot(
        woid=1000,
        next_position=500_000_000,
        next_txn_id=77,
        next_file_id=5,
        channel_id=CID,
        created_ns=123,
        files=dict(FILES),
        positions=cols[0],
        file_ids=cols[1],
        offsets=cols[2],
        sizes=cols[3],
        taken={3: [(0, 10)]},
        file_dirs={3: 0, 4: 1},
        runs=runs,
        holes=holes or [],
    )


def test_a_hundred_million_queued_events_in_two_runs_take_a_few_hundred_bytes() -> None:
    runs = [StoredRun(10, 60_000_000, 3, 4096), StoredRun(60_000_010, 40_000_000, 4, 80)]
    snap = _snap(runs, holes=[11, 500], entries=((5, 3, 1024, 136), (7, 3, 1160, 136)))
    buf = ckpt.encode(snap, KIND)
    assert len(buf) < 512
    assert len(snap) == 100_000_000 - 2 + 2
    back = ckpt.decode(buf, KIND, CID)
    assert back.runs == runs
    assert back.holes == [11, 500]
    assert list(back.positions) == [5, 7]
    assert list(back.offsets) == [1024, 1160]
    assert len(back) == len(snap)
    assert struct.unpack_from("<H", buf, 8)[0] == ckpt.RUNS_VERSION
    assert b"".join(ckpt.encode_blocks(snap, KIND, block=64)) == buf


def test_marks_ride_along_in_version_6() -> None:
    snap = _snap([StoredRun(0, 5, 3, 80)])
    snap.marks = [("producer:a", b"17", 900, 3)]
    back = ckpt.decode(ckpt.encode(snap, KIND), KIND, CID)
    assert back.marks == snap.marks
    assert back.runs == snap.runs


def test_queued_positions_expand_runs_less_holes_plus_entries() -> None:
    snap = _snap([StoredRun(10, 4, 3, 80), StoredRun(20, 2, 4, 80)], holes=[11], entries=((15, 3, 200, 32),))
    pos, fids = snap.queued_positions()
    assert list(pos) == [10, 12, 13, 15, 20, 21]
    assert list(fids) == [3, 3, 3, 3, 4, 4]


def _recrc(buf: bytearray) -> bytes:
    struct.pack_into("<I", buf, len(buf) - 4, fmt.crc(KIND, bytes(buf[:-4])))
    return bytes(buf)


def test_an_entry_inside_a_run_is_refused() -> None:
    # format.md: the entries outside runs "must not lie inside a run" (else a position is queued twice).
    buf = ckpt.encode(_snap([StoredRun(10, 4, 3, 80)], entries=((12, 3, 200, 32),)), KIND)
    with pytest.raises(FormatError, match="inside a run"):
        ckpt.decode(buf, KIND, CID)


@pytest.mark.parametrize(
    ("runs", "holes", "why"),
    [
        ([StoredRun(0, 5, 3, 80), StoredRun(3, 5, 3, 800)], [], "overlap"),
        ([StoredRun(0, 0, 3, 80)], [], "empty"),
        ([StoredRun(0, 5, 9, 80)], [], "not in its file table"),
        ([StoredRun(0, 5, 3, 8)], [], "inside a file header"),
        ([StoredRun(0, 5, 3, 84)], [], "alignment"),
        ([StoredRun(0, 5, 4, FILES[4])], [], "past its file"),
        ([StoredRun(0, 1 << 40, 3, 80)], [], "more events than its file holds"),
        ([StoredRun(0, (4 << 30) // 40, 3, 80)], [], "more events than its file holds"),
        ([StoredRun((1 << 63) - 2, 4, 3, 80)], [], "more events than its file holds"),
        ([StoredRun(0, 5, 3, 80)], [7], "outside every run"),
        ([StoredRun(0, 5, 3, 80)], [3, 2], "do not increase"),
    ],
)
def test_runs_that_cannot_name_events_are_refused(runs: list[StoredRun], holes: list[int], why: str) -> None:
    # Encoded as given (the encoder trusts the queue), checksummed: the decoder must still refuse it.
    buf = ckpt.encode(_snap(runs, holes), KIND)
    with pytest.raises(FormatError, match=why):
        ckpt.decode(buf, KIND, CID)


def test_every_truncation_and_flag_change_is_refused() -> None:
    buf = ckpt.encode(_snap([StoredRun(0, 5, 3, 80)], holes=[2], entries=((9, 4, 80, 32),)), KIND)
    for n in range(len(buf)):
        with pytest.raises(FormatError):
            ckpt.decode(buf[:n], KIND, CID)
    for flags in (ckpt.SEALED, 4, 0x8000):
        b = bytearray(buf)
        struct.pack_into("<H", b, 10, flags)
        with pytest.raises(FormatError, match="flags"):
            ckpt.decode(_recrc(b), KIND, CID)
    b = bytearray(buf)
    struct.pack_into("<H", b, 8, ckpt.VERSION)  # a version 2 reader's view of it: sizes do not add up
    with pytest.raises(FormatError):
        ckpt.decode(_recrc(b), KIND, CID)


def test_earlier_versions_are_still_written_without_runs_and_read() -> None:
    snap = _snap([], entries=((1, 3, 80, 32), (2, 3, 112, 32)))
    snap.runs = None
    buf = ckpt.encode(snap, KIND)
    assert struct.unpack_from("<H", buf, 8)[0] == ckpt.VERSION
    back = ckpt.decode(buf, KIND, CID)
    assert back.runs is None
    assert list(back.positions) == [1, 2]
    assert len(back) == 2


def test_sealed_marks_and_a_mac_in_an_encrypted_channel(tmp_path: Path) -> None:
    pytest.importorskip("cryptography")
    from filechannel.crypto import Encryption, MetaMac

    enc = Encryption(keys={"k1": bytes(range(32))}, active_key="k1")
    mac = MetaMac(enc, CID)
    snap = _snap([StoredRun(0, 1_000_000, 3, 80)], holes=[5])
    snap.marks = [("producer:a", b"secret-offset", 900, 3)]
    store = ckpt.CheckpointStore(DEFAULT_FS, str(tmp_path))
    nbytes, _copies = store.write(snap, KIND, mac=mac)
    assert nbytes < 1024
    (found,) = store.list()
    raw = Path(found.path).read_bytes()
    assert b"secret-offset" not in raw
    assert b"producer:a" not in raw
    assert struct.unpack_from("<H", raw, 10)[0] == ckpt.HAS_MARKS | ckpt.SEALED
    back = store.load(found, KIND, CID, mac, required=True)
    assert back.runs == snap.runs
    assert back.holes == [5]
    assert back.marks == snap.marks
    # A flipped byte in the runs table: the MAC refuses it (before any checksum).
    at = raw.index(struct.pack("<QQQQ", 0, 1_000_000, 3, 80))
    bad = bytearray(raw)
    bad[at + 8] ^= 1
    with pytest.raises(FormatError):
        ckpt.decode_sealed(bytes(bad), KIND, CID, found.path, mac, True)
