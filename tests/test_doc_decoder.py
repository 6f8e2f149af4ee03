"""A reader of channel directories written from docs/format.md alone, checked against the library.

The first half of this file is the reader. It uses only ``struct``, ``zlib``,
``google_crc32c`` (and, for encrypted files, the ``cryptography`` package's
HKDF and AEADs) and what docs/format.md (with docs/checkpoints.md) says:
it must not import ``filechannel.format``, ``filechannel.checkpoint`` or
``filechannel.log``. If a channel cannot be read with it, the docs are wrong.

The second half builds varied channels with the public API and asserts that
the reader finds exactly the queue the library serves.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import re
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

try:
    import google_crc32c
except ImportError:  # pragma: no cover - the channel then uses zlib's CRC-32
    google_crc32c = None

# ==========================================================================================
# The reader (docs/format.md only)
# ==========================================================================================


class DocFormatError(Exception):
    """The bytes do not follow docs/format.md."""


def crc(kind: int, data: bytes, seed: int = 0) -> int:
    """The channel's checksum of ``data`` continued from ``seed`` ("Checksums and the file seed")."""
    if kind == 1:
        assert google_crc32c is not None, "CRC-32C channel, google_crc32c missing"
        return int(google_crc32c.extend(seed, data))
    if kind == 2:
        return zlib.crc32(data, seed)
    raise DocFormatError(f"unknown checksum kind {kind}")


def pad8(n: int) -> int:
    return (8 - n % 8) % 8


PUT, TAKE, COMMIT, ROLLBACK, BATCH_END, RETIRE, MARK = 1, 2, 3, 4, 5, 6, 7
SEG_NAME = re.compile(r"^seg-([0-9a-f]{16})\.wal$")
CKPT_NAME = re.compile(r"^ckpt-([0-9a-f]{16})\.ckpt$")
DATA_MAGIC = b"\x89FCW\r\n\x1a\n"
CKPT_MAGIC = b"\x89FCK\r\n\x1a\n"


@dataclass(frozen=True)
class ChannelInfo:
    channel_id: bytes
    kind: int
    created_ns: int


def read_channel_file(directory: str) -> ChannelInfo:
    """The CHANNEL file: 40 bytes, zlib CRC-32 of [0, 36) at 36."""
    buf = Path(directory, "CHANNEL").read_bytes()
    if len(buf) != 40:
        raise DocFormatError("CHANNEL is not 40 bytes")
    if zlib.crc32(buf[0:36]) != struct.unpack_from("<I", buf, 36)[0]:
        raise DocFormatError("CHANNEL crc")
    if buf[0:8] != b"FCCHANNL":
        raise DocFormatError("CHANNEL magic")
    version, kind = struct.unpack_from("<HH", buf, 8)
    if version != 1 or kind not in (1, 2):
        raise DocFormatError("CHANNEL version or kind")
    return ChannelInfo(buf[12:28], kind, struct.unpack_from("<Q", buf, 28)[0])


@dataclass(frozen=True)
class Rec:
    op: int
    woid: int
    txn: int
    file_id: int
    offset: int
    size: int
    payload: bytes


@dataclass
class DataFile:
    file_id: int
    header_len: int
    base_woid: int
    next_position: int
    next_txn_id: int
    live_files: list[int]
    size: int
    records: list[Rec] = field(default_factory=list)  # accepted (batch-verified) records, BATCH_ENDs too
    end: int = 0  # end of the last verified batch
    aead: Any = None  # an encrypted file: its AEAD under the file key


def file_seed(ch: ChannelInfo, file_id: int) -> int:
    return crc(ch.kind, ch.channel_id + struct.pack("<Q", file_id))


KEYS: dict[str, bytes] = {}
"""Master keys by key id, for encrypted data files (the tests set them)."""


