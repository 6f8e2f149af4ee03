"""The C accelerator against its pure-Python twin: same bytes, same records, same errors.

``filechannel._speedups`` frames a batch of PUT records (the twin of
``format._RecordEncoder.add_puts``) and walks clean, verified batches (the
twin of the happy path of ``scan.Scanner.scan``). Each test here runs the
same input through both paths (``fmt.speedups`` set and ``None``) and
compares everything observable: the bytes written, offsets and sizes, the
records a scan keeps, where it ends, the damage it reports and the exception
it raises. On a machine where the extension did not build (or with
FILECHANNEL_PURE_PYTHON=1) there is no twin to compare, and these tests say so
by skipping; every other test of the suite then runs the pure path.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import os
import struct
import subprocess
import sys
import zlib
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import google_crc32c
import pytest
from helpers import NO_ACCELERATOR, decode_puts_outcome, payload_fits
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from filechannel import format as fmt
from filechannel import scan
from filechannel.config import ChannelConfig
from filechannel.errors import CorruptLogError, FormatError

C = fmt.speedups
needs_c = pytest.mark.skipif(C is None, reason=NO_ACCELERATOR)
KINDS = [fmt.CRC32C, fmt.CRC32_ZLIB]
CID = b"\x07" * 16
TWIN = settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.fixture(params=["google-crc32c", "builtin", "table"])
def crc_impl(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run a test under each CRC-32C the extension can use."""
    if C is None:
        pytest.skip(NO_ACCELERATOR)
    was = C.crc32c_impl()
    if request.param != "google-crc32c":
        C.unbind_crc32c()
        C.use_table(request.param == "table")
    elif was != "google-crc32c":
        pytest.skip("google-crc32c's libcrc32c was not found")
    try:
        yield request.param
    finally:
        C.use_table(False)
        if was == "google-crc32c":
            lib_dir = os.path.dirname(google_crc32c.__file__) + ".libs"
            assert any(C.bind_crc32c(os.path.join(lib_dir, f)) for f in sorted(os.listdir(lib_dir)))
        assert C.crc32c_impl() == was


# --------------------------------------------------------------------------
# checksums


@needs_c
@TWIN
@given(data=st.binary(max_size=5000), seed=st.integers(0, 2**32 - 1))
@example(data=b"", seed=0)
@example(data=b"123456789", seed=0)
def test_crc_matches_google_crc32c_and_zlib(crc_impl: str, data: bytes, seed: int) -> None:
    assert C.crc(fmt.CRC32C, data, seed) == google_crc32c.extend(seed, data)
    assert C.crc(fmt.CRC32_ZLIB, data, seed) == zlib.crc32(data, seed)
    # unaligned starts and lengths take the byte-at-a-time edges of both loops
    for cut in (1, 3, 7):
        assert C.crc(fmt.CRC32C, memoryview(data)[cut:], seed) == google_crc32c.extend(seed, data[cut:])


@needs_c
def test_crc_check_value_and_unknown_kind() -> None:
    assert C.crc(fmt.CRC32C, b"123456789") == 0xE3069283  # the CRC-32C check value
    with pytest.raises(ValueError, match="unknown checksum algorithm 9"):
        C.crc(9, b"x")


# --------------------------------------------------------------------------
# framing a batch of PUT records

payload_lists = st.lists(st.binary(max_size=300), max_size=40)


def _encode(
    enc: fmt._RecordEncoder, woid: int, txn: int, payloads: list[Any], offset: int, prefix: bytes = b""
) -> tuple[Any, ...]:
    """Frame ``payloads`` into lists of offsets and sizes, and again into array("q") columns
    (what the writer passes): both forms must hold the same values."""
    parts: list[bytes] = [b"prefix"]
    offs: list[int] = [-1]
    sizes: list[int] = []
    end = enc.add_puts(parts, woid, txn, payloads, offs, sizes, offset, prefix)
    col_offs, col_sizes = array("q", [-1]), array("q")
    col_parts: list[bytes] = [b"prefix"]
    col_end = enc.add_puts(col_parts, woid, txn, payloads, col_offs, col_sizes, offset, prefix)
    assert (b"".join(col_parts), list(col_offs), list(col_sizes), col_end) == (b"".join(parts), offs, sizes, end)
    return b"".join(parts), offs, sizes, end


@needs_c
@TWIN
@given(
    payloads=payload_lists,
    woid=st.integers(0, 2**64 - 1 - 64),
    txn=st.integers(0, 2**64 - 1),
    offset=st.integers(0, 2**40),
    kind=st.sampled_from(KINDS),
    wrap=st.sampled_from(["bytes", "bytearray", "memoryview", "tuple"]),
    prefix=st.sampled_from([b"", fmt.EMPTY_HEADERS, b"\x01\x02\x03"]),
)
@example(payloads=[], woid=0, txn=0, offset=0, kind=fmt.CRC32C, wrap="bytes", prefix=b"")
@example(payloads=[b"x" * n for n in range(17)], woid=1, txn=2, offset=3, kind=fmt.CRC32C, wrap="bytes", prefix=b"")
@example(payloads=[b"x" * n for n in range(9)], woid=1, txn=2, offset=3, kind=fmt.CRC32C, wrap="bytes", prefix=b"ab")
def test_encode_puts_is_byte_identical(
    crc_impl: str, payloads: list[bytes], woid: int, txn: int, offset: int, kind: int, wrap: str, prefix: bytes
) -> None:
    seed = fmt.file_seed(kind, CID, 3)
    given_payloads: Any = payloads
    if wrap == "bytearray":
        given_payloads = [bytearray(p) for p in payloads]
    elif wrap == "memoryview":
        given_payloads = [memoryview(p) for p in payloads]
    elif wrap == "tuple":
        given_payloads = tuple(payloads)
    c_enc = fmt.record_encoder(seed, kind)
    assert isinstance(c_enc, fmt._CRecordEncoder)
    try:
        py = _encode(fmt._RecordEncoder(seed, kind), woid, txn, given_payloads, offset, prefix)
    except TypeError as exc:  # google_crc32c takes read-only buffers only: so must the twin
        assert wrap in ("bytearray", "memoryview")
        assert payloads
        assert kind == fmt.CRC32C
        assert not prefix  # with a prefix, the twin frames prefix + payload: bytes
        with pytest.raises(TypeError, match=str(exc)):
            _encode(c_enc, woid, txn, given_payloads, offset, prefix)
        return
    assert _encode(c_enc, woid, txn, given_payloads, offset, prefix) == py
    if prefix and wrap == "bytes":  # a prefix frames exactly what joining it to each payload frames
        assert _encode(c_enc, woid, txn, [prefix + p for p in payloads], offset) == py
    # and every frame decodes back to its payload
    blob, offs, sizes, _end = py
    pos = len(b"prefix")
    for i, p in enumerate(payloads):
        rec = fmt.decode_record(blob, pos, seed, kind, 1 << 20)
        assert isinstance(rec, fmt.Record)
        assert (rec.op, rec.woid, rec.txn_id, rec.payload, rec.size) == (
            fmt.PUT,
            woid + i,
            txn,
            prefix + p,
            sizes[i + 0],
        )
        assert offs[i + 1] == offset + pos - len(b"prefix")
        pos = rec.end


