"""Golden files: an encrypted channel written by an earlier release must open to exactly its events.

``tests/data/golden-encrypted-v2/`` is a small encrypted, authenticated channel
(format version 2) made once by :func:`make` with a fixed test key and fixed
write-order ids (a fresh channel's), then committed. Its salts are random, so
it cannot be made again byte for byte: never regenerate it to make this test
pass. Every later version must open it (with its checkpoints, and with every
batch replayed and its chained tag recomputed), read it with
``ChannelReader`` and pass ``verify`` with the key. A change that alters how a
batch tag is computed (dropping the previous batch's tag from the chain, say)
on both the write and the read side passes every round-trip test but breaks
every channel already on disk: this file is what sees it.

Regenerate only for a new data layout, in a new directory beside this one:
``python tests/test_golden_encrypted.py tests/data/golden-encrypted-vN``.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("cryptography", reason="the crypto extra is not installed (README, Installing)")

import filechannel
from filechannel import format as fmt
from filechannel.crypto import Encryption, header_cipher
from filechannel.verify import verify_channel

GOLDEN = Path(__file__).parent / "data" / "golden-encrypted-v2"
KEY = bytes(range(32))
KEY_ID = "golden"
OPTS: dict[str, Any] = {"background": False, "minimum_required_space": 0, "checkpoint_interval": 0}


def enc() -> Encryption:
    return Encryption(keys={KEY_ID: KEY}, active_key=KEY_ID)


def body(t: int, i: int) -> bytes:
    return b"golden-%d-%d " % (t, i) * 20


# What the golden channel holds: 6 transactions of 3 events (with headers and a mark each),
# the first 4 events taken, a rolled back put, a checkpoint, then one more event.
EXPECTED = [(4 + n, body(*divmod(4 + n, 3)), {"t": str((4 + n) // 3), "i": str((4 + n) % 3)}) for n in range(14)]
EXPECTED.append((18, b"after the checkpoint", {"late": "1"}))
EXPECTED_MARKS = {"src": b"offset-5"}


def make(d: str) -> None:
    """Write the golden channel to ``d`` (see the module docstring: only for a new layout)."""
    shutil.rmtree(d, ignore_errors=True)
    with filechannel.open(d, encryption=enc(), max_file_size=4096, **OPTS) as ch:
        for t in range(6):
            with ch.transaction() as tx:
                for i in range(3):
                    tx.put(body(t, i), {"t": str(t), "i": str(i)})
                tx.mark("src", b"offset-%d" % t)
        with ch.transaction() as tx:
            tx.take_batch(4)
        tx = ch.transaction()
        tx.put(b"rolled back")
        tx.rollback()
        ch.checkpoint()
        with ch.transaction() as tx:
            tx.put(b"after the checkpoint", {"late": "1"})
    for root, _dirs, files in os.walk(d):
        for f in files:
            if f == "LOCK":
                os.unlink(os.path.join(root, f))


def copy_golden(dest: Path) -> str:
    """A writable copy (an open writes: a new data file, checkpoints) with the modes a channel wants."""
    d = str(dest / "golden")
    shutil.copytree(GOLDEN, d)
    for root, _dirs, files in os.walk(d):
        os.chmod(root, 0o700)
        for f in files:
            os.chmod(os.path.join(root, f), 0o600)
    return d


def queued(ch: filechannel.FileChannel) -> list[tuple[int, bytes, dict[str, str]]]:
    tx = ch.transaction()
    evs = tx.take_batch(1000)
    tx.rollback()
    return [(e.position, e.body, dict(e.headers)) for e in evs]


def test_the_golden_files_are_an_authenticated_encrypted_channel() -> None:
    segs = sorted((GOLDEN / "data").glob("seg-*.wal"))
    assert len(segs) == 2
    for p in segs:
        h = fmt.decode_file_header(p.read_bytes())
        assert isinstance(h, fmt.FileHeader)
        assert h.cipher
        assert h.authenticated
        assert h.key_id == KEY_ID
        assert b"golden-" not in p.read_bytes()  # sealed
    assert (GOLDEN / "ANCHOR").exists()


@pytest.mark.parametrize("replay", ["checkpoint", "full"])
def test_the_golden_channel_opens_to_exactly_its_events(tmp_path: Path, replay: str) -> None:
    d = copy_golden(tmp_path)
    with filechannel.open(d, encryption=enc(), replay=replay, **OPTS) as ch:
        assert queued(ch) == EXPECTED
        assert ch.marks() == EXPECTED_MARKS
        st = ch.stats()
        assert st["corruption_report"] == []
        assert st["checkpoint_fallbacks"] == 0
        assert st["torn_tails_truncated"] == 0
        with ch.transaction() as tx:  # and it goes on: a new event chains on in a new file
            tx.put(b"new")
    with filechannel.open(d, encryption=enc(), replay="full", **OPTS) as ch:
        assert queued(ch) == [*EXPECTED, (19, b"new", {})]


def test_every_golden_batch_tag_is_recomputed_and_checked(tmp_path: Path) -> None:
    """Without checkpoints every batch is scanned: each tag must chain from the one before."""
    d = copy_golden(tmp_path)
    shutil.rmtree(os.path.join(d, "checkpoints"))
    with filechannel.open(d, encryption=enc(), **OPTS) as ch:
        assert queued(ch) == EXPECTED


def test_the_golden_channel_reads_and_verifies_with_the_key(tmp_path: Path) -> None:
    d = copy_golden(tmp_path)
    with filechannel.ChannelReader(d, encryption=enc()) as r:
        start, end = r.available()
        got = [(e.position, e.body, dict(e.headers)) for e in r.read(start, end)]
    assert got == EXPECTED
    res = verify_channel(d, encryption=enc())
    assert res.ok, res.problems


def test_a_wrong_key_does_not_open_the_golden_channel(tmp_path: Path) -> None:
    d = copy_golden(tmp_path)
    wrong = Encryption(keys={KEY_ID: bytes(32)}, active_key=KEY_ID)
    with pytest.raises(filechannel.DecryptionError):
        filechannel.open(d, encryption=wrong, **OPTS)


def test_the_chain_changes_the_tag() -> None:
    """A batch tag depends on the previous batch's tag: the same batch under another chain gets another tag."""
    path = sorted((GOLDEN / "data").glob("seg-*.wal"))[0]
    buf = path.read_bytes()
    h = fmt.decode_file_header(buf)
    assert isinstance(h, fmt.FileHeader)
    seed = fmt.file_seed(h.crc_kind, h.channel_id, h.file_id)
    cipher = header_cipher(enc(), str(path), h, buf, h.channel_id)
    assert cipher is not None
    prev, start, pos, checked = h.key_check, h.header_len, h.header_len, 0
    while pos < len(buf) and buf[pos]:
        r = fmt.decode_record(buf, pos, seed, h.crc_kind, 1 << 20)
        assert isinstance(r, fmt.Record)
        if r.op == fmt.BATCH_END:
            frame = buf[pos : pos + 64 + fmt.BATCH_TAG_LEN]
            stored = frame[64 : 64 + fmt.BATCH_TAG_LEN]
            assert cipher.batch_tag(r.woid, fmt.batch_auth_data(prev, buf[start:pos], frame)) == stored
            for other in (bytes(fmt.BATCH_TAG_LEN), b"", stored):
                if other != prev:
                    assert cipher.batch_tag(r.woid, fmt.batch_auth_data(other, buf[start:pos], frame)) != stored
            prev, start, checked = stored, r.end, checked + 1
        pos = r.end
    assert checked >= 3


if __name__ == "__main__":
    make(sys.argv[1])
