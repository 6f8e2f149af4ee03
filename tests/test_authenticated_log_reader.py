"""ChannelReader follows an authenticated log: batches forged or edited after it opened are never delivered.

The reader scans only the bytes appended since its last refresh. In an
encrypted channel (format version 2) those scans check every batch tag and
carry the chain's last tag from one refresh to the next, as recovery does at
open: a batch with valid checksums but no valid tag is refused (or, with
``on_corruption="skip"``, reported and dropped), never applied.
"""

from __future__ import annotations

import os
import struct
from array import array
from pathlib import Path

import pytest

pytest.importorskip("cryptography", reason="the crypto extra is not installed (README, Installing)")

from test_authenticated_log import OPTS, append_forged_batch, batches, enc, header, make, segs

import filechannel
from filechannel import format as fmt


def reader(d: str, policy: str = "fail") -> filechannel.ChannelReader:
    r = filechannel.ChannelReader(d, encryption=enc(), on_corruption=policy)
    r.available()  # opened: what follows is read by the incremental scans
    return r


def bodies_of(r: filechannel.ChannelReader) -> list[bytes]:
    start, end = r.available()
    return [e.body for e in r.read(start, end)]


def forge_take_only(d: str) -> int:
    """Append a committed take of positions 3-5 (valid checksums, made-up tag) to the newest file."""
    path = segs(d)[-1]
    with filechannel.open(d, encryption=enc(), **OPTS) as ch:
        woid = ch._log.last_woid + 1
        txn = ch._log.new_txn_id()
    forged = [(fmt.TAKE, txn, fmt.encode_take([(3, 3)])), (fmt.COMMIT, txn, fmt.encode_commit(0, 0, 3))]
    return append_forged_batch(path, forged, woid)


def test_genuine_batches_appended_across_refreshes_are_delivered(chan_dir: str) -> None:
    """The chain carried between refreshes accepts what the owner writes, in one file and across a roll."""
    bodies = make(chan_dir, n_txns=2)
    r = reader(chan_dir)
    with filechannel.open(chan_dir, encryption=enc(), **OPTS) as ch:
        for t in range(4):
            with ch.transaction() as tx:
                tx.put(b"late-%d" % t)
            bodies.append(b"late-%d" % t)
            assert bodies_of(r) == bodies  # one refresh per batch: each chains to the one before
    assert r.corruption == []


@pytest.mark.parametrize("policy", ["fail", "skip"])
def test_a_take_only_transaction_forged_after_the_reader_opened_is_never_applied(chan_dir: str, policy: str) -> None:
    bodies = make(chan_dir)
    r = reader(chan_dir, policy)
    # The reader already read this file up to its last batch: the forged batch chains to that batch's tag.
    at = forge_take_only(chan_dir)
    if policy == "fail":
        with pytest.raises(filechannel.CorruptLogError, match="batch authentication failed") as ei:
            r.available()
        assert ei.value.path == segs(chan_dir)[-1]
        assert ei.value.offset == at
        return
    assert bodies_of(r) == bodies  # positions 3-5 are still there
    assert bodies_of(r) == bodies  # a second refresh meets it again: still refused, reported once
    assert len(r.corruption) == 1
    assert "batch authentication failed" in r.corruption[0].reason


@pytest.mark.parametrize("policy", ["fail", "skip"])
def test_a_commit_edited_with_fixed_checksums_after_the_reader_opened_is_never_applied(
    chan_dir: str, policy: str
) -> None:
    """The owner commits a batch after the reader opened; its COMMIT is edited, every checksum fixed."""
    bodies = make(chan_dir, n_txns=2)
    r = reader(chan_dir, policy)
    with filechannel.open(chan_dir, encryption=enc(), **OPTS) as ch, ch.transaction() as tx:
        tx.put(b"third")
    path = segs(chan_dir)[-1]
    h = header(path)
    seed = fmt.file_seed(h.crc_kind, h.channel_id, h.file_id)
    buf = bytearray(Path(path).read_bytes())
    start, be_off = batches(path)[-1]
    pos = start
    while pos < be_off:
        rec = fmt.decode_record(bytes(buf), pos, seed, h.crc_kind, 1 << 30)
        assert isinstance(rec, fmt.Record)
        if rec.op == fmt.COMMIT:
            fp, npt, nt = fmt.decode_commit(rec.payload)
            new = fmt.encode_record(
                fmt.COMMIT, rec.woid, rec.txn_id, fmt.encode_commit(fp - 3, npt, nt), seed, h.crc_kind
            )
            buf[pos : pos + len(new)] = new  # claims position 3: the event there would be replaced
        pos = rec.end
    fixed = bytearray(buf[be_off + 32 : be_off + 64])
    struct.pack_into("<I", fixed, 12, fmt.crc(h.crc_kind, bytes(buf[start:be_off]), seed))
    woid = struct.unpack_from("<Q", buf, be_off + 8)[0]
    tag = bytes(buf[be_off + 64 : be_off + 80])
    frame = fmt.encode_record(fmt.BATCH_END, woid, 0, bytes(fixed) + tag, seed, h.crc_kind)
    buf[be_off : be_off + len(frame)] = frame
    Path(path).write_bytes(bytes(buf))
    if policy == "fail":
        with pytest.raises(filechannel.CorruptLogError, match="batch authentication failed") as ei:
            r.available()
        assert ei.value.offset == start
        return
    assert bodies_of(r) == bodies  # the edited batch is dropped: nothing replaced, nothing added
    assert [e.body for e in r.read(3, 4)] == [bodies[3]]
    assert any("batch authentication failed" in c.reason for c in r.corruption)


@pytest.mark.parametrize("policy", ["fail", "skip"])
def test_a_plaintext_data_file_forged_after_the_reader_opened_is_refused(chan_dir: str, policy: str) -> None:
    bodies = make(chan_dir)
    r = reader(chan_dir, policy)
    with filechannel.open(chan_dir, encryption=enc(), **OPTS) as ch:
        log = ch._log
        woid, pos, txn = log.last_woid + 1, log.next_position, log.new_txn_id()
        cid, kind, live = log.channel_id, log.crc_kind, log.file_ids()
        fid = max(live) + 1
    h = fmt.FileHeader(kind, cid, fid, woid, pos, txn + 1, 0, tuple(live))
    head = fmt.encode_file_header(h)
    seed = fmt.file_seed(kind, cid, fid)
    enc_ = fmt.record_encoder(seed, kind)
    parts: list[bytes] = []
    offs: array[int] = array("q")
    sizes: array[int] = array("q")
    enc_.add_puts(parts, woid, txn, [fmt.encode_event(b"forged", None)], offs, sizes, len(head))
    enc_.add(parts, fmt.COMMIT, woid + 1, txn, fmt.encode_commit(pos, 1, 0))
    enc_.close_batch(parts, len(head), woid, woid + 2)
    forged = os.path.join(chan_dir, "data", f"seg-{fid:016x}.wal")
    Path(forged).write_bytes(head + b"".join(parts))
    if policy == "fail":
        with pytest.raises(filechannel.CorruptLogError, match="plaintext data file newer") as ei:
            r.available()
        assert ei.value.path == forged
        return
    assert bodies_of(r) == bodies
    assert bodies_of(r) == bodies
    assert len(r.corruption) == 1
    assert "plaintext data file newer" in r.corruption[0].reason
