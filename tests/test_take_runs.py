"""A take that misses the cache reads one run of adjacent records per pread (``Log.read_events``).

The damage policy still works per event, exactly as when every event was read
on its own: one damaged record in the middle of a run, in a take that spans
several data files, makes ``on_corruption="fail"`` raise a ``CorruptLogError``
naming that record's file and offset (nothing is taken), and
``on_corruption="skip"`` drop exactly that event and return the rest in order.
Encrypted channels decrypt each record of a run with its file's cipher; a
tampered ciphertext whose checksum was fixed up is a ``DecryptionError``.
Every test runs on the C path and on the pure-Python path.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import helpers
import pytest

import filechannel
from filechannel import crypto
from filechannel import format as fmt
from filechannel.log import CHANNEL_FILE, decode_channel_file

N = 120
PER_TXN = 30
# small files: the N events span several data files, a transaction's records one run each
OPTS: dict[str, Any] = {"minimum_required_space": 0, "cache_bytes": 0, "max_file_size": 4096}
VICTIM = 75  # inside a run (not a transaction's first or last event), not in the first file


@pytest.fixture(params=["c", "python"])
def path_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test on the C path and on the pure-Python path."""
    if request.param == "python":
        monkeypatch.setattr(fmt, "speedups", None)
    elif fmt.speedups is None:
        pytest.skip(helpers.NO_ACCELERATOR)
    return request.param


def body_of(p: int) -> bytes:
    return b"event-%04d|" % p + b"x" * (p % 17)


def headers_of(p: int) -> dict[str, str]:
    return {"n": str(p), "ü": "€" * (p % 3)} if p % 4 else {}


def fill(ch: filechannel.FileChannel) -> None:
    for i in range(0, N, PER_TXN):
        with ch.transaction() as tx:
            for p in range(i, i + PER_TXN):
                tx.put(body_of(p), headers_of(p))


def put_records(d: str) -> list[tuple[str, int, fmt.Record, int]]:
    """Every PUT record in write order (= position order here): (path, file id, record, seed)."""
    found = helpers.put_records(d)
    assert len(found) == N
    assert len({fid for _, fid, _, _ in found}) >= 3  # the take spans several files
    return found


def rewrite(d: str, position: int, change: Any, fix_crc: bool) -> tuple[str, int]:
    """Change the stored payload of the event at ``position``; with ``fix_crc`` its checksum still verifies."""
    _, kind, _ = decode_channel_file(Path(d, CHANNEL_FILE).read_bytes())
    path, _fid, rec, seed = put_records(d)[position]
    with open(path, "r+b") as f:
        f.seek(rec.offset)
        frame = bytearray(f.read(rec.size))
        payload = bytearray(frame[32 : 32 + len(rec.payload)])
        change(payload)
        assert len(payload) == len(rec.payload)
        frame[32 : 32 + len(payload)] = payload
        if fix_crc:
            c = fmt.crc(kind, bytes(payload), fmt.crc(kind, bytes(frame[:24]), seed))
            frame[24:28] = c.to_bytes(4, "little")
        f.seek(rec.offset)
        f.write(frame)
    return path, rec.offset


def flip_body_byte(payload: bytearray) -> None:
    payload[-3] ^= 0x20


def expected(minus: int | None = None) -> list[tuple[int, bytes, dict[str, str]]]:
    return [(p, body_of(p), headers_of(p)) for p in range(N) if p != minus]


def got(events: list[filechannel.Event]) -> list[tuple[int | None, bytes, dict[str, str]]]:
    return [(e.position, e.body, dict(e.headers)) for e in events]


def count_preads(monkeypatch: pytest.MonkeyPatch, ch: filechannel.FileChannel) -> list[int]:
    fs = ch._log.fs
    real = fs.pread
    sizes: list[int] = []

    def pread(fd: int, n: int, offset: int) -> bytes:
        sizes.append(n)
        return real(fd, n, offset)

    monkeypatch.setattr(fs, "pread", pread)
    return sizes