def _fake_seal(head: bytes, offset: int, payload: bytes) -> bytes:
    """A stand-in sealer: depends on every argument, returns ENC_TAG_LEN more bytes (a real one: test_encryption)."""
    key = hashlib.sha256(head + offset.to_bytes(8, "little")).digest()
    body = bytes(b ^ key[i % 32] for i, b in enumerate(bytes(payload)))
    return body + key[: fmt.ENC_TAG_LEN]


@needs_c
@TWIN
@given(
    payloads=payload_lists,
    woid=st.integers(0, 2**40),
    offset=st.integers(0, 2**40),
    kind=st.sampled_from(KINDS),
    wrap=st.sampled_from(["bytes", "bytearray"]),
    prefix=st.sampled_from([b"", fmt.EMPTY_HEADERS]),
)
def test_encode_puts_sealed_is_byte_identical(
    crc_impl: str, payloads: list[bytes], woid: int, offset: int, kind: int, wrap: str, prefix: bytes
) -> None:
    """An encrypted file: the sealer is called with the same arguments, the frames cover its output."""
    seed = fmt.file_seed(kind, CID, 3)
    calls: dict[str, list[tuple[bytes, int, bytes]]] = {"c": [], "py": []}

    def sealer(who: str) -> Any:
        def seal(head: bytes, off: int, payload: bytes) -> bytes:
            calls[who].append((bytes(head), off, bytes(payload)))
            return _fake_seal(head, off, payload)

        return seal

    given_payloads = [bytearray(p) for p in payloads] if wrap == "bytearray" else payloads
    py = _encode(fmt._RecordEncoder(seed, kind, sealer("py")), woid, 9, given_payloads, offset, prefix)
    c_enc = fmt.record_encoder(seed, kind, sealer("c"))
    assert isinstance(c_enc, fmt._CRecordEncoder)
    assert _encode(c_enc, woid, 9, given_payloads, offset, prefix) == py
    assert calls["c"] == calls["py"]
    assert all(sealed.startswith(prefix) for _, _, sealed in calls["c"])  # the prefix is sealed with the payload
    assert len(calls["c"]) == 2 * len(payloads)  # _encode frames twice: into lists, then into columns


@needs_c
def test_encode_puts_sealer_errors_propagate_and_bad_lengths_are_refused() -> None:
    seed = fmt.file_seed(fmt.CRC32C, CID, 3)

    def boom(head: bytes, off: int, payload: bytes) -> bytes:
        raise RuntimeError("sealer failed")

    for enc in (fmt._RecordEncoder(seed, fmt.CRC32C, boom), fmt._CRecordEncoder(seed, fmt.CRC32C, boom)):
        with pytest.raises(RuntimeError, match="sealer failed"):
            enc.add_puts([], 1, 1, [b"a"], [], [], 0)
    # A sealer returning the wrong length would make a frame lie about its size: the C path refuses it
    # (the Python twin trusts crypto.py, whose AEAD always adds ENC_TAG_LEN bytes).
    with pytest.raises(ValueError, match="sealer returned 1 bytes"):
        fmt._CRecordEncoder(seed, fmt.CRC32C, lambda h, o, p: b"x").add_puts([], 1, 1, [b"a"], [], [], 0)


@needs_c
@pytest.mark.parametrize("bad", [12, "text", None])
def test_encode_puts_rejects_what_the_python_twin_rejects(bad: Any) -> None:
    seed = fmt.file_seed(fmt.CRC32C, CID, 3)
    for enc in (fmt._RecordEncoder(seed, fmt.CRC32C), fmt._CRecordEncoder(seed, fmt.CRC32C)):
        with pytest.raises(TypeError):
            enc.add_puts([], 1, 1, [b"ok", bad], [], [], 0)
    with pytest.raises(TypeError):  # not iterable at all
        fmt._CRecordEncoder(seed, fmt.CRC32C).add_puts([], 1, 1, 5, [], [], 0)  # type: ignore[arg-type]


# --------------------------------------------------------------------------
# scanning: a real data file, mutated, scanned by both paths


@dataclass
class Ctx:
    """A ScanContext that records what the scan reports."""

    crc_kind: int
    config: ChannelConfig
    channel_id: bytes = CID
    max_payload: int = 1 << 20
    reports: list[str] = field(default_factory=list)

    def report_corruption(self, report: scan.CorruptionReport) -> None:
        self.reports.append(repr(report))

    def note_torn_tail(self, path: str, start: int, size: int, reason: str) -> None:
        self.reports.append(f"torn {path} {start} {size} {reason}")


def _build_file(kind: int) -> tuple[bytes, list[int]]:
    """A data file of several batches (puts, takes, commits, a rollback); returns it and its batch ends."""
    from simfs import SimFS

    import filechannel

    fs = SimFS()
    saved = fmt.default_crc_kind
    fmt.default_crc_kind = lambda: kind  # type: ignore[assignment]  # a new channel's checksum algorithm
    try:
        ch = filechannel.open("/sim/ch", fs=fs, background=False, minimum_required_space=0, max_file_size=1 << 20)
    finally:
        fmt.default_crc_kind = saved  # type: ignore[assignment]
    for i in range(6):
        with ch.transaction() as tx:
            tx.put_many([b"event %d" % i * (i + 1)] * (i + 1))
            if i % 2:  # MARK records (a variable payload, bounded) before the PUTs
                tx.mark(f"producer:{i}", b"%d" % i)
    with ch.transaction() as tx:
        tx.mark("tail:/var/log/app.log", b"offset 1234")  # a transaction of marks alone
    with ch.transaction() as tx:
        tx.take_batch(3)
    tx2 = ch.transaction()
    tx2.put(b"rolled back")
    tx2.rollback()
    with ch.transaction() as tx:
        tx.put(b"last", headers={"k": "v"})
    ch.close()
    data = fs.read("/sim/ch/data/seg-0000000000000001.wal")
    hdr = fmt.decode_file_header(data)
    assert isinstance(hdr, fmt.FileHeader)
    seed = fmt.file_seed(kind, hdr.channel_id, 1)
    ends = [hdr.header_len]
    pos = hdr.header_len
    while True:
        found = scan.find_verified_batch_end(data, pos, seed, kind, 1 << 20)
        if found is None:
            break
        pos = found[0] + scan.BATCH_END_SIZE
        ends.append(pos)
    return data, ends


FILES: dict[int, tuple[bytes, list[int]]] = {}


def _file(kind: int) -> tuple[bytes, list[int]]:
    if kind not in FILES:
        FILES[kind] = _build_file(kind)
    return FILES[kind]


