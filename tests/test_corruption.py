"""Bit rot and tampering, exhaustively on small logs (SimFS, so each case is one recovery).

Rules under test (docs/format.md, log.py):

* any damage in an older data file, or damage in the newest file followed by
  a verified BATCH_END, is corruption: ``CorruptLogError`` (``on_corruption=
  "fail"``), or with ``"skip"`` the damaged records are dropped and reported;
* damage in the newest file with nothing verified after it is a torn tail:
  truncated, copied aside, and the recovered state is a prefix of the commits;
* missing, swapped or foreign data files are refused;
* whatever happens, no altered event is ever returned: every event read back
  is byte-identical to the one committed at that position.

Most cases run with ``replay="full"`` (every record is read at open); the
default checkpoint replay is checked to never return altered data either
(damage it does not read at open is caught when the event is read).
"""

from __future__ import annotations

import os
import tracemalloc
from typing import Any

import pytest
from simfs import SimFS

import filechannel
from filechannel import format as fmt
from filechannel.verify import verify_channel

DIR = "/sim/ch"
DATA = "/sim/ch/data"
OPTS: dict[str, Any] = {"background": False, "minimum_required_space": 0, "max_file_size": 4096}
FULL: dict[str, Any] = dict(OPTS, replay="full")

COUNTS: dict[str, int] = {}

State = list[tuple[int, bytes]]


def count(name: str, n: int = 1) -> None:
    COUNTS[name] = COUNTS.get(name, 0) + n


def drain(ch: filechannel.FileChannel) -> State:
    tx = ch.transaction()
    evs = tx.take_batch(ch.config.transaction_capacity)
    tx.rollback()
    return [(e.position, e.body) for e in evs]


def segs(fs: SimFS) -> list[str]:
    return sorted(p for p in fs.files(DATA) if p.endswith(".wal"))


class Built:
    """A closed channel with several data files, and the states after each commit."""

    def __init__(self, n_txns: int = 20, with_takes: bool = True) -> None:
        self.fs = SimFS()
        ch = filechannel.open(DIR, fs=self.fs, **OPTS)
        self.states: list[State] = [[]]
        q: dict[int, bytes] = {}
        pos = 0
        for i in range(n_txns):
            with ch.transaction() as tx:
                for j in range(3):
                    body = f"t{i}-e{j}|".encode() * (20 + 7 * j)
                    tx.put(body, headers={"i": str(i)} if j == 1 else None)
                    q[pos] = body
                    pos += 1
                if with_takes and i % 4 == 3:
                    got = tx.take_batch(2)
                    for e in got:
                        del q[e.position]
            self.states.append(sorted(q.items()))
        ch.close()
        # every event ever committed (a damaged TAKE record can bring taken ones back)
        self.all_events: State = sorted({p: b for st in self.states for p, b in st}.items())
        self.files = segs(self.fs)
        assert len(self.files) >= 3, self.files
        self.full = self.states[-1]

    def copy(self) -> SimFS:
        return self.fs.snapshot()


@pytest.fixture(scope="module")
def built() -> Built:
    return Built()


def open_state(fs: SimFS, **kw: Any) -> tuple[State, filechannel.FileChannel]:
    ch = filechannel.open(DIR, fs=fs, **{**FULL, **kw})
    try:
        return drain(ch), ch
    finally:
        ch.close()


def assert_exact_subset(got: State, full: State) -> None:
    """Every event returned is the one committed at that position, byte for byte."""
    ref = dict(full)
    for p, b in got:
        assert p in ref, f"position {p} was never committed"
        assert ref[p] == b, f"altered event returned at position {p}"


# --------------------------------------------------------------------------
# R1: every byte of an older data file


@pytest.mark.parametrize("which", [0, 1])
def test_flip_every_byte_of_an_older_file(built: Built, which: int) -> None:
    path = built.files[which]
    orig = built.fs.read(path)
    undetected = []
    for off in range(len(orig)):
        fs = built.copy()
        damaged = bytearray(orig)
        damaged[off] ^= 0x5A if off % 2 else 0x01
        fs.write(path, bytes(damaged))
        count("byte flips")
        try:
            got, _ = open_state(fs)
        except filechannel.CorruptLogError as exc:
            assert "seg-" in exc.path  # noqa: PT017
            continue
        # Not detected: only possible where the byte carries no meaning (padding).
        assert got == built.full, f"flip at {off} changed the state without an error"
        undetected.append(off)
    # The file header's zero padding is the only byte range nothing reads.
    h = fmt.decode_file_header(orig)
    assert isinstance(h, fmt.FileHeader)
    crc_end = fmt.FILE_HEADER_FIXED + 8 * len(h.live_files) + 4
    assert all(crc_end <= off < h.header_len for off in undetected), undetected


