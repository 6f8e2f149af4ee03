"""Encryption at rest: no plaintext on disk, tampering and moved records caught, keys checked at open."""

from __future__ import annotations

import base64
import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("cryptography", reason="the crypto extra is not installed (README, Installing)")

from helpers import records

import filechannel
from filechannel import crypto
from filechannel import format as fmt
from filechannel.crypto import Encryption
from filechannel.verify import verify_channel

K1 = bytes(range(32))
K2 = bytes(range(100, 132))
OPTS: dict[str, Any] = {"minimum_required_space": 0, "background": False}


def enc(active: str = "k1", **more: bytes) -> Encryption:
    return Encryption(keys={"k1": K1, "k2": K2, **more}, active_key=active)


def write_keystore(path: Path, keys: dict[str, bytes], mode: int = 0o600) -> str:
    path.write_text(json.dumps({k: base64.b64encode(v).decode() for k, v in keys.items()}))
    os.chmod(path, mode)
    return str(path)


def all_files(d: str) -> Iterator[tuple[str, bytes]]:
    for root, _dirs, files in os.walk(d):
        for f in files:
            p = os.path.join(root, f)
            with open(p, "rb") as fh:
                yield p, fh.read()


def assert_no_plaintext(d: str, secrets: list[bytes]) -> None:
    n = 0
    for p, data in all_files(d):
        n += 1
        for s in secrets:
            assert s not in data, f"{s!r} in plaintext in {p}"
    assert n > 0


def seg_files(d: str) -> list[str]:
    data = os.path.join(d, "data")
    return sorted(os.path.join(data, n) for n in os.listdir(data) if n.endswith(".wal"))


def file_cipher(h: fmt.FileHeader) -> Any:
    """The cipher of a data file of these tests (an attacker with the key could do this)."""
    return enc().file_cipher("", h.cipher, h.key_id, h.salt, h.channel_id, h.file_id)


def refix(buf: bytearray, path_header: fmt.FileHeader, batch_start: int, be_off: int, retag: bool = True) -> None:
    """Recompute every record checksum in ``[batch_start, be_off]`` and the BATCH_END's batch checksum.

    In an authenticated file, ``retag`` also recomputes the batch tag with the key: what only a key
    holder can do, so that a test reaches the per-record tag behind the batch tag. Without it, the
    batch tag is left as it was (what an attacker without the key can do).
    """
    h = path_header
    seed = fmt.file_seed(h.crc_kind, h.channel_id, h.file_id)
    pos = batch_start
    while pos < be_off:
        n = struct.unpack_from("<I", buf, pos + 4)[0]
        c = fmt.crc(
            h.crc_kind, bytes(buf[pos + 32 : pos + 32 + n]), fmt.crc(h.crc_kind, bytes(buf[pos : pos + 24]), seed)
        )
        struct.pack_into("<I", buf, pos + 24, c)
        pos += fmt.record_size(n)
    assert pos == be_off
    bc = fmt.crc(h.crc_kind, bytes(buf[batch_start:be_off]), seed)
    # BATCH_END payload: batch_start u64, batch_len u32, batch_crc u32, ...
    struct.pack_into("<I", buf, be_off + 32 + 12, bc)
    if h.authenticated and retag:
        prev = h.key_check if batch_start == h.header_len else bytes(buf[batch_start - 16 : batch_start])
        woid = struct.unpack_from("<Q", buf, be_off + 8)[0]
        data = fmt.batch_auth_data(prev, bytes(buf[batch_start:be_off]), bytes(buf[be_off : be_off + 64]))
        buf[be_off + 64 : be_off + 80] = file_cipher(h).batch_tag(woid, data)
    n = struct.unpack_from("<I", buf, be_off + 4)[0]
    c = fmt.crc(
        h.crc_kind,
        bytes(buf[be_off + 32 : be_off + 32 + n]),
        fmt.crc(h.crc_kind, bytes(buf[be_off : be_off + 24]), seed),
    )
    struct.pack_into("<I", buf, be_off + 24, c)


# ------------------------------------------------------------------------------------------
# round trip, no plaintext on disk


def test_round_trip_and_no_plaintext_anywhere(chan_dir: str) -> None:
    secrets = [b"BODY-SECRET-%d" % i for i in range(40)]
    ch = filechannel.open(chan_dir, encryption=enc(), max_file_size=8192, checkpoint_interval=0, **OPTS)
    for i in range(0, 40, 4):
        with ch.transaction() as tx:
            for j in range(i, i + 4):
                tx.put(secrets[j] + b"x" * 300, headers={"user": f"HDR-SECRET-{j}"})
    tx = ch.transaction()
    tx.put(b"ROLLED-BACK-SECRET")
    tx.rollback()
    with ch.transaction() as tx:
        taken = tx.take_batch(6)
    assert [e.body for e in taken] == [s + b"x" * 300 for s in secrets[:6]]
    ch.checkpoint()
    assert ch.stats()["key_ids_in_use"] == ["k1"]
    ch.close()
    hdrs = [b"HDR-SECRET-%d" % i for i in range(40)]
    assert_no_plaintext(chan_dir, [*secrets, *hdrs, b"ROLLED-BACK-SECRET"])
    with filechannel.open(chan_dir, encryption=enc(), **OPTS) as ch2, ch2.transaction() as tx:
        got = tx.take_batch(100)
    assert [e.body for e in got] == [s + b"x" * 300 for s in secrets[6:]]
    assert [dict(e.headers) for e in got] == [{"user": f"HDR-SECRET-{j}"} for j in range(6, 40)]


