"""atheris target: the C accelerator and its pure-Python twin agree on arbitrary bytes (see README.md).

One input drives three comparisons; any difference in values, offsets, reports or
exceptions is a crash (an ``AssertionError``):

- a real data file with the input's bytes spliced in (where and how: the input's first
  bytes) is scanned by both paths, record by record and compactly (recovery's scan), under
  ``on_corruption`` fail and skip;
- the clean file's PUT records, read back from the damaged bytes, are verified and decoded
  by both ``decode_puts`` (events, and payloads left undecoded);
- payloads cut from the input are framed by both PUT encoders (alone and behind a shared
  prefix), the write is closed by both ``close_batch``, and sized by both ``frames_size``.

Needs the C accelerator (it compares it with the Python code); without it every input fails
with an AssertionError that says so.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_FILES: dict[int, tuple[bytes, list[tuple[int, int]]]] = {}
_CID = b"\x07" * 16


@dataclass
class _Ctx:
    """A scan context that records what the scan reports."""

    crc_kind: int
    config: Any
    channel_id: bytes
    max_payload: int = 1 << 20
    reports: list[str] = field(default_factory=list)

    def report_corruption(self, report: object) -> None:
        self.reports.append(repr(report))

    def note_torn_tail(self, path: str, start: int, size: int, reason: str) -> None:
        self.reports.append(f"torn {path} {start} {size} {reason}")


def _base(kind: int) -> tuple[bytes, list[tuple[int, int]]]:
    """A data file of varied batches (checksum ``kind``) and its PUT records' (offset, size)."""
    if kind not in _FILES:
        from simfs import SimFS

        import filechannel
        from filechannel import format as fmt

        fs = SimFS()
        saved = fmt.default_crc_kind
        fmt.default_crc_kind = lambda: kind  # type: ignore[assignment]  # the new channel's checksum
        try:
            ch = filechannel.open("/sim/ch", fs=fs, background=False, minimum_required_space=0)
        finally:
            fmt.default_crc_kind = saved  # type: ignore[assignment]
        for i in range(5):
            with ch.transaction() as tx:
                tx.put_many([b"event %d" % i * (i + 1)] * (i + 1), headers={"k": "v" * i} if i % 2 else None)
        with ch.transaction() as tx:
            tx.take_batch(4)
            tx.put("ü€".encode(), headers={"ключ": "значение"})
        tx = ch.transaction()
        tx.put(b"rolled back")
        tx.rollback()
        ch.close()
        data = fs.read("/sim/ch/data/seg-0000000000000001.wal")
        recs = _scan(False, data, kind, "fail", compact=False)[0]
        puts = [(r.offset, r.size) for r in recs if r.op == fmt.PUT]
        _FILES[kind] = (data, puts)
    return _FILES[kind]


def _scan(accel: bool, data: bytes, kind: int, mode: str, compact: bool) -> tuple[Any, ...]:
    from filechannel import format as fmt
    from filechannel import scan
    from filechannel.config import ChannelConfig
    from filechannel.errors import CorruptLogError

    hdr = fmt.decode_file_header(data)
    if not isinstance(hdr, fmt.FileHeader):
        return ("header", repr(hdr))
    ctx = _Ctx(kind, ChannelConfig(on_corruption=mode), hdr.channel_id)
    saved = fmt.speedups
    fmt.speedups = saved if accel else None
    try:
        s = scan.Scanner(ctx, "/f", 1, data, hdr)
        try:
            fs = s.scan(True, 0, compact=compact)
        except CorruptLogError as exc:
            return ("raised", type(exc).__name__, str(exc), ctx.reports)
    finally:
        fmt.speedups = saved
    return (fs.records, fs.end, fs.size, fs.last_woid, fs.header_damaged, ctx.reports)


