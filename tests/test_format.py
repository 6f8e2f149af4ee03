"""The framing in format.py: round trips, golden vectors from docs/format.md, every corruption kind."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from filechannel import format as fmt
from filechannel.errors import FormatError
from filechannel.log import decode_channel_file, encode_channel_file

DOC = Path(__file__).resolve().parent.parent / "docs" / "format.md"
CID = bytes(range(16))
KINDS = [k for k in (fmt.CRC32C, fmt.CRC32_ZLIB) if k != fmt.CRC32C or fmt.HAVE_CRC32C]
LIMIT = 1 << 20


def seed_of(kind: int, fid: int = 7, cid: bytes = CID) -> int:
    return fmt.file_seed(kind, cid, fid)


def header(kind: int = fmt.CRC32_ZLIB, live: tuple[int, ...] = (3, 5)) -> fmt.FileHeader:
    return fmt.FileHeader(
        crc_kind=kind,
        channel_id=CID,
        file_id=7,
        base_woid=100,
        next_position=42,
        next_txn_id=9,
        created_ns=1_700_000_000_000_000_000,
        live_files=live,
    )


# -- round trips --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("live", [(), (1,), (3, 5), tuple(range(1, 40))])
def test_file_header_round_trip(kind: int, live: tuple[int, ...]) -> None:
    h = header(kind, live)
    b = fmt.encode_file_header(h)
    assert len(b) == h.header_len
    assert len(b) % 8 == 0
    assert fmt.decode_file_header(b) == h
    # Trailing bytes (the first record) do not matter.
    assert fmt.decode_file_header(b + b"\1" * 40) == h


def test_channel_file_round_trip() -> None:
    b = encode_channel_file(CID, fmt.CRC32_ZLIB, 123)
    assert len(b) == 40
    assert decode_channel_file(b) == (CID, fmt.CRC32_ZLIB, 123)
    for i in range(len(b)):
        bad = bytearray(b)
        bad[i] ^= 0x01
        with pytest.raises(FormatError):
            decode_channel_file(bytes(bad))
    with pytest.raises(FormatError):
        decode_channel_file(b[:-1])


PAYLOADS = {
    fmt.PUT: fmt.encode_event(b"body", {"k": "v", "\u00e9": "\U0001f600"}),
    fmt.TAKE: fmt.encode_take([(0, 3), (10, 1)]),
    fmt.COMMIT: fmt.encode_commit(5, 2, 4),
    fmt.ROLLBACK: fmt.encode_rollback(3, 1),
    fmt.BATCH_END: fmt.encode_batch_end(fmt.BatchEnd(88, 152, 0xDEADBEEF, 5, 7)),
    fmt.RETIRE: fmt.encode_retire(12),
    fmt.MARK: fmt.encode_marks([fmt.Mark("producer:a", b"17"), fmt.Mark("tail:/var/log/x", b"\x00" * 9, 42)]),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("op", sorted(PAYLOADS))
def test_record_round_trip_every_kind(kind: int, op: int) -> None:
    seed = seed_of(kind)
    payload = PAYLOADS[op]
    b = fmt.encode_record(op, 77, 3, payload, seed, kind)
    assert len(b) == fmt.record_size(len(payload))
    assert len(b) % 8 == 0
    prefix = b"\0" * 16
    rec = fmt.decode_record(prefix + b, 16, seed, kind, LIMIT)
    assert isinstance(rec, fmt.Record)
    assert (rec.op, rec.woid, rec.txn_id, rec.offset, rec.size, rec.payload) == (op, 77, 3, 16, len(b), payload)
    assert rec.end == 16 + len(b)
    # The fast encoder writes the same bytes.
    parts: list[bytes] = []
    n = fmt.record_encoder(seed, kind).add(parts, op, 77, 3, payload)
    assert b"".join(parts) == b
    assert n == len(b)


def test_payload_round_trips() -> None:
    assert fmt.decode_event(PAYLOADS[fmt.PUT]) == (b"body", {"k": "v", "\u00e9": "\U0001f600"})
    assert fmt.decode_event(fmt.encode_event(b"", None)) == (b"", {})
    assert fmt.decode_take(PAYLOADS[fmt.TAKE]) == [(0, 3), (10, 1)]
    assert fmt.decode_take(fmt.encode_take([])) == []
    assert fmt.decode_commit(PAYLOADS[fmt.COMMIT]) == (5, 2, 4)
    assert fmt.decode_rollback(PAYLOADS[fmt.ROLLBACK]) == (3, 1)
    assert fmt.decode_batch_end(PAYLOADS[fmt.BATCH_END]) == fmt.BatchEnd(88, 152, 0xDEADBEEF, 5, 7)
    assert fmt.decode_retire(PAYLOADS[fmt.RETIRE]) == 12


@given(
    body=st.binary(max_size=300),
    headers=st.dictionaries(st.text(max_size=20), st.text(max_size=20), max_size=5),
    woid=st.integers(0, 2**64 - 1),
    txn=st.integers(0, 2**64 - 1),
)
def test_event_record_round_trip_property(body: bytes, headers: dict[str, str], woid: int, txn: int) -> None:
    kind = KINDS[0]
    seed = seed_of(kind)
    payload = fmt.encode_event(body, headers)
    rec = fmt.decode_record(fmt.encode_record(fmt.PUT, woid, txn, payload, seed, kind), 0, seed, kind, LIMIT)
    assert isinstance(rec, fmt.Record)
    assert (rec.woid, rec.txn_id) == (woid, txn)
    assert fmt.decode_event(rec.payload) == (body, headers)


@pytest.mark.parametrize("bad", [b"", b"\1\0\0", b"\5\0\0\0" + b"x" * 3, b"\1\0\0\0\0\0\0\0", b"\1\0\0\0\x09\0\0\0ab"])
def test_bad_event_payloads(bad: bytes) -> None:
    with pytest.raises(FormatError):
        fmt.decode_event(bad)


def test_bad_fixed_size_payloads() -> None:
    for dec, good in (
        (fmt.decode_commit, PAYLOADS[fmt.COMMIT]),
        (fmt.decode_rollback, PAYLOADS[fmt.ROLLBACK]),
        (fmt.decode_batch_end, PAYLOADS[fmt.BATCH_END]),
        (fmt.decode_retire, PAYLOADS[fmt.RETIRE]),
        (fmt.decode_take, PAYLOADS[fmt.TAKE]),
    ):
        for b in (good[:-1], good + b"\0", b""):
            with pytest.raises(FormatError):
                dec(b)


# -- every corruption kind of a record ---------------------------------------------------------


def _good(kind: int = fmt.CRC32_ZLIB) -> bytes:
    return fmt.encode_record(fmt.PUT, 5, 2, fmt.encode_event(b"hello", {"a": "b"}), seed_of(kind), kind)


def _set(b: bytes, offset: int, value: bytes) -> bytes:
    return b[:offset] + value + b[offset + len(value) :]


@pytest.mark.parametrize(
    ("name", "mutate"),
    [
        ("op 0", lambda b: _set(b, 0, b"\0")),
        ("unknown op 7", lambda b: _set(b, 0, b"\7")),
        ("unknown op 255", lambda b: _set(b, 0, b"\xff")),
        ("flags set", lambda b: _set(b, 1, b"\1")),
        ("reserved u16 set", lambda b: _set(b, 2, b"\0\1")),
        ("length over limit", lambda b: _set(b, 4, struct.pack("<I", LIMIT + 1))),
        ("length changed", lambda b: _set(b, 4, struct.pack("<I", 8))),
        ("woid changed", lambda b: _set(b, 8, b"\6")),
        ("txn changed", lambda b: _set(b, 16, b"\3")),
        ("checksum changed", lambda b: _set(b, 24, bytes([b[24] ^ 1]))),
        ("reserved u32 set", lambda b: _set(b, 28, b"\1")),
        ("payload byte flipped", lambda b: _set(b, 40, bytes([b[40] ^ 0x80]))),
    ],
)
def test_record_corruption_kinds(name: str, mutate: object) -> None:
    kind = fmt.CRC32_ZLIB
    bad = mutate(_good(kind))  # type: ignore[operator]
    with pytest.raises(FormatError):
        fmt.decode_record(bad, 0, seed_of(kind), kind, LIMIT)


@pytest.mark.parametrize("kind", KINDS)
def test_wrong_seed_other_file_or_channel(kind: int) -> None:
    good = _good(kind)
    assert isinstance(fmt.decode_record(good, 0, seed_of(kind), kind, LIMIT), fmt.Record)
    with pytest.raises(FormatError, match="checksum"):
        fmt.decode_record(good, 0, seed_of(kind, fid=8), kind, LIMIT)  # another file
    with pytest.raises(FormatError, match="checksum"):
        fmt.decode_record(good, 0, seed_of(kind, cid=b"\xff" * 16), kind, LIMIT)  # another channel


def test_every_single_bit_flip_of_a_record_is_caught() -> None:
    kind = fmt.CRC32_ZLIB
    good = _good(kind)
    n = len(fmt.encode_event(b"hello", {"a": "b"}))
    covered = 32 + n  # padding is covered by the batch checksum, not the record's
    for i in range(covered):
        for bit in range(8):
            bad = bytearray(good)
            bad[i] ^= 1 << bit
            try:
                r = fmt.decode_record(bytes(bad), 0, seed_of(kind), kind, LIMIT)
            except FormatError:
                continue
            # A flipped length bit can only make the frame look longer (INCOMPLETE).
            assert r is fmt.INCOMPLETE, (i, bit)


def test_length_over_limit_is_rejected_before_reading() -> None:
    # A huge declared length with only the 32-byte head present: FormatError, not INCOMPLETE.
    head = _good()[:32]
    bad = _set(head, 4, struct.pack("<I", 0xFFFFFFFF))
    with pytest.raises(FormatError, match="exceeds"):
        fmt.decode_record(bad, 0, seed_of(fmt.CRC32_ZLIB), fmt.CRC32_ZLIB, LIMIT)


@pytest.mark.parametrize(
    ("offset", "value"),
    [(0, b"\x88"), (8, b"\2"), (12, b"\x13"), (12, b"\3"), (10, b"\x68"), (20, b"\1"), (72, b"\xff\xff\xff\xff")],
)
def test_file_header_corruption(offset: int, value: bytes) -> None:
    b = fmt.encode_file_header(header())
    with pytest.raises(FormatError):
        fmt.decode_file_header(_set(b, offset, value))


def test_file_header_of_another_format_is_rejected_early() -> None:
    with pytest.raises(FormatError, match="magic"):
        fmt.decode_file_header(b"PK\3\4")
    assert fmt.decode_file_header(fmt.MAGIC[:5]) is fmt.INCOMPLETE


# -- one byte at a time (h11 style) -------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_decoding_fed_one_byte_at_a_time(kind: int) -> None:
    seed = seed_of(kind)
    hb = fmt.encode_file_header(header(kind))
    for i in range(len(hb)):
        assert fmt.decode_file_header(hb[:i]) is fmt.INCOMPLETE, i
    assert fmt.decode_file_header(hb) == header(kind)
    for op, payload in PAYLOADS.items():
        rb = fmt.encode_record(op, 1, 1, payload, seed, kind)
        for i in range(len(rb)):
            assert fmt.decode_record(rb[:i], 0, seed, kind, LIMIT) is fmt.INCOMPLETE, (op, i)
        assert isinstance(fmt.decode_record(rb, 0, seed, kind, LIMIT), fmt.Record)


@given(st.binary(max_size=200), st.integers(0, 64))
def test_arbitrary_bytes_only_format_error(buf: bytes, offset: int) -> None:
    for k in KINDS:
        try:
            fmt.decode_record(buf, min(offset, len(buf)), 1234, k, LIMIT)
        except FormatError:
            pass
    try:
        fmt.decode_file_header(buf)
    except FormatError:
        pass
    for dec in (fmt.decode_event, fmt.decode_take, fmt.decode_commit, fmt.decode_batch_end, fmt.decode_retire):
        try:
            dec(buf)  # type: ignore[operator]
        except FormatError:
            pass


# -- golden vectors: the hex dumps in docs/format.md ---------------------------------------------


def _hex_blocks() -> dict[str, bytes]:
    """Parse every ```hex NAME block of docs/format.md into bytes, checking the offsets."""
    text = DOC.read_text(encoding="utf-8")
    blocks = re.findall(r"^```hex (\S+)\n(.*?)^```", text, flags=re.M | re.S)
    out: dict[str, bytes] = {}
    for name, body in blocks:
        data = bytearray()
        for line in body.splitlines():
            if not line.strip() or line.startswith("#"):
                continue
            off, _, hexes = line.partition(":")
            assert int(off, 16) == len(data), f"{name}: offset {off} out of sequence"
            data += bytes.fromhex(hexes)
        out[name] = bytes(data)
    return out


def test_golden_vectors_in_format_md() -> None:
    blocks = _hex_blocks()
    assert set(blocks) == {"CHANNEL", "data/seg-0000000000000002.wal"}
    cid, kind, created = decode_channel_file(blocks["CHANNEL"])
    assert encode_channel_file(cid, kind, created) == blocks["CHANNEL"]

    buf = blocks["data/seg-0000000000000002.wal"]
    h = fmt.decode_file_header(buf)
    assert isinstance(h, fmt.FileHeader)
    assert (h.file_id, h.channel_id, h.crc_kind, h.live_files) == (2, cid, kind, (1,))
    assert (h.base_woid, h.next_position, h.next_txn_id) == (5, 2, 3)
    assert fmt.encode_file_header(h) == buf[: h.header_len]

    seed = fmt.file_seed(kind, cid, 2)
    pos = h.header_len
    batch_start = pos
    records = []
    while pos < len(buf):
        r = fmt.decode_record(buf, pos, seed, kind, LIMIT)
        assert isinstance(r, fmt.Record)
        # Re-encoding the decoded fields gives the same bytes.
        assert fmt.encode_record(r.op, r.woid, r.txn_id, r.payload, seed, kind) == buf[pos : r.end]
        if r.op == fmt.BATCH_END:
            be = fmt.decode_batch_end(r.payload)
            assert be.batch_start == batch_start
            assert be.batch_len == pos - batch_start
            assert be.batch_crc == fmt.crc(kind, buf[batch_start:pos], seed)
            assert be.last_woid + 1 == r.woid
            batch_start = r.end
        records.append(r)
        pos = r.end
    assert pos == len(buf) == batch_start
    ops = [fmt.OP_NAMES[r.op] for r in records]
    assert ops == [
        "put",
        "put",
        "commit",
        "batch_end",
        "rollback",
        "take",
        "commit",
        "batch_end",
        "retire",
        "batch_end",
    ]
    woids = [r.woid for r in records]
    assert woids == list(range(5, 15))
    assert fmt.decode_event(records[0].payload) == (b"hello", {"src": "doc"})
    assert fmt.decode_event(records[1].payload) == (b"world", {})
    assert fmt.decode_commit(records[2].payload) == (2, 2, 0)
    assert fmt.decode_rollback(records[4].payload) == (1, 0)
    assert fmt.decode_take(records[5].payload) == [(0, 2)]
    assert fmt.decode_commit(records[6].payload) == (4, 0, 2)
    assert fmt.decode_retire(records[8].payload) == 1
    assert [r.txn_id for r in records[:3]] == [2, 2, 2]

    # Fed one byte at a time, each record is INCOMPLETE until its last byte arrives.
    for r in records[:3]:
        for end in range(r.offset, r.end):
            assert fmt.decode_record(buf[:end], r.offset, seed, kind, LIMIT) is fmt.INCOMPLETE
        assert fmt.decode_record(buf[: r.end], r.offset, seed, kind, LIMIT) == r


def test_golden_vector_opens_as_a_channel(tmp_path: Path) -> None:
    """The dumped bytes are a real channel: write them out and open it."""
    import filechannel

    blocks = _hex_blocks()
    d = tmp_path / "ch"
    (d / "data").mkdir(parents=True)
    d.chmod(0o700)  # a channel directory others can read is refused
    for name, data in blocks.items():
        (d / name).write_bytes(data)
    with filechannel.open(d, minimum_required_space=0) as ch:
        with ch.transaction() as tx:
            evs = tx.take_batch(10)
        assert [(e.body, dict(e.headers), e.position) for e in evs] == [
            (b"hello", {"src": "doc"}, 2),
            (b"world", {}, 3),
        ]


def test_live_file_list_limit_is_a_format_error() -> None:
    """header_len is a u16, so the live-file list is bounded; past it, FormatError (not struct.error)."""
    h = fmt.FileHeader(
        crc_kind=fmt.CRC32_ZLIB,
        channel_id=CID,
        file_id=7,
        base_woid=1,
        next_position=0,
        next_txn_id=1,
        created_ns=0,
        live_files=tuple(range(1, 8182)),  # (65535 - 76 - 4) // 8
    )
    assert fmt.decode_file_header(fmt.encode_file_header(h)) == h
    too_many = fmt.FileHeader(**{**{f: getattr(h, f) for f in h.__slots__}, "live_files": (*h.live_files, 99999)})
    with pytest.raises(FormatError):
        fmt.encode_file_header(too_many)


@pytest.mark.parametrize("op", sorted(fmt.OP_NAMES))
def test_only_a_put_or_a_mark_may_carry_the_sealed_flag(op: int) -> None:
    seed, kind = 7, fmt.CRC32C
    sealed: list[bytes] = []
    fmt.record_encoder(seed, kind, lambda head, off, p: p + bytes(fmt.ENC_TAG_LEN)).add_puts(
        sealed, 1, 1, [b"x" * 5], [], [], 0
    )
    rec = fmt.decode_record(b"".join(sealed), 0, seed, kind, 1 << 20)
    assert isinstance(rec, fmt.Record)
    assert rec.sealed
    assert b"".join(sealed)[1] == fmt.FLAG_SEALED
    payload = PAYLOADS[op]
    plain = fmt.encode_record(op, 1, 1, payload, seed, kind)
    got = fmt.decode_record(plain, 0, seed, kind, 1 << 20)
    assert isinstance(got, fmt.Record)
    assert not got.sealed
    # The flag set on this op, with the checksum fixed up so only the flag is wrong.
    head = bytearray(plain[:24])
    head[1] = fmt.FLAG_SEALED
    c = fmt.crc(kind, payload, fmt.crc(kind, bytes(head), seed))
    flagged = bytes(head) + struct.pack("<II", c, 0) + plain[32:]
    if op in (fmt.PUT, fmt.MARK):
        r = fmt.decode_record(flagged, 0, seed, kind, 1 << 20)
        assert isinstance(r, fmt.Record)
        assert r.sealed
    else:
        with pytest.raises(FormatError, match="reserved record bits"):
            fmt.decode_record(flagged, 0, seed, kind, 1 << 20)