@pytest.mark.parametrize("which", [0, 1])
def test_flip_every_byte_skip_mode_reports_and_never_alters(built: Built, which: int) -> None:
    path = built.files[which]
    orig = built.fs.read(path)
    step = 3  # every third byte: the fail-mode test above covers every one
    for off in range(0, len(orig), step):
        fs = built.copy()
        damaged = bytearray(orig)
        damaged[off] ^= 0xFF
        fs.write(path, bytes(damaged))
        count("byte flips")
        assert_verify_agrees_with_open(fs, f"flip at {off}")
        ch = filechannel.open(DIR, fs=fs, **{**FULL, "on_corruption": "skip"})
        try:
            got = drain(ch)
            st = ch.stats()
        finally:
            ch.close()
        assert_loss_reported_exactly(got, st, built.full, built.all_events, f"flip at {off}")
        if got != built.full:
            assert any(os.path.basename(path) in r for r in st["corruption_report"])


def test_flip_every_byte_with_checkpoint_replay_never_returns_altered_data(built: Built) -> None:
    path = built.files[0]
    orig = built.fs.read(path)
    for off in range(0, len(orig), 2):
        fs = built.copy()
        damaged = bytearray(orig)
        damaged[off] ^= 0x10
        fs.write(path, bytes(damaged))
        count("byte flips")
        try:
            ch = filechannel.open(DIR, fs=fs, **OPTS)
        except filechannel.CorruptLogError:
            continue
        try:
            got = drain(ch)
        except filechannel.CorruptLogError:
            continue
        finally:
            ch.close()
        assert_exact_subset(got, built.full)
        assert got == built.full


# --------------------------------------------------------------------------
# R4: truncate the newest file at every length


def without_checkpoints(fs: SimFS) -> SimFS:
    """The channel as a crash would leave it: no checkpoint vouches for the newest bytes."""
    for p in list(fs.files(DIR + "/checkpoints")):
        fs.remove(p)
    return fs


def assert_verify_agrees_with_open(fs: SimFS, what: str) -> None:
    """`verify` and a skip-mode open plus drain (default replay) report the same lost positions."""
    v = verify_channel(DIR, fs=fs.snapshot())
    ch = filechannel.open(DIR, fs=fs.snapshot(), **{**OPTS, "on_corruption": "skip"})
    try:
        got = drain(ch)
        st = ch.stats()
    finally:
        ch.close()
    assert [list(r) for r in v.lost_positions] == st["lost_positions"], what
    assert [p for p, _ in got] == [e[0] for e in v.queued], what
    count("verify agreements")


def assert_loss_reported_exactly(got: State, st: dict[str, Any], full: State, all_events: State, what: str) -> None:
    """Skip mode: what is served is intact, and what is missing is exactly what stats() lists."""
    assert_exact_subset(got, all_events)
    missing = {p for p, _ in full} - {p for p, _ in got}
    reported = {p for a, b in st["lost_positions"] for p in range(a, b)}
    assert missing <= reported, f"{what}: lost {sorted(missing - reported)} without a report"
    assert reported <= {p for p, _ in all_events}, f"{what}: reported positions that never existed"
    if reported - missing:
        # Reported but served: only positions a damaged TAKE record brought back, never a served event.
        assert not (reported & {p for p, _ in got}), f"{what}: reported lost but served"


@pytest.mark.parametrize("replay", ["full", "checkpoint"])
def test_truncate_newest_file_at_every_length_after_a_crash(built: Built, replay: str) -> None:
    # Without a checkpoint vouching for its length, a cut newest file is a torn tail.
    path = built.files[-1]
    orig = built.fs.read(path)
    fid = int(os.path.basename(path)[4:20], 16)
    h = fmt.decode_file_header(orig)
    assert isinstance(h, fmt.FileHeader)
    boundaries = {h.header_len, *batch_ends(orig, fid, *channel_ident(built.fs))}
    last_k = 0
    for n in range(len(orig) + 1):
        fs = without_checkpoints(built.copy())
        fs.write(path, orig[:n])
        count("truncations")
        assert_verify_agrees_with_open(fs, f"truncated to {n}")
        got, _ = open_state(fs, replay=replay)
        assert got in built.states, f"truncated to {n}: not a prefix of the commits"
        k = built.states.index(got)
        assert k >= last_k, f"truncated to {n}: fewer commits than a shorter file gave"
        last_k = k
        torn = [p for p in fs.files(DATA) if ".torn-" in p]
        if n == 0:
            pass  # an empty newest file is set aside as one whose creation crashed
        elif n in boundaries:
            assert not torn, f"truncated to {n}, a batch boundary: nothing is torn"
        else:
            assert torn, f"truncated to {n}: no forensic copy kept"
        if n % 5 == 0:  # recovery is idempotent
            assert open_state(fs, replay=replay)[0] == got
    assert last_k == len(built.states) - 1