def _batch_ends(data: bytes, kind: int) -> list[int]:
    hdr = fmt.decode_file_header(data)
    assert isinstance(hdr, fmt.FileHeader)
    seed = fmt.file_seed(kind, hdr.channel_id, hdr.file_id)
    ends = [hdr.header_len]
    while (found := scan.find_verified_batch_end(data, ends[-1], seed, kind, 1 << 20)) is not None:
        ends.append(found[0] + scan.BATCH_END_SIZE)
    return ends


def _interleaved_file(kind: int) -> tuple[bytes, list[int]]:
    """The channel's file header, then batches whose PUTs interleave transactions (hand-made:
    the writer keeps a transaction's PUTs together, but a run must end wherever its
    transaction does, and both paths must agree on where)."""
    orig, ends = _file(kind)
    hdr = fmt.decode_file_header(orig)
    assert isinstance(hdr, fmt.FileHeader)
    seed = fmt.file_seed(kind, hdr.channel_id, hdr.file_id)
    out = bytearray(orig[: ends[0]])
    woid = hdr.base_woid
    batches = [
        [(fmt.PUT, 1), (fmt.PUT, 1), (fmt.PUT, 2), (fmt.PUT, 1), (fmt.COMMIT, 2), (fmt.PUT, 3), (fmt.PUT, 3)],
        [(fmt.PUT, 3), (fmt.PUT, 1), (fmt.COMMIT, 1), (fmt.PUT, 4)],
        [(fmt.COMMIT, 3), (fmt.PUT, 4), (fmt.PUT, 5), (fmt.PUT, 5), (fmt.PUT, 4)],
    ]
    for batch in batches:
        start, first = len(out), woid
        for op, txn in batch:
            payload = b"put %d/%d" % (txn, woid) if op == fmt.PUT else fmt.encode_commit(txn * 10, 3, 0)
            out += fmt.encode_record(op, woid, txn, payload, seed, kind)
            woid += 1
        be = fmt.BatchEnd(start, len(out) - start, fmt.crc(kind, bytes(out[start:]), seed), first, woid - 1)
        out += fmt.encode_record(fmt.BATCH_END, woid, 0, fmt.encode_batch_end(be), seed, kind)
        woid += 1
    data = bytes(out)
    return data, _batch_ends(data, kind)


def _woid_before(kind: int, base: int) -> int:
    """The write-order id of the last BATCH_END before ``base`` in the clean file (0 at the start)."""
    if not base:
        return 0
    orig, _ends = _file(kind)
    recs = _scan(False, orig, kind, 0, True, "fail", "commit", 0, 0)[0]
    return max(r.woid for r in recs if r.offset < base) + 1


def _scan(
    accel: bool,
    data: bytes,
    kind: int,
    base: int,
    newest: bool,
    mode: str,
    fsync: str,
    vouched: int,
    floor: int,
    compact: bool = False,
) -> tuple[Any, ...]:
    hdr = fmt.decode_file_header(data)
    assert isinstance(hdr, fmt.FileHeader)
    ctx = Ctx(kind, ChannelConfig(on_corruption=mode, fsync=fsync), channel_id=hdr.channel_id)
    saved = fmt.speedups
    fmt.speedups = saved if accel else None
    try:
        s = scan.Scanner(ctx, "/f", 1, data[base:], hdr, base=base)
        try:
            fs = s.scan(newest, 0, start=base if base else None, floor=floor, vouched=vouched, compact=compact)
        except CorruptLogError as exc:
            return ("raised", type(exc).__name__, str(exc), ctx.reports)
    finally:
        fmt.speedups = saved
    return (fs.records, fs.end, fs.size, fs.last_woid, fs.header_damaged, ctx.reports)


def _runs_expanded(result: tuple[Any, ...]) -> tuple[Any, ...]:
    """A compact scan's result with its runs expanded (what a non-compact scan keeps)."""
    if result[0] == "raised":
        return result
    return (list(scan.expand_runs(result[0])), *result[1:])


@needs_c
@TWIN
@given(
    kind=st.sampled_from(KINDS),
    at=st.integers(0, 10_000),
    junk=st.binary(max_size=48),
    how=st.sampled_from(["none", "overwrite", "insert", "truncate", "flip"]),
    newest=st.booleans(),
    mode=st.sampled_from(["fail", "skip"]),
    fsync=st.sampled_from(["commit", "interval"]),
    vouch=st.integers(0, 10_000),
    floor=st.integers(0, 45),
    base_at=st.integers(0, 20),
    interleaved=st.booleans(),
)
@example(
    kind=fmt.CRC32C,
    at=0,
    junk=b"",
    how="none",
    newest=True,
    mode="fail",
    fsync="commit",
    vouch=0,
    floor=0,
    base_at=0,
    interleaved=True,
)
def test_scan_is_identical_on_both_paths(
    crc_impl: str,
    kind: int,
    at: int,
    junk: bytes,
    how: str,
    newest: bool,
    mode: str,
    fsync: str,
    vouch: int,
    floor: int,
    base_at: int,
    interleaved: bool,
) -> None:
    orig, ends = _interleaved_file(kind) if interleaved else _file(kind)
    hl = ends[0]
    at = hl + at % (len(orig) - hl + 1)  # leave the file header alone: it is not the scanner's loop
    if how == "overwrite":
        data = orig[:at] + junk + orig[at + len(junk) :]
    elif how == "insert":
        data = orig[:at] + junk + orig[at:]
    elif how == "truncate":
        data = orig[:at]
    elif how == "flip":
        data = orig[:at] + bytes([orig[at] ^ (1 + (len(junk) % 255))]) + orig[at + 1 :] if at < len(orig) else orig
    else:
        data = orig
    base = ends[base_at % len(ends)]
    if base > len(data):
        base = hl
    if base == hl:
        base = 0  # the whole file (a reader following a file starts at a batch end instead)
    vouched = vouch % (len(orig) + 64)
    # A floor above the records at ``start`` is not a state the channel writes (a checkpoint's
    # floor is the write-order id it recorded at its offset), but a data file restored from an
    # older backup next to a newer checkpoint makes it: both paths report it the same way.
    c = _scan(True, data, kind, base, newest, mode, fsync, vouched, floor)
    py = _scan(False, data, kind, base, newest, mode, fsync, vouched, floor)
    assert c == py
    if how == "none" and not base and vouched <= len(data) and not floor:
        assert c[0]
        assert c[1] == ends[-1]
    # Compact (recovery's scan): the same runs over the same columns on both paths, and
    # expanded, exactly the records of the scan above (damage decisions included).
    cc = _scan(True, data, kind, base, newest, mode, fsync, vouched, floor, compact=True)
    pyc = _scan(False, data, kind, base, newest, mode, fsync, vouched, floor, compact=True)
    assert cc == pyc
    assert _runs_expanded(cc) == c