CHILD = """
import os, sys, filechannel
from filechannel.crypto import Encryption
e = Encryption(keys={"k1": bytes(range(32))}, active_key="k1")
ch = filechannel.open(sys.argv[1], encryption=e, minimum_required_space=0, checkpoint_interval=0)
with ch.transaction() as tx:
    tx.put(b"FIRST-SECRET")
with ch.transaction() as tx:
    tx.put(b"TORN-SECRET" * 5, headers={"h": "TORN-HEADER"})
os._exit(0)  # no close, no checkpoint: as if killed
"""


def test_crash_with_a_torn_tail_leaves_no_plaintext(chan_dir: str) -> None:
    import subprocess
    import sys

    subprocess.run([sys.executable, "-c", CHILD, chan_dir], check=True, timeout=60)
    (path,) = seg_files(chan_dir)
    recs = records(path)
    last_be = [r for r in recs if r.op == fmt.BATCH_END][-1]
    buf = bytearray(Path(path).read_bytes())
    buf[last_be.end - 8 : last_be.end] = bytes(8)  # the crash tore the last write
    Path(path).write_bytes(bytes(buf))
    with filechannel.open(chan_dir, encryption=enc(), **OPTS) as ch:
        assert ch._log.torn_tails
        tx = ch.transaction()
        assert [e.body for e in tx.take_batch(10)] == [b"FIRST-SECRET"]
        tx.rollback()
    torn = [p for p, _ in all_files(chan_dir) if ".torn-" in p]
    assert torn, "the torn tail was set aside"
    assert b"TORN-SECRET" not in Path(torn[0]).read_bytes()
    assert len(Path(torn[0]).read_bytes()) >= 55  # the torn PUT is in it, as ciphertext
    assert_no_plaintext(chan_dir, [b"FIRST-SECRET", b"TORN-SECRET", b"TORN-HEADER"])


# ------------------------------------------------------------------------------------------
# the cipher: nonces, tampering, moved records


def test_equal_length_plaintexts_do_not_share_a_keystream(chan_dir: str) -> None:
    pt1 = b"A" * 64
    pt2 = b"B" * 64
    with filechannel.open(chan_dir, encryption=enc(), **OPTS) as ch:
        with ch.transaction() as tx:
            tx.put(pt1)
            tx.put(pt2)
        path = ch._log.file_path(ch._log.file_ids()[-1])
    puts = [r for r in records(path) if r.op == fmt.PUT]
    assert len(puts) == 2
    ct1, ct2 = puts[0].payload, puts[1].payload
    assert len(ct1) == len(ct2) == 4 + 64 + fmt.ENC_TAG_LEN
    x_ct = bytes(a ^ b for a, b in zip(ct1[:68], ct2[:68], strict=True))
    x_pt = bytes(a ^ b for a, b in zip(fmt.encode_event(pt1, None), fmt.encode_event(pt2, None), strict=True))
    assert x_ct != x_pt


def _one_event_channel(chan_dir: str, bodies: list[bytes]) -> tuple[str, fmt.FileHeader, bytearray]:
    with filechannel.open(chan_dir, encryption=enc(), checkpoint_interval=0, **OPTS) as ch:
        with ch.transaction() as tx:
            for b in bodies:
                tx.put(b)
        path = ch._log.file_path(ch._log.file_ids()[-1])
    # The close wrote a checkpoint; remove it so the open replays (and the take reads the record).
    for p, _ in list(all_files(os.path.join(chan_dir, "checkpoints"))):
        os.unlink(p)
    buf = bytearray(Path(path).read_bytes())
    h = fmt.decode_file_header(bytes(buf))
    assert isinstance(h, fmt.FileHeader)
    forget_anchored_tags(chan_dir, h.channel_id)
    return path, h, buf


def forget_anchored_tags(chan_dir: str, channel_id: bytes) -> None:
    """Rewrite ANCHOR (with the key, as only a key holder can) without its per-file lengths and tags.

    So that a test that re-tags a batch with the key reaches the per-record check behind it.
    """
    p = os.path.join(chan_dir, "ANCHOR")
    body, _kid, _tag = fmt.split_sealed(Path(p).read_bytes())
    new = fmt.encode_auth_state(fmt.AuthState(fmt.decode_auth_state(body).first_auth, ()))
    kid, tag = enc().meta_mac(channel_id).tag("ANCHOR", new)
    Path(p).write_bytes(fmt.encode_sealed(new, kid, tag))