def test_a_take_from_disk_reads_one_run_per_transaction(
    path_kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with filechannel.open(str(tmp_path / "ch"), **OPTS) as ch:
        fill(ch)
        preads = count_preads(monkeypatch, ch)
        with ch.transaction() as tx:
            assert got(tx.take_batch(N)) == expected()
        st = ch.stats()
        assert st["disk_reads"] == N
        assert st["cache_hits"] == 0
        # a transaction's PUTs are back to back; its COMMIT (and a file's end) end a run
        assert len(preads) == N // PER_TXN
        assert ch.size == 0


def test_fail_raises_for_the_damaged_record_and_takes_nothing(path_kind: str, tmp_path: Path) -> None:
    d = str(tmp_path / "ch")
    with filechannel.open(d, **OPTS) as ch:
        fill(ch)
        path, off = rewrite(d, VICTIM, flip_body_byte, fix_crc=False)
        for _ in range(2):  # every take that reaches it fails the same way
            tx = ch.transaction()
            with pytest.raises(filechannel.CorruptLogError) as ei:
                tx.take_batch(N)
            assert os.path.samefile(ei.value.path, path)
            assert ei.value.offset == off
            assert ei.value.reason == "record checksum mismatch"
            assert not isinstance(ei.value, filechannel.DecryptionError)
            assert ch.size == N  # nothing taken: the whole take went back
            assert ch.stats()["inflight_takes"] == 0
            tx.rollback()
        with ch.transaction() as tx:  # the events before it still come out, in order
            assert got(tx.take_batch(VICTIM)) == expected()[:VICTIM]
            tx.rollback()


def test_fail_names_an_event_that_verifies_but_does_not_decode(path_kind: str, tmp_path: Path) -> None:
    d = str(tmp_path / "ch")
    with filechannel.open(d, **OPTS) as ch:
        fill(ch)

        def bad_count(payload: bytearray) -> None:
            payload[0:4] = (1000).to_bytes(4, "little")

        path, off = rewrite(d, VICTIM, bad_count, fix_crc=True)
        with pytest.raises(filechannel.CorruptLogError) as ei, ch.transaction() as tx:
            tx.take_batch(N)
        assert os.path.samefile(ei.value.path, path)
        assert ei.value.offset == off
        assert ei.value.reason == "queued event does not decode: event header count 1000 exceeds the payload"
        assert ch.size == N


def test_skip_drops_exactly_the_damaged_event_and_returns_the_rest_in_order(path_kind: str, tmp_path: Path) -> None:
    d = str(tmp_path / "ch")
    with filechannel.open(d, **OPTS, on_corruption="skip") as ch:
        fill(ch)
        rewrite(d, VICTIM, flip_body_byte, fix_crc=False)
        with ch.transaction() as tx:
            assert got(tx.take_batch(N)) == expected(minus=VICTIM)
        st = ch.stats()
        assert st["damaged_events_dropped"] == 1
        assert st["lost_positions"] == [[VICTIM, VICTIM + 1]] or st["lost_positions"] == [(VICTIM, VICTIM + 1)]
        assert ch.size == 0
    with filechannel.open(d, **OPTS, on_corruption="skip") as ch:
        assert ch.size == 0  # dropped for good


# -- encrypted channels ----------------------------------------------------------------


def encryption() -> Any:
    pytest.importorskip("cryptography", reason="the crypto extra is not installed")
    return crypto.Encryption(keys={"k1": bytes(range(32))}, active_key="k1")


def test_an_encrypted_take_from_disk_returns_the_events(path_kind: str, tmp_path: Path) -> None:
    enc = encryption()
    d = str(tmp_path / "ch")
    with filechannel.open(d, **OPTS, encryption=enc) as ch:
        fill(ch)
        with ch.transaction() as tx:
            assert got(tx.take_batch(N)) == expected()
            tx.rollback()
    assert all(rec.sealed for _, _, rec, _ in put_records(d))
    with filechannel.open(d, **OPTS, encryption=enc) as ch, ch.transaction() as tx:
        assert got(tx.take_batch(N)) == expected()


@pytest.mark.parametrize("policy", ["fail", "skip"])
def test_a_tampered_ciphertext_is_a_decryption_error(path_kind: str, tmp_path: Path, policy: str) -> None:
    enc = encryption()
    d = str(tmp_path / "ch")
    with filechannel.open(d, **OPTS, encryption=enc, on_corruption=policy) as ch:
        fill(ch)
        path, off = rewrite(d, VICTIM, flip_body_byte, fix_crc=True)  # the checksum verifies, the tag does not
        tx = ch.transaction()
        if policy == "fail":
            with pytest.raises(filechannel.DecryptionError) as ei:
                tx.take_batch(N)
            assert os.path.samefile(ei.value.path, path)
            assert ei.value.offset == off
            assert ei.value.reason == crypto.TAMPERED
            assert ch.size == N
            tx.rollback()
        else:
            assert got(tx.take_batch(N)) == expected(minus=VICTIM)
            tx.commit()
            assert ch.stats()["damaged_events_dropped"] == 1
            assert ch.size == 0