@pytest.mark.parametrize("replay", ["full", "checkpoint"])
def test_truncated_newest_file_of_a_closed_channel_is_reported_loss(built: Built, replay: str) -> None:
    # The checkpoint written at close recorded the file's length: a cut is lost data.
    path = built.files[-1]
    orig = built.fs.read(path)
    h = fmt.decode_file_header(orig)
    assert isinstance(h, fmt.FileHeader)
    for n in range(h.header_len + 1, len(orig), 8):
        fs = built.copy()
        fs.write(path, orig[:n])
        count("truncations")
        with pytest.raises(filechannel.CorruptLogError, match="shorter than the checkpoint"):
            open_state(fs, replay=replay)
        assert_verify_agrees_with_open(fs, f"cut to {n}")
        ch = filechannel.open(DIR, fs=fs, **{**FULL, "replay": replay, "on_corruption": "skip"})
        try:
            got, st = drain(ch), ch.stats()
        finally:
            ch.close()
        assert any("shorter than the checkpoint" in r for r in st["corruption_report"])
        assert_loss_reported_exactly(got, st, built.full, built.all_events, f"cut to {n}")


# --------------------------------------------------------------------------
# R2/R3: damage in the newest file with verified batches after it


def batch_ends(buf: bytes, fid: int, channel_id: bytes, kind: int) -> list[int]:
    """Offsets just past each BATCH_END record in a data file."""
    seed = fmt.file_seed(kind, channel_id, fid)
    h = fmt.decode_file_header(buf)
    assert isinstance(h, fmt.FileHeader)
    pos, out = h.header_len, []
    while pos < len(buf):
        r = fmt.decode_record(buf, pos, seed, kind, 1 << 20)
        assert isinstance(r, fmt.Record)
        pos = r.end
        if r.op == fmt.BATCH_END:
            out.append(pos)
    return out


def batch_ends_before_last(buf: bytes, fid: int, cid: bytes, kind: int) -> int:
    """Where the last batch of a file starts."""
    ends = batch_ends(buf, fid, cid, kind)
    return ends[-2] if len(ends) > 1 else 0


def channel_ident(fs: SimFS) -> tuple[bytes, int]:
    from filechannel.log import decode_channel_file

    cid, kind, _ = decode_channel_file(fs.read(DIR + "/CHANNEL"))
    return cid, kind


@pytest.mark.parametrize("block", [512, 4096])
@pytest.mark.parametrize("fill", ["zeros", "ones", "garbage"])
def test_damaged_block_in_newest_file_after_a_crash(built: Built, block: int, fill: str) -> None:
    path = built.files[-1]
    orig = built.fs.read(path)
    fid = int(os.path.basename(path)[4:20], 16)
    ends = batch_ends(orig, fid, *channel_ident(built.fs))
    h = fmt.decode_file_header(orig)
    assert isinstance(h, fmt.FileHeader)
    for start in range(0, len(orig), block if block < len(orig) else 256):
        stop = min(len(orig), start + block)
        fs = without_checkpoints(built.copy())
        pat = {"zeros": b"\0", "ones": b"\xff", "garbage": b"\xa5\x17"}[fill]
        bad = (pat * block)[: stop - start]
        fs.write(path, orig[:start] + bad + orig[stop:])
        count("damaged blocks")
        if start < h.header_len:
            # the header of the newest file: refused, or set aside if nothing verifies
            try:
                got, _ = open_state(fs)
            except filechannel.CorruptLogError:
                continue
            # nothing in the file verifies any more: dropped as a file whose creation crashed
            assert got in built.states
            continue
        intact_after = any(e - start > 0 and prev >= stop for prev, e in zip([0, *ends[:-1]], ends, strict=True))
        if intact_after:
            with pytest.raises(filechannel.CorruptLogError):
                open_state(fs)
            got, _ = open_state(fs, on_corruption="skip")
            assert_exact_subset(got, built.all_events)
        else:
            got, _ = open_state(fs)
            assert got in built.states, f"damage at {start}: not a prefix"


