"""Sealed marks: in an encrypted channel no mark key or value reaches the disk in plaintext.

A MARK record of an encrypted data file is sealed as a PUT is (flag ``FLAG_SEALED``,
the file's cipher, the record's woid as nonce), re-logged copies too, and a
checkpoint's marks table is one AEAD message (checkpoint version 4). These tests grep
every byte under the channel directory after commits, checkpoints, re-logs and a
close; reopen from a checkpoint and by full replay across retirements; treat a sealed
MARK whose tag fails as damage (``on_corruption``); refuse what cannot be opened
without the key; and check that the C walk and the pure-Python scan agree on sealed
MARK frames, and on their length bounds.
"""

from __future__ import annotations

import os
import random
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest
from helpers import NO_ACCELERATOR, data_files, records
from hypothesis import given, settings
from hypothesis import strategies as st

import filechannel
from filechannel import checkpoint as ckpt
from filechannel import format as fmt
from filechannel import scan
from filechannel.config import ChannelConfig
from filechannel.errors import CorruptLogError, FormatError
from filechannel.verify import verify_channel

pytest.importorskip("cryptography")

KEY = bytes(range(32))
OPTS: dict[str, Any] = {"minimum_required_space": 0, "background": False, "checkpoint_interval": 0}
# Distinctive bytes, as the agent and the sources store them: file paths, inodes, digests, producer ids.
SECRET_KEYS = [f"tail:/srv/logs/QX7-secret-{i}.log" for i in range(4)]
SECRET_VALUES = [b"inode=88%d;first-kib=ZK4-blake2b-%d" % (i, i) for i in range(4)]
C = fmt.speedups


def enc(key: bytes = KEY, key_id: str = "k1") -> filechannel.Encryption:
    return filechannel.Encryption(keys={key_id: key}, active_key=key_id)


def drop_checkpoints(d: str) -> None:
    shutil.rmtree(os.path.join(d, "checkpoints"), ignore_errors=True)


def busy_channel(d: str) -> dict[str, bytes]:
    """Marks committed, checkpointed, re-logged across retirements, then a close; returns the marks.

    ``SECRET_KEYS[0]`` is set once, in the first data file: after that file retires it lives
    only in re-logged copies (and in checkpoints).
    """
    rng = random.Random(11)
    model: dict[str, bytes] = {}
    retired = 0
    ch = filechannel.open(d, **OPTS, max_file_size=4096, encryption=enc())
    try:
        with ch.transaction() as tx:
            tx.put(b"first")
            tx.mark(SECRET_KEYS[0], SECRET_VALUES[0])
        model[SECRET_KEYS[0]] = SECRET_VALUES[0]
        for i in range(60):
            with ch.transaction() as tx:
                tx.put(os.urandom(rng.randint(200, 700)))
                k = rng.randint(1, 3)
                tx.mark(SECRET_KEYS[k], SECRET_VALUES[k] + b"#%d" % i)
                model[SECRET_KEYS[k]] = SECRET_VALUES[k] + b"#%d" % i
            with ch.transaction() as tx:
                tx.take_batch(3)
            if i % 20 == 19:
                ch.checkpoint()
        with ch.transaction() as tx:  # a transaction of marks alone
            tx.mark(SECRET_KEYS[3], SECRET_VALUES[3])
        model[SECRET_KEYS[3]] = SECRET_VALUES[3]
        assert ch.marks() == model
        retired = ch.stats()["files_retired"]
    finally:
        ch.close()
    assert retired >= 3
    assert os.path.basename(data_files(d)[0]) != fmt_seg(1)  # the file that first held SECRET_KEYS[0] is gone
    return model


def fmt_seg(file_id: int) -> str:
    return scan.segment_name(file_id)


# -- nothing in plaintext ----------------------------------------------------------------------------


def test_no_mark_key_or_value_is_on_disk_after_commits_checkpoints_relogs_and_a_close(chan_dir: str) -> None:
    busy_channel(chan_dir)
    needles = [k.encode() for k in SECRET_KEYS] + SECRET_VALUES + [b"QX7-secret", b"ZK4-blake2b"]
    seen = 0
    for root, _dirs, files in os.walk(chan_dir):
        for name in files:
            data = Path(root, name).read_bytes()
            seen += 1
            for needle in needles:
                assert needle not in data, f"{needle!r} in plaintext in {os.path.join(root, name)}"
    assert seen >= 3  # data files, checkpoints, metadata