@pytest.mark.parametrize("policy", ["fail", "skip"])
def test_tampered_ciphertext_with_fixed_checksums_is_reported_never_returned(chan_dir: str, policy: str) -> None:
    path, h, buf = _one_event_channel(chan_dir, [b"one", b"two-secret", b"three"])
    recs = records(path)
    victim = [r for r in recs if r.op == fmt.PUT][1]
    be = next(r for r in recs if r.op == fmt.BATCH_END)
    buf[victim.offset + 32 + 5] ^= 0x01  # a ciphertext bit
    refix(buf, h, h.header_len, be.offset)
    Path(path).write_bytes(bytes(buf))
    # The checksums verify: recovery (which needs no key) sees intact records.
    with filechannel.open(chan_dir, encryption=enc(), on_corruption=policy, **OPTS) as ch:
        assert ch.size == 3
        tx = ch.transaction()
        if policy == "fail":
            with pytest.raises(filechannel.DecryptionError) as ei:
                tx.take_batch(10)
            assert ei.value.path == path
            assert ei.value.offset == victim.offset
            assert "authentication tag" in str(ei.value)
            tx.rollback()
        else:
            got = tx.take_batch(10)
            tx.commit()
            assert [e.body for e in got] == [b"one", b"three"]
            assert ch.stats()["lost_positions"] == [[1, 2]]
    res = verify_channel(chan_dir, encryption=enc())
    assert res.lost_positions == [(1, 2)] if policy == "fail" else True
    if policy == "fail":
        # verify without a key checks checksums only: the tampering passes them.
        blind = verify_channel(chan_dir)
        assert blind.ok
        assert blind.undecrypted == 3


def test_a_record_moved_to_another_offset_is_rejected(chan_dir: str) -> None:
    # Swap two equal-length PUT records (frames and all), fix every checksum: each now
    # sits at another offset, and its woid no longer follows the batch order either,
    # so swap the woids back too: only the AAD (offset, woid) can tell.
    path, h, buf = _one_event_channel(chan_dir, [b"first!", b"second"])
    recs = records(path)
    p1, p2 = [r for r in recs if r.op == fmt.PUT]
    be = next(r for r in recs if r.op == fmt.BATCH_END)
    f1 = bytes(buf[p1.offset : p1.end])
    f2 = bytes(buf[p2.offset : p2.end])
    buf[p1.offset : p1.end] = f2[:8] + f1[8:16] + f2[16:]  # keep the woid of the place
    buf[p2.offset : p2.end] = f1[:8] + f2[8:16] + f1[16:]
    refix(buf, h, h.header_len, be.offset)
    Path(path).write_bytes(bytes(buf))
    with filechannel.open(chan_dir, encryption=enc(), **OPTS) as ch:
        assert ch.size == 2
        tx = ch.transaction()
        with pytest.raises(filechannel.DecryptionError):
            tx.take()
        tx.rollback()


def test_a_record_copied_into_another_file_is_rejected(chan_dir: str) -> None:
    # File B's only PUT gets file A's ciphertext (same length; B's own frame header,
    # so its woid and txn id fit; checksums fixed for B's seed).
    ch = filechannel.open(chan_dir, encryption=enc(), checkpoint_interval=0, max_file_size=4096, **OPTS)
    with ch.transaction() as tx:
        tx.put(b"A" * 3000)
    with ch.transaction() as tx:
        tx.put(b"B" * 3000)  # does not fit: a second file
    fa, fb = (ch._log.file_path(f) for f in ch._log.file_ids()[-2:])
    ch.close()
    for p, _ in list(all_files(os.path.join(chan_dir, "checkpoints"))):
        os.unlink(p)
    ra = next(r for r in records(fa) if r.op == fmt.PUT)
    rb_all = records(fb)
    rb = next(r for r in rb_all if r.op == fmt.PUT)
    assert ra.size == rb.size
    bufa = Path(fa).read_bytes()
    bufb = bytearray(Path(fb).read_bytes())
    hb = fmt.decode_file_header(bytes(bufb))
    assert isinstance(hb, fmt.FileHeader)
    # Keep B's own woid and txn id in the frame; the ciphertext is A's.
    bufb[rb.offset + 32 : rb.end] = bufa[ra.offset + 32 : ra.end]
    be = next(r for r in rb_all if r.op == fmt.BATCH_END and r.offset > rb.offset)
    refix(bufb, hb, rb.offset, be.offset)
    Path(fb).write_bytes(bytes(bufb))
    forget_anchored_tags(chan_dir, hb.channel_id)  # the re-tag is a key holder's: reach the record's own tag
    with filechannel.open(chan_dir, encryption=enc(), **OPTS) as ch2:
        tx = ch2.transaction()
        assert tx.take() is not None  # A's own record, in place
        with pytest.raises(filechannel.DecryptionError):
            tx.take()
        tx.rollback()


# ------------------------------------------------------------------------------------------
# keys: errors at open


def _encrypted_channel(chan_dir: str, e: Encryption | None = None) -> None:
    with filechannel.open(chan_dir, encryption=e or enc(), **OPTS) as ch, ch.transaction() as tx:
        tx.put(b"x")


def test_no_encryption_given_fails_at_open_naming_the_key_id(chan_dir: str) -> None:
    _encrypted_channel(chan_dir)
    with pytest.raises(filechannel.DecryptionError) as ei:
        filechannel.open(chan_dir, **OPTS)
    assert ei.value.key_id == "k1"
    assert "'k1'" in str(ei.value)
    assert isinstance(ei.value, filechannel.CorruptLogError)
    with pytest.raises(filechannel.DecryptionError):
        filechannel.ChannelReader(chan_dir).available()