@pytest.mark.parametrize("accel", [False, True])
def test_a_floor_above_the_records_at_start_is_reported_and_the_scan_ends(accel: bool) -> None:
    """Skip mode, resuming at a batch end below a checkpoint's floor (an older data file restored
    beside a newer checkpoint): every record at or below the floor is reported, never kept, and
    the scan ends (it used to resume at the same offset forever)."""
    import threading

    if accel and C is None:
        pytest.skip(NO_ACCELERATOR)
    data, ends = _file(fmt.CRC32C)
    base = ends[2]
    floor = _woid_before(fmt.CRC32C, ends[5])  # the records of batches 3 and 4 are at or below it
    out: list[tuple[Any, ...]] = []
    t = threading.Thread(
        target=lambda: out.append(_scan(accel, data, fmt.CRC32C, base, False, "skip", "commit", 0, floor)), daemon=True
    )
    t.start()
    t.join(60)
    assert not t.is_alive(), "the scan did not end"
    records, end, size, _last, _hd, reports = out[0]
    assert end == size == len(data)
    assert records
    assert all(r.woid > floor for r in records)
    assert min(r.offset for r in records) >= ends[5] - 64  # nothing kept from below the floor
    assert f"offset={base}," in reports[0]
    assert "does not increase" in reports[0]


@needs_c
def test_scan_hands_over_to_python_at_damage() -> None:
    """The C walk keeps the verified prefix; the Python loop reports the damage after it."""
    data, ends = _file(fmt.CRC32C)
    bad = bytearray(data)
    bad[ends[3] + 40] ^= 0xFF  # a payload byte of the first record of the fourth batch
    records: list[scan.LogRecord] = []
    hdr = fmt.decode_file_header(data)
    assert isinstance(hdr, fmt.FileHeader)
    seed = fmt.file_seed(fmt.CRC32C, hdr.channel_id, 1)
    end, last = C.scan_batches(bytes(bad), ends[0], seed, fmt.CRC32C, 1 << 20, 0, 0, 1, scan.LogRecord, records)
    assert end == ends[3]
    assert last == records[-1].woid + 1  # the BATCH_END's own write-order id follows its batch
    assert all(not r.salvaged for r in records)
    c = _scan(True, bytes(bad), fmt.CRC32C, 0, False, "fail", "commit", 0, 0)
    assert c[0] == "raised"
    assert f"at byte {ends[3]}" in c[2] or str(ends[3]) in c[2]
    assert c == _scan(False, bytes(bad), fmt.CRC32C, 0, False, "fail", "commit", 0, 0)


def _columns(records: list[Any]) -> list[tuple[int, int]]:
    runs = [r for r in records if isinstance(r, scan.PutRun)]
    assert len({id(r.offsets) for r in runs}) <= 1  # one pair of columns per scan
    return list(zip(runs[0].offsets, runs[0].sizes, strict=True)) if runs else []


@pytest.mark.parametrize("accel", [False, True])
def test_a_compact_scan_keeps_one_run_per_transaction_stretch(accel: bool) -> None:
    """Runs: one per stretch of a transaction's PUTs inside one batch, in write order, over one
    pair of columns holding every verified PUT's pointer; other records stay records."""
    if accel and C is None:
        pytest.skip(NO_ACCELERATOR)
    data, _ends = _file(fmt.CRC32C)
    plain = _scan(accel, data, fmt.CRC32C, 0, True, "fail", "commit", 0, 0)[0]
    compact = _scan(accel, data, fmt.CRC32C, 0, True, "fail", "commit", 0, 0, compact=True)[0]
    puts = [r for r in plain if r.op == fmt.PUT]
    runs = [r for r in compact if isinstance(r, scan.PutRun)]
    assert [r.count for r in runs] == [1, 2, 3, 4, 5, 6, 1]  # the file's transactions, put_many(i + 1) each
    assert [r.op for r in compact if not isinstance(r, scan.PutRun)] == [r.op for r in plain if r.op != fmt.PUT]
    assert _columns(compact) == [(r.offset, r.size) for r in puts]
    assert [r.woid for r in compact] == sorted(r.woid for r in compact)
    for run in runs:
        assert run.op == scan.PUT_RUN
        assert not run.salvaged
        assert run.records() == [r for r in puts if r.txn_id == run.txn_id]
    assert list(scan.expand_runs(compact)) == plain


@pytest.mark.parametrize("accel", [False, True])
def test_runs_end_where_their_transaction_does(accel: bool) -> None:
    """PUTs of several transactions in one batch: a run per stretch of one transaction."""
    if accel and C is None:
        pytest.skip(NO_ACCELERATOR)
    data, ends = _interleaved_file(fmt.CRC32C)
    assert len(ends) == 4
    plain = _scan(accel, data, fmt.CRC32C, 0, True, "fail", "commit", 0, 0)[0]
    compact = _scan(accel, data, fmt.CRC32C, 0, True, "fail", "commit", 0, 0, compact=True)[0]
    got = [(r.txn_id, r.count) if isinstance(r, scan.PutRun) else r.op for r in compact]
    c = fmt.COMMIT
    assert got == [(1, 2), (2, 1), (1, 1), c, (3, 2), (3, 1), (1, 1), c, (4, 1), c, (4, 1), (5, 2), (4, 1)]
    assert list(scan.expand_runs(compact)) == plain


@needs_c
def test_compact_scan_keeps_runs_before_damage_and_salvages_records_after() -> None:
    """Damage in a batch: both paths keep runs around it, salvage that batch's intact records
    as records (skip mode), and report the same; runs never hold a salvaged PUT."""
    data, ends = _file(fmt.CRC32C)
    bad = bytearray(data)
    bad[ends[4] + 40] ^= 0xFF  # a payload byte of the first PUT of the fifth batch
    c = _scan(True, bytes(bad), fmt.CRC32C, 0, False, "skip", "commit", 0, 0, compact=True)
    py = _scan(False, bytes(bad), fmt.CRC32C, 0, False, "skip", "commit", 0, 0, compact=True)
    assert c == py
    assert _runs_expanded(c) == _scan(True, bytes(bad), fmt.CRC32C, 0, False, "skip", "commit", 0, 0)
    salvaged = [r for r in c[0] if r.salvaged]
    assert salvaged
    assert all(isinstance(r, scan.LogRecord) for r in salvaged)
    assert any(r.op == fmt.PUT for r in salvaged)
    in_runs = [p.offset for r in c[0] if isinstance(r, scan.PutRun) for p in r.records()]
    assert not [o for o in in_runs if ends[4] <= o < ends[5]]  # the damaged batch: records only
    assert any(o >= ends[5] for o in in_runs)  # the verified batches after it: runs again


