"""Property tests of the format codec: arbitrary bytes raise only FormatError; valid input round-trips.

``filechannel.format`` promises that decoding any bytes returns a value,
returns ``INCOMPLETE`` or raises ``FormatError``: nothing else (no
``struct.error``, ``IndexError``, ``UnicodeDecodeError``, ``MemoryError``).
Longer coverage-guided runs: tests/fuzz/ (atheris).
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import pytest
from helpers import NO_ACCELERATOR
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from filechannel import format as fmt
from filechannel.errors import FormatError

KIND = fmt.default_crc_kind()
SEED = fmt.file_seed(KIND, b"\x01" * 16, 7)
RUNS = {"n": 0}
sys.path.insert(0, str(Path(__file__).parent / "fuzz"))  # the atheris targets, run here by Hypothesis

FAST = settings(suppress_health_check=[HealthCheck.too_slow])


def _only_format_error(fn, *args):  # type: ignore[no-untyped-def]
    RUNS["n"] += 1
    try:
        return fn(*args)
    except FormatError:
        return None


@FAST
@given(st.binary(max_size=300), st.integers(0, 64), st.integers(0, 1 << 33))
@example(b"\x01" + b"\0" * 3 + b"\xff\xff\xff\xff" + b"\0" * 24, 0, 0xFFFFFFFF)
@example(b"", 0, 0)
def test_decode_record_raises_only_format_error(buf: bytes, offset: int, max_payload: int) -> None:
    offset = min(offset, len(buf))
    r = _only_format_error(fmt.decode_record, buf, offset, SEED, KIND, max_payload)
    if isinstance(r, fmt.Record):
        assert r.offset == offset
        assert r.end <= len(buf)
        assert len(r.payload) <= max_payload


@FAST
@given(st.binary(max_size=400))
def test_decode_file_header_raises_only_format_error(buf: bytes) -> None:
    _only_format_error(fmt.decode_file_header, buf)


@FAST
@given(st.binary(max_size=200))
def test_decode_payloads_raise_only_format_error(buf: bytes) -> None:
    for fn in (fmt.decode_event, fmt.decode_take, fmt.decode_commit, fmt.decode_batch_end, fmt.decode_rollback):
        _only_format_error(fn, buf)


@FAST
@given(
    st.binary(max_size=100),
    st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=3),
    st.integers(0, 400),
)
def test_mutated_headers_in_event_payloads(body: bytes, counts: list[int], cut: int) -> None:
    """Header counts and lengths that lie about the payload."""
    payload = struct.pack("<I", counts[0]) + b"".join(struct.pack("<II", c, c) for c in counts[1:]) + body
    _only_format_error(fmt.decode_event, payload[: cut or None])


header_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=20)


@FAST
@given(st.binary(max_size=200), st.dictionaries(header_text, header_text, max_size=4))
def test_event_round_trip(body: bytes, headers: dict[str, str]) -> None:
    RUNS["n"] += 1
    assert fmt.decode_event(fmt.encode_event(body, headers)) == (body, headers)


def _fit(op: int, payload: bytes) -> bytes:
    """``payload`` cut or padded to a length a record of ``op`` may have (a TAKE: whole ranges, counted)."""
    if op in fmt.FIXED_PAYLOAD_SIZES:
        n = fmt.FIXED_PAYLOAD_SIZES[op][0]
        return (payload + bytes(n))[:n]
    if op == fmt.TAKE:
        k = len(payload) // 16
        return struct.pack("<I", k) + payload[: 16 * k]
    if op == fmt.MARK:
        return (payload + bytes(21))[: max(21, len(payload))]  # at least the smallest mark payload
    return payload


@FAST
@given(
    st.sampled_from(sorted(fmt.OP_NAMES)),
    st.integers(0, 2**64 - 1),
    st.integers(0, 2**64 - 1),
    st.binary(max_size=100),
    st.binary(max_size=16),
)
def test_record_round_trip_and_any_flip_is_detected(op: int, woid: int, txn: int, payload: bytes, pre: bytes) -> None:
    RUNS["n"] += 1
    pre = pre + b"\0" * (-len(pre) & 7)
    payload = _fit(op, payload)
    enc = fmt.encode_record(op, woid, txn, payload, SEED, KIND)
    buf = pre + enc
    r = fmt.decode_record(buf, len(pre), SEED, KIND, 1 << 20)
    assert isinstance(r, fmt.Record)
    assert (r.op, r.woid, r.txn_id, r.payload, r.size) == (op, woid, txn, payload, len(enc))
    # the fast encoder writes the same bytes
    parts: list[bytes] = []
    fmt.record_encoder(SEED, KIND).add(parts, op, woid, txn, payload)
    assert b"".join(parts) == enc
    # a record from another file (other seed) does not verify
    other = fmt.file_seed(KIND, b"\x01" * 16, 8)
    assert _only_format_error(fmt.decode_record, buf, len(pre), other, KIND, 1 << 20) in (None, fmt.INCOMPLETE)
    # flipping any bit of the meaningful bytes is detected (CRC-32 catches every 1-bit error)
    for i in range(32 + len(payload)):
        bad = bytearray(enc)
        bad[i] ^= 1 << (i % 8)
        got = _only_format_error(fmt.decode_record, bytes(bad), 0, SEED, KIND, 1 << 20)
        assert not isinstance(got, fmt.Record) or got.payload != payload or got.woid != woid or got.op != op, i


@FAST
@given(
    st.integers(0, 2**64 - 1),
    st.integers(0, 2**64 - 1),
    st.integers(0, 2**64 - 1),
    st.lists(st.integers(0, 2**64 - 1), max_size=20),
    st.sampled_from([fmt.CRC32C, fmt.CRC32_ZLIB] if fmt.HAVE_CRC32C else [fmt.CRC32_ZLIB]),
)
def test_file_header_round_trip(fid: int, woid: int, pos: int, live: list[int], kind: int) -> None:
    RUNS["n"] += 1
    h = fmt.FileHeader(kind, b"\x02" * 16, fid, woid, pos, 5, 123, tuple(live))
    enc = fmt.encode_file_header(h)
    assert len(enc) == h.header_len
    assert len(enc) % 8 == 0
    assert fmt.decode_file_header(enc) == h
    assert fmt.decode_file_header(enc[:-1]) is fmt.INCOMPLETE or len(enc) <= fmt.FILE_HEADER_FIXED


@FAST
@given(
    st.lists(st.integers(0, 2**64 - 1), max_size=20),
    st.integers(1, 2),
    st.text(alphabet="abcXYZ019._:-", min_size=1, max_size=64),
    st.binary(min_size=32, max_size=32),
    st.binary(min_size=16, max_size=16),
    st.integers(0, 10_000),
)
def test_encrypted_file_header_round_trip_and_flips(
    live: list[int], cipher: int, key_id: str, salt: bytes, check: bytes, flip: int
) -> None:
    """The encryption extension (flag bit 4) round-trips; any flipped bit is a FormatError or INCOMPLETE."""
    RUNS["n"] += 1
    h = fmt.FileHeader(
        fmt.CRC32_ZLIB,
        b"\x02" * 16,
        9,
        1,
        0,
        1,
        123,
        tuple(live),
        cipher=cipher,
        key_id=key_id,
        salt=salt,
        key_check=check,
    )
    enc = fmt.encode_file_header(h)
    assert len(enc) == h.header_len
    assert len(enc) % 8 == 0
    assert fmt.decode_file_header(enc) == h
    assert h.check_offset == len(enc) - 4 - 16
    assert enc[h.check_offset : h.check_offset + 16] == check
    bad = bytearray(enc)
    bad[flip % len(bad)] ^= 1 << (flip % 8)
    got = _only_format_error(fmt.decode_file_header, bytes(bad))
    assert got is None or got is fmt.INCOMPLETE, got


@FAST
@given(st.lists(st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1)), max_size=10))
def test_take_commit_batch_end_round_trip(ranges: list[tuple[int, int]]) -> None:
    RUNS["n"] += 1
    assert fmt.decode_take(fmt.encode_take(ranges)) == ranges
    assert fmt.decode_commit(fmt.encode_commit(9, 8, 7)) == (9, 8, 7)
    be = fmt.BatchEnd(1, 2, 3, 4, 5)
    assert fmt.decode_batch_end(fmt.encode_batch_end(be)) == be


# --------------------------------------------------------------------------
# the file scanner: a channel whose data file holds arbitrary bytes


def _channel_with_file() -> tuple[object, str, bytes]:
    from simfs import SimFS

    import filechannel

    fs = SimFS()
    ch = filechannel.open("/sim/ch", fs=fs, background=False, minimum_required_space=0, max_file_size=4096)
    for i in range(3):
        with ch.transaction() as tx:
            tx.put(b"event %d" % i, headers={"k": "v"})
    ch.close()
    path = "/sim/ch/data/seg-0000000000000001.wal"
    return fs, path, fs.read(path)


_BASE = _channel_with_file()


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10_000), st.binary(max_size=64), st.sampled_from(["overwrite", "insert", "truncate"]))
def test_scanner_on_mutated_files_raises_only_documented_errors(at: int, junk: bytes, how: str) -> None:
    import filechannel

    fs0, path, orig = _BASE
    fs = fs0.snapshot()  # type: ignore[attr-defined]
    at = at % (len(orig) + 1)
    if how == "overwrite":
        data = orig[:at] + junk + orig[at + len(junk) :]
    elif how == "insert":
        data = orig[:at] + junk + orig[at:]
    else:
        data = orig[:at]
    fs.write(path, data)
    RUNS["n"] += 1
    for mode in ("fail", "skip"):
        try:
            ch = filechannel.open(
                "/sim/ch", fs=fs, background=False, minimum_required_space=0, replay="full", on_corruption=mode
            )
        except filechannel.CorruptLogError:
            continue
        try:
            with ch.transaction() as tx:
                evs = tx.take_batch(100)
            for e in evs:
                assert e.body == b"event %d" % e.position
                assert dict(e.headers) == {"k": "v"}
        except filechannel.CorruptLogError:
            pass
        finally:
            ch.close()


# --------------------------------------------------------------------------
# the C accelerator against its pure-Python twin, through the atheris target tests/fuzz/fuzz_twins.py


@pytest.mark.skipif(fmt.speedups is None, reason=NO_ACCELERATOR)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(min_size=4, max_size=300))
@example(b"\x00\x00\x00\x00")
@example(b"\x01\xff\xff\x03" + b"\x05hello" * 3)
def test_fuzz_twins_target_finds_no_difference(data: bytes) -> None:
    import fuzz_twins

    fuzz_twins.test_one_input(data)
    RUNS["n"] += 1


def test_zz_report() -> None:
    print(f"\nfuzz executions (hypothesis): {RUNS['n']}")
