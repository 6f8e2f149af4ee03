"""WriteAheadLog reads after open check batch tags: a record edited with fixed checksums is refused.

An encrypted WriteAheadLog writes format version 2 files (a tag over every
batch, chained from the header's key check). Recovery checks the chain at
open; ``read_all`` reads the files again from disk, and checks it too, so an
edit made while the log is open (an attacker with write access and no key)
is refused (or, in skip mode, reported and dropped), never silently applied.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest

pytest.importorskip("cryptography", reason="the crypto extra is not installed (README, Installing)")

from test_authenticated_log import batches, header

import filechannel
from filechannel import format as fmt
from filechannel.crypto import Encryption

RECORDS = [b"record-%d" % i for i in range(3)]


def enc() -> Encryption:
    return Encryption(keys={"k1": bytes(range(32))}, active_key="k1")


def wal_files(d: str) -> list[str]:
    return sorted(os.path.join(r, f) for r, _, fs in os.walk(d) for f in fs if f.endswith(".wal"))


def edit_commit_txn(path: str, batch: int) -> int:
    """Point the COMMIT of batch ``batch`` at another transaction, every checksum fixed; return the batch start."""
    h = header(path)
    assert h.authenticated  # an encrypted WAL writes version 2 files
    seed = fmt.file_seed(h.crc_kind, h.channel_id, h.file_id)
    buf = bytearray(Path(path).read_bytes())
    start, be_off = batches(path)[batch]
    pos = start
    edited = False
    while pos < be_off:
        r = fmt.decode_record(bytes(buf), pos, seed, h.crc_kind, 1 << 30)
        assert isinstance(r, fmt.Record)
        if r.op == fmt.COMMIT:
            new = fmt.encode_record(fmt.COMMIT, r.woid, r.txn_id + 1000, r.payload, seed, h.crc_kind)
            buf[pos : pos + len(new)] = new
            edited = True
        pos = r.end
    assert edited
    fixed = bytearray(buf[be_off + 32 : be_off + 64])
    struct.pack_into("<I", fixed, 12, fmt.crc(h.crc_kind, bytes(buf[start:be_off]), seed))
    woid = struct.unpack_from("<Q", buf, be_off + 8)[0]
    frame = fmt.encode_record(
        fmt.BATCH_END, woid, 0, bytes(fixed) + bytes(buf[be_off + 64 : be_off + 80]), seed, h.crc_kind
    )
    buf[be_off : be_off + len(frame)] = frame
    Path(path).write_bytes(bytes(buf))
    return start


@pytest.mark.parametrize("policy", ["fail", "skip"])
def test_a_commit_edited_with_fixed_checksums_while_open_is_refused_by_read_all(tmp_path: Path, policy: str) -> None:
    d = str(tmp_path / "wal")
    with filechannel.WriteAheadLog(d, encryption=enc(), on_corruption=policy) as w:
        for i, r in enumerate(RECORDS):
            w.write(r, time=100 + i)
        assert list(w.read_all()) == RECORDS
        # Batch 0 holds the file's span and the first record; batch 1 the second record.
        at = edit_commit_txn(wal_files(d)[-1], 1)
        if policy == "fail":
            with pytest.raises(filechannel.CorruptLogError, match="batch authentication failed") as ei:
                list(w.read_all())
            assert ei.value.offset == at
        else:
            assert list(w.read_all()) == [RECORDS[0], RECORDS[2]]
            assert any("batch authentication failed" in c.reason for c in w.corruption)