@needs_c
def test_c_compact_walk_fills_the_columns_it_is_given() -> None:
    """Columns already holding rows (a scan resumed after damage): runs index past them."""
    from array import array

    data, ends = _file(fmt.CRC32C)
    hdr = fmt.decode_file_header(data)
    assert isinstance(hdr, fmt.FileHeader)
    seed = fmt.file_seed(fmt.CRC32C, hdr.channel_id, 1)
    offsets, sizes = array("q", [7, 8]), array("q", [9, 10])
    records: list[Any] = []
    end, _last = C.scan_batches(
        data, ends[0], seed, fmt.CRC32C, 1 << 20, 0, 0, 1, scan.LogRecord, records, scan.PutRun, offsets, sizes
    )
    assert end == ends[-1]
    runs = [r for r in records if isinstance(r, scan.PutRun)]
    assert runs[0].start == 2
    assert offsets[:2] == array("q", [7, 8])
    assert sum(r.count for r in runs) == len(offsets) - 2
    assert not any(gc.is_tracked(r) for r in records)
    with pytest.raises(ValueError, match="two columns"):
        C.scan_batches(data, ends[0], seed, fmt.CRC32C, 1 << 20, 0, 0, 1, scan.LogRecord, [], scan.PutRun, offsets)


@needs_c
def test_c_walk_calls_a_record_type_whose_slots_it_cannot_fill() -> None:
    """A record or run type without the expected slots is called with the fields instead of
    filled slot by slot: the same values either way."""
    from array import array

    def plain(fields: list[str]) -> type:  # no __slots__: its fields live in a __dict__
        def init(self: Any, *args: Any) -> None:
            self.__dict__.update(zip(fields, args, strict=True))

        return type("Plain", (), {"__init__": init})

    def values(records: list[Any]) -> list[dict[str, Any]]:
        names = ("op", "woid", "txn_id", "file_id", "offset", "size", "payload", "start", "count", "salvaged", "sealed")
        return [{k: getattr(r, k) for k in names if hasattr(r, k)} for r in records]

    data, ends = _file(fmt.CRC32C)
    hdr = fmt.decode_file_header(data)
    assert isinstance(hdr, fmt.FileHeader)
    seed = fmt.file_seed(fmt.CRC32C, hdr.channel_id, 1)
    rec_plain = plain([f.name for f in dataclasses.fields(scan.LogRecord)])  # called with every field
    run_plain = plain([f.name for f in dataclasses.fields(scan.PutRun)])
    for compact in (False, True):
        got = []
        for rec_type, run_type in ((scan.LogRecord, scan.PutRun), (rec_plain, run_plain)):
            records: list[Any] = []
            extra = (run_type, array("q"), array("q")) if compact else ()
            end, _last = C.scan_batches(data, ends[0], seed, fmt.CRC32C, 1 << 20, 0, 0, 1, rec_type, records, *extra)
            assert end == ends[-1]
            assert {type(r) for r in records} == ({rec_type, run_type} if compact else {rec_type})
            got.append(values(records))
        assert got[0] == got[1]
        assert len(got[0]) > 5


@needs_c
def test_c_records_are_not_tracked_by_the_cyclic_gc() -> None:
    """Records hold only ints, bytes and a bool (no cycle possible): the C walk untracks them,
    so a recovery holding a million of them does not make every GC pass walk them all."""
    data, _ends = _file(fmt.CRC32C)
    c = _scan(True, data, fmt.CRC32C, 0, True, "fail", "commit", 0, 0)
    py = _scan(False, data, fmt.CRC32C, 0, True, "fail", "commit", 0, 0)
    assert c == py
    assert len(c[0]) > 20
    assert not any(gc.is_tracked(r) for r in c[0])
    assert all(gc.is_tracked(r) for r in py[0])  # the twin's own records are ordinary objects
    with pytest.raises(dataclasses.FrozenInstanceError):
        c[0][0].op = 0  # and frozen: nothing can later make one part of a cycle


# --------------------------------------------------------------------------
# which path is active


def test_the_accelerator_is_built_where_a_compiler_exists() -> None:
    """A build that broke must not pass as "no compiler here": the twin tests would all skip."""
    import shutil
    import sysconfig

    from filechannel._accel import PURE_PYTHON_ENV

    if os.environ.get(PURE_PYTHON_ENV, "") not in ("", "0"):
        assert C is None
        return
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    include = sysconfig.get_paths()["include"]
    zlib_h = any(os.path.exists(os.path.join(d, "zlib.h")) for d in ("/usr/include", "/usr/local/include"))
    if shutil.which(cc) and os.path.exists(os.path.join(include, "Python.h")) and zlib_h:
        assert C is not None, (
            f"a compiler ({cc}), Python.h and zlib.h exist but filechannel._speedups is not built: "
            "rerun `pip install -e .` (scripts/venv.sh) and read its build output"
        )


def test_accelerator_reported_and_forced_pure_by_the_environment(tmp_path: Any) -> None:
    import filechannel

    with filechannel.open(str(tmp_path / "a"), minimum_required_space=0, background=False) as ch:
        assert ch.stats()["accelerator"] == fmt.accelerator()
    code = (
        "import filechannel, sys; from filechannel import format as f;"
        "ch = filechannel.open(sys.argv[1], minimum_required_space=0, background=False);"
        "print(f.accelerator(), ch.stats()['accelerator']); ch.close()"
    )
    env = dict(os.environ, FILECHANNEL_PURE_PYTHON="1")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "b")], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["python", "python"]
    if C is not None:
        env.pop("FILECHANNEL_PURE_PYTHON")
        out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "c")], env=env, capture_output=True, text=True)
        assert out.stdout.split() == ["c", "c"], out.stderr


@needs_c
@pytest.mark.parametrize("mode", ["fail", "skip"])
def test_scan_is_identical_with_every_byte_flipped(mode: str) -> None:
    """Every byte after the file header, flipped in turn (padding included: only batch checksums cover it)."""
    orig, ends = _file(fmt.CRC32C)
    differing = 0
    for at in range(ends[0], len(orig)):
        data = orig[:at] + bytes([orig[at] ^ 0x20]) + orig[at + 1 :]
        c = _scan(True, data, fmt.CRC32C, 0, False, mode, "commit", 0, 0)
        assert c == _scan(False, data, fmt.CRC32C, 0, False, mode, "commit", 0, 0), at
        cc = _scan(True, data, fmt.CRC32C, 0, False, mode, "commit", 0, 0, compact=True)
        assert cc == _scan(False, data, fmt.CRC32C, 0, False, mode, "commit", 0, 0, compact=True), at
        assert _runs_expanded(cc) == c, at
        differing += c != _scan(True, orig, fmt.CRC32C, 0, False, mode, "commit", 0, 0)
    assert differing == len(orig) - ends[0]  # no flipped byte goes unnoticed


