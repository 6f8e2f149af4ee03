"""The small files of an encrypted channel carry MACs; ANCHOR holds the chain's end outside the data files.

An attacker with write access to the channel directory, without the key, edits
checkpoints, ``.ack`` files, ``DATA_DIRS`` and ``DATADIR`` (checksums fixed),
deletes checkpoints and cuts whole batches, or swaps in a data file from a copy
of the channel. Each edit is refused (or, in skip mode, reported): never
delivered, never silent.
"""

from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("cryptography", reason="the crypto extra is not installed (README, Installing)")

from helpers import batch_ends, data_files

import filechannel
from filechannel import checkpoint as ckpt
from filechannel import format as fmt
from filechannel.crypto import Encryption
from filechannel.directory import encode_meta, split_meta
from filechannel.verify import verify_channel

KEY = bytes(range(32))
OPTS: dict[str, Any] = {"minimum_required_space": 0, "background": False, "checkpoint_interval": 0}


def enc() -> Encryption:
    return Encryption(keys={"k1": KEY}, active_key="k1")


def checkpoints(d: str) -> list[str]:
    ck = os.path.join(d, "checkpoints")
    return sorted(os.path.join(ck, n) for n in os.listdir(ck) if n.endswith(".ckpt"))


def drop_checkpoints(d: str) -> None:
    for p in checkpoints(d):
        os.unlink(p)


def forge_meta(path: str, change: dict[str, Any]) -> None:
    """Edit a MACed metadata file's JSON and fix its checksum, keeping its (now wrong) MAC line."""
    buf = Path(path).read_bytes()
    obj, _line, key_id, tag = split_meta(buf, path)
    assert key_id is not None, f"{path} has no MAC"
    assert tag is not None
    obj.update(change)
    fixed = encode_meta(obj)  # valid checksum, no MAC line
    Path(path).write_bytes(fixed + b"mac:%s:%s\n" % (key_id.encode(), tag.hex().encode()))


def put_all(d: str, bodies: list[bytes], **kw: Any) -> None:
    with filechannel.open(d, encryption=enc(), **OPTS, **kw) as ch:
        for b in bodies:
            with ch.transaction() as tx:
                tx.put(b)


def take_all(d: str, **kw: Any) -> list[bytes]:
    out = []
    with filechannel.open(d, encryption=enc(), **OPTS, **kw) as ch:
        while True:
            with ch.transaction() as tx:
                got = tx.take_batch(100)
            if not got:
                return out
            out += [e.body for e in got]


BODIES = [b"event-%d" % i for i in range(8)]


# -- acks ------------------------------------------------------------------------------------


def test_an_edited_ack_is_refused_and_takes_nothing(chan_dir: str) -> None:
    put_all(chan_dir, BODIES)
    with filechannel.ChannelReader(chan_dir, "r1", encryption=enc()) as r:
        start, _end = r.available()
        r.ack(start + 2)
    path = os.path.join(chan_dir, "consumers", "r1.ack")
    forge_meta(path, {"acked": 7})
    # The reader refuses its own forged position (it would skip events 2..6).
    with pytest.raises(filechannel.CorruptLogError, match="MAC fails"):
        filechannel.ChannelReader(chan_dir, "r1", encryption=enc()).available()
    # The owner applies no forged acknowledgement: nothing is taken on its behalf.
    with filechannel.open(chan_dir, encryption=enc(), **OPTS) as ch:
        with pytest.raises(filechannel.CorruptLogError, match="MAC fails"):
            ch.apply_acks()
        assert ch.size == len(BODIES)


def test_an_ack_without_its_mac_is_refused(chan_dir: str) -> None:
    put_all(chan_dir, BODIES)
    with filechannel.ChannelReader(chan_dir, "r1", encryption=enc()) as r:
        r.ack(r.available()[0] + 1)
    path = os.path.join(chan_dir, "consumers", "r1.ack")
    obj, _line, _k, _t = split_meta(Path(path).read_bytes(), path)
    obj["acked"] = 6
    Path(path).write_bytes(encode_meta(obj))  # a valid checksum, the MAC line stripped
    with pytest.raises(filechannel.CorruptLogError, match="has no MAC"):
        filechannel.ChannelReader(chan_dir, "r1", encryption=enc()).available()


