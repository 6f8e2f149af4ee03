"""WriteAheadLog with encryption=: the channel's per-file AEAD on every record, keys checked at open."""

from __future__ import annotations

import errno
import json
import os
import struct
from pathlib import Path

import pytest
from simfs import SimFS

pytest.importorskip("cryptography", reason="the crypto extra is not installed (README, Installing)")

import filechannel
from filechannel import format as fmt
from filechannel.cli import main as cli_main
from filechannel.crypto import Encryption
from filechannel.wal import dump_wal, verify_wal

K1 = bytes(range(32))
K2 = bytes(range(50, 82))


def enc(active: str = "k1") -> Encryption:
    return Encryption(keys={"k1": K1, "k2": K2}, active_key=active)


def all_bytes(d: str) -> list[tuple[str, bytes]]:
    out = []
    for root, _dirs, files in os.walk(d):
        for f in files:
            p = os.path.join(root, f)
            out.append((p, Path(p).read_bytes()))
    return out


SECRETS = [b"secret-record-%03d" % i for i in range(40)]


def test_records_are_not_on_disk_in_plaintext_and_round_trip(tmp_path: Path) -> None:
    d = str(tmp_path / "wal")
    with filechannel.WriteAheadLog(d, encryption=enc(), max_file_size=4096, rolling_interval=5) as w:
        hs = [w.write(s * 3, time=100 + i) for i, s in enumerate(SECRETS[:30])]
        hs += w.write_many([s * 3 for s in SECRETS[30:]], time=200)
        assert [w.read(h) for h in hs] == [s * 3 for s in SECRETS]
        assert list(w.read_all()) == [s * 3 for s in SECRETS]
        assert w.stats()["files"] > 3  # rolled by size and time
    files = all_bytes(d)
    assert files
    for path, data in files:
        for s in SECRETS:
            assert s not in data, f"{s!r} in plaintext in {path}"
    with filechannel.WriteAheadLog(d, encryption=enc("k2")) as w:  # another active key: old files still read
        assert [w.read(h) for h in hs] == [s * 3 for s in SECRETS]
        w.write(b"under k2", time=300)
        w.clean(150, wait_for_completion=True)
        got = list(w.read_all())
        assert got[-1] == b"under k2"
        assert got[:-1] == [s * 3 for s in SECRETS if s * 3 in got]
        assert all(s * 3 in got for s in SECRETS[30:])  # time 200 > 150: kept


def test_wrong_key_or_no_key_is_refused_at_open(tmp_path: Path) -> None:
    d = str(tmp_path / "wal")
    with filechannel.WriteAheadLog(d, encryption=enc()) as w:
        w.write(b"x" * 50)
    with pytest.raises(filechannel.DecryptionError):
        filechannel.WriteAheadLog(d)
    wrong = Encryption(keys={"k1": K2}, active_key="k1")
    with pytest.raises(filechannel.DecryptionError) as info:
        filechannel.WriteAheadLog(d, encryption=wrong)
    assert info.value.key_id == "k1"
    with pytest.raises(filechannel.DecryptionError):
        filechannel.WriteAheadLog(d, encryption=Encryption(keys={"other": K1}, active_key="other"))
    with filechannel.WriteAheadLog(d, encryption=enc()) as w:  # the right key still opens it
        assert list(w.read_all()) == [b"x" * 50]


def _retag(path: str, offset: int, flip_at: int) -> None:
    """Flip a ciphertext byte of the record at ``offset`` and recompute its checksum (the tag still fails)."""
    buf = bytearray(Path(path).read_bytes())
    h = fmt.decode_file_header(bytes(buf))
    assert isinstance(h, fmt.FileHeader)
    n = struct.unpack_from("<I", buf, offset + 4)[0]
    buf[offset + 32 + flip_at] ^= 1
    seed = fmt.file_seed(h.crc_kind, h.channel_id, h.file_id)
    c = fmt.crc(
        h.crc_kind,
        bytes(buf[offset + 32 : offset + 32 + n]),
        fmt.crc(h.crc_kind, bytes(buf[offset : offset + 24]), seed),
    )
    struct.pack_into("<I", buf, offset + 24, c)
    Path(path).write_bytes(bytes(buf))