def test_stat_reports_the_active_path(tmp_path: Any) -> None:
    import filechannel

    d = str(tmp_path / "ch")
    filechannel.open(d, minimum_required_space=0, background=False).close()
    import importlib.util

    built = "c" if importlib.util.find_spec("filechannel._speedups") is not None else "python"
    for env_value, want in (("1", "python"), ("", built)):
        env = dict(os.environ, FILECHANNEL_PURE_PYTHON=env_value)
        out = subprocess.run(
            [sys.executable, "-m", "filechannel", "stat", d, "--json"], env=env, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["accelerator"] == want


# --------------------------------------------------------------------------
# decoding the records a take reads from disk (format.decode_puts)

header_text = st.text(max_size=12)
# raw header bytes: mostly valid UTF-8, sometimes not (lone continuation bytes, encoded surrogates)
header_raw = st.one_of(
    header_text.map(lambda t: t.encode("utf-8")),
    st.binary(max_size=8),
    st.sampled_from([b"\xed\xa0\x80", b"\xff", b"\xc3", b"a\x80b"]),
)


@st.composite
def put_payloads(draw: st.DrawFn) -> bytes:
    """A PUT payload: a well-formed event, one with raw (maybe invalid) header bytes, or any bytes."""
    body = draw(st.binary(max_size=200))
    shape = draw(st.sampled_from(["event", "raw-headers", "bytes"]))
    if shape == "event":
        headers = draw(st.dictionaries(header_text, header_text, max_size=4))
        return fmt.encode_event(body, headers)
    if shape == "bytes":
        return draw(st.binary(max_size=40))
    pairs = draw(st.lists(st.tuples(header_raw, header_raw), max_size=3))
    count = len(pairs) + draw(st.sampled_from([0, 0, 0, 1, 2**32 - 1 - len(pairs)]))
    out = fmt._U32.pack(count)
    for k, v in pairs:
        out += fmt._KV_LEN.pack(len(k), len(v) + draw(st.sampled_from([0, 0, 0, 1, 2**31]))) + k + v
    return out + body


def _put_buffer(
    kind: int, payloads: list[bytes], sealed: list[bool], gap: int
) -> tuple[bytes, list[int], list[int], int]:
    """Records back to back (``gap`` bytes of junk first), their offsets and sizes, and the file seed."""
    seed = fmt.file_seed(kind, CID, 5)
    buf = b"\xab" * gap
    offs, sizes = [], []
    for i, p in enumerate(payloads):
        rec = bytearray(fmt.encode_record(fmt.PUT, i + 1, 9, p, seed, kind))
        if sealed[i % len(sealed)]:  # a sealed PUT: the flag, then the checksum again
            rec[1] = fmt.FLAG_SEALED
            c = fmt.crc(kind, bytes(rec[32 : 32 + len(p)]), fmt.crc(kind, bytes(rec[:24]), seed))
            rec[24:28] = c.to_bytes(4, "little")
        offs.append(len(buf))
        sizes.append(len(rec))
        buf += rec
    return buf, offs, sizes, seed


def _decode_event_outcome(payload: bytes) -> Any:
    """What decode_puts should hold for a verified, decoded record: the event, or decode_event's error."""
    try:
        return fmt.decode_event(payload)
    except fmt.FormatError as exc:
        return decode_puts_outcome([exc])[0]


def _both(buf: Any, offs: list[int], sizes: list[int], seed: int, kind: int, max_payload: int, decode: bool) -> Any:
    """Run both twins; return the pure result after checking the C one is identical."""
    c = decode_puts_outcome(
        C.decode_puts(buf, offs, sizes, seed, kind, max_payload, decode, fmt.FormatError, fmt.EventFormatError)
    )
    py = decode_puts_outcome(fmt._decode_puts(buf, offs, sizes, seed, kind, max_payload, decode))
    assert c == py
    return py


@needs_c
@settings(TWIN, max_examples=400)
@given(
    payloads=st.lists(put_payloads(), min_size=1, max_size=12),
    sealed=st.lists(st.booleans(), min_size=1, max_size=4),
    kind=st.sampled_from(KINDS),
    gap=st.integers(0, 9),
    edits=st.lists(
        st.tuples(
            st.sampled_from(["flip", "overwrite", "truncate", "insert", "length", "zero"]),
            st.integers(0, 10_000),
            st.integers(0, 255),
        ),
        max_size=4,
    ),
    moves=st.lists(st.tuples(st.integers(0, 11), st.integers(-40, 40), st.integers(-40, 40)), max_size=3),
    max_payload=st.sampled_from([0, 7, 64, 300, 2**32 - 1, 2**40]),
    decode=st.booleans(),
    wrap=st.sampled_from(["bytes", "bytearray", "memoryview"]),
)
@example(
    payloads=[b"\0\0\0\0hi"],
    sealed=[False],
    kind=fmt.CRC32C,
    gap=0,
    edits=[],
    moves=[],
    max_payload=2**32 - 1,
    decode=True,
    wrap="bytes",
)
def test_decode_puts_is_identical_on_both_paths(
    crc_impl: str,
    payloads: list[bytes],
    sealed: list[bool],
    kind: int,
    gap: int,
    edits: list[tuple[str, int, int]],
    moves: list[tuple[int, int, int]],
    max_payload: int,
    decode: bool,
    wrap: str,
) -> None:
    buf, offs, sizes, seed = _put_buffer(kind, payloads, sealed, gap)
    clean = _both(buf, offs, sizes, seed, kind, 2**32 - 1, decode)
    for p, s, r in zip(payloads, sealed * len(payloads), clean, strict=False):
        # undamaged: every record verifies; decoded exactly when decode_event would decode it
        assert r == (p if s or not decode else _decode_event_outcome(p))
    data = bytearray(buf)
    for how, at, val in edits:
        if not data:
            break
        at %= len(data)
        if how == "flip":
            data[at] ^= 1 << (val & 7)
        elif how == "overwrite":
            data[at] = val
        elif how == "truncate":
            del data[at:]
        elif how == "insert":
            data[at:at] = bytes([val])
        elif how == "length":  # a record's payload length, made large or off by a little
            i = offs[val % len(offs)] + 4
            if i + 4 <= len(data):
                data[i : i + 4] = (val * 0x01010101 if val & 1 else len(payloads[val % len(offs)]) + 1).to_bytes(
                    4, "little"
                )
        else:
            data[at : at + 32] = bytes(min(32, len(data) - at))
    for i, doff, dsize in moves:  # pointers that are not quite right
        i %= len(offs)
        offs[i] = max(0, offs[i] + doff)
        sizes[i] += dsize
    wrapped: Any = {"bytes": bytes, "bytearray": bytearray, "memoryview": memoryview}[wrap](bytes(data))
    _both(wrapped, offs, sizes, seed, kind, max_payload, decode)


@needs_c
@pytest.mark.parametrize("kind", KINDS)
def test_decode_puts_is_identical_with_every_byte_flipped_or_cut(kind: int) -> None:
    payloads = [fmt.encode_event(b"body-%d" % i, {"k": "v" * i, "ü": "€"} if i % 2 else None) for i in range(5)] + [
        b"\x02\0\0\0" + b"\x01\0\0\0\x01\0\0\0" + b"a\xff"
    ]
    buf, offs, sizes, seed = _put_buffer(kind, payloads, [False, False, True, False, False, False], 0)
    clean = _both(buf, offs, sizes, seed, kind, 2**32 - 1, True)
    assert clean[-1][0] == "EventFormatError"  # the crafted header count
    for at in range(len(buf)):
        flipped = buf[:at] + bytes([buf[at] ^ 0x10]) + buf[at + 1 :]
        got = _both(flipped, offs, sizes, seed, kind, 2**32 - 1, True)
        hit = next(i for i in range(len(offs)) if offs[i] <= at < offs[i] + sizes[i])
        assert [g for i, g in enumerate(got) if i != hit] == [c for i, c in enumerate(clean) if i != hit]
        # every flipped byte of a record is noticed, except in its zero padding (only batch checksums cover it)
        assert got[hit] != clean[hit] or at >= offs[hit] + 32 + len(payloads[hit])
        _both(buf[:at], offs, sizes, seed, kind, 2**32 - 1, True)


@needs_c
def test_decode_puts_rejects_what_the_python_twin_rejects() -> None:
    buf, offs, sizes, seed = _put_buffer(fmt.CRC32C, [b"\0\0\0\0x"], [False], 0)
    for args, exc in [
        ((buf, offs, sizes, seed, 9, 100, True), fmt.FormatError),
        ((buf, offs, [*sizes, 1], seed, fmt.CRC32C, 100, True), ValueError),
        ((buf, [-1], sizes, seed, fmt.CRC32C, 100, True), ValueError),
        ((buf, offs, sizes, seed, fmt.CRC32C, -1, True), ValueError),
    ]:
        with pytest.raises(exc) as c_err:
            C.decode_puts(*args, fmt.FormatError, fmt.EventFormatError)
        with pytest.raises(exc) as py_err:
            fmt._decode_puts(*args)  # type: ignore[arg-type]
        assert str(c_err.value) == str(py_err.value)


@needs_c
def test_decode_puts_results_hold_no_extra_references() -> None:
    buf, offs, sizes, seed = _put_buffer(fmt.CRC32C, [fmt.encode_event(b"x" * 100, {"a": "b"})] * 3, [False], 0)
    got = C.decode_puts(buf, offs, sizes, seed, fmt.CRC32C, 2**32 - 1, True, fmt.FormatError, fmt.EventFormatError)
    body, headers = got[0]
    # the tuple, the local name, getrefcount's argument
    assert sys.getrefcount(body) == 3
    assert sys.getrefcount(headers) == 3
    bad = C.decode_puts(buf, offs, [s + 8 for s in sizes], seed, fmt.CRC32C, 100, True, fmt.FormatError, None)
    assert [type(b) for b in bad] == [fmt.FormatError] * 3


@needs_c
def test_decode_puts_survives_an_error_type_that_shrinks_the_offsets() -> None:
    buf, offs, sizes, seed = _put_buffer(fmt.CRC32C, [b"\0\0\0\0x"] * 4, [False], 0)

    def shrinking(offset: int, reason: str) -> fmt.FormatError:
        del offs[:]
        return fmt.FormatError(offset, reason)

    with pytest.raises(RuntimeError, match="changed size"):
        C.decode_puts(buf, offs, [s + 8 for s in sizes], seed, fmt.CRC32C, 100, True, shrinking, None)


# --------------------------------------------------------------------------
# a take's cache hits as Events (take_slots)


def _take_both(bodies: list[Any], headers: list[Any], a: int, m: int, first: int) -> Any:
    """Run ``channel._take_slots`` on copies of the run through each path; both must agree on
    everything: the Events (and their type), the byte count, what is left in the run, or the error."""
    from filechannel.takes import take_slots as _take_slots

    saved = fmt.speedups
    out = []
    for accel in (True, False):
        fmt.speedups = saved if accel else None
        run = list(bodies)
        try:
            events, nbytes = _take_slots(run, list(headers), a, m, first)
            out.append(("ok", events, [type(e) for e in events], nbytes, run))
        except (ValueError, TypeError, OverflowError) as exc:
            out.append(("raised", type(exc).__name__, str(exc), run))
        finally:
            fmt.speedups = saved
    assert out[0] == out[1]
    return out[0]


@needs_c
@TWIN
@given(
    bodies=st.lists(st.one_of(st.binary(max_size=20), st.none()), max_size=30),
    headers=st.lists(st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=2), max_size=31),
    a=st.integers(-2, 32),
    m=st.integers(-1, 32),
    first=st.integers(0, 2**62),
)
@example(bodies=[b"a", b"bc", b"def"], headers=[{}, {"k": "v"}, {}], a=1, m=2, first=10)
def test_take_slots_is_identical_on_both_paths(
    bodies: list[bytes | None], headers: list[Any], a: int, m: int, first: int
) -> None:
    from filechannel.channel import Event

    got = _take_both(bodies, headers, a, m, first)
    if a < 0 or m < 0 or a + m > min(len(bodies), len(headers)):
        assert got == ("raised", "ValueError", "take_slots: the stretch is not inside the run", bodies)
        return
    seg = bodies[a : a + m]
    if None in seg:  # a slot already cleared: refused before anything changes
        assert got == ("raised", "TypeError", "object of type 'NoneType' has no len()", bodies)
        return
    assert got[0] == "ok"
    assert got[1] == [Event(b, h, first + i) for i, (b, h) in enumerate(zip(seg, headers[a : a + m], strict=True))]
    assert got[2] == [Event] * m
    assert got[3] == sum(len(b) for b in seg if b is not None)
    assert got[4] == bodies[:a] + [None] * m + bodies[a + m :]


