"""A damaged CHANNEL file has a way out: `filechannel repair-channel-file DIR` rebuilds it.

The errors for a damaged CHANNEL name the command; it rebuilds CHANNEL from the
channel id every DATADIR and data file header agree on (a copy of the damaged
file kept beside it), and refuses, changing nothing, when they disagree.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from helpers import run_cli

import filechannel
from filechannel import format as fmt
from filechannel.log import decode_channel_file


def _make(d: str, n: int, *, take: int = 0) -> None:
    """A channel of ``n`` events (the first ``take`` taken) over several data files."""
    with filechannel.open(d, max_file_size=64 * 1024, minimum_required_space=0) as ch:
        for i in range(0, n, 100):
            with ch.transaction() as tx:
                tx.put_many([b"event-%05d-" % j + b"x" * 200 for j in range(i, min(n, i + 100))])
        if take:
            with ch.transaction() as tx:
                tx.take_batch(take)


def _queued(d: str) -> list[bytes]:
    with filechannel.open(d, minimum_required_space=0) as ch:
        tx = ch.transaction()
        evs = tx.take_batch(ch.config.transaction_capacity)
        tx.rollback()
    return [e.body for e in evs]


def _flip(path: str, at: int) -> None:
    raw = bytearray(Path(path).read_bytes())
    raw[at] ^= 0x01
    Path(path).write_bytes(bytes(raw))


def _segs(d: str) -> list[str]:
    data = os.path.join(d, "data")
    return sorted(os.path.join(data, n) for n in os.listdir(data) if n.endswith(".wal"))


def test_damaged_channel_file_is_rebuilt_and_every_event_comes_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = str(tmp_path / "ch")
    _make(d, 1000, take=150)
    assert len(_segs(d)) > 1
    chan = os.path.join(d, "CHANNEL")
    cid, kind, _ = decode_channel_file(Path(chan).read_bytes())
    expected = _queued(d)
    assert len(expected) == 850
    _flip(chan, 14)  # a byte of the channel id: the checksum no longer matches
    damaged = Path(chan).read_bytes()
    # Every way in refuses, and names the way out.
    for argv in (["stat", d], ["verify", d], ["take", d, "--on-corruption", "skip"], ["dump", d]):
        code, _, err = run_cli(capsys, *argv)
        assert code == 2, (argv, err)
        assert len(err.strip().splitlines()) == 1, err
        assert f"{chan} at byte 36: CHANNEL file checksum mismatch" in err
        assert f"rebuild it from them with `filechannel repair-channel-file {d}`" in err, err
    code, out, err = run_cli(capsys, "repair-channel-file", d)
    assert code == 0, err
    copies = [n for n in os.listdir(d) if n.startswith("CHANNEL.damaged-")]
    assert len(copies) == 1
    assert Path(d, copies[0]).read_bytes() == damaged  # the damaged file is kept as it was
    assert out.startswith(f"rebuilt {chan}: channel id {cid.hex()}, checksum kind ")
    assert f"the damaged file is kept as {os.path.join(d, copies[0])}" in out
    assert decode_channel_file(Path(chan).read_bytes())[:2] == (cid, kind)
    assert not os.path.exists(chan + ".tmp")
    code, out, err = run_cli(capsys, "verify", d)
    assert code == 0, out + err
    assert "ok, 850 events queued" in out
    assert _queued(d) == expected
    # Run again: nothing to repair, nothing written.
    before = sorted(os.listdir(d))
    code, out, _ = run_cli(capsys, "repair-channel-file", d)
    assert code == 0
    assert "is intact" in out
    assert "nothing to repair" in out
    assert sorted(os.listdir(d)) == before


def test_an_empty_channel_file_is_rebuilt(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = str(tmp_path / "ch")
    _make(d, 300)
    Path(d, "CHANNEL").write_bytes(b"")  # cut to nothing, e.g. by a file system crash
    code, _, err = run_cli(capsys, "repair-channel-file", d)
    assert code == 0, err
    assert _queued(d) == [b"event-%05d-" % j + b"x" * 200 for j in range(300)]


def _refused(capsys: pytest.CaptureFixture[str], d: str) -> str:
    chan = Path(d, "CHANNEL")
    damaged = chan.read_bytes()
    before = sorted(os.listdir(d))
    code, out, err = run_cli(capsys, "repair-channel-file", d)
    assert code == 2, out + err
    assert out == ""
    assert chan.read_bytes() == damaged  # nothing rewritten, no copy made
    assert sorted(os.listdir(d)) == before
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"filechannel: error: refusing to rebuild {chan}: "), err
    return lines[0]


def test_a_data_file_of_another_channel_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    _make(a, 300)
    _make(b, 10)
    a_id = decode_channel_file(Path(a, "CHANNEL").read_bytes())[0]
    b_id = decode_channel_file(Path(b, "CHANNEL").read_bytes())[0]
    stray = os.path.join(a, "data", "seg-00000000000000ff.wal")
    shutil.copy(_segs(b)[0], stray)
    _flip(os.path.join(a, "CHANNEL"), 20)
    line = _refused(capsys, a)
    assert "disagree on the channel id" in line
    assert a_id.hex() in line
    assert f"{b_id.hex()} in {stray}" in line


def test_a_datadir_of_another_channel_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    _make(a, 300)
    _make(b, 10)
    b_id = decode_channel_file(Path(b, "CHANNEL").read_bytes())[0]
    shutil.copy(os.path.join(b, "data", "DATADIR"), os.path.join(a, "data", "DATADIR"))
    _flip(os.path.join(a, "CHANNEL"), 0)
    line = _refused(capsys, a)
    assert "disagree on the channel id" in line
    assert f"{b_id.hex()} in {os.path.join(a, 'data', 'DATADIR')}" in line


def test_no_data_file_to_confirm_with_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = str(tmp_path / "ch")
    _make(d, 10)
    for seg in _segs(d):
        os.unlink(seg)
    _flip(os.path.join(d, "CHANNEL"), 30)
    line = _refused(capsys, d)
    assert "no data file header that decodes" in line


def test_repair_refuses_a_channel_open_elsewhere(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = str(tmp_path / "ch")
    _make(d, 10)
    with filechannel.open(d, minimum_required_space=0):
        code, _, err = run_cli(capsys, "repair-channel-file", d)
    assert code == 2
    assert "already open" in err
    assert not [n for n in os.listdir(d) if n.startswith("CHANNEL.")]


def test_an_intact_channel_file_of_a_newer_version_is_not_rebuilt(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = str(tmp_path / "ch")
    _make(d, 10)
    chan = Path(d, "CHANNEL")
    raw = bytearray(chan.read_bytes())
    raw[8:10] = (99).to_bytes(2, "little")  # a format version this release does not know
    raw[36:40] = fmt.crc(fmt.CRC32_ZLIB, bytes(raw[:36])).to_bytes(4, "little")  # and a valid checksum
    chan.write_bytes(bytes(raw))
    code, _, err = run_cli(capsys, "stat", d)
    assert code == 2
    assert "unsupported channel format version 99" in err
    assert "repair-channel-file" not in err  # not damaged: rebuilding it as version 1 would be wrong
    line = _refused_intact(capsys, d)
    assert "is intact (its checksum matches) but unusable here: unsupported channel format version 99" in line


def _refused_intact(capsys: pytest.CaptureFixture[str], d: str) -> str:
    chan = Path(d, "CHANNEL")
    before = (chan.read_bytes(), sorted(os.listdir(d)))
    code, out, err = run_cli(capsys, "repair-channel-file", d)
    assert code == 2, out + err
    assert (chan.read_bytes(), sorted(os.listdir(d))) == before
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]