def test_tampered_record_with_a_good_checksum_is_a_decryption_error(tmp_path: Path) -> None:
    d = str(tmp_path / "wal")
    with filechannel.WriteAheadLog(d, encryption=enc()) as w:
        hs = w.write_many([b"alpha" * 20, b"beta" * 20, b"gamma" * 20])
        path = os.path.join(d, "data", f"seg-{hs[1].file_id:016x}.wal")
        _retag(path, hs[1].offset, 5)
        assert w.read(hs[0]) == b"alpha" * 20
        with pytest.raises(filechannel.DecryptionError) as info:
            w.read(hs[1])
        assert info.value.offset == hs[1].offset
        with pytest.raises(filechannel.CorruptLogError):  # the batch checksum no longer matches either
            list(w.read_all())
    with pytest.raises(filechannel.CorruptLogError):
        filechannel.WriteAheadLog(d, encryption=enc())
    with filechannel.WriteAheadLog(d, encryption=enc(), on_corruption="skip") as w:
        # An authenticated file's records count only inside a batch whose tag verifies (as at open and
        # in a channel): the one batch of write_many is dropped whole and reported, nothing is salvaged.
        assert list(w.read_all()) == []
        assert w.corruption


def test_cli_and_inspection_with_and_without_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = str(tmp_path / "wal")
    keystore = tmp_path / "keys.json"
    import base64

    keystore.write_text(json.dumps({"k1": base64.b64encode(K1).decode()}))
    os.chmod(keystore, 0o600)
    e = Encryption(keys=str(keystore))
    with filechannel.WriteAheadLog(d, encryption=e, rolling_interval=10) as w:
        w.write(b"one", time=100)
        w.write_many([b"two", b"three"], time=120)
    recs = list(dump_wal(d))
    assert [r["kind"] for r in recs] == ["encrypted"] * 5  # 2 spans, 3 records
    rep = verify_wal(d)
    assert rep.ok
    assert rep.records == 3
    assert any("checksum only" in n for n in rep.notes)
    recs = list(dump_wal(d, encryption=e))
    assert [r.get("data") for r in recs if r["kind"] == "record"] == [b"one", b"two", b"three"]
    assert cli_main(["wal", "verify", d, "--keystore", str(keystore)]) == 0
    assert "ok, 3 records (11 bytes)" in capsys.readouterr().out
    assert cli_main(["wal", "dump", d, "--data", "--keystore", str(keystore)]) == 0
    out = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r.get("data") for r in out if r["kind"] == "record"] == ["one", "two", "three"]
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"k1": base64.b64encode(K2).decode()}))
    os.chmod(other, 0o600)
    assert cli_main(["wal", "verify", d, "--keystore", str(other)]) == 2
    assert "k1" in capsys.readouterr().err


@pytest.mark.parametrize("short", [None, 10])
def test_enospc_then_more_writes_then_a_power_cut_reopens_with_every_record(short: int | None) -> None:
    """An undone batch must not advance the batch-tag chain (issue 32, item 19); the power cut comes before a close."""
    fs = SimFS()
    d = "/sim/wal"
    w = filechannel.WriteAheadLog(d, fs=fs, encryption=enc())
    w.write(b"one")
    fs.inject("pwrite_all", 1, errno.ENOSPC, short=short, path="seg-")
    with pytest.raises(OSError) as info:
        w.write(b"two" * 50)
    assert info.value.errno == errno.ENOSPC
    w.write(b"three")
    w.write_many([b"four", b"five"])
    assert list(w.read_all()) == [b"one", b"three", b"four", b"five"]
    for seed, mode in ((0, "drop"), (1, "keep"), (5, "random")):
        with filechannel.WriteAheadLog(d, fs=fs.crash(seed, mode), encryption=enc()) as w2:
            assert list(w2.read_all()) == [b"one", b"three", b"four", b"five"]
    w.close()
