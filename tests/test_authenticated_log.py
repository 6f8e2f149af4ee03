"""The authenticated log (format version 2): forged, edited, moved and reordered batches are caught.

An attacker with write access to the channel directory but without the key
can write valid checksums, never a valid batch tag. Every edit below is one
such attacker's; each is refused at open (``on_corruption="fail"``) or, in
skip mode, dropped and reported: never delivered, never silent.
"""

from __future__ import annotations

import os
import shutil
import struct
from array import array
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("cryptography", reason="the crypto extra is not installed (README, Installing)")

import filechannel
from filechannel import format as fmt
from filechannel.crypto import Encryption
from filechannel.verify import verify_channel

KEY = bytes(range(32))
OPTS: dict[str, Any] = {"minimum_required_space": 0, "background": False, "checkpoint_interval": 0}


def enc() -> Encryption:
    return Encryption(keys={"k1": KEY}, active_key="k1")


def segs(d: str) -> list[str]:
    data = os.path.join(d, "data")
    return sorted(os.path.join(data, n) for n in os.listdir(data) if n.endswith(".wal"))


def drop_checkpoints(d: str) -> None:
    ck = os.path.join(d, "checkpoints")
    for n in os.listdir(ck) if os.path.isdir(ck) else []:
        os.unlink(os.path.join(ck, n))


def header(path: str) -> fmt.FileHeader:
    h = fmt.decode_file_header(Path(path).read_bytes())
    assert isinstance(h, fmt.FileHeader)
    return h


def batches(path: str) -> list[tuple[int, int]]:
    """``(batch start, BATCH_END offset)`` of every batch of a file, in order."""
    buf = Path(path).read_bytes()
    h = header(path)
    seed = fmt.file_seed(h.crc_kind, h.channel_id, h.file_id)
    out = []
    pos = start = h.header_len
    while pos < len(buf) and buf[pos]:
        r = fmt.decode_record(buf, pos, seed, h.crc_kind, 1 << 30)
        assert isinstance(r, fmt.Record)
        if r.op == fmt.BATCH_END:
            out.append((start, pos))
            start = r.end
        pos = r.end
    return out


def make(d: str, n_txns: int = 4, per_txn: int = 3) -> list[bytes]:
    """An encrypted channel with ``n_txns`` committed transactions, one batch each; returns the bodies."""
    bodies = []
    with filechannel.open(d, encryption=enc(), **OPTS) as ch:
        for t in range(n_txns):
            with ch.transaction() as tx:
                for i in range(per_txn):
                    body = b"event-%d-%d" % (t, i)
                    tx.put(body)
                    bodies.append(body)
    drop_checkpoints(d)  # no checkpoint vouches: only the log itself can tell
    return bodies


def drain(d: str, **kw: Any) -> tuple[list[bytes], dict[str, Any]]:
    with filechannel.open(d, encryption=enc(), **OPTS, **kw) as ch:
        tx = ch.transaction()
        got = [e.body for e in tx.take_batch(10_000)]
        tx.rollback()
        return got, ch.stats()


def frames(seed: int, kind: int, start: int, woid: int, records: list[tuple[int, int, bytes]], tag: bytes) -> bytes:
    """Records with valid checksums, closed by a BATCH_END with valid checksums and the given tag."""
    enc_ = fmt.record_encoder(seed, kind)
    parts: list[bytes] = []
    first = woid
    for op, txn, payload in records:
        enc_.add(parts, op, woid, txn, payload)
        woid += 1
    body = b"".join(parts)
    fixed = struct.pack("<QIIQQ", start, len(body), fmt.crc(kind, body, seed), first, woid - 1)
    return body + fmt.encode_record(fmt.BATCH_END, woid, 0, fixed + tag, seed, kind)


def append_forged_batch(path: str, records: list[tuple[int, int, bytes]], woid: int) -> int:
    """Append a batch with valid checksums and a made-up tag where the file's records end; return its offset."""
    h = header(path)
    buf = bytearray(Path(path).read_bytes())
    end = batches(path)[-1][1]
    end += fmt.record_size(48)
    seed = fmt.file_seed(h.crc_kind, h.channel_id, h.file_id)
    data = frames(seed, h.crc_kind, end, woid, records, os.urandom(16))
    buf[end : end + len(data)] = data
    Path(path).write_bytes(bytes(buf))
    return end