@pytest.mark.parametrize("replay", ["checkpoint", "full"])
def test_sealed_marks_survive_a_reopen_and_retirements(chan_dir: str, replay: str) -> None:
    """Every MARK on disk is sealed, the checkpoint's table too; both recoveries still find every mark."""
    model = busy_channel(chan_dir)
    marks = [r for p in data_files(chan_dir) for r in records(p) if r.op == fmt.MARK]
    assert marks
    assert all(r.sealed for r in marks)
    newest = sorted(Path(chan_dir, "checkpoints").glob("ckpt-*.ckpt"))[-1]
    version, flags = struct.unpack_from("<HH", newest.read_bytes(), 8)
    assert (version, flags) == (ckpt.RUNS_VERSION, ckpt.HAS_MARKS | ckpt.SEALED)  # version 4's sealed table
    if replay == "full":
        drop_checkpoints(chan_dir)
    with filechannel.open(chan_dir, **OPTS, encryption=enc()) as ch:
        assert ch.recovery_source == replay
        assert ch.marks() == model
        with ch.transaction() as tx:
            tx.mark(SECRET_KEYS[1], b"after the reopen")
    model[SECRET_KEYS[1]] = b"after the reopen"
    drop_checkpoints(chan_dir)
    with filechannel.open(chan_dir, **OPTS, encryption=enc()) as ch:
        assert ch.marks() == model