@needs_c
def test_take_slots_refuses_what_it_cannot_build_and_keeps_references_right() -> None:
    from filechannel.channel import Event

    with pytest.raises(TypeError, match="tuple subclass"):
        C.take_slots(dict, [b"a"], [{}], 0, 1, 0)
    with pytest.raises(TypeError):
        C.take_slots(Event, (b"a",), [{}], 0, 1, 0)  # lists only (the wrapper sends other sequences to the twin)
    with pytest.raises(OverflowError):
        C.take_slots(Event, [b"a", b"b"], [{}, {}], 0, 2, sys.maxsize)
    body, hdrs = b"x" * 100, {"k": "v"}
    bodies = [body] * 60
    before = (sys.getrefcount(body), sys.getrefcount(hdrs))
    evs, n = C.take_slots(Event, bodies, [hdrs] * 60, 5, 50, 7)
    assert n == 5000
    assert bodies == [body] * 5 + [None] * 50 + [body] * 5
    # each taken body's reference moved from its slot into its Event; each Event holds one more on the headers
    assert (sys.getrefcount(body), sys.getrefcount(hdrs)) == (before[0], before[1] + 50)
    del evs
    assert (sys.getrefcount(body), sys.getrefcount(hdrs)) == (before[0] - 50, before[1])
    assert C.take_slots(Event, [], [], 0, 0, 0) == ([], 0)