def test_a_forged_take_only_transaction_is_refused_never_applied(chan_dir: str) -> None:
    bodies = make(chan_dir)
    path = segs(chan_dir)[-1]
    with filechannel.open(chan_dir, encryption=enc(), **OPTS) as ch:
        woid = ch._log.last_woid + 1
        txn = ch._log.new_txn_id()
    drop_checkpoints(chan_dir)
    # Take positions 3-5 out of the middle of the queue, as a committed transaction would.
    forged = [(fmt.TAKE, txn, fmt.encode_take([(3, 3)])), (fmt.COMMIT, txn, fmt.encode_commit(0, 0, 3))]
    at = append_forged_batch(path, forged, woid)
    with pytest.raises(filechannel.CorruptLogError, match="batch authentication failed") as ei:
        filechannel.open(chan_dir, encryption=enc(), **OPTS)
    assert ei.value.path == path
    assert ei.value.offset == at  # named, not cut as a torn tail
    assert not verify_channel(chan_dir, encryption=enc()).ok
    got, st = drain(chan_dir, on_corruption="skip")
    assert got == bodies  # the forged take removed nothing
    assert st["corruptions_skipped"] >= 1


def test_a_forged_plaintext_data_file_is_refused(chan_dir: str) -> None:
    bodies = make(chan_dir)
    with filechannel.open(chan_dir, encryption=enc(), **OPTS) as ch:
        log = ch._log
        woid, pos, txn = log.last_woid + 1, log.next_position, log.new_txn_id()
        cid, kind, live = log.channel_id, log.crc_kind, log.file_ids()
        fid = max(live) + 1
    drop_checkpoints(chan_dir)
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
    with pytest.raises(filechannel.CorruptLogError, match="plaintext data file newer") as ei:
        filechannel.open(chan_dir, encryption=enc(), **OPTS)
    assert ei.value.path == forged
    assert not verify_channel(chan_dir, encryption=enc()).ok
    got, st = drain(chan_dir, on_corruption="skip")
    assert got == bodies
    assert b"forged" not in got
    assert st["corruptions_skipped"] == 1
    with pytest.raises(filechannel.CorruptLogError, match="plaintext data file newer"):
        filechannel.ChannelReader(chan_dir, encryption=enc()).available()


@pytest.mark.parametrize("policy", ["fail", "skip"])
def test_an_edited_control_record_with_fixed_checksums_is_caught(chan_dir: str, policy: str) -> None:
    """The COMMIT of the second transaction claims other positions; every checksum is fixed."""
    bodies = make(chan_dir)
    path = segs(chan_dir)[-1]
    h = header(path)
    seed = fmt.file_seed(h.crc_kind, h.channel_id, h.file_id)
    buf = bytearray(Path(path).read_bytes())
    start, be_off = batches(path)[1]
    pos = start
    while pos < be_off:
        r = fmt.decode_record(bytes(buf), pos, seed, h.crc_kind, 1 << 30)
        assert isinstance(r, fmt.Record)
        if r.op == fmt.COMMIT:
            fp, npt, nt = fmt.decode_commit(r.payload)
            new = fmt.encode_record(
                fmt.COMMIT, r.woid, r.txn_id, fmt.encode_commit(fp + 100, npt, nt), seed, h.crc_kind
            )
            buf[pos : pos + len(new)] = new
        pos = r.end
    body = bytes(buf[start:be_off])
    fixed = bytearray(buf[be_off + 32 : be_off + 64])
    struct.pack_into("<I", fixed, 12, fmt.crc(h.crc_kind, body, seed))
    woid = struct.unpack_from("<Q", buf, be_off + 8)[0]
    tag = bytes(buf[be_off + 64 : be_off + 80])
    frame = fmt.encode_record(fmt.BATCH_END, woid, 0, bytes(fixed) + tag, seed, h.crc_kind)
    buf[be_off : be_off + len(frame)] = frame
    Path(path).write_bytes(bytes(buf))
    if policy == "fail":
        with pytest.raises(filechannel.CorruptLogError, match="batch authentication failed") as ei:
            filechannel.open(chan_dir, encryption=enc(), **OPTS)
        assert ei.value.offset == start
        return
    got, st = drain(chan_dir, on_corruption="skip")
    assert got == bodies[:3] + bodies[6:]  # the edited batch is lost, reported; the rest is intact
    assert st["lost_positions"] == [[3, 6]]