def test_an_ack_moved_to_another_consumer_is_refused(chan_dir: str) -> None:
    put_all(chan_dir, BODIES)
    for name, n in (("slow", 1), ("fast", 6)):
        with filechannel.ChannelReader(chan_dir, name, encryption=enc()) as r:
            r.ack(r.available()[0] + n)
    cdir = os.path.join(chan_dir, "consumers")
    obj, _line, key_id, tag = split_meta(Path(cdir, "fast.ack").read_bytes(), "fast")
    assert key_id is not None
    assert tag is not None
    obj["name"] = "slow"
    Path(cdir, "slow.ack").write_bytes(encode_meta(obj) + b"mac:%s:%s\n" % (key_id.encode(), tag.hex().encode()))
    with pytest.raises(filechannel.CorruptLogError, match="MAC fails"):
        filechannel.ChannelReader(chan_dir, "slow", encryption=enc()).available()


# -- checkpoints -----------------------------------------------------------------------------


def test_an_edited_checkpoint_is_not_used_and_every_event_comes_once(chan_dir: str) -> None:
    put_all(chan_dir, BODIES)
    (path,) = checkpoints(chan_dir)[-1:]
    buf = bytearray(Path(path).read_bytes())
    body, _kid, _tag = fmt.split_sealed(bytes(buf))
    (n,) = struct.unpack_from("<I", body, len(body) - 4)
    ck_len = len(body) - 4 - n
    snap = ckpt.decode(bytes(buf[:ck_len]), snap_kind(chan_dir), snap_cid(chan_dir))
    assert len(snap) == len(BODIES)
    # Point queue entry 1 at entry 0's record (a duplicate, and event 1 dropped), CRC fixed.
    q = ck_len - 4 - 32 * len(snap)  # the four columns: positions, file ids, offsets, sizes
    offs = q + 2 * 8 * len(snap)
    struct.pack_into("<q", buf, offs + 8, struct.unpack_from("<q", buf, offs)[0])
    struct.pack_into("<I", buf, ck_len - 4, fmt.crc(snap_kind(chan_dir), bytes(buf[: ck_len - 4])))
    Path(path).write_bytes(bytes(buf))
    with filechannel.open(chan_dir, encryption=enc(), **OPTS) as ch:
        assert any("MAC fails" in f for f in ch.checkpoint_fallbacks)
    assert take_all(chan_dir) == BODIES


def snap_kind(d: str) -> int:
    return fmt.decode_file_header(Path(data_files(d)[0]).read_bytes()).crc_kind  # type: ignore[union-attr]


def snap_cid(d: str) -> bytes:
    return fmt.decode_file_header(Path(data_files(d)[0]).read_bytes()).channel_id  # type: ignore[union-attr]


def test_a_checkpoint_without_a_mac_is_not_used(chan_dir: str) -> None:
    put_all(chan_dir, BODIES)
    (path,) = checkpoints(chan_dir)[-1:]
    body, _kid, _tag = fmt.split_sealed(Path(path).read_bytes())
    (n,) = struct.unpack_from("<I", body, len(body) - 4)
    Path(path).write_bytes(bytes(body[: len(body) - 4 - n]))  # a valid plain checkpoint
    with filechannel.open(chan_dir, encryption=enc(), **OPTS) as ch:
        assert any("has no MAC" in f for f in ch.checkpoint_fallbacks)
    assert take_all(chan_dir) == BODIES


# -- DATA_DIRS and DATADIR -----------------------------------------------------------------------