def test_wrong_key_fails_at_open(chan_dir: str) -> None:
    _encrypted_channel(chan_dir)
    wrong = Encryption(keys={"k1": bytes(32)}, active_key="k1")
    with pytest.raises(filechannel.DecryptionError, match="not the one this file was written with") as ei:
        filechannel.open(chan_dir, encryption=wrong, **OPTS)
    assert ei.value.key_id == "k1"
    with pytest.raises(filechannel.DecryptionError):
        filechannel.ChannelReader(chan_dir, encryption=wrong).available()


def test_missing_key_id_fails_at_open(chan_dir: str) -> None:
    _encrypted_channel(chan_dir)
    other = Encryption(keys={"k2": K2}, active_key="k2")
    with pytest.raises(filechannel.DecryptionError, match="key id 'k1', which is not among the keys") as ei:
        filechannel.open(chan_dir, encryption=other, **OPTS)
    assert ei.value.key_id == "k1"


def test_keystore_file_checks(tmp_path: Path) -> None:
    good = write_keystore(tmp_path / "good.json", {"a": K1, "b": K2})
    e = Encryption(keys=good)
    assert e.active_key == "b"  # the last key listed: keygen appends
    assert Encryption(keys=good, active_key="a").active_key == "a"
    loose = write_keystore(tmp_path / "loose.json", {"a": K1}, mode=0o644)
    with pytest.raises(filechannel.ConfigError, match="chmod 600"):
        Encryption(keys=loose)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    os.chmod(bad, 0o600)
    with pytest.raises(filechannel.ConfigError, match="not valid JSON"):
        Encryption(keys=str(bad))
    short = write_keystore(tmp_path / "short.json", {"a": b"\x01" * 16})
    with pytest.raises(filechannel.ConfigError, match="16 bytes; keys are 32 bytes"):
        Encryption(keys=short)
    b64 = tmp_path / "b64.json"
    b64.write_text('{"a": "***"}')
    os.chmod(b64, 0o600)
    with pytest.raises(filechannel.ConfigError, match="not valid base64"):
        Encryption(keys=str(b64))
    with pytest.raises(filechannel.ConfigError, match="cannot read keystore"):
        Encryption(keys=str(tmp_path / "absent.json"))


def test_encryption_option_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(filechannel.ConfigError, match="31 bytes"):
        Encryption(keys={"a": b"x" * 31}, active_key="a")
    with pytest.raises(filechannel.ConfigError, match="not among the keys"):
        Encryption(keys={"a": K1}, active_key="b")
    with pytest.raises(filechannel.ConfigError, match="cipher must be one of"):
        Encryption(keys={"a": K1}, cipher="aes-128-ctr")
    with pytest.raises(filechannel.ConfigError, match="key id"):
        Encryption(keys={"a b": K1})
    with pytest.raises(filechannel.ConfigError, match="active_key is required"):
        Encryption(keys=lambda kid: K1)
    with pytest.raises(filechannel.ConfigError, match="encryption"):
        filechannel.open("/nonexistent/never", encryption={"a": K1})
    monkeypatch.setenv("FC_TEST_KEYS", json.dumps({"env1": base64.b64encode(K2).decode()}))
    assert Encryption.from_env("FC_TEST_KEYS") == {"env1": K2}
    monkeypatch.delenv("FC_TEST_KEYS")
    with pytest.raises(filechannel.ConfigError, match="FC_TEST_KEYS is not set"):
        Encryption.from_env("FC_TEST_KEYS")
    e = Encryption(keys={"a": K1})
    assert "K1" not in repr(e)
    assert repr(K1) not in repr(e)
    import pickle

    with pytest.raises(TypeError, match="keystore path"):
        pickle.dumps(e)


def test_callable_keys_and_chacha(chan_dir: str) -> None:
    keys = {"c1": K1}
    e = Encryption(keys=keys.__getitem__, active_key="c1", cipher="chacha20-poly1305")
    with filechannel.open(chan_dir, encryption=e, **OPTS) as ch, ch.transaction() as tx:
        tx.put(b"cha-cha-SECRET")
    assert_no_plaintext(chan_dir, [b"cha-cha-SECRET"])
    with filechannel.open(chan_dir, encryption=e, **OPTS) as ch, ch.transaction() as tx:
        assert tx.take().body == b"cha-cha-SECRET"  # type: ignore[union-attr]


# ------------------------------------------------------------------------------------------
# rotation, mixed history


def test_rotation_across_restarts(chan_dir: str) -> None:
    with filechannel.open(chan_dir, encryption=enc("k1"), **OPTS) as ch, ch.transaction() as tx:
        tx.put(b"under-k1")
    with filechannel.open(chan_dir, encryption=enc("k2"), **OPTS) as ch:
        with ch.transaction() as tx:
            tx.put(b"under-k2")
        assert ch.stats()["key_ids_in_use"] == ["k1", "k2"]
    # k1 is still needed: its file holds a queued event.
    with pytest.raises(filechannel.DecryptionError, match="'k1'"):
        filechannel.open(chan_dir, encryption=Encryption(keys={"k2": K2}), **OPTS)
    with filechannel.open(chan_dir, encryption=enc("k2"), **OPTS) as ch:
        with ch.transaction() as tx:
            assert [e.body for e in tx.take_batch(10)] == [b"under-k1", b"under-k2"]
        ch.checkpoint()
        with ch.transaction() as tx:
            tx.put(b"more")  # a write lets the drained k1 file retire
        assert ch.stats()["key_ids_in_use"] == ["k2"]
    with filechannel.open(chan_dir, encryption=Encryption(keys={"k2": K2}), **OPTS) as ch, ch.transaction() as tx:
        assert tx.take().body == b"more"  # type: ignore[union-attr]


