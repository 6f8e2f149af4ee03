"""OsFS's gathered write: a sequence of buffers lands exactly as their concatenation would."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from filechannel import _fs


def _write(tmp_path: Path, bufs: list[bytes], offset: int = 0) -> bytes:
    fs = _fs.OsFS()
    path = str(tmp_path / "f")
    fd = fs.create(path)
    try:
        fs.pwrite_all(fd, bufs, offset)
    finally:
        fs.close(fd)
    with open(path, "rb") as f:
        return f.read()


def test_buffers_land_back_to_back(tmp_path: Path) -> None:
    bufs = [b"abc", b"", b"defgh", bytes(range(256)) * 3, b"", b"z"]
    assert _write(tmp_path, bufs, 5) == bytes(5) + b"".join(bufs)


def test_more_buffers_than_one_pwritev_takes(tmp_path: Path) -> None:
    bufs = [bytes([i % 251]) * (i % 7) for i in range(3000)]
    assert _write(tmp_path, bufs) == b"".join(bufs)


def test_short_gathered_writes_resume_mid_buffer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.pwritev
    calls = []

    def short(fd: int, bufs: list[memoryview], offset: int) -> int:
        # Write at most 5 bytes per call, splitting buffers: the loop must carry on mid-buffer.
        calls.append(len(bufs))
        first = bytes(bufs[0])[:5]
        return real(fd, [first], offset)

    monkeypatch.setattr(os, "pwritev", short)
    bufs = [b"0123456789abc", b"de", b"", b"fghijklmnopqrstuvwxyz"]
    assert _write(tmp_path, bufs) == b"".join(bufs)
    assert len(calls) == 9  # 13 bytes in 3 calls, 2 in 1, 21 in 5