def test_edited_data_dirs_and_identity_are_refused(chan_dir: str, tmp_path: Path) -> None:
    put_all(chan_dir, BODIES)
    p = os.path.join(chan_dir, "DATA_DIRS")
    saved = Path(p).read_bytes()
    forge_meta(p, {"data_dirs": ["data", str(tmp_path / "elsewhere")]})
    with pytest.raises(filechannel.CorruptLogError, match="list of data directories: its MAC fails"):
        filechannel.open(chan_dir, encryption=enc(), **OPTS)
    Path(p).write_bytes(saved)
    ident = os.path.join(chan_dir, "data", "DATADIR")
    forge_meta(ident, {"owner": "/somewhere/else"})
    with pytest.raises(filechannel.CorruptLogError, match="data directory identity: its MAC fails"):
        filechannel.open(chan_dir, encryption=enc(), **OPTS)


def test_a_wrong_key_is_named_as_such_not_as_an_edit(chan_dir: str) -> None:
    put_all(chan_dir, BODIES)
    wrong = Encryption(keys={"k1": bytes(32)}, active_key="k1")
    with pytest.raises(filechannel.DecryptionError, match="not the one this file was written with"):
        filechannel.open(chan_dir, encryption=wrong, **OPTS)


# -- ANCHOR: truncation, deletion, a copy's file ---------------------------------------------------


def test_whole_batches_cut_after_the_checkpoints_were_deleted_are_caught(chan_dir: str) -> None:
    put_all(chan_dir, BODIES)
    drop_checkpoints(chan_dir)
    path = data_files(chan_dir)[-1]
    ends = batch_ends(path)
    with open(path, "r+b") as f:
        f.truncate(ends[-3])  # the last two batches (two committed events) cut cleanly
    with pytest.raises(filechannel.CorruptLogError, match="shorter than"):
        filechannel.open(chan_dir, encryption=enc(), **OPTS)
    res = verify_channel(chan_dir, encryption=enc())
    assert not res.ok
    assert any("shorter than" in r.reason for r in res.reports)
    with filechannel.open(chan_dir, encryption=enc(), on_corruption="skip", **OPTS) as ch:
        assert ch.stats()["corruption_report"]


def test_a_deleted_anchor_is_refused_and_reported_in_skip_mode(chan_dir: str) -> None:
    put_all(chan_dir, BODIES)
    os.unlink(os.path.join(chan_dir, "ANCHOR"))
    with pytest.raises(filechannel.CorruptLogError, match="ANCHOR is missing"):
        filechannel.open(chan_dir, encryption=enc(), **OPTS)
    with filechannel.open(chan_dir, encryption=enc(), on_corruption="skip", **OPTS) as ch:
        assert any("ANCHOR is missing" in r for r in ch.stats()["corruption_report"])
    # The skip-mode open wrote a new ANCHOR: the channel is whole again.
    assert take_all(chan_dir) == BODIES


def test_an_edited_anchor_is_refused(chan_dir: str) -> None:
    put_all(chan_dir, BODIES)
    p = os.path.join(chan_dir, "ANCHOR")
    buf = bytearray(Path(p).read_bytes())
    buf[20] ^= 1
    Path(p).write_bytes(bytes(buf))
    with pytest.raises(filechannel.CorruptLogError, match="MAC fails"):
        filechannel.open(chan_dir, encryption=enc(), **OPTS)


def test_the_newest_file_deleted_whole_is_caught(chan_dir: str) -> None:
    put_all(chan_dir, BODIES[:4], max_file_size=4096)
    put_all(chan_dir, BODIES[4:], max_file_size=4096)  # a second open: a second data file
    files = data_files(chan_dir)
    assert len(files) >= 2
    drop_checkpoints(chan_dir)
    os.unlink(files[-1])
    with pytest.raises(filechannel.CorruptLogError, match="ANCHOR or the checkpoint recorded it"):
        filechannel.open(chan_dir, encryption=enc(), **OPTS)