def test_mixed_plaintext_then_encrypted(chan_dir: str) -> None:
    with filechannel.open(chan_dir, **OPTS) as ch:
        with ch.transaction() as tx:
            tx.put(b"old-plain")
        assert ch.stats()["key_ids_in_use"] == []
    with filechannel.open(chan_dir, encryption=enc(), **OPTS) as ch:
        with ch.transaction() as tx:
            tx.put(b"NEW-SECRET")
        assert ch.stats()["key_ids_in_use"] == ["k1"]
    data = b"".join(d for p, d in all_files(chan_dir) if p.endswith(".wal"))
    assert b"old-plain" in data
    assert b"NEW-SECRET" not in data
    with pytest.raises(filechannel.DecryptionError):
        filechannel.open(chan_dir, **OPTS)
    with filechannel.open(chan_dir, encryption=enc(), **OPTS) as ch, ch.transaction() as tx:
        assert [e.body for e in tx.take_batch(10)] == [b"old-plain", b"NEW-SECRET"]


def test_reader_and_segments_with_a_keystore_path(tmp_path: Path) -> None:
    import pickle

    ks = write_keystore(tmp_path / "keys.json", {"k1": K1})
    d = str(tmp_path / "ch")
    owner = filechannel.open(d, encryption=Encryption(keys=ks), **OPTS)
    with owner.transaction() as tx:
        tx.put_many([b"r1", b"r2", b"r3"], headers={"h": "v"})
    reader = filechannel.ChannelReader(d, "c1", encryption=ks)
    start, end = reader.available()
    assert [e.body for e in reader.read(start, end)] == [b"r1", b"r2", b"r3"]
    segs = pickle.loads(pickle.dumps(reader.segments(start, end)))
    assert all(s.key_id == "k1" for s in segs)
    assert b"k1" not in pickle.dumps(segs) or K1 not in pickle.dumps(segs)
    assert [e.body for s in segs for e in filechannel.read_segment(s, encryption=ks)] == [b"r1", b"r2", b"r3"]
    with pytest.raises(filechannel.DecryptionError):
        filechannel.read_segment(segs[0])
    # A pickled reader carries the path only, and reads on.
    blob = pickle.dumps(reader)
    assert K1 not in blob
    with owner.transaction() as tx:
        tx.put(b"r4")
    r2 = pickle.loads(blob)
    assert [e.body for e in r2.read(3, 4)] == [b"r4"]
    r2.close()
    reader.close()
    owner.close()


def test_the_associated_data_binds_channel_file_offset_and_frame() -> None:
    from filechannel.crypto import FileCipher

    cid = bytes(range(16))
    salt = bytes(32)
    c = FileCipher(1, "k1", salt, K1, cid, 7)
    head = struct.pack("<BBHIQQ", fmt.PUT, 0, 0, 5 + 16, 42, 3)
    ct = c.seal(head, 800, b"hello")
    assert c.open(head, 800, ct) == b"hello"
    assert c.open(head, 808, ct) is None  # another offset
    assert FileCipher(1, "k1", salt, K1, cid, 8).open(head, 800, ct) is None  # another file
    assert FileCipher(1, "k1", salt, K1, bytes(16), 7).open(head, 800, ct) is None  # another channel
    assert FileCipher(1, "k1", bytes([1]) * 32, K1, cid, 7).open(head, 800, ct) is None  # another salt
    other_txn = struct.pack("<BBHIQQ", fmt.PUT, 0, 0, 5 + 16, 42, 4)
    assert c.open(other_txn, 800, ct) is None  # another frame header
    # The nonce is the woid: the same plaintext under another woid encrypts differently.
    head43 = struct.pack("<BBHIQQ", fmt.PUT, 0, 0, 5 + 16, 43, 3)
    assert c.seal(head43, 800, b"hello") != ct


# ------------------------------------------------------------------------------------------
# the command line