@needs_c
@TWIN
@given(
    op=st.integers(-1, 257),
    woid=st.integers(-1, 2**64),
    txn=st.integers(0, 2**64 - 1),
    payload=st.binary(max_size=70),
    kind=st.sampled_from(KINDS),
    wrap=st.sampled_from(["bytes", "bytearray", "memoryview"]),
)
@example(op=fmt.TAKE, woid=5, txn=6, payload=b"", kind=fmt.CRC32C, wrap="bytes")
def test_add_is_byte_identical(
    crc_impl: str, op: int, woid: int, txn: int, payload: bytes, kind: int, wrap: str
) -> None:
    """One non-PUT frame (TAKE, COMMIT, BATCH_END ...): the C ``add`` gives the Python parts' bytes, or its error."""
    seed = fmt.file_seed(kind, CID, 3)
    given_payload: Any = {"bytes": payload, "bytearray": bytearray(payload), "memoryview": memoryview(payload)}[wrap]

    def run(enc: fmt._RecordEncoder) -> tuple[str, int, bytes] | tuple[str, type, str]:
        parts: list[bytes] = [b"before"]
        try:
            n = enc.add(parts, op, woid, txn, given_payload)
        except Exception as exc:  # compared between the twins
            return ("error", type(exc), str(exc))
        return ("ok", n, b"".join(parts))

    c_enc = fmt.record_encoder(seed, kind)
    assert isinstance(c_enc, fmt._CRecordEncoder)
    py = run(fmt._RecordEncoder(seed, kind))
    assert run(c_enc) == py
    if py[0] == "ok" and op in fmt.OP_NAMES:
        if not payload_fits(op, payload):  # framed as asked, but no record of that op has that length
            with pytest.raises(FormatError, match="payload length"):
                fmt.decode_record(py[2], len(b"before"), seed, kind, 1 << 20)
            return
        rec = fmt.decode_record(py[2], len(b"before"), seed, kind, 1 << 20)
        assert isinstance(rec, fmt.Record)
        assert (rec.op, rec.woid, rec.txn_id, rec.payload, rec.size) == (op, woid, txn, payload, py[1])


@needs_c
def test_take_runs_falls_back_on_anything_unusual() -> None:
    """``take_runs`` answers None (the Python path decides) unless the positions are ints that strictly ascend."""
    assert C.take_runs([]) == ([], [])
    assert C.take_runs([(5, 1, 0, 40), (6, 1, 40, 40), (8, 2, 0, 40)]) == ([(5, 2), (8, 1)], [(1, 5, 2), (2, 8, 1)])
    for odd in (
        [(5, 1, 0, 40), (5, 1, 0, 40)],  # repeated
        [(6, 1, 0, 40), (5, 1, 0, 40)],  # descending
        [(5, 1, 0)],  # not an entry
        [[5, 1, 0, 40]],  # a list, not a tuple
        [(5.0, 1, 0, 40)],  # not an int
        [(2**63, 1, 0, 40)],  # past int64
        [(2**63 - 1, 1, 0, 40)],  # the next position would overflow
    ):
        assert C.take_runs(odd) is None, odd
    with pytest.raises(TypeError):
        C.take_runs((1, 2))


@needs_c
@TWIN
@given(first=st.integers(-(2**63), 2**63 - 1), n=st.integers(0, 300))
def test_int64_range_is_the_range(first: int, n: int) -> None:
    """The queue's positions column, extended from ``int64_range`` bytes, holds ``range(first, first + n)``."""
    if first + n - 1 > 2**63 - 1 and n:
        with pytest.raises(OverflowError):
            C.int64_range(first, n)
        return
    col = array("q")
    col.frombytes(C.int64_range(first, n))
    assert col == array("q", range(first, first + n))


@needs_c
def test_encode_puts_refuses_columns_it_cannot_extend() -> None:
    enc = fmt.record_encoder(fmt.file_seed(fmt.CRC32C, CID, 3), fmt.CRC32C)
    for bad in ((), "offsets", 7):
        with pytest.raises(TypeError, match="list or an array"):
            enc.add_puts([], 1, 1, [b"a"], bad, [], 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bad count"):
        C.int64_range(0, -1)


@needs_c
@TWIN
@given(
    payloads=st.lists(
        st.one_of(st.binary(max_size=40), st.binary(max_size=40).map(bytearray), st.integers()), max_size=20
    ),
    extra=st.integers(0, 64),
)
def test_frames_size_is_the_sum_of_record_sizes(payloads: list[Any], extra: int) -> None:
    """A commit's size estimate: C and the Python loop agree with record_size, or fail alike."""
    out = []
    saved = fmt.speedups
    for accel in (True, False):
        fmt.speedups = saved if accel else None
        try:
            out.append(("ok", fmt.frames_size(payloads, extra)))
        except TypeError as exc:
            out.append(("raised", str(exc)))
        finally:
            fmt.speedups = saved
    assert out[0] == out[1]
    if all(isinstance(p, (bytes, bytearray)) for p in payloads):
        assert out[0] == ("ok", sum(fmt.record_size(len(p) + extra) for p in payloads))
    else:
        assert out[0][0] == "raised"


@needs_c
@TWIN
@given(
    parts=st.lists(st.binary(max_size=80), max_size=6),
    start=st.integers(-1, 2**64),
    first_woid=st.integers(0, 2**64 - 1),
    woid=st.integers(0, 2**64 - 1),
    kind=st.sampled_from(KINDS),
)
@example(parts=[b"a" * 56, b"b" * 48], start=4096, first_woid=10, woid=12, kind=fmt.CRC32C)
def test_close_batch_is_byte_identical(
    crc_impl: str, parts: list[bytes], start: int, first_woid: int, woid: int, kind: int
) -> None:
    """The BATCH_END frame that closes a write: the same bytes from C and Python, which decode back."""
    seed = fmt.file_seed(kind, CID, 3)

    def run(enc: fmt._RecordEncoder) -> tuple[Any, ...]:
        got = list(parts)
        try:
            n = enc.close_batch(got, start, first_woid, woid)
        except (OverflowError, struct.error):
            return ("raised", "out of range")
        except ValueError as exc:
            return ("raised", str(exc))
        assert got[: len(parts)] == parts
        return ("ok", n, b"".join(got[len(parts) :]))  # the frame (one part from C, four from Python)

    py = run(fmt._RecordEncoder(seed, kind))
    c_enc = fmt.record_encoder(seed, kind)
    assert isinstance(c_enc, fmt._CRecordEncoder)
    # (out-of-range ints, which the writer never passes: struct.error from Python, OverflowError from C)
    assert run(c_enc) == py
    in_range = 0 <= start < 2**64 and woid > 0
    assert (py[0] == "ok") == in_range
    if in_range:
        _ok, n, frame = py
        body = b"".join(parts)
        rec = fmt.decode_record(frame, 0, seed, kind, 1 << 20)
        assert isinstance(rec, fmt.Record)
        assert (rec.op, rec.woid, rec.size) == (fmt.BATCH_END, woid, n)
        assert fmt.decode_batch_end(rec.payload) == fmt.BatchEnd(
            start, len(body), fmt.crc(kind, body, seed), first_woid, woid - 1
        )
