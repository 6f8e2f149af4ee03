"""scan.committed_puts: the committed PUTs of a data file, found walking forward from any record boundary.

Checked against the queue a channel builds from its commits (the pointers each
commit hands over), on real data files: put_many and one-event transactions,
headers, marks, take-only commits and rollbacks in between, one and two data
directories, plain and encrypted.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from helpers import records

import filechannel
from filechannel import format as fmt
from filechannel import scan
from filechannel.scan import ranges_of


def _build(d: Path, **opts: Any) -> dict[int, list[tuple[int, int, int]]]:
    """Commit a mix of transactions; return each data file's queued ``(position, offset, size)``, in order."""
    ch = filechannel.open(d, checkpoint_interval=0, minimum_required_space=0, background=False, **opts)
    try:
        for i in range(30):
            with ch.transaction() as tx:
                if i % 3 == 0:
                    tx.put_many([b"a" * (i + 1)] * (i % 7 + 1))
                elif i % 3 == 1:
                    tx.put(b"b" * i, {"k": str(i)})
                    tx.mark("m", str(i).encode())
                else:
                    tx.put(b"c")
            if i % 5 == 4:
                tx2 = ch.transaction()
                tx2.put(b"rolled back")
                tx2.rollback()
        with ch.transaction() as tx:
            tx.put(b"last")
        out: dict[int, list[tuple[int, int, int]]] = {}
        for p, f, off, size in ch._queue:
            out.setdefault(f, []).append((p, off, size))
        return out
    finally:
        ch.close()


def _files(d: Path) -> dict[int, str]:
    out = {}
    for root, _dirs, names in os.walk(d):
        for n in names:
            m = scan.SEG_RE.match(n)
            if m:
                out[int(m.group(1), 16)] = os.path.join(root, n)
    return out


def _walk(path: str, start: int | None, lo: int, hi: int, want: int, fast: bool = True) -> scan.PutWalk:
    buf = Path(path).read_bytes()
    h = fmt.decode_file_header(buf)
    assert isinstance(h, fmt.FileHeader)
    seed = fmt.file_seed(h.crc_kind, h.channel_id, h.file_id)
    return scan.committed_puts(
        buf, 0, h.header_len if start is None else start, lo, hi, want, seed, h.crc_kind, 1 << 30, True, fast
    )


@pytest.mark.parametrize("fast", [True, False], ids=["C walk", "Python walk"])
@pytest.mark.parametrize("dirs", [1, 2])
@pytest.mark.parametrize("encrypted", [False, True])
def test_the_walk_finds_every_committed_put_from_any_record_boundary(
    tmp_path: Path, dirs: int, encrypted: bool, fast: bool
) -> None:
    opts: dict[str, Any] = {"max_file_size": 1 << 16}
    if dirs == 2:
        opts["data_dirs"] = [str(tmp_path / "d0"), str(tmp_path / "d1")]
    if encrypted:
        pytest.importorskip("cryptography")
        opts["encryption"] = filechannel.Encryption(keys={"k": bytes(range(32))})
    want = _build(tmp_path / "ch", **opts)
    files = _files(tmp_path)
    assert set(want) <= set(files)
    for fid, entries in want.items():
        # The whole file, one run (consecutive positions) at a time: two directories leave gaps.
        found: list[tuple[int, int, int]] = []
        start = None
        for lo, hi in ranges_of([p for p, _o, _s in entries]):
            got = _walk(files[fid], start, lo, hi, 1 << 30, fast)
            assert got.done
            found += [(got.first + i, o, s) for i, (o, s) in enumerate(zip(got.offsets, got.sizes, strict=True))]
            start = got.next_offset
        assert found == entries
        # From every record boundary of the file, bounded by lo, hi and want.
        for r in records(files[fid]):
            after = [e for e in entries if e[1] >= r.offset]
            if not after:
                continue
            run = [e for i, e in enumerate(after) if e[0] - after[0][0] == i]  # up to a gap: one run
            lo = run[0][0] + (1 if len(run) > 2 else 0)
            hi = run[-1][0] + (0 if len(run) > 3 else 1)
            expect = [e for e in run if lo <= e[0] < hi][:3]
            got = _walk(files[fid], r.offset, lo, hi, 3, fast)
            pairs = zip(got.offsets, got.sizes, strict=True)
            assert [(got.first + i, o, s) for i, (o, s) in enumerate(pairs)] == expect
            assert got.done
            if expect:
                # A record boundary at or before the next PUT: walking on from it finds what follows.
                assert got.next_offset <= expect[-1][1] + expect[-1][2]
                assert got.next_offset in {x.offset for x in records(files[fid])} | {len(Path(files[fid]).read_bytes())}
                rest = [e for e in run if e[0] > expect[-1][0]][:2]
                if rest:
                    more = _walk(files[fid], got.next_offset, rest[0][0], run[-1][0] + 1, 2, fast)
                    pairs = zip(more.offsets, more.sizes, strict=True)
                    assert [(more.first + i, o, s) for i, (o, s) in enumerate(pairs)] == rest


def test_a_truncated_buffer_says_it_is_not_done_and_a_bad_frame_is_refused(tmp_path: Path) -> None:
    want = _build(tmp_path / "ch")
    files = _files(tmp_path)
    fid = min(want)
    buf = Path(files[fid]).read_bytes()
    h = fmt.decode_file_header(buf)
    assert isinstance(h, fmt.FileHeader)
    seed = fmt.file_seed(h.crc_kind, h.channel_id, h.file_id)
    entries = want[fid]
    cut = entries[5][1] + 8
    got = scan.committed_puts(buf[:cut], 0, h.header_len, 0, 1 << 62, 100, seed, h.crc_kind, 1 << 30)
    assert not got.done
    assert len(got.offsets) <= 5
    # A damaged frame is stepped over: the event whose record it was comes back LOST, the rest intact.
    bad = bytearray(buf)
    bad[entries[3][1]] = 0x7F  # not an op
    got = scan.committed_puts(bytes(bad), 0, h.header_len, 0, entries[-1][0] + 1, 100, seed, h.crc_kind, 1 << 30, True)
    assert got.damaged == (entries[3][1],)
    assert got.first == entries[0][0]
    want = [(p, o) for p, o, _s in entries]
    want[3] = (entries[3][0], scan.LOST)
    assert list(zip(range(got.first, got.first + len(got.offsets)), got.offsets, strict=True)) == want