def _encoded(enc: Any, payloads: list[bytes], woid: int, offset: int, prefix: bytes) -> tuple[Any, ...]:
    """Frame ``payloads`` (behind ``prefix``) as one write and close it with its BATCH_END."""
    parts: list[bytes] = []
    offs: list[int] = []
    sizes: list[int] = []
    try:
        end = enc.add_puts(parts, woid, 7, payloads, offs, sizes, offset, prefix)
        end += enc.close_batch(parts, offset, woid, woid + len(payloads))
    except (ValueError, OverflowError) as exc:
        return ("raised", type(exc).__name__, str(exc))
    return b"".join(parts), offs, sizes, end


def test_one_input(data: bytes) -> None:
    from helpers import decode_puts_outcome

    from filechannel import format as fmt

    c = fmt.speedups
    assert c is not None, "the C accelerator is not active: there is nothing to compare"
    if len(data) < 4:
        data = data + bytes(4 - len(data))
    kind = (fmt.CRC32C, fmt.CRC32_ZLIB)[data[0] & 1]
    orig, puts = _base(kind)
    hdr = fmt.decode_file_header(orig)
    assert isinstance(hdr, fmt.FileHeader)
    junk = data[4:]
    # the input's bytes 1-2 choose where they go (after the file header), byte 3 how
    at = hdr.header_len + int.from_bytes(data[1:3], "little") % (len(orig) - hdr.header_len + 1)
    how = data[3] % 4
    if how == 0:
        damaged = orig[:at] + junk + orig[at + len(junk) :]
    elif how == 1:
        damaged = orig[:at] + junk + orig[at:]
    elif how == 2:
        damaged = orig[:at] + junk
    else:
        damaged = orig[:at] + bytes([orig[at] ^ (data[3] | 1)]) + orig[at + 1 :] if at < len(orig) else orig

    # 1. the scan, record by record and compact, both damage policies
    for mode in ("fail", "skip"):
        for compact in (False, True):
            assert _scan(True, damaged, kind, mode, compact) == _scan(False, damaged, kind, mode, compact)

    # 2. the clean file's PUT records, read back from the damaged bytes
    seed = fmt.file_seed(kind, hdr.channel_id, hdr.file_id)
    offs = [o for o, _ in puts]
    sizes = [s for _, s in puts]
    for decode in (True, False):
        for max_payload in (1 << 20, data[0]):
            got_c = c.decode_puts(
                damaged, offs, sizes, seed, kind, max_payload, decode, fmt.FormatError, fmt.EventFormatError
            )
            got_py = fmt._decode_puts(damaged, offs, sizes, seed, kind, max_payload, decode)
            assert decode_puts_outcome(got_c) == decode_puts_outcome(got_py)

    # 3. payloads cut from the input (each length byte, then that many bytes), framed by both encoders
    payloads: list[bytes] = []
    i = 4
    while i < len(data) and len(payloads) < 64:
        n = data[i]
        payloads.append(data[i + 1 : i + 1 + n])
        i += 1 + n
    woid = int.from_bytes(data[1:3], "little") << ((data[0] >> 2) % 48)  # below 2**64, as the writer's are
    enc_seed = fmt.file_seed(kind, _CID, 3)
    c_enc = fmt.record_encoder(enc_seed, kind)
    assert isinstance(c_enc, fmt._CRecordEncoder)
    py_enc = fmt._RecordEncoder(enc_seed, kind)
    for prefix in (b"", fmt.EMPTY_HEADERS, payloads[0] if payloads else b"x"):
        assert _encoded(c_enc, payloads, woid, at, prefix) == _encoded(py_enc, payloads, woid, at, prefix)
        saved = fmt.speedups
        try:
            fmt.speedups = None
            py_size = fmt.frames_size(payloads, len(prefix))
        finally:
            fmt.speedups = saved
        assert fmt.frames_size(payloads, len(prefix)) == py_size


def main() -> None:
    from _cli import run

    run(test_one_input, ["filechannel.format", "filechannel.scan"])


if __name__ == "__main__":
    main()