@pytest.mark.parametrize("block", [64, 512])
def test_damaged_block_in_newest_file_of_a_closed_channel(built: Built, block: int) -> None:
    # A checkpoint vouches for every byte: any damage is corruption, reported exactly in skip mode.
    path = built.files[-1]
    orig = built.fs.read(path)
    for start in range(0, len(orig), block):
        stop = min(len(orig), start + block)
        fs = built.copy()
        fs.write(path, orig[:start] + b"\xa5" * (stop - start) + orig[stop:])
        count("damaged blocks")
        try:
            got, _ = open_state(fs)
        except filechannel.CorruptLogError:
            pass
        else:
            raise AssertionError(f"damage at {start}..{stop} in vouched data was not reported")
        assert_verify_agrees_with_open(fs, f"block {start}..{stop}")
        ch = filechannel.open(DIR, fs=fs, **{**FULL, "on_corruption": "skip"})
        try:
            got, st = drain(ch), ch.stats()
        finally:
            ch.close()
        assert_loss_reported_exactly(got, st, built.full, built.all_events, f"block {start}..{stop}")


# --------------------------------------------------------------------------
# R5: garbage or old records appended to the newest file


@pytest.mark.parametrize("kind", ["zeros", "garbage", "old-batch", "whole-file-copy", "half-record"])
def test_appended_tail_is_ignored(built: Built, kind: str) -> None:
    path = built.files[-1]
    orig = built.fs.read(path)
    h = fmt.decode_file_header(orig)
    assert isinstance(h, fmt.FileHeader)
    body = orig[h.header_len :]
    tails = {
        "zeros": [b"\0" * n for n in (1, 8, 31, 32, 512, 4096)],
        "garbage": [os.urandom(n) for n in (5, 64, 700)],
        "old-batch": [body[: n * 8] for n in range(1, len(body) // 8 + 1, 5)],
        "whole-file-copy": [orig, built.fs.read(built.files[0])[h.header_len :]],
        "half-record": [body[:20], body[:100]],
    }[kind]
    for tail in tails:
        fs = built.copy()
        fs.write(path, orig + tail)
        count("appended tails")
        assert_verify_agrees_with_open(fs, "appended tail")
        got, _ = open_state(fs)
        assert got == built.full
        got, _ = open_state(fs)  # and again, after the tail was cut
        assert got == built.full


# --------------------------------------------------------------------------
# R6/R7: missing, swapped or foreign files


def test_missing_middle_file_is_refused(built: Built) -> None:
    for victim in built.files[:-1]:
        fs = built.copy()
        fs.remove(victim)
        count("file-level cases")
        with pytest.raises(filechannel.CorruptLogError) as ei:
            open_state(fs)
        assert os.path.basename(victim) in ei.value.path
        # the default replay refuses too
        with pytest.raises(filechannel.CorruptLogError):
            open_state(fs, replay="checkpoint")
        # accepting the loss: verify and a skip-mode open report the same positions, and they are
        # exactly the queued events the missing file held
        assert_verify_agrees_with_open(fs, f"without {victim}")
        got, ch = open_state(fs, on_corruption="skip")
        assert_loss_reported_exactly(got, ch.stats(), built.full, built.all_events, f"without {victim}")


def test_swapped_files_are_refused(built: Built) -> None:
    a, b = built.files[0], built.files[1]
    fs = built.copy()
    da, db = fs.read(a), fs.read(b)
    fs.write(a, db)
    fs.write(b, da)
    count("file-level cases")
    with pytest.raises(filechannel.CorruptLogError):
        open_state(fs)
    with pytest.raises(filechannel.CorruptLogError):
        open_state(fs, replay="checkpoint")


@pytest.mark.parametrize("where", ["replace-middle", "replace-newest", "add-newer", "add-older"])
def test_file_from_another_channel_is_refused(built: Built, where: str) -> None:
    other = Built(n_txns=20, with_takes=False)
    fs = built.copy()
    count("file-level cases")
    if where == "replace-middle":
        fs.write(built.files[1], other.fs.read(other.files[1]))
    elif where == "replace-newest":
        fs.write(built.files[-1], other.fs.read(other.files[-1]))
    elif where == "add-newer":
        fs.write(f"{DATA}/seg-00000000000000ff.wal", other.fs.read(other.files[-1]))
    else:
        fs.write(f"{DATA}/seg-0000000000000000.wal", other.fs.read(other.files[0]))
    try:
        got, _ = open_state(fs)
    except filechannel.CorruptLogError:
        return
    # Only an older file that nothing lists as live may be ignored (and removed).
    assert where == "add-older"
    assert got == built.full


# --------------------------------------------------------------------------
# R10: a length field of 2**32 - 1


@pytest.mark.parametrize("which", ["older", "newest"])
def test_huge_length_field(built: Built, which: int) -> None:
    path = built.files[0] if which == "older" else built.files[-1]
    orig = built.fs.read(path)
    h = fmt.decode_file_header(orig)
    assert isinstance(h, fmt.FileHeader)
    # the length field of the first record, then of a record in the middle
    fid = int(os.path.basename(path)[4:20], 16)
    cid, kind = channel_ident(built.fs)
    seed = fmt.file_seed(kind, cid, fid)
    offsets, pos = [], h.header_len
    while pos < len(orig):
        r = fmt.decode_record(orig, pos, seed, kind, 1 << 20)
        assert isinstance(r, fmt.Record)
        offsets.append(pos)
        pos = r.end
    for off in (offsets[0], offsets[len(offsets) // 2]):
        fs = built.copy()
        damaged = bytearray(orig)
        damaged[off + 4 : off + 8] = b"\xff\xff\xff\xff"
        fs.write(path, bytes(damaged))
        count("length fields")
        tracemalloc.start()
        try:
            try:
                got, _ = open_state(fs)
            except filechannel.CorruptLogError:
                got = None
            if which == "older" or (off != offsets[-1] and off < batch_ends_before_last(orig, fid, cid, kind)):
                assert got is None, "a damaged length in acknowledged data was not reported"
            else:
                assert got is None or got in built.states
            assert_verify_agrees_with_open(fs, "huge length")
            got, _ = open_state(fs, on_corruption="skip")
            assert_exact_subset(got, built.all_events)
        finally:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        assert peak < 16 << 20, f"recovery allocated {peak} bytes for a damaged length"


# --------------------------------------------------------------------------
# R8: a damaged checkpoint falls back and gives the same queue


def test_flip_every_byte_of_the_newest_checkpoint(built: Built) -> None:
    ckpts = sorted(p for p in built.fs.files(DIR + "/checkpoints") if p.endswith(".ckpt"))
    assert ckpts, "closing a channel writes a checkpoint"
    path = ckpts[-1]
    orig = built.fs.read(path)
    for off in range(len(orig)):
        fs = built.copy()
        damaged = bytearray(orig)
        damaged[off] ^= 0x41
        fs.write(path, bytes(damaged))
        count("checkpoint flips")
        assert_verify_agrees_with_open(fs, f"checkpoint flip at {off}")
        got, _ = open_state(fs, replay="checkpoint")
        assert got == built.full, f"checkpoint flip at {off}"


def test_zz_report() -> None:
    print("\ncorrupt inputs tried: " + ", ".join(f"{k}={v}" for k, v in sorted(COUNTS.items())))


def test_a_damaged_file_header_costs_no_event(built: Built) -> None:
    # Records are read with the seed the file name gives: only the header is lost.
    for path in built.files:
        fs = built.copy()
        damaged = bytearray(built.fs.read(path))
        damaged[0] ^= 0xFF
        fs.write(path, bytes(damaged))
        with pytest.raises(filechannel.CorruptLogError, match="header"):
            open_state(fs)
        got, ch = open_state(fs, on_corruption="skip")
        st = ch.stats()
        assert got == built.full
        assert st["lost_positions"] == []
        assert any("header" in r for r in st["corruption_report"])


def test_one_damaged_event_loses_that_event_not_its_transaction(built: Built) -> None:
    queued = {b for _, b in built.full}
    cid, kind = channel_ident(built.fs)
    for path in built.files[:-1]:  # a queued event in a sealed file, inside a batch of several
        orig = built.fs.read(path)
        fid = int(os.path.basename(path)[4:20], 16)
        seed = fmt.file_seed(kind, cid, fid)
        h = fmt.decode_file_header(orig)
        assert isinstance(h, fmt.FileHeader)
        pos = h.header_len
        target = None
        while pos < len(orig):
            r = fmt.decode_record(orig, pos, seed, kind, 1 << 20)
            assert isinstance(r, fmt.Record)
            if r.op == fmt.PUT and fmt.decode_event(r.payload)[0] in queued:
                target = pos
            pos = r.end
        if target is not None:
            break
    assert target is not None
    damaged = bytearray(orig)
    damaged[target + 40] ^= 0x01  # a body byte
    fs = built.copy()
    fs.write(path, bytes(damaged))
    got, ch = open_state(fs, on_corruption="skip")
    st = ch.stats()
    missing = {p for p, _ in built.full} - {p for p, _ in got}
    assert len(missing) == 1
    assert [[p, p + 1] for p in missing] == st["lost_positions"]