def test_a_file_from_a_copy_is_not_accepted_in_place_of_the_original(tmp_path: Path) -> None:
    a = str(tmp_path / "a")
    put_all(a, BODIES[:2])
    b = str(tmp_path / "b")
    shutil.copytree(a, b)
    put_all(a, [b"a-only"])
    put_all(b, [b"b-only"])
    # Same channel id, same file name: B's newest file put in place of A's.
    fa, fb = data_files(a)[-1], data_files(b)[-1]
    assert os.path.basename(fa) == os.path.basename(fb)
    shutil.copyfile(fb, fa)
    with pytest.raises(filechannel.CorruptLogError, match="not the one this channel wrote"):
        filechannel.open(a, encryption=enc(), **OPTS)
    got = take_all(a, on_corruption="skip")
    assert b"b-only" not in got


def test_a_channel_that_gets_keys_seals_its_small_files(chan_dir: str) -> None:
    with filechannel.open(chan_dir, **OPTS) as ch, ch.transaction() as tx:
        tx.put(b"plain")
    with filechannel.ChannelReader(chan_dir, "r1") as r:
        r.available()
    assert b"mac:" not in Path(chan_dir, "consumers", "r1.ack").read_bytes()
    with filechannel.open(chan_dir, encryption=enc(), **OPTS) as ch, ch.transaction() as tx:
        tx.put(b"sealed")
    for p in ("DATA_DIRS", "data/DATADIR", "consumers/r1.ack"):
        assert b"\nmac:k1:" in Path(chan_dir, p).read_bytes(), p
    assert fmt.split_sealed(Path(chan_dir, "ANCHOR").read_bytes())[1] == "k1"
    with filechannel.ChannelReader(chan_dir, "r1", encryption=enc()) as r:
        start, end = r.available()
        assert [e.body for e in r.read(start, end)] == [b"plain", b"sealed"]


def test_a_key_rotation_reseals_the_small_files(chan_dir: str) -> None:
    k2 = bytes(range(1, 33))
    put_all(chan_dir, BODIES[:2])
    with filechannel.ChannelReader(chan_dir, "r1", encryption=enc()) as r:
        start, end = r.available()
        r.ack(end)
    both = Encryption(keys={"k1": KEY, "k2": k2}, active_key="k2")
    with filechannel.open(chan_dir, encryption=both, **OPTS) as ch:
        assert ch.size == 0  # the open applied r1's acknowledgement
        ch.checkpoint()
        with ch.transaction() as tx:
            tx.put(b"under-k2")
    for p in ("DATA_DIRS", "data/DATADIR", "consumers/r1.ack"):
        assert b"\nmac:k2:" in Path(chan_dir, p).read_bytes(), p
    only_k2 = Encryption(keys={"k2": k2}, active_key="k2")
    with filechannel.ChannelReader(chan_dir, "r1", encryption=only_k2) as r:
        start, end = r.available()
        assert [e.body for e in r.read(start, end)] == [b"under-k2"]


def test_verify_reports_a_forged_ack(chan_dir: str) -> None:
    put_all(chan_dir, BODIES)
    with filechannel.ChannelReader(chan_dir, "r1", encryption=enc()) as r:
        r.ack(r.available()[0] + 1)
    assert verify_channel(chan_dir, encryption=enc()).ok
    forge_meta(os.path.join(chan_dir, "consumers", "r1.ack"), {"acked": 7})
    res = verify_channel(chan_dir, encryption=enc())
    assert not res.ok
    assert any("consumer r1: its MAC fails" in r.reason for r in res.reports)


def test_a_copied_encrypted_channel_keeps_working(tmp_path: Path) -> None:
    a = str(tmp_path / "a")
    put_all(a, BODIES[:3])
    with filechannel.ChannelReader(a, "r1", encryption=enc()) as r:
        r.available()
    b = str(tmp_path / "b")
    shutil.copytree(a, b, symlinks=True)  # what `cp -a` does (docs/backup.md)
    shutil.rmtree(a)
    put_all(b, BODIES[3:])
    with filechannel.ChannelReader(b, "r1", encryption=enc()) as r:
        start, end = r.available()
        assert [e.body for e in r.read(start, end)] == BODIES
    assert verify_channel(b, encryption=enc()).ok