def test_a_plaintext_mark_of_an_earlier_writer_is_read_and_its_re_logged_copy_is_sealed(
    chan_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An encrypted file with an unsealed MARK (a pre-release writer: the batch tag covers it) still reads."""
    with monkeypatch.context() as m:  # the earlier writer: MARK payloads framed as they are
        m.setattr(fmt._RecordEncoder, "add_sealed", lambda self, parts, op, w, t, p, o: self.add(parts, op, w, t, p))
        with filechannel.open(chan_dir, **OPTS, max_file_size=4096, encryption=enc()) as ch, ch.transaction() as tx:
            tx.put(b"x" * 1000)
            tx.mark(SECRET_KEYS[0], SECRET_VALUES[0])
    (old,) = [r for r in records(data_files(chan_dir)[0]) if r.op == fmt.MARK]
    assert not old.sealed
    drop_checkpoints(chan_dir)
    with filechannel.open(chan_dir, **OPTS, max_file_size=4096, encryption=enc()) as ch:
        assert ch.marks() == {SECRET_KEYS[0]: SECRET_VALUES[0]}
        with ch.transaction() as tx:
            tx.take()  # the first file empties and retires: its mark is re-logged first
        assert ch.stats()["files_retired"] == 1
    assert not Path(data_files(chan_dir)[0]).name.endswith(fmt_seg(1))
    marks = [r for p in data_files(chan_dir) for r in records(p) if r.op == fmt.MARK]
    assert marks
    assert all(r.sealed for r in marks)
    drop_checkpoints(chan_dir)
    with filechannel.open(chan_dir, **OPTS, encryption=enc()) as ch:
        assert ch.marks() == {SECRET_KEYS[0]: SECRET_VALUES[0]}


# -- the checkpoint's marks table ---------------------------------------------------------------------


def test_a_checkpoint_marks_table_is_sealed_under_its_own_salt() -> None:
    cid = bytes(range(16))
    kind = fmt.CRC32C
    mac = enc().meta_mac(cid)
    s = ckpt.Snapshot(9, 3, 4, 5, cid, 0, {1: 88})
    s.marks = [(SECRET_KEYS[0], SECRET_VALUES[0], 8, 1), (SECRET_KEYS[1], b"", 3, 1)]
    data = ckpt.encode(s, kind, mac)
    assert struct.unpack_from("<H", data, 8)[0] == ckpt.SEALED_MARKS_VERSION
    assert SECRET_KEYS[0].encode() not in data
    assert SECRET_VALUES[0] not in data
    assert b"QX7" not in data
    assert ckpt.encode(s, kind, mac) != data  # a fresh salt (so a fresh key) for every checkpoint
    assert ckpt.decode(data, kind, cid, mac).marks == s.marks
    # Without the key the rest of the checkpoint is still read; the marks are not.
    keyless = ckpt.decode(data, kind, cid)
    assert keyless.marks == []
    assert keyless.marks_unread
    assert keyless.files == {1: 88}
    # A plaintext channel's checkpoint is version 3 as before.
    assert struct.unpack_from("<H", ckpt.encode(s, kind), 8)[0] == ckpt.MARKS_VERSION
    # A flipped bit in the sealed table (the checksum fixed) does not open; nor does another key.
    bad = bytearray(data)
    bad[len(bad) - 10] ^= 1
    bad[-4:] = struct.pack("<I", fmt.crc(kind, bytes(bad[:-4])))
    with pytest.raises(FormatError, match="does not open"):
        ckpt.decode(bytes(bad), kind, cid, mac)
    with pytest.raises(FormatError, match="does not open"):
        ckpt.decode(data, kind, cid, enc(bytes(32)).meta_mac(cid))
    with pytest.raises(filechannel.DecryptionError, match="key id 'k1'"):
        ckpt.decode(data, kind, cid, enc(KEY, "k2").meta_mac(cid))


# -- damage --------------------------------------------------------------------------------------------


def _reauthenticate(path: str, cipher: Any) -> None:
    """Fix every batch checksum and batch tag of an authenticated file, in order (records' crcs: the caller's)."""
    buf = bytearray(Path(path).read_bytes())
    h = fmt.decode_file_header(bytes(buf))
    assert isinstance(h, fmt.FileHeader)
    seed, kind = fmt.file_seed(h.crc_kind, h.channel_id, h.file_id), h.crc_kind
    prev = h.key_check
    for be_rec in [r for r in records(path) if r.op == fmt.BATCH_END]:
        b = fmt.decode_batch_end(be_rec.payload)
        off = be_rec.offset
        fixed = struct.pack(
            "<QIIQQ",
            b.batch_start,
            b.batch_len,
            fmt.crc(kind, bytes(buf[b.batch_start : off]), seed),
            b.first_woid,
            b.last_woid,
        )
        buf[off + 32 : off + 64] = fixed
        tag = cipher.batch_tag(be_rec.woid, fmt.batch_auth_data(prev, buf[b.batch_start : off], buf[off : off + 64]))
        buf[off : be_rec.end] = fmt.encode_record(fmt.BATCH_END, be_rec.woid, 0, fixed + tag, seed, kind)
        prev = tag
    Path(path).write_bytes(bytes(buf))


def _forget_anchored_tags(chan_dir: str, channel_id: bytes) -> None:
    """Rewrite ANCHOR (with the key, as only a key holder can) without its per-file lengths and tags."""
    p = os.path.join(chan_dir, "ANCHOR")
    body, _kid, _tag = fmt.split_sealed(Path(p).read_bytes())
    new = fmt.encode_auth_state(fmt.AuthState(fmt.decode_auth_state(body).first_auth, ()))
    kid, tag = enc().meta_mac(channel_id).tag("ANCHOR", new)
    Path(p).write_bytes(fmt.encode_sealed(new, kid, tag))


@pytest.mark.parametrize("policy", ["fail", "skip"])
def test_a_sealed_mark_whose_tag_fails_is_damage(chan_dir: str, policy: str) -> None:
    """Its checksums and batch tag made good (only its own tag can tell): fail refuses, skip reports and drops it."""
    with filechannel.open(chan_dir, **OPTS, encryption=enc()) as ch:
        with ch.transaction() as tx:
            tx.put(b"one")
            tx.mark(SECRET_KEYS[0], b"old")
        with ch.transaction() as tx:
            tx.put(b"two")
            tx.mark(SECRET_KEYS[0], b"new")
    drop_checkpoints(chan_dir)
    path = data_files(chan_dir)[-1]
    m = [r for r in records(path) if r.op == fmt.MARK and r.sealed][-1]  # the second transaction's
    payload = bytearray(m.payload)
    payload[3] ^= 0x40  # inside the ciphertext
    h = fmt.decode_file_header(Path(path).read_bytes())
    assert isinstance(h, fmt.FileHeader)
    seed = fmt.file_seed(h.crc_kind, h.channel_id, h.file_id)
    head = fmt.record_head(fmt.MARK, fmt.FLAG_SEALED, len(payload), m.woid, m.txn_id)
    buf = bytearray(Path(path).read_bytes())
    buf[m.offset + 24 : m.offset + 28] = struct.pack(
        "<I", fmt.crc(h.crc_kind, bytes(payload), fmt.crc(h.crc_kind, head, seed))
    )
    buf[m.offset + 32 : m.offset + 32 + len(payload)] = payload
    Path(path).write_bytes(bytes(buf))
    cipher = enc().file_cipher(path, h.cipher, h.key_id, h.salt, h.channel_id, h.file_id)
    _reauthenticate(path, cipher)
    _forget_anchored_tags(chan_dir, h.channel_id)  # the re-tag is a key holder's: reach the record's own tag
    if policy == "fail":
        with pytest.raises(filechannel.DecryptionError, match=r"mark record: .*authentication tag fails") as ei:
            filechannel.open(chan_dir, **OPTS, encryption=enc())
        assert ei.value.offset == m.offset
        assert ei.value.path == path
        return
    with filechannel.open(chan_dir, **OPTS, encryption=enc(), on_corruption="skip") as ch:
        assert ch.marks() == {SECRET_KEYS[0]: b"old"}  # the damaged copy never counts
        assert any("mark record" in r for r in ch.stats()["corruption_report"])
        tx = ch.transaction()
        assert [e.body for e in tx.take_batch(5)] == [b"one", b"two"]  # only the marks are lost
        tx.rollback()


def test_without_the_key_sealed_marks_are_refused_or_left_unread(chan_dir: str) -> None:
    """An open without the key fails as for PUTs; a keyless inspection reads neither marks nor their bytes."""
    with filechannel.open(chan_dir, **OPTS, encryption=enc()) as ch, ch.transaction() as tx:
        tx.mark(SECRET_KEYS[0], SECRET_VALUES[0])  # marks alone: no PUT in the channel
    with pytest.raises(filechannel.DecryptionError, match="without encryption="):
        filechannel.open(chan_dir, **OPTS)
    res = verify_channel(chan_dir)  # no key: the checksums only, from the checkpoint (sealed table unread)
    assert res.ok
    assert res.recovery_source == "checkpoint"
    drop_checkpoints(chan_dir)
    from filechannel.log import Log

    log = Log(chan_dir, ChannelConfig(), readonly=True, keyless_ok=True)
    try:
        got = [r for r in log.replay() if r.op == fmt.MARK]
    finally:
        log.close()
    assert got
    assert all(r.sealed and SECRET_VALUES[0] not in r.payload for r in got)
    assert verify_channel(chan_dir).ok  # a full replay without the key leaves them unread too


# -- the C walk and the pure-Python scan ----------------------------------------------------------------


CID = bytes(range(16, 32))


def _sealer(head: bytes, offset: int, payload: bytes) -> bytes:
    """A stand-in cipher for the frame tests: reversible, 16 bytes longer, unlike the plaintext."""
    return bytes(b ^ 0x5A for b in payload) + struct.pack("<QQ", offset, len(payload))


def _sealed_file(kind: int) -> bytes:
    """A version 1 file (32-byte BATCH_ENDs, what the C walk reads) of batches holding sealed MARK records."""
    h = fmt.FileHeader(
        crc_kind=kind, channel_id=CID, file_id=1, base_woid=1, next_position=0, next_txn_id=1, created_ns=0
    )
    out = bytearray(fmt.encode_file_header(h))
    seed = fmt.file_seed(kind, CID, 1)
    enc_ = fmt.record_encoder(seed, kind, _sealer)
    woid, txn = 1, 1
    for n_marks in (1, 2, 0, 3):
        parts: list[bytes] = []
        start, first = len(out), woid
        off = start
        for j in range(n_marks):
            ms = [fmt.Mark(f"k{txn}.{j}.{i}", b"v" * (i * 7)) for i in range(j + 1)]
            off += enc_.add_sealed(parts, fmt.MARK, woid, txn, fmt.encode_marks(ms), off)
            woid += 1
        off = enc_.add_puts(parts, woid, txn, [b"\0\0\0\0body %d" % txn], [], [], off)
        woid += 1
        off += enc_.add(parts, fmt.COMMIT, woid, txn, fmt.encode_commit(txn - 1, 1, 0))
        woid += 1
        enc_.close_batch(parts, start, first, woid)
        woid += 1
        txn += 1
        out += b"".join(bytes(p) for p in parts)
    return bytes(out)


class _Ctx:
    def __init__(self, kind: int, mode: str) -> None:
        self.crc_kind = kind
        self.config = ChannelConfig(on_corruption=mode)  # type: ignore[arg-type]
        self.channel_id = CID
        self.max_payload = 1 << 20
        self.reports: list[str] = []

    def report_corruption(self, report: scan.CorruptionReport) -> None:
        self.reports.append(repr(report))

    def note_torn_tail(self, path: str, start: int, size: int, reason: str) -> None:
        self.reports.append(f"torn {path} {start} {size} {reason}")


def _scan(accel: bool, data: bytes, kind: int, mode: str, compact: bool) -> tuple[Any, ...]:
    hdr = fmt.decode_file_header(data)
    assert isinstance(hdr, fmt.FileHeader)
    ctx = _Ctx(kind, mode)
    saved = fmt.speedups
    fmt.speedups = saved if accel else None
    try:
        try:
            fs = scan.Scanner(ctx, "/f", 1, data, hdr).scan(True, 0, vouched=len(data), compact=compact)
        except CorruptLogError as exc:
            return ("raised", str(exc), ctx.reports)
    finally:
        fmt.speedups = saved
    return (list(scan.expand_runs(fs.records)), fs.end, fs.last_woid, ctx.reports)


needs_c = pytest.mark.skipif(C is None, reason=NO_ACCELERATOR)


@needs_c
@pytest.mark.parametrize("compact", [False, True])
def test_the_c_walk_and_the_python_scan_agree_on_sealed_marks(compact: bool) -> None:
    for kind in (fmt.CRC32C, fmt.CRC32_ZLIB):
        data = _sealed_file(kind)
        c = _scan(True, data, kind, "fail", compact)
        py = _scan(False, data, kind, "fail", compact)
        assert c == py
        assert c[1] == len(data)
        marks = [r for r in c[0] if r.op == fmt.MARK]
        assert len(marks) == 6
        assert all(r.sealed for r in marks)
        assert all(r.payload[:8] != struct.pack("<II", 1, 0) for r in marks)  # stored as sealed
        plain = fmt.decode_marks(bytes(b ^ 0x5A for b in marks[0].payload[:-16]))
        assert plain == [fmt.Mark("k1.0.0", b"")]


@needs_c
@settings(max_examples=150, deadline=None)
@given(at=st.integers(0, 2000), bit=st.integers(0, 7), mode=st.sampled_from(["fail", "skip"]), compact=st.booleans())
def test_the_twins_agree_on_damaged_sealed_marks(at: int, bit: int, mode: str, compact: bool) -> None:
    data = bytearray(_sealed_file(fmt.CRC32C))
    hdr_len = fmt.decode_file_header(bytes(data)).header_len  # type: ignore[union-attr]
    i = hdr_len + at % (len(data) - hdr_len)
    data[i] ^= 1 << bit
    c = _scan(True, bytes(data), fmt.CRC32C, mode, compact)
    assert c == _scan(False, bytes(data), fmt.CRC32C, mode, compact)
    first_end = _batch_end(bytes(_sealed_file(fmt.CRC32C)))
    if mode == "skip" and i >= first_end:  # the batch before the damage is read, its sealed MARK with it
        assert any(r.op == fmt.MARK and r.sealed and r.offset < first_end for r in c[0])


def _batch_end(data: bytes) -> int:
    """The end of the first batch of a file."""
    h = fmt.decode_file_header(data)
    assert isinstance(h, fmt.FileHeader)
    found = scan.find_verified_batch_end(data, h.header_len, fmt.file_seed(h.crc_kind, CID, 1), h.crc_kind, 1 << 20)
    assert found is not None
    return found[0] + scan.BATCH_END_SIZE


@pytest.mark.parametrize("accel", [False, True])
def test_a_sealed_mark_frame_has_the_plaintext_bounds_plus_its_tag(accel: bool) -> None:
    """Both frame checks (format.decode_record and the C twins) move a sealed MARK's bounds up by the tag."""
    if accel and C is None:
        pytest.skip(NO_ACCELERATOR)
    seed, kind = 5, fmt.CRC32C
    lo, hi = fmt.mark_len_bounds(True)
    assert (lo, hi) == (fmt.MARK_MIN_PAYLOAD + fmt.ENC_TAG_LEN, fmt.MARK_MAX_PAYLOAD + fmt.ENC_TAG_LEN)
    saved = fmt.speedups
    fmt.speedups = saved if accel else None
    try:
        for n, ok in ((lo - 1, False), (lo, True), (hi, True), (hi + 1, False)):
            payload = bytes(n)
            head = fmt.record_head(fmt.MARK, fmt.FLAG_SEALED, n, 1, 1)
            c = fmt.crc(kind, payload, fmt.crc(kind, head, seed))
            frame = head + struct.pack("<II", c, 0) + payload + bytes(-n & 7)
            out = fmt.decode_puts(frame, [0], [len(frame)], seed, kind, 1 << 30, decode=False)[0]
            if ok:
                rec = fmt.decode_record(frame, 0, seed, kind, 1 << 30)
                assert isinstance(rec, fmt.Record)
                assert rec.sealed
                assert rec.op == fmt.MARK
                assert out == payload
            else:
                with pytest.raises(FormatError, match=f"mark payload length {n} is not between {lo} and {hi}"):
                    fmt.decode_record(frame, 0, seed, kind, 1 << 30)
                assert isinstance(out, FormatError)
                assert f"is not between {lo} and {hi}" in str(out)
    finally:
        fmt.speedups = saved