def test_reordered_batches_are_caught(chan_dir: str) -> None:
    """Two batches of equal length swapped, each BATCH_END's start and checksums fixed for its new place."""
    make(chan_dir, n_txns=3)
    path = segs(chan_dir)[-1]
    h = header(path)
    seed = fmt.file_seed(h.crc_kind, h.channel_id, h.file_id)
    buf = bytearray(Path(path).read_bytes())
    (s1, e1), (s2, e2) = batches(path)[1:3]
    n1, n2 = e1 + fmt.record_size(48) - s1, e2 + fmt.record_size(48) - s2
    assert n1 == n2
    assert s2 == s1 + n1
    b1, b2 = bytes(buf[s1 : s1 + n1]), bytes(buf[s2 : s2 + n2])

    def moved(batch: bytes, new_start: int) -> bytes:
        be = len(batch) - fmt.record_size(48)
        fixed = bytearray(batch[be + 32 : be + 64])
        struct.pack_into("<Q", fixed, 0, new_start)
        woid = struct.unpack_from("<Q", batch, be + 8)[0]
        return batch[:be] + fmt.encode_record(
            fmt.BATCH_END, woid, 0, bytes(fixed) + batch[be + 64 : be + 80], seed, h.crc_kind
        )

    buf[s1 : s1 + n1] = moved(b2, s1)
    buf[s2 : s2 + n2] = moved(b1, s2)
    Path(path).write_bytes(bytes(buf))
    with pytest.raises(filechannel.CorruptLogError):
        filechannel.open(chan_dir, encryption=enc(), **OPTS)


def test_a_removed_middle_batch_is_caught(chan_dir: str) -> None:
    """The second batch cut out; the later batches moved up, their starts and checksums fixed."""
    make(chan_dir, n_txns=3)
    path = segs(chan_dir)[-1]
    h = header(path)
    seed = fmt.file_seed(h.crc_kind, h.channel_id, h.file_id)
    buf = bytearray(Path(path).read_bytes())
    bs = batches(path)
    (s1, _), (s2, e2) = bs[1], bs[2]
    n = s2 - s1
    later = bytes(buf[s2 : e2 + fmt.record_size(48)])
    be = len(later) - fmt.record_size(48)
    fixed = bytearray(later[be + 32 : be + 64])
    struct.pack_into("<Q", fixed, 0, s1)
    woid = struct.unpack_from("<Q", later, be + 8)[0]
    later = later[:be] + fmt.encode_record(
        fmt.BATCH_END, woid, 0, bytes(fixed) + later[be + 64 : be + 80], seed, h.crc_kind
    )
    del buf[s1 : s1 + n]
    buf[s1 : s1 + len(later)] = later
    Path(path).write_bytes(bytes(buf))
    with pytest.raises(filechannel.CorruptLogError, match=r"batch authentication failed|shorter than the checkpoint"):
        filechannel.open(chan_dir, encryption=enc(), **OPTS)


def test_every_single_byte_flip_is_refused_or_reported_never_delivered(tmp_path: Path) -> None:
    pristine = str(tmp_path / "pristine")
    bodies = make(pristine, n_txns=2, per_txn=2)
    rel = os.path.relpath(segs(pristine)[-1], pristine)
    clean = Path(pristine, rel).read_bytes()
    end = batches(os.path.join(pristine, rel))[-1][1] + fmt.record_size(48)
    for i in range(end):
        d = str(tmp_path / f"flip-{i}")
        shutil.copytree(pristine, d)
        buf = bytearray(clean)
        buf[i] ^= 0x40
        Path(d, rel).write_bytes(bytes(buf))
        try:
            got, st = drain(d)
        except filechannel.CorruptLogError:
            got, st = drain(d, on_corruption="skip")
            assert st["corruptions_skipped"] >= 1, i
        # Whatever comes back is a genuine event, in order; a loss is reported, never silent. Damage
        # in the last batch with no checkpoint vouching for it looks like a torn write: it is cut as
        # a torn tail (a WARNING and a counter), and only a suffix of the events may go that way.
        assert got == [b for b in bodies if b in got], i
        if got != bodies:
            torn = st["torn_tails_truncated"] >= 1 and got == bodies[: len(got)]
            assert st["corruptions_skipped"] >= 1 or st["lost_positions"] or torn, i
        shutil.rmtree(d)