def file_aead(suite: int, master: bytes, salt: bytes, ch: ChannelInfo, file_id: int) -> Any:
    """The AEAD of an encrypted file ("Encrypted data files": HKDF-SHA256 of the master key)."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    info = b"filechannel/v1 data file key" + bytes([suite]) + ch.channel_id + struct.pack("<Q", file_id)
    key = HKDF(algorithm=hashes.SHA256(), length=32, salt=salt, info=info).derive(master)
    return {1: AESGCM, 2: ChaCha20Poly1305}[suite](key)


def read_data_header(buf: bytes, ch: ChannelInfo, file_id: int) -> DataFile:
    """The data file header: 80 + 8n + e bytes, crc of [0, 76 + 8n + e) with seed 0 after it."""
    if len(buf) < 80 or buf[0:8] != DATA_MAGIC:
        raise DocFormatError("data file magic or size")
    version, header_len, flags = struct.unpack_from("<HHI", buf, 8)
    cid = buf[16:32]
    fid, base_woid, next_pos, next_txn, _created, n = struct.unpack_from("<QQQQQI", buf, 32)
    x = 76 + 8 * n
    e = 0
    if flags & 0x10:  # the encryption extension
        k = buf[x + 1]
        e = 40 + k + pad8(k) + 16
    if version not in (1, 2) or (version == 2 and not flags & 0x10):
        raise DocFormatError("data file version or header_len")
    if header_len != 80 + 8 * n + e or len(buf) < header_len:
        raise DocFormatError("data file version or header_len")
    if flags & ~0x1F or flags & 0xF != ch.kind:
        raise DocFormatError("data file flags")
    if struct.unpack_from("<I", buf, x + e)[0] != crc(ch.kind, buf[0 : x + e], 0):
        raise DocFormatError("data file header crc")
    if cid != ch.channel_id or fid != file_id:
        raise DocFormatError("data file of another channel or file")
    live = list(struct.unpack_from(f"<{n}Q", buf, 76))
    assert live == sorted(live), "live_files are ascending"
    aead = None
    if e:
        suite, k, reserved, salt = struct.unpack_from("<BB6s32s", buf, x)
        if suite not in (1, 2) or reserved != bytes(6):
            raise DocFormatError("encryption extension")
        key_id = buf[x + 40 : x + 40 + k].decode("ascii")
        check_at = x + 40 + k + pad8(k)
        aead = file_aead(suite, KEYS[key_id], salt, ch, fid)
        aead.decrypt(bytes(12), buf[check_at : check_at + 16], buf[:check_at])  # the key check
    return DataFile(fid, header_len, base_woid, next_pos, next_txn, live, len(buf), aead=aead)


def read_records(buf: bytes, ch: ChannelInfo, df: DataFile, newest: bool, start: int | None = None) -> None:
    """Read the batch-verified records of a data file from ``start`` (default: header_len).

    A clean end is the end of the file, or (newest file only) an all-zero rest.
    Anything else raises: the channels of these tests never crashed.
    """
    seed = file_seed(ch, df.file_id)
    pos = g = df.header_len if start is None else start
    held: list[Rec] = []
    prev_woid = df.base_woid - 1
    while pos < len(buf):
        if buf[pos] == 0 and not held and newest and buf.count(0, pos) == len(buf) - pos:
            break  # zero-filled space ahead of the writer (op 0 is never valid)
        if len(buf) - pos < 32:
            raise DocFormatError(f"file {df.file_id}: frame cut off at {pos}")
        op, flags, res1, plen, woid, txn = struct.unpack_from("<BBHIQQ", buf, pos)
        rcrc, res2 = struct.unpack_from("<II", buf, pos + 24)
        # flags: 1 ("sealed") exactly on the PUTs of an encrypted file, else 0
        sealed = op in (PUT, MARK) and df.aead is not None
        if op not in range(1, 8) or flags != (1 if sealed else 0) or res1 or res2:
            raise DocFormatError(f"file {df.file_id}: bad frame at {pos}")
        if plen > len(buf) - pos - 32:
            raise DocFormatError(f"file {df.file_id}: payload_len past the end at {pos}")
        payload = buf[pos + 32 : pos + 32 + plen]
        if crc(ch.kind, payload, crc(ch.kind, buf[pos : pos + 24], seed)) != rcrc:
            raise DocFormatError(f"file {df.file_id}: record crc at {pos}")
        if woid <= prev_woid:
            raise DocFormatError(f"file {df.file_id}: woid does not increase at {pos}")
        prev_woid = woid
        size = 32 + plen + pad8(plen)
        rec = Rec(op, woid, txn, df.file_id, pos, size, payload)
        if op == BATCH_END:
            if plen not in (32, 48) or txn != 0:  # 48 in an authenticated (version 2) file: the batch tag last
                raise DocFormatError("BATCH_END payload")
            b_start, b_len, b_crc, first_woid, last_woid = struct.unpack_from("<QIIQQ", payload)
            if b_start != g or b_len != pos - g or crc(ch.kind, buf[g:pos], seed) != b_crc:
                raise DocFormatError(f"file {df.file_id}: batch at {g} does not verify")
            # The batch rule: at least one record, consecutive woids, BATCH_END = last_woid + 1.
            if [r.woid for r in held] != list(range(first_woid, last_woid + 1)) or not held:
                raise DocFormatError(f"file {df.file_id}: batch woids {first_woid}..{last_woid} do not match")
            if woid != last_woid + 1:
                raise DocFormatError("BATCH_END woid")
            df.records += held
            df.records.append(rec)
            held = []
            g = pos + size
        else:
            held.append(rec)
        pos += size
    if held:
        raise DocFormatError(f"file {df.file_id}: records without a BATCH_END at {g}")
    df.end = g


@dataclass
class DataDir:
    files: dict[int, DataFile]  # the live files, by id
    bufs: dict[int, bytes]
    retired_present: list[int]


def read_data_dir(path: str, ch: ChannelInfo) -> DataDir:
    """Which files are live (the newest file's header minus its RETIREs), and their records."""
    ids = sorted(int(m.group(1), 16) for n in os.listdir(path) if (m := SEG_NAME.match(n)))
    if not ids:
        return DataDir({}, {}, [])
    bufs = {i: Path(path, f"seg-{i:016x}.wal").read_bytes() for i in ids}
    newest = read_data_header(bufs[ids[-1]], ch, ids[-1])
    read_records(bufs[newest.file_id], ch, newest, newest=True)
    retired = {struct.unpack("<Q", r.payload)[0] for r in newest.records if r.op == RETIRE}
    live = (set(newest.live_files) - retired) | {newest.file_id}
    missing = live - set(ids)
    if missing:
        raise DocFormatError(f"live data files missing: {sorted(missing)}")
    files: dict[int, DataFile] = {}
    prev_last = 0
    for fid in sorted(live):
        if fid == newest.file_id:
            df = newest
        else:
            df = read_data_header(bufs[fid], ch, fid)
            read_records(bufs[fid], ch, df, newest=False)
        if df.base_woid <= prev_last:
            raise DocFormatError("woids overlap the previous data file")
        if df.records:
            prev_last = df.records[-1].woid
        files[fid] = df
    return DataDir(files, bufs, sorted(set(ids) - live))


def decode_event(payload: bytes) -> tuple[bytes, dict[str, str]]:
    """A PUT payload: u32 header_count, (u32 key_len, u32 value_len, key, value)*, body."""
    if len(payload) < 4:
        raise DocFormatError("PUT payload too short")
    (count,) = struct.unpack_from("<I", payload, 0)
    if 4 + 8 * count > len(payload):
        raise DocFormatError("PUT header count")
    pos = 4
    headers: dict[str, str] = {}
    for _ in range(count):
        if pos + 8 > len(payload):
            raise DocFormatError("PUT header past the payload")
        kl, vl = struct.unpack_from("<II", payload, pos)
        pos += 8
        if pos + kl + vl > len(payload):
            raise DocFormatError("PUT header past the payload")
        headers[payload[pos : pos + kl].decode("utf-8")] = payload[pos + kl : pos + kl + vl].decode("utf-8")
        pos += kl + vl
    return payload[pos:], headers


Pointer = tuple[int, int, int]  # (file_id, offset, size) of a PUT record


@dataclass
class Replay:
    queue: dict[int, Pointer]  # position -> pointer
    position_of: dict[tuple[int, int], int] = field(default_factory=dict)  # (file, offset) -> position
    next_position: int = 0
    ignored_take_positions: int = 0  # takes of positions not queued (re-logged takes, say)
    take_only_commits: int = 0


def replay(records: list[Rec], queue: dict[int, Pointer] | None = None, next_position: int = 0) -> Replay:
    """Step 6 of "Reading a channel": PUT/TAKE held per transaction until its COMMIT."""
    out = Replay(dict(queue or {}), next_position=next_position)
    puts: dict[int, list[Pointer]] = {}
    takes: dict[int, list[tuple[int, int]]] = {}
    for r in sorted(records, key=lambda r: r.woid):
        if r.op == PUT:
            puts.setdefault(r.txn, []).append((r.file_id, r.offset, r.size))
        elif r.op == TAKE:
            assert r.txn not in takes, "at most one TAKE per transaction"
            (n,) = struct.unpack_from("<I", r.payload, 0)
            if len(r.payload) != 4 + 16 * n:
                raise DocFormatError("TAKE payload size")
            takes[r.txn] = [struct.unpack_from("<QQ", r.payload, 4 + 16 * i) for i in range(n)]
        elif r.op == COMMIT:
            if len(r.payload) != 16:
                raise DocFormatError("COMMIT payload size")
            first, n_puts, n_takes = struct.unpack("<QII", r.payload)
            ptrs = puts.pop(r.txn, [])
            if len(ptrs) != n_puts:
                raise DocFormatError(f"COMMIT of {n_puts} puts after {len(ptrs)} PUT records")
            for i, ptr in enumerate(ptrs):
                out.queue[first + i] = ptr
                out.position_of[ptr[:2]] = first + i
            ranges = takes.pop(r.txn, [])
            if sum(c for _, c in ranges) != n_takes:
                raise DocFormatError("COMMIT n_takes does not match its TAKE")
            if ranges and not ptrs:
                out.take_only_commits += 1
            for a, c in ranges:
                for p in range(a, a + c):
                    if out.queue.pop(p, None) is None:
                        out.ignored_take_positions += 1
            out.next_position = max(out.next_position, first + n_puts)
        elif r.op == ROLLBACK:
            if len(r.payload) != 8:
                raise DocFormatError("ROLLBACK payload size")
            puts.pop(r.txn, None)
            takes.pop(r.txn, None)
        elif r.op == RETIRE and len(r.payload) != 8:
            raise DocFormatError("RETIRE payload size")
    return out


def read_event(dd: DataDir, ch: ChannelInfo, ptr: Pointer) -> tuple[bytes, dict[str, str]]:
    """Read the PUT record at a pointer, checking its frame and crc."""
    fid, off, size = ptr
    buf = dd.bufs[fid]
    op, _f, _r, plen, _w, _t = struct.unpack_from("<BBHIQQ", buf, off)
    if op != PUT or 32 + plen + pad8(plen) != size:
        raise DocFormatError(f"no PUT record of {size} bytes at {ptr}")
    payload = buf[off + 32 : off + 32 + plen]
    if (
        crc(ch.kind, payload, crc(ch.kind, buf[off : off + 24], file_seed(ch, fid)))
        != struct.unpack_from("<I", buf, off + 24)[0]
    ):
        raise DocFormatError(f"PUT at {ptr} does not verify")
    aead = dd.files[fid].aead
    if aead is not None:
        frame = buf[off : off + 24]
        aad = ch.channel_id + struct.pack("<QQ", fid, off) + frame
        payload = aead.decrypt(bytes(4) + frame[8:16], payload, aad)
    return decode_event(payload)


@dataclass
class Checkpoint:
    woid: int
    next_position: int
    next_txn_id: int
    next_file_id: int
    files: list[tuple[int, int]]
    taken: list[tuple[int, list[tuple[int, int]]]]
    entries: list[tuple[int, int, int, int]]  # (position, file_id, offset, size); version 6: outside every run
    version: int = 2
    runs: list[tuple[int, int, int, int]] = field(default_factory=list)  # (first_position, count, file_id, offset)
    holes: list[int] = field(default_factory=list)
    marks: dict[str, bytes] | None = None  # the marks table, when there is one (sealed: opened with KEYS)
    queue: list[tuple[int, int, int, int]] = field(default_factory=list)  # runs + entries (decode_channel fills it)


def read_checkpoint(path: str, ch: ChannelInfo) -> Checkpoint:
    """A checkpoint: 88-byte header, file table, taken table, column-major queue, trailer."""
    buf = Path(path).read_bytes()
    if buf.endswith(b"FCMAC\0\0\x01"):
        # An encrypted channel's checkpoint: key id, its length, a 32-byte MAC, the magic;
        # before them the list of authenticated files and its u32 length (format.md).
        klen = buf[len(buf) - 8 - 32 - 1]
        body = buf[: len(buf) - 8 - 32 - 1 - klen]
        (n,) = struct.unpack_from("<I", body, len(body) - 4)
        if body[len(body) - 4 - n : len(body) - 4 - n + 8] not in (b"FCAUTH01", b"FCAUTH02"):
            raise DocFormatError("checkpoint authenticated-file list")
        buf = body[: len(body) - 4 - n]
    if len(buf) < 92:
        raise DocFormatError("checkpoint too short")
    if struct.unpack_from("<I", buf, len(buf) - 4)[0] != crc(ch.kind, buf[: len(buf) - 4], 0):
        raise DocFormatError("checkpoint trailer")
    if buf[0:8] != CKPT_MAGIC:
        raise DocFormatError("checkpoint magic")
    version, flags, kind = struct.unpack_from("<HHI", buf, 8)
    if version not in (1, 2, 6) or kind != ch.kind or buf[16:32] != ch.channel_id:
        raise DocFormatError("checkpoint version, kind or channel")
    if flags not in ((0, 1, 3) if version == 6 else (0,)):
        raise DocFormatError("checkpoint flags")
    woid, next_pos, next_txn, next_file, _created = struct.unpack_from("<QQQQQ", buf, 32)
    n_files, n_taken, n_events = struct.unpack_from("<IIQ", buf, 72)
    pos = 88
    width = 16 if version == 1 else 24  # version 2 on: u32 data directory index, u32 reserved
    if pos + width * n_files + 4 > len(buf):
        raise DocFormatError("checkpoint parts do not add up to its size")
    files = [struct.unpack_from("<QQ", buf, pos + width * i) for i in range(n_files)]
    if version != 1:
        dirs = [struct.unpack_from("<II", buf, pos + width * i + 16) for i in range(n_files)]
        assert all(r == 0 and d == 0 for d, r in dirs), "one data directory (the default): index 0"
    pos += width * n_files
    taken: list[tuple[int, list[tuple[int, int]]]] = []
    for _ in range(n_taken):
        fid, nr = struct.unpack_from("<QI", buf, pos)
        pos += 12
        taken.append((fid, [struct.unpack_from("<QQ", buf, pos + 16 * i) for i in range(nr)]))
        pos += 16 * nr
    marks: dict[str, bytes] | None = None
    if flags == 1:  # the marks table (version 3's)
        marks, pos = read_marks_table(buf, pos)
    elif flags == 3:  # sealed: u8 cipher, u8 k, u16 reserved, u32 c, 32-byte salt, key id, c bytes
        cipher, k, res, c = struct.unpack_from("<BBHI", buf, pos)
        if cipher not in (1, 2) or not 1 <= k <= 64 or res:
            raise DocFormatError("sealed marks table")
        salt = buf[pos + 8 : pos + 40]
        key_id = buf[pos + 40 : pos + 40 + k].decode("ascii")
        sealed = buf[pos + 40 + k : pos + 40 + k + c]
        pos += 40 + k + c
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF

        info = b"filechannel/v2 checkpoint marks key" + bytes([cipher]) + ch.channel_id
        key = HKDF(algorithm=hashes.SHA256(), length=32, salt=salt, info=info).derive(KEYS[key_id])
        table = {1: AESGCM, 2: ChaCha20Poly1305}[cipher](key).decrypt(bytes(12), sealed, buf[:88])
        marks, end = read_marks_table(table, 0)
        assert end == len(table), "the sealed marks table is exactly a marks table"
    runs: list[tuple[int, int, int, int]] = []
    holes: list[int] = []
    if version == 6:  # the runs table: u64 n_runs, u64 n_holes, 32-byte runs, 8-byte holes
        n_runs, n_holes = struct.unpack_from("<QQ", buf, pos)
        pos += 16
        if pos + 32 * n_runs + 8 * n_holes + 4 > len(buf):
            raise DocFormatError("checkpoint parts do not add up to its size")
        runs = [struct.unpack_from("<QQQQ", buf, pos + 32 * i) for i in range(n_runs)]
        pos += 32 * n_runs
        holes = list(struct.unpack_from(f"<{n_holes}Q", buf, pos))
        pos += 8 * n_holes
    if pos + 32 * n_events + 4 != len(buf):
        raise DocFormatError("checkpoint parts do not add up to its size")
    cols = [struct.unpack_from(f"<{n_events}q", buf, pos + 8 * n_events * c) for c in range(4)]
    entries = list(zip(*cols, strict=True))
    assert [f for f, _ in files] == sorted({f for f, _ in files}), "file table ascending"
    assert [f for f, _ in taken] == sorted({f for f, _ in taken}), "taken table ascending"
    assert [e[0] for e in entries] == sorted({e[0] for e in entries}), "queue in position order"
    # The runs' rules: non-empty, ascending and disjoint, offsets 8-aligned after the header and
    # before the file's resume_offset, files in the file table; holes ascending, each inside a run;
    # entries outside every run.
    resume = dict(files)
    prev_end = -1
    for first, count, fid, off in runs:
        assert count > 0, "runs non-empty"
        assert first >= prev_end, "runs ascending, disjoint"
        assert fid in resume, "a run's file is in the file table"
        assert off % 8 == 0, "run offsets 8-aligned"
        assert 80 <= off < resume[fid], "run offset inside its file's checkpointed part"
        assert first + count < 1 << 63, "a run's positions are i64"
        assert 40 * count <= resume[fid] - off, "a run's count fits its file"
        prev_end = first + count

    def in_run(p: int) -> bool:
        return any(a <= p < a + c for a, c, _f, _o in runs)

    assert holes == sorted(set(holes)), "holes ascending"
    assert all(in_run(h) for h in holes), "holes inside runs"
    assert not any(in_run(e[0]) for e in entries), "entries outside every run"
    return Checkpoint(woid, next_pos, next_txn, next_file, files, taken, entries, version, runs, holes, marks)


def read_marks_table(buf: bytes, pos: int) -> tuple[dict[str, bytes], int]:
    """A marks table at ``pos``: u32 n, then n times (u64 woid, u64 file_id, u16 key_len, u16 value_len, key, value)."""
    (n,) = struct.unpack_from("<I", buf, pos)
    if n > 65536:
        raise DocFormatError("too many marks")
    pos += 4
    marks: dict[str, bytes] = {}
    for _ in range(n):
        _woid, _fid, kl, vl = struct.unpack_from("<QQHH", buf, pos)
        key = buf[pos + 20 : pos + 20 + kl].decode("utf-8")
        marks[key] = buf[pos + 20 + kl : pos + 20 + kl + vl]
        pos += 20 + kl + vl
    return marks, pos


def walk_run(df: DataFile, first: int, count: int, offset: int) -> dict[int, Pointer]:
    """A run's events: the committed PUTs of ``df`` with positions in ``[first, first + count)``.

    Walks the file's records forward from ``offset`` ("Runs table"): a transaction's PUTs
    have consecutive woids and its TAKE (if any) and COMMIT follow them, so a COMMIT
    ``(first, n_puts, n_takes)`` at woid ``w`` gives the PUT with woid ``v`` the position
    ``first + v - (w - n_puts - (1 if n_takes else 0))``.
    """
    found: dict[int, Pointer] = {}
    pend: dict[int, list[Rec]] = {}
    for r in df.records:
        if r.offset < offset:
            continue
        if r.op == PUT:
            pend.setdefault(r.txn, []).append(r)
        elif r.op == COMMIT:
            c_first, n_puts, n_takes = struct.unpack("<QII", r.payload)
            base = r.woid - n_puts - (1 if n_takes else 0)
            for p in pend.pop(r.txn, []):
                position = c_first + p.woid - base
                if first <= position < first + count:
                    found[position] = (p.file_id, p.offset, p.size)
            if len(found) == count:
                return found
        elif r.op == ROLLBACK:
            pend.pop(r.txn, None)
    raise DocFormatError(f"run {first}+{count} in file {df.file_id} from {offset}: found {len(found)} events")


def checkpoint_queue(ck: Checkpoint, dd: DataDir) -> list[tuple[int, int, int, int]]:
    """The checkpoint's queue: its runs walked (less the holes) plus its entries outside runs.

    Runs of files retired since the checkpoint are left out (their events were taken after it).
    """
    holes = set(ck.holes)
    out = list(ck.entries)
    for first, count, fid, off in ck.runs:
        if fid not in dd.files:
            continue
        assert off >= dd.files[fid].header_len, "a run's offset is after its file's header"
        got = walk_run(dd.files[fid], first, count, off)
        out += [(p, *got[p]) for p in range(first, first + count) if p not in holes]
    return sorted(out)


def newest_checkpoint(directory: str, ch: ChannelInfo) -> tuple[str, Checkpoint] | None:
    d = os.path.join(directory, "checkpoints")
    if not os.path.isdir(d):
        return None
    names = sorted((n for n in os.listdir(d) if CKPT_NAME.match(n)), reverse=True)
    if not names:
        return None
    path = os.path.join(d, names[0])
    ck = read_checkpoint(path, ch)
    assert names[0] == f"ckpt-{ck.woid:016x}.ckpt"
    return path, ck


def queue_from_checkpoint(ck: Checkpoint, directory: str, ch: ChannelInfo) -> Replay:
    """Start from a checkpoint: its queue minus retired files, then the records after resume offsets."""
    dpath = os.path.join(directory, "data")
    now = read_data_dir(dpath, ch)  # to know which files are live now
    live = now.files
    resume = dict(ck.files)
    base = {p: (f, o, s) for p, f, o, s in checkpoint_queue(ck, now) if f in live}
    records: list[Rec] = []
    for fid, df in live.items():
        buf = Path(dpath, f"seg-{fid:016x}.wal").read_bytes()
        again = read_data_header(buf, ch, fid)
        start = resume.get(fid)
        if start is not None and (start % 8 or not again.header_len <= start <= len(buf)):
            raise DocFormatError(f"resume offset {start} does not fit file {fid}: the checkpoint is not usable")
        read_records(buf, ch, again, newest=fid == max(live), start=start)
        assert all(r.woid > ck.woid for r in again.records), "records after resume_offset follow W"
        records += again.records
        assert again.end == df.end
    return replay(records, base, ck.next_position)


@dataclass
class Decoded:
    channel: ChannelInfo
    events: list[tuple[int, bytes, dict[str, str]]]  # the queue: (position, body, headers)
    full: Replay
    data: DataDir
    checkpoint: Checkpoint | None


def decode_channel(directory: str) -> Decoded:
    """Everything above: CHANNEL, the default data directory, full replay, the newest checkpoint."""
    ch = read_channel_file(directory)
    dd = read_data_dir(os.path.join(directory, "data"), ch)
    records = [r for df in dd.files.values() for r in df.records]
    full = replay(records, {}, max((df.next_position for df in dd.files.values()), default=0))
    events = [(p, *read_event(dd, ch, full.queue[p])) for p in sorted(full.queue)]
    found = newest_checkpoint(directory, ch)
    ck = None
    if found is not None:
        ck = found[1]
        check_checkpoint(ck, directory, ch, dd, full)
    return Decoded(ch, events, full, dd, ck)


def check_checkpoint(ck: Checkpoint, directory: str, ch: ChannelInfo, dd: DataDir, full: Replay) -> None:
    """The checkpoint agrees with the data files."""
    table = dict(ck.files)
    taken = {p for fid, ranges in ck.taken for a, c in ranges for p in range(a, a + c)}
    assert {fid for fid, _ in ck.taken} <= set(table), "taken table lists files of the file table"
    ck.queue = checkpoint_queue(ck, dd)
    for pos, fid, off, size in ck.queue:
        assert pos not in taken, "a queued position is not in the taken table"
        assert fid in table, "queue entries point into files of the file table"
        if fid not in dd.files:
            continue  # retired since the checkpoint: its events were taken after it
        # The columns point at a PUT record (verified), whose COMMIT gave it this position.
        read_event(dd, ch, (fid, off, size))
        assert full.position_of[(fid, off)] == pos
        assert off < table[fid], "a queued event was written before the checkpoint"
    last_on_disk = max((df.records[-1].woid for df in dd.files.values() if df.records), default=0)
    if ck.woid >= last_on_disk:  # nothing written after it: it is the queue
        assert sorted(e[0] for e in ck.queue) == sorted(full.queue)
    from_ck = queue_from_checkpoint(ck, directory, ch)
    assert from_ck.queue == full.queue, "checkpoint + records after it == full replay"


# ==========================================================================================
# The tests: channels built with the public API, read by the reader above
# ==========================================================================================

import filechannel  # noqa: E402  (after the reader, which must not depend on it)

OPTS: dict[str, Any] = {"background": False, "minimum_required_space": 0}
HEADER_CHOICES = [None, {}, {"src": "web-1"}, {"k": "v", "é": "😀", "empty": ""}, {"a" * 40: "b" * 90}]


def served(ch: filechannel.FileChannel) -> list[tuple[int, bytes, dict[str, str]]]:
    """What the library serves: take everything in one transaction, then roll back."""
    tx = ch.transaction()
    out: list[tuple[int, bytes, dict[str, str]]] = []
    while True:
        evs = tx.take_batch(1000)
        if not evs:
            break
        for e in evs:
            assert e.position is not None
            out.append((e.position, e.body, dict(e.headers)))
    tx.rollback()
    return out


def served_after_open(d: str, **opts: Any) -> list[tuple[int, bytes, dict[str, str]]]:
    ch = filechannel.open(d, **OPTS, **opts)
    try:
        return served(ch)
    finally:
        ch.close()


class Workload:
    """Random transactions on one channel, reopened now and then."""

    def __init__(self, d: str, rng: random.Random, **opts: Any) -> None:
        self.d = d
        self.rng = rng
        self.opts = opts
        self.ch = filechannel.open(d, **OPTS, **opts)

    def event(self) -> tuple[bytes, dict[str, str] | None]:
        rng = self.rng
        n = rng.choice([0, 1, 5, 7, 8, 9, 100, rng.randrange(1, 900)])
        return rng.randbytes(n), rng.choice(HEADER_CHOICES)

    def step(self) -> None:
        rng = self.rng
        r = rng.random()
        if r < 0.40:  # puts
            tx = self.ch.transaction()
            if rng.random() < 0.3:
                tx.put_many([rng.randbytes(rng.randrange(0, 300)) for _ in range(rng.randrange(1, 12))])
            else:
                for _ in range(rng.randrange(1, 8)):
                    body, headers = self.event()
                    tx.put(body, headers=headers)
            if rng.random() < 0.85:
                tx.commit()
            else:
                tx.rollback()
        elif r < 0.75:  # takes (sometimes with puts)
            tx = self.ch.transaction()
            tx.take_batch(rng.randrange(1, 10))
            if rng.random() < 0.3:
                body, headers = self.event()
                tx.put(body, headers=headers)
            if rng.random() < 0.8:
                tx.commit()
            else:
                tx.rollback()
        elif r < 0.85:
            self.ch.checkpoint()
        elif r < 0.93:
            self.reopen()
        else:  # an empty transaction writes nothing
            with self.ch.transaction():
                pass

    def reopen(self) -> None:
        self.ch.close()
        replay_mode = self.rng.choice(["checkpoint", "full"])
        self.ch = filechannel.open(self.d, **OPTS, **self.opts, replay=replay_mode)


def check_everything(d: str, ch: filechannel.FileChannel) -> Decoded:
    """Read the channel while it is open, after close, after reopening, and without checkpoints."""
    # 1. While open: the newest file may end in zero-filled space; the checkpoint may be stale.
    live = decode_channel(d)
    assert live.events == served(ch)
    # 2. Closed (close writes a checkpoint when anything changed).
    ch.close()
    closed = decode_channel(d)
    assert closed.events == live.events
    assert closed.checkpoint is not None
    # 3. The library, reopened from that checkpoint and with a full replay, agrees.
    assert served_after_open(d) == closed.events
    assert served_after_open(d, replay="full") == closed.events
    # 4. Without any checkpoint: the data files alone.
    shutil_rm_checkpoints(d)
    bare = decode_channel(d)
    assert bare.checkpoint is None
    assert bare.events == closed.events
    assert served_after_open(d) == closed.events
    # The files the reader ignores: temporaries and the informational last-open.json.
    info = json.loads(Path(d, "checkpoints", "last-open.json").read_text(encoding="utf-8"))
    assert {"time", "source", "checkpoint", "checkpoint_woid", "fallbacks", "replay_seconds", "queued"} <= set(info)
    assert info["queued"] == len(closed.events)
    return closed


def shutil_rm_checkpoints(d: str) -> None:
    cdir = Path(d, "checkpoints")
    for p in cdir.iterdir():
        if CKPT_NAME.match(p.name):
            p.unlink()


@pytest.mark.parametrize(
    ("seed", "opts", "steps"),
    [
        (1, {"max_file_size": 4096}, 120),
        (2, {"max_file_size": 4096, "fsync": "interval", "fsync_interval": 60.0}, 120),
        (3, {"max_file_size": 16384}, 150),
        (4, {}, 60),
        (5, {"max_file_size": 4096, "cache_bytes": 0}, 120),
    ],
)
def test_random_channels_read_from_the_docs(tmp_path: Path, seed: int, opts: dict[str, Any], steps: int) -> None:
    d = str(tmp_path / "ch")
    w = Workload(d, random.Random(seed), **opts)
    try:
        for _ in range(steps):
            w.step()
            if w.rng.random() < 0.05:
                assert decode_channel(d).events == served(w.ch)
    except BaseException:
        w.ch.close()
        raise
    check_everything(d, w.ch)


def test_files_roll_retire_and_takes_are_relogged(tmp_path: Path) -> None:
    """A file holding TAKE records retires while the file of those events stays: the takes are re-logged."""
    d = str(tmp_path / "ch")
    ch = filechannel.open(d, **OPTS, max_file_size=4096)
    for i in range(2):  # file 1: positions 0..9; file 2: positions 10..19
        with ch.transaction() as tx:
            for j in range(10):
                tx.put(bytes([i * 10 + j]) * 300, headers={"n": str(i * 10 + j)})
    with ch.transaction() as tx:  # TAKE of 0..4, written in file 2
        assert [e.position for e in tx.take_batch(5)] == list(range(5))
    with ch.transaction() as tx:  # file 3: positions 20..29
        tx.put_many([b"z" * 300] * 10)
    holder = ch.transaction()  # holds position 5: file 1 stays
    (held,) = holder.take_batch(1)
    with ch.transaction() as tx:  # takes 6..19: file 2 retires, its take of 0..4 is re-logged
        tx.take_batch(14)
    holder.rollback()

    dec = decode_channel(d)
    assert sorted(dec.data.files) == [1, 3]
    assert dec.full.take_only_commits >= 1
    assert dec.full.ignored_take_positions >= 10  # 10..19 (file 2 is gone) and repeated takes
    assert [p for p, _, _ in dec.events] == [5, *range(20, 30)]
    assert dec.events[0] == (5, held.body, {"n": "5"})
    retires = [r for df in dec.data.files.values() for r in df.records if r.op == RETIRE]
    assert [struct.unpack("<Q", r.payload)[0] for r in retires] == [2]
    assert dec.events == served(ch)
    check_everything(d, ch)


def test_checkpoint_with_open_transactions_and_later_writes(tmp_path: Path) -> None:
    """A checkpoint counts the takes of open transactions as queued; records after it replay on top."""
    d = str(tmp_path / "ch")
    ch = filechannel.open(d, **OPTS, max_file_size=4096)
    with ch.transaction() as tx:
        tx.put_many([b"a" * 500] * 6, headers={"h": "1"})
    with ch.transaction() as tx:
        tx.put(b"", headers={"only": "headers"})
        tx.put(b"no headers")
    open_tx = ch.transaction()
    open_tx.take_batch(3)
    ch.checkpoint()
    dec = decode_channel(d)
    assert dec.checkpoint is not None
    assert [e[0] for e in dec.checkpoint.queue] == list(range(8))
    assert dec.checkpoint.woid == max(r.woid for df in dec.data.files.values() for r in df.records)
    open_tx.commit()
    with ch.transaction() as tx:
        tx.take_batch(3)
        tx.put(b"after", headers={"x": "y"})
    dec = decode_channel(d)  # a stale checkpoint: the reader replays what follows it
    assert [p for p, _, _ in dec.events] == [6, 7, 8]
    assert dec.events == served(ch)
    assert dec.events[-1] == (8, b"after", {"x": "y"})
    check_everything(d, ch)


def test_abandoned_transactions_and_rollbacks(tmp_path: Path) -> None:
    """Closing with an open take returns its events; rolled-back puts leave only a ROLLBACK note."""
    d = str(tmp_path / "ch")
    ch = filechannel.open(d, **OPTS)
    with ch.transaction() as tx:
        tx.put_many([b"1", b"2", b"3"])
    tx = ch.transaction()
    tx.put(b"never")
    tx.rollback()
    tx = ch.transaction()
    tx.take_batch(2)
    tx.rollback()
    taker = ch.transaction()
    taker.take_batch(2)
    ch.close()  # abandons taker
    dec = decode_channel(d)
    assert [(p, b) for p, b, _ in dec.events] == [(0, b"1"), (1, b"2"), (2, b"3")]
    ops = [r.op for df in dec.data.files.values() for r in df.records]
    assert ROLLBACK in ops
    assert served_after_open(d) == dec.events


def test_a_queue_with_holes_and_marks_read_from_the_docs(tmp_path: Path) -> None:
    """Takes replayed out of a run's middle leave holes; marks go in a plain marks table (flags 1)."""
    d = str(tmp_path / "ch")
    ch = filechannel.open(d, **OPTS)
    with ch.transaction() as tx:
        tx.mark("source-offset", b"42")
        tx.put_many([bytes([i]) * (i + 1) for i in range(30)])
    held = ch.transaction()
    held.take_batch(10)  # open: its events stay queued
    with ch.transaction() as tx:
        assert [e.body[0] for e in tx.take_batch(10)] == list(range(10, 20))
    ch.close()  # abandons ``held``
    ch = filechannel.open(d, **OPTS, replay="full")  # a run of 30 events, 10 of them taken out of its middle
    ch.checkpoint()
    dec = decode_channel(d)
    ck = dec.checkpoint
    assert ck is not None
    assert ck.version == 6
    assert ck.marks == {"source-offset": b"42"} == ch.marks()
    assert ck.holes == list(range(10, 20)), (ck.runs, ck.holes, ck.entries)
    assert [e[0] for e in ck.queue] == [*range(10), *range(20, 30)]
    assert [(p, b) for p, b, _ in dec.events] == [(p, bytes([p]) * (p + 1)) for p in [*range(10), *range(20, 30)]]
    assert dec.events == served(ch)
    check_everything(d, ch)


def test_doc_tables_add_up() -> None:
    """Each byte table of docs/format.md is contiguous and has the size the code writes."""
    from filechannel import checkpoint as code_checkpoint
    from filechannel import directory as code_log
    from filechannel import format as code_format

    text = (Path(__file__).resolve().parent.parent / "docs" / "format.md").read_text(encoding="utf-8")

    def table(after: str) -> list[tuple[int, int]]:
        """The rows with a numeric offset and size of the first table after ``after``."""
        lines = text.split(after, 1)[1].splitlines()
        first = next(i for i, line in enumerate(lines) if line.startswith("|"))
        rows = []
        for line in lines[first:]:
            if not line.startswith("|"):
                break
            m = re.match(r"^\| (\d+) \| (\d+) \|", line)
            if m:
                rows.append((int(m.group(1)), int(m.group(2))))
        return rows

    def end(rows: list[tuple[int, int]]) -> int:
        for (a, n), (b, _) in itertools.pairwise(rows):
            assert a + n == b, f"offset {b} does not follow {a} + {n}"
        return rows[-1][0] + rows[-1][1]

    assert end(table("### CHANNEL (40 bytes)")) == code_log._CHANNEL_FMT.size + 4 == 40
    assert end(table("## Data file header")) == code_format.FILE_HEADER_FIXED == 76
    assert end(table("## Record frame")) == code_format.RECORD_HEADER_LEN == 32
    assert end(table("**Header** (88 bytes):")) == code_checkpoint._HEAD.size == 88


def test_the_example_channel_in_the_docs(tmp_path: Path) -> None:
    """The hex dumps at the end of docs/format.md, written out, read as the text says."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "format.md").read_text(encoding="utf-8")
    d = tmp_path / "ch"
    (d / "data").mkdir(parents=True)
    for name, body in re.findall(r"^```hex (\S+)\n(.*?)^```", text, flags=re.M | re.S):
        hexes = [line.partition(":")[2] for line in body.splitlines() if line.strip() and not line.startswith("#")]
        (d / name).write_bytes(bytes.fromhex("".join(hexes)))
    dec = decode_channel(str(d))
    assert dec.events == [(2, b"hello", {"src": "doc"}), (3, b"world", {})]
    assert sorted(dec.data.files) == [2]
    assert dec.checkpoint is None


def test_an_encrypted_channel_read_from_the_docs(tmp_path: Path) -> None:
    """Plaintext files, then encrypted ones under two keys and both ciphers: decoded from the docs alone."""
    pytest.importorskip("cryptography", reason="the crypto extra is not installed")
    from filechannel import Encryption

    keys = {"2026-10": bytes(range(32)), "2026-11": bytes(range(1, 33))}
    KEYS.clear()
    KEYS.update(keys)
    d = str(tmp_path / "ch")
    rng = random.Random(7)
    runs: list[dict[str, Any]] = [
        {},
        {"encryption": Encryption(keys=keys, active_key="2026-10")},
        {"encryption": Encryption(keys=keys, active_key="2026-11", cipher="chacha20-poly1305")},
    ]
    for opts in runs:
        ch = filechannel.open(d, max_file_size=4096, **OPTS, **opts)
        for _ in range(30):
            with ch.transaction() as tx:
                for _ in range(rng.randint(1, 4)):
                    tx.put(rng.randbytes(rng.randint(0, 700)), headers=rng.choice(HEADER_CHOICES))
                if rng.random() < 0.2:
                    tx.mark(f"offset-{rng.randint(0, 3)}", rng.randbytes(rng.randint(0, 40)))
            if rng.random() < 0.3:
                with ch.transaction() as tx:
                    tx.take_batch(rng.randint(1, 3))
        live = decode_channel(d)
        assert live.events == served(ch)
        ch.close()
    newest = sorted(n for n in os.listdir(os.path.join(d, "data")) if SEG_NAME.match(n))[-1]
    with open(os.path.join(d, "data", newest), "rb") as fh:
        assert struct.unpack_from("<I", fh.read(16), 12)[0] & 0x10, "the newer files are encrypted"
    closed = decode_channel(d)
    assert closed.checkpoint is not None
    assert closed.events == served_after_open(d, encryption=runs[-1]["encryption"])
    # The checkpoint's marks table is sealed (flags 3) and opens with the docs' key derivation.
    assert closed.checkpoint.version == 6
    assert closed.checkpoint.marks
    again = filechannel.open(d, **OPTS, encryption=runs[-1]["encryption"])
    assert closed.checkpoint.marks == again.marks()
    again.close()
    KEYS.clear()