def cli(capsys: pytest.CaptureFixture[str], *argv: str, stdin: bytes | None = None) -> tuple[int, str, str]:
    import io
    import sys

    from filechannel import cli as cli_mod

    old = sys.stdin
    if stdin is not None:
        sys.stdin = io.TextIOWrapper(io.BytesIO(stdin))
    try:
        code = cli_mod.main(list(argv))
    finally:
        sys.stdin = old
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_keygen_put_take_stat_dump_verify(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ks = str(tmp_path / "keys.json")
    d = str(tmp_path / "ch")
    code, _, err = cli(capsys, "keygen", ks, "--id", "2026-10")
    assert code == 0, err
    assert os.stat(ks).st_mode & 0o777 == 0o600
    assert list(json.loads(Path(ks).read_text())) == ["2026-10"]
    code, _, err = cli(capsys, "keygen", ks, "--id", "2026-10")
    assert code == 2
    assert "already holds key id '2026-10'" in err
    code, _, err = cli(capsys, "put", d, "--keystore", ks, "--header", "who=CLI-HEADER", stdin=b"CLI-SECRET-1\n")
    assert code == 0, err
    code, _, err = cli(capsys, "keygen", ks, "--id", "2026-11")  # rotation: the new last key
    assert code == 0, err
    code, _, err = cli(capsys, "put", d, "--keystore", ks, stdin=b"CLI-SECRET-2\n")
    assert code == 0, err
    assert_no_plaintext(d, [b"CLI-SECRET", b"CLI-HEADER"])
    # No keystore: stat, dump and verify work (no key needed for checksums); put and take do not.
    code, out, err = cli(capsys, "stat", d, "--json")
    assert code == 0, err
    assert json.loads(out)["key_ids_in_use"] == ["2026-10", "2026-11"]
    code, out, err = cli(capsys, "dump", d)
    assert code == 0, err
    assert [json.loads(line)["op"] for line in out.splitlines()].count("put") == 2
    code, out, err = cli(capsys, "verify", d)
    assert code == 0, err
    assert "2 encrypted events checked by checksum only" in out
    code, out, err = cli(capsys, "take", d)
    assert code == 2
    assert "is encrypted (key id '2026-1" in err
    assert "--on-corruption" not in err
    assert "Traceback" not in err
    code, out, err = cli(capsys, "dump", d, "--bodies")
    assert code == 2
    # With the keystore.
    code, out, err = cli(capsys, "verify", d, "--keystore", ks)
    assert code == 0, err
    assert "checksum only" not in out
    code, out, err = cli(capsys, "dump", d, "--bodies", "--keystore", ks)
    assert code == 0, err
    assert [json.loads(line).get("body") for line in out.splitlines() if '"put"' in line] == [
        "CLI-SECRET-1",
        "CLI-SECRET-2",
    ]
    code, out, err = cli(capsys, "take", d, "-n", "5", "--keystore", ks)
    assert code == 0, err
    assert out.split() == ["CLI-SECRET-1", "CLI-SECRET-2"]


def test_cli_keystore_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = str(tmp_path / "ch")
    loose = write_keystore(tmp_path / "loose.json", {"a": K1}, mode=0o640)
    code, _, err = cli(capsys, "put", d, "--keystore", loose, stdin=b"x\n")
    assert code == 2
    assert err.startswith(f"filechannel: error: --keystore {loose}: ")
    assert "chmod 600" in err
    assert not os.path.exists(d)
    code, _, err = cli(capsys, "keygen", loose)
    assert code == 2
    assert "group or others can read it" in err
    code, _, err = cli(capsys, "keygen", str(tmp_path / "k.json"), "--id", "no spaces")
    assert code == 2
    assert "--id 'no spaces' is not valid" in err
    ks = write_keystore(tmp_path / "k1.json", {"k1": K1})
    code, _, err = cli(capsys, "put", d, "--keystore", ks, stdin=b"x\n")
    assert code == 0, err
    wrong = write_keystore(tmp_path / "wrong.json", {"k1": K2})
    code, _, err = cli(capsys, "take", d, "--keystore", wrong)
    assert code == 2
    assert "key given for key id 'k1' is not the one" in err
    other = write_keystore(tmp_path / "other.json", {"k9": K2})
    code, _, err = cli(capsys, "stat", d, "--keystore", other)
    assert code == 2
    assert "key id 'k1', which is not among the keys" in err


def test_a_wrong_keystore_says_wrong_key_first_and_the_cli_names_keystore(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = str(tmp_path / "ch")
    ks = write_keystore(tmp_path / "k1.json", {"k1": K1})
    assert cli(capsys, "put", d, "--keystore", ks, stdin=b"x\n")[0] == 0
    other_id = write_keystore(tmp_path / "other.json", {"k9": K2})  # no key for the channel's key id
    other_key = write_keystore(tmp_path / "wrong.json", {"k1": K2})  # that id, another key
    for wrong in (other_id, other_key):
        for command in ("take", "stat", "peek", "verify", "checkpoint", "put"):
            code, _, err = cli(capsys, command, d, "--keystore", wrong, stdin=b"y\n")
            assert code == 2, (command, err)
            assert err.startswith("filechannel: error: wrong key for this channel: "), (command, err)
            assert "at byte" not in err  # nothing is damaged
            assert "--keystore PATH" in err
            assert "filechannel.open" not in err
            assert "Encryption(" not in err
            assert len(err.strip().splitlines()) == 1
    # No keystore at all: the CLI asks for one, not for encryption=.
    code, _, err = cli(capsys, "take", d)
    assert code == 2
    assert "no --keystore was given: give --keystore PATH" in err
    assert "encryption=" not in err
    # The Python API keeps its own advice, after the same first words.
    with pytest.raises(filechannel.DecryptionError) as ei:
        filechannel.open(d, encryption=Encryption(keys=other_id), **OPTS)
    assert str(ei.value).startswith(f"wrong key for this channel: {d}")
    assert ei.value.wrong_key
    assert "encryption=filechannel.Encryption(keys=...)" in str(ei.value)


def test_a_damaged_header_of_an_encrypted_file_loses_its_events_never_guesses(chan_dir: str) -> None:
    # Two files; the first (sealed) gets a flipped salt byte, so its header checksum fails.
    ch = filechannel.open(chan_dir, encryption=enc(), checkpoint_interval=0, max_file_size=4096, **OPTS)
    with ch.transaction() as tx:
        tx.put(b"in-first-file" + b"." * 3000)
    with ch.transaction() as tx:
        tx.put(b"in-second-file" + b"." * 3000)
    first = ch._log.file_path(ch._log.file_ids()[0])
    ch.close()
    h = fmt.decode_file_header(Path(first).read_bytes())
    assert isinstance(h, fmt.FileHeader)
    got, st = _damage_header_then_drain(chan_dir, first, fmt.FILE_HEADER_FIXED + 8 * len(h.live_files) + 8)  # salt
    assert [e.body[:14] for e in got] == [b"in-second-file"]
    assert st["lost_positions"] == [[0, 1]]


def _damage_header_then_drain(chan_dir: str, path: str, at: int) -> tuple[list[filechannel.Event], dict[str, Any]]:
    """Flip a header byte of a data file (no checkpoint to fall back on); the open must refuse,
    then skip mode drains what is left: the events taken and the channel's stats."""
    for p, _ in list(all_files(os.path.join(chan_dir, "checkpoints"))):
        os.unlink(p)
    buf = bytearray(Path(path).read_bytes())
    buf[at] ^= 0xFF
    Path(path).write_bytes(bytes(buf))
    with pytest.raises(filechannel.CorruptLogError, match="header"):
        filechannel.open(chan_dir, encryption=enc(), **OPTS)
    with filechannel.open(chan_dir, encryption=enc(), on_corruption="skip", **OPTS) as ch2:
        tx = ch2.transaction()
        got = tx.take_batch(10)
        tx.commit()
        return got, ch2.stats()


def test_a_damaged_header_of_a_plaintext_file_in_a_mixed_history_keeps_its_events(chan_dir: str) -> None:
    # Plaintext history first, then encrypted files; the plaintext file's header is damaged.
    # Its records carry no sealed flag: they are read as they are, with encryption= given.
    ch = filechannel.open(chan_dir, checkpoint_interval=0, max_file_size=4096, **OPTS)
    with ch.transaction() as tx:
        tx.put(b"old-plain" + b"." * 3000)
    with ch.transaction() as tx:
        tx.put(b"old-plain-2" + b"." * 3000)
    plain_first = ch._log.file_path(ch._log.file_ids()[0])
    ch.close()
    with filechannel.open(chan_dir, encryption=enc(), checkpoint_interval=0, max_file_size=4096, **OPTS) as ch:
        with ch.transaction() as tx:
            tx.put(b"NEW-SECRET" + b"." * 3000)
        assert ch._log.is_encrypted(ch._log.file_ids()[-1])
    got, st = _damage_header_then_drain(chan_dir, plain_first, 20)  # inside the channel id
    assert [e.body[:11] for e in got] == [b"old-plain..", b"old-plain-2", b"NEW-SECRET."]
    assert st["lost_positions"] == []
    assert any("data file header" in r for r in st["corruption_report"])


def test_a_reader_follows_new_files_and_a_rotation(tmp_path: Path) -> None:
    ks = write_keystore(tmp_path / "keys.json", {"k1": K1, "k2": K2})
    d = str(tmp_path / "ch")
    owner = filechannel.open(d, encryption=enc("k1"), max_file_size=4096, **OPTS)
    with owner.transaction() as tx:
        tx.put(b"a" * 100)
    reader = filechannel.ChannelReader(d, encryption=ks)
    assert reader.available() == (0, 1)
    for i in range(3):  # each fills a file: the owner rolls
        with owner.transaction() as tx:
            tx.put(bytes([98 + i]) * 3000)
    owner.close()
    owner = filechannel.open(d, encryption=enc("k2"), max_file_size=4096, **OPTS)  # a new file, under k2
    with owner.transaction() as tx:
        tx.put(b"under-k2")
    start, end = reader.available()
    assert (start, end) == (0, 5)
    got = reader.read(start, end)
    assert [e.body[:1] for e in got] == [b"a", b"b", b"c", b"d", b"u"]
    assert got[-1].body == b"under-k2"
    segs = reader.segments(start, end)
    assert {s.key_id for s in segs} == {"k1", "k2"}
    assert [e.body for s in segs for e in filechannel.read_segment(s, encryption=ks)] == [e.body for e in got]
    only_k1 = write_keystore(tmp_path / "k1only.json", {"k1": K1})
    with pytest.raises(filechannel.DecryptionError, match="'k2'"):
        filechannel.read_segment(segs[-1], encryption=only_k1)
    reader.close()
    owner.close()


def test_no_key_and_nonce_ever_seals_two_plaintexts_across_crashes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Many crash/recover cycles on the simulated file system, sealing instrumented (X1 of the anchors)."""
    from simfs import SimFS

    from filechannel.crypto import FileCipher

    sealed: dict[tuple[bytes, int, str, bytes], bytes] = {}
    reused = []
    real_seal = FileCipher.seal

    def spy(self: FileCipher, head: bytes, offset: int, payload: bytes) -> bytes:
        key = (self.salt, self.file_id, self.key_id, head[8:16])  # the file key, and the nonce (the woid)
        old = sealed.setdefault(key, payload)
        if old != payload:
            reused.append(key)
        return real_seal(self, head, offset, payload)

    monkeypatch.setattr(FileCipher, "seal", spy)
    fs = SimFS()
    # fsync="interval": writes are not synced, so a crash loses or tears them and the next
    # incarnation hands the same write-order ids out again (in a new file, under a new key).
    opts: dict[str, Any] = {
        "fs": fs,
        "encryption": enc(),
        "max_file_size": 4096,
        "fsync": "interval",
        "fsync_interval": 3600.0,
        **OPTS,
    }
    n = 0
    for cycle in range(25):
        ch = filechannel.open("/sim/ch", **opts)
        for _ in range(3):
            with ch.transaction() as tx:
                n += 1
                tx.put(b"event-%d-" % n + b"x" * (cycle * 37 % 900))
        fs = fs.crash(cycle, ("torn", "random", "drop", "prefix")[cycle % 4])
        opts["fs"] = fs
    woids = [k[3] for k in sealed]
    assert len(woids) - len(set(woids)) > 10, "the crashes made write-order ids be handed out again"
    assert reused == []
    with filechannel.open("/sim/ch", **opts) as ch:
        assert ch.size > 0


def test_cli_verify_with_a_keystore_reports_tampering(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = str(tmp_path / "ch")
    path, h, buf = _one_event_channel(d, [b"one", b"two-secret", b"three"])
    recs = records(path)
    victim = [r for r in recs if r.op == fmt.PUT][1]
    be = next(r for r in recs if r.op == fmt.BATCH_END)
    buf[victim.offset + 40] ^= 0x80
    refix(buf, h, h.header_len, be.offset)
    Path(path).write_bytes(bytes(buf))
    ks = write_keystore(tmp_path / "keys.json", {"k1": K1, "k2": K2}, mode=0o600)
    code, out, _ = cli(capsys, "verify", d)  # no key: the checksums are intact
    assert code == 0
    assert "checked by checksum only" in out
    code, out, _ = cli(capsys, "verify", d, "--keystore", ks)
    assert code == 1
    assert f"problem: {path} at byte {victim.offset}: record checksum is intact but its authentication tag fails" in out
    assert "lost positions: 1 (1 events)" in out


def test_cli_salvage_and_checkpoint_keep_an_encrypted_channel_encrypted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ks = write_keystore(tmp_path / "keys.json", {"k1": K1})
    d, dest = str(tmp_path / "ch"), str(tmp_path / "salvaged")
    code, _, err = cli(capsys, "put", d, "--keystore", ks, stdin=b"SALVAGE-ME-1\nSALVAGE-ME-2\n")
    assert code == 0, err
    code, out, err = cli(capsys, "checkpoint", d)
    assert code == 2
    assert "key id 'k1'" in err
    code, out, err = cli(capsys, "checkpoint", d, "--keystore", ks)
    assert code == 0, err
    code, out, err = cli(capsys, "verify", d, "--salvage", dest)
    assert code == 2
    assert "needs --keystore" in err
    code, out, err = cli(capsys, "verify", d, "--salvage", dest, "--keystore", ks)
    assert code == 0, err
    assert "salvaged 2 intact events" in out
    assert_no_plaintext(dest, [b"SALVAGE-ME"])
    with filechannel.open(dest, encryption=Encryption(keys=ks), **OPTS) as ch, ch.transaction() as tx:
        assert [e.body for e in tx.take_batch(5)] == [b"SALVAGE-ME-1", b"SALVAGE-ME-2"]


def test_a_sealed_record_is_never_decoded_as_plaintext_without_its_header(
    chan_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A channel opened without encryption= whose encrypted file lost its header cannot tell the
    file was encrypted; the record's own sealed flag still keeps its ciphertext from being decoded
    as an event. Made certain here with a "ciphertext" that is a valid event encoding (real
    ciphertext is one only by chance)."""
    ch = filechannel.open(chan_dir, checkpoint_interval=0, **OPTS)  # plaintext history first
    with ch.transaction() as tx:
        tx.put(b"plain")
    ch.close()

    def look_alike(self: object, head: bytes, offset: int, payload: bytes) -> bytes:
        n = len(payload) + crypto.TAG_LEN
        return fmt.encode_event(b"G" * (n - len(fmt.encode_event(b"", None))), None)

    monkeypatch.setattr(crypto.FileCipher, "seal", look_alike)
    with filechannel.open(chan_dir, encryption=enc(), checkpoint_interval=0, **OPTS) as ch:
        with ch.transaction() as tx:
            tx.put(b"secret")
        sealed = ch._log.file_path(ch._log.file_ids()[-1])
    monkeypatch.undo()
    for p, _ in list(all_files(os.path.join(chan_dir, "checkpoints"))):
        os.unlink(p)
    buf = bytearray(Path(sealed).read_bytes())
    buf[12] ^= 0x10  # the header's "encrypted" flag bit: its checksum fails, the header is lost
    Path(sealed).write_bytes(bytes(buf))
    with filechannel.open(chan_dir, on_corruption="skip", **OPTS) as ch2:
        tx = ch2.transaction()
        got = tx.take_batch(10)
        tx.commit()
        assert [e.body for e in got] == [b"plain"]
        assert ch2.stats()["lost_positions"] == [[1, 2]]
    reader = filechannel.ChannelReader(chan_dir, on_corruption="skip")
    try:
        bodies = [e.body for e in reader.read(*reader.available())]
    finally:
        reader.close()
    assert not any(b.startswith(b"G") for b in bodies)
