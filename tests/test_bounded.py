"""Decoders bounded by construction (issue 23): crafted lengths cost linear work and never a MemoryError.

Work is counted, not timed: ``format.crc`` is wrapped to add up the bytes
checksummed, which is what a crafted length used to multiply. Each scan runs on
both paths (the C accelerator where it is built, and the pure-Python twin).
"""

from __future__ import annotations

import struct
from typing import Any

import pytest
from simfs import SimFS

import filechannel
from filechannel import format as fmt
from filechannel import scan
from filechannel.config import ChannelConfig
from filechannel.errors import CorruptLogError, FormatError

C = fmt.speedups
PATHS = ["c", "python"] if C is not None else ["python"]
_REC_HEAD = struct.Struct("<BBHIQQ")


class Ctx:
    """A ScanContext that keeps what the scan reports."""

    def __init__(self, kind: int, cid: bytes, mode: str) -> None:
        self.crc_kind = kind
        self.channel_id = cid
        self.max_payload = 0xFFFF_FFFF  # what Log uses: the format's limit
        self.config = ChannelConfig(on_corruption=mode)
        self.reports: list[scan.CorruptionReport] = []
        self.torn: list[tuple[str, int, int, str]] = []

    def report_corruption(self, report: scan.CorruptionReport) -> None:
        self.reports.append(report)

    def note_torn_tail(self, path: str, start: int, size: int, reason: str) -> None:
        self.torn.append((path, start, size, reason))


def data_file() -> bytes:
    """A small, clean data file of a few committed batches."""
    fs = SimFS()
    ch = filechannel.open("/sim/ch", fs=fs, background=False, minimum_required_space=0, max_file_size=1 << 20)
    for i in range(4):
        with ch.transaction() as tx:
            tx.put_many([b"event %d" % i] * 3)
    ch.close()
    data = fs.read("/sim/ch/data/seg-0000000000000001.wal")
    end = len(data)
    while end and data[end - 1] == 0:  # drop the zero-filled space ahead of the writer
        end -= 1
    return data[: end + (-end & 7)]


@pytest.fixture(params=PATHS)
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "python":
        monkeypatch.setattr(fmt, "speedups", None)
    return str(request.param)


@pytest.fixture
def checksummed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Bytes checksummed by ``format.crc`` (every Python-side checksum) while the test runs."""
    count = [0]
    real = fmt.crc

    def counting(kind: int, data: Any, seed: int = 0) -> int:
        count[0] += len(data)
        return real(kind, data, seed)

    monkeypatch.setattr(fmt, "crc", counting)
    return count


def crafted_tail(op: int, size: int, step: int, woid: int) -> bytes:
    """``size`` bytes of frames every ``step`` bytes, each of ``op`` and claiming a payload to the end."""
    out = bytearray(size)
    for off in range(0, size - 32 + 1, step):
        _REC_HEAD.pack_into(out, off, op, 0, 0, size - off - 32, woid + off, 1)
    return bytes(out)


def run_scan(data: bytes, mode: str, newest: bool) -> tuple[scan.FileScan | CorruptLogError, Ctx]:
    hdr = fmt.decode_file_header(data)
    assert isinstance(hdr, fmt.FileHeader)
    ctx = Ctx(hdr.crc_kind, hdr.channel_id, mode)
    try:
        return scan.Scanner(ctx, "/f", 1, data, hdr).scan(newest, 0), ctx
    except CorruptLogError as exc:
        return exc, ctx


@pytest.mark.parametrize("tail", [64 * 1024, 256 * 1024])
def test_a_tail_of_batch_ends_claiming_the_rest_of_the_file_is_scanned_in_linear_work(
    path: str, checksummed: list[int], tail: int
) -> None:
    clean = data_file()
    data = clean + crafted_tail(fmt.BATCH_END, tail, 32, 1 << 40)
    got, ctx = run_scan(data, "fail", newest=True)
    assert isinstance(got, scan.FileScan)
    assert got.end == len(clean)  # the clean batches, then a torn tail
    assert [t[1:3] for t in ctx.torn] == [(len(clean), len(data))]
    # Quadratic before: each of the tail/32 frames was checksummed to the end of the file.
    assert checksummed[0] <= 4 * len(data), checksummed[0]


@pytest.mark.parametrize("op", [fmt.PUT, fmt.TAKE])
@pytest.mark.parametrize("tail", [64 * 1024, 128 * 1024])
def test_salvage_of_frames_claiming_the_rest_of_the_file_is_linear_work(
    path: str, checksummed: list[int], op: int, tail: int
) -> None:
    clean = data_file()
    data = clean + crafted_tail(op, tail, 8, 1 << 40)
    got, ctx = run_scan(data, "skip", newest=False)  # a sealed file: its tail is acknowledged data
    assert isinstance(got, scan.FileScan)
    assert got.end == len(data)  # skip mode: the scan ends past the stretch it salvaged (and reported)
    lost = [(r.offset, r.lost_bytes) for r in ctx.reports]
    assert lost == [(len(clean), tail)], lost
    # salvage's budget, plus the scan's own reads (the first crafted frame, the clean batches)
    assert checksummed[0] <= (scan.SALVAGE_WORK + 2) * len(data) + scan.SALVAGE_SLACK, checksummed[0]


@pytest.mark.parametrize("op", [fmt.PUT, fmt.TAKE, fmt.BATCH_END])
def test_first_record_after_a_damaged_header_is_bounded_work(checksummed: list[int], op: int) -> None:
    clean = data_file()
    hdr = fmt.decode_file_header(clean)
    assert isinstance(hdr, fmt.FileHeader)
    seed = fmt.file_seed(hdr.crc_kind, hdr.channel_id, 1)
    junk = crafted_tail(op, 512 * 1024, 8, 1)
    buf = junk + clean[hdr.header_len :]
    got = scan.first_record(buf, 0, len(buf), seed, hdr.crc_kind, 0xFFFF_FFFF)
    assert got is None or got == len(junk)
    assert checksummed[0] <= scan.SALVAGE_WORK * len(buf) + scan.SALVAGE_SLACK, checksummed[0]
    # and where nothing is crafted, it finds the first record
    assert scan.first_record(bytes(80) + clean[hdr.header_len :], 0, 1 << 20, seed, hdr.crc_kind, 1 << 20) == 80


@pytest.mark.parametrize("op", [fmt.COMMIT, fmt.ROLLBACK, fmt.BATCH_END, fmt.RETIRE, fmt.TAKE])
def test_a_frame_of_the_wrong_length_for_its_op_is_refused_before_its_checksum(checksummed: list[int], op: int) -> None:
    n = 1 << 20
    frame = _REC_HEAD.pack(op, 0, 0, n, 1, 1) + bytes(8 + n)
    with pytest.raises(FormatError, match="payload length") as exc:
        fmt.decode_record(frame, 0, 7, fmt.CRC32_ZLIB, 0xFFFF_FFFF)
    assert exc.value.offset == 4
    assert checksummed[0] == 0


@pytest.mark.parametrize("op", [fmt.COMMIT, fmt.TAKE, fmt.RETIRE])
def test_a_verified_batch_holding_a_record_of_the_wrong_length_is_damage_on_both_paths(path: str, op: int) -> None:
    clean = data_file()
    hdr = fmt.decode_file_header(clean)
    assert isinstance(hdr, fmt.FileHeader)
    kind = hdr.crc_kind
    seed = fmt.file_seed(kind, hdr.channel_id, 1)
    good, _ = run_scan(clean, "fail", newest=True)
    assert isinstance(good, scan.FileScan)
    woid = good.last_woid + 1
    start = len(clean)
    body = fmt.encode_record(fmt.PUT, woid, 99, fmt.encode_event(b"x", None), seed, kind)
    payload = {fmt.COMMIT: bytes(24), fmt.TAKE: struct.pack("<I", 2) + bytes(16), fmt.RETIRE: bytes(16)}[op]
    body += fmt.encode_record(op, woid + 1, 99, payload, seed, kind)
    be = fmt.BatchEnd(start, len(body), fmt.crc(kind, body, seed), woid, woid + 1)
    data = clean + body + fmt.encode_record(fmt.BATCH_END, woid + 2, 0, fmt.encode_batch_end(be), seed, kind)
    got, ctx = run_scan(data, "fail", newest=True)
    assert isinstance(got, scan.FileScan)
    assert got.end == len(clean)  # the batch is not taken in: its second record is not a record
    assert "payload length" in ctx.torn[0][3]


# --------------------------------------------------------------------------
# checkpoints: every queue entry is checked when the checkpoint is decoded


def _edit_entry(col: str, value: int) -> Any:
    def edit(s: Any) -> None:
        getattr(s, col)[1] = value

    return edit


CHECKPOINT_EDITS = {
    "size 2**40": _edit_entry("sizes", 1 << 40),
    "negative offset": _edit_entry("offsets", -4096),
    "offset inside the header": _edit_entry("offsets", 8),
    "offset off alignment": lambda s: s.offsets.__setitem__(1, s.offsets[1] + 4),
    "size off alignment": lambda s: s.sizes.__setitem__(1, s.sizes[1] + 1),
    "size below a frame": _edit_entry("sizes", 8),
    "past the file's length": lambda s: s.offsets.__setitem__(1, s.files[s.file_ids[1]]),
    "unknown file": _edit_entry("file_ids", 99),
    "positions not increasing": lambda s: s.positions.__setitem__(1, s.positions[0]),
    # The runs of a version 6 checkpoint (the queue outside the open transaction's takes).
    "run in an unknown file": lambda s: s.runs.__setitem__(0, s.runs[0]._replace(file_id=99)),
    "run inside the header": lambda s: s.runs.__setitem__(0, s.runs[0]._replace(offset=8)),
    "run past the file's length": lambda s: s.runs.__setitem__(0, s.runs[0]._replace(offset=1 << 30)),
    "runs overlapping": lambda s: s.runs.append(s.runs[0]),
    "hole outside every run": lambda s: s.holes.append(1 << 40),
}


@pytest.mark.parametrize("what", sorted(CHECKPOINT_EDITS))
def test_a_checkpoint_entry_that_cannot_exist_falls_back_to_a_full_replay(what: str) -> None:
    from filechannel import checkpoint as ckpt

    fs = SimFS()
    opts: dict[str, Any] = {"fs": fs, "background": False, "minimum_required_space": 0}
    ch = filechannel.open("/sim/ch", **opts)
    bodies = [b"event %d" % i for i in range(6)]
    for i in range(0, 8, 2):
        with ch.transaction() as tx:
            tx.put_many([*bodies, b"event 6", b"event 7"][i : i + 2])
    held = ch.transaction()
    held.take_batch(6)  # open: the checkpoint holds these six as entries, the other two as a run
    ch.checkpoint()
    ch._log.close()  # a crash: no checkpoint on close, the open transaction's takes come back
    bodies += [b"event 6", b"event 7"]
    cdir = "/sim/ch/checkpoints"
    name = max(n for n in fs.listdir(cdir) if n.endswith(".ckpt"))
    path = f"{cdir}/{name}"
    cid, kind, _ = _channel_ident(fs)
    snap = ckpt.decode(fs.read(path), kind, cid)
    assert len(snap) == 8
    assert snap.entry_count() == 6
    CHECKPOINT_EDITS[what](snap)
    data = ckpt.encode(snap, kind)  # encoded as given: the checksum is right, the entry is not
    with pytest.raises(FormatError):
        ckpt.decode(data, kind, cid)
    fd = fs.open_rw(path)
    fs.truncate(fd, 0)
    fs.pwrite_all(fd, data, 0)
    fs.close(fd)
    ch = filechannel.open("/sim/ch", **opts)
    try:
        assert ch.checkpoint_fallbacks, "the damaged checkpoint was used"
        tx = ch.transaction()
        got = [e.body for e in tx.take_batch(100)]
        tx.rollback()
        assert got == bodies
    finally:
        ch.close()


def _channel_ident(fs: SimFS) -> tuple[bytes, int, int]:
    from filechannel.log import decode_channel_file

    return decode_channel_file(fs.read("/sim/ch/CHANNEL"))


# --------------------------------------------------------------------------
# data files read through a mapping: bounded memory


@pytest.mark.parametrize("tail", [b"", b"\x05" + bytes(63), bytes(4096)])
def test_a_mapped_data_file_scans_as_its_bytes_do(path: str, tmp_path: Any, tail: bytes) -> None:
    from filechannel._fs import DEFAULT_FS, map_file

    data = data_file() + tail
    f = tmp_path / "seg"
    f.write_bytes(data)
    want, want_ctx = run_scan(data, "skip", newest=True)
    with map_file(DEFAULT_FS, str(f)) as view:
        assert not isinstance(view, bytes)  # mapped, not read
        got, got_ctx = run_scan(view, "skip", newest=True)  # type: ignore[arg-type]
    assert isinstance(got, scan.FileScan)
    assert isinstance(want, scan.FileScan)
    assert (got.records, got.end, got.size) == (want.records, want.end, want.size)
    assert (got_ctx.torn, got_ctx.reports) == (want_ctx.torn, want_ctx.reports)


_SPARSE_VERIFY = """
import resource, sys
resource.setrlimit(resource.RLIMIT_DATA, (1 << 30, 1 << 30))  # heap: far less than the file
from filechannel.verify import verify_channel
from filechannel.errors import CorruptLogError
try:
    r = verify_channel(sys.argv[1])
except CorruptLogError as exc:
    print("corrupt", exc.path, exc.offset)
else:
    print("verified", len(r.queued), [(p, s) for p, s, _ in r.torn_tails])
"""


def test_verify_of_a_6_gib_sparse_data_file_runs_in_bounded_memory(tmp_path: Any) -> None:
    """Recovery maps data files (``_fs.map_file``): a file larger than the heap limit is verified, not read whole."""
    import subprocess
    import sys

    d = tmp_path / "ch"
    ch = filechannel.open(str(d), background=False, minimum_required_space=0)
    with ch.transaction() as tx:
        tx.put_many([b"a", b"b"])
    ch.close()
    seg = max((d / "data").iterdir())
    size = seg.stat().st_size
    with open(seg, "r+b") as f:
        f.truncate(6 << 30)  # sparse: no blocks, six GiB of zeros to a reader
    out = subprocess.run(
        [sys.executable, "-c", _SPARSE_VERIFY, str(d)], capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "MemoryError" not in out.stderr
    assert out.stdout.startswith(("verified 2", "corrupt")), out.stdout
    assert str(seg) in out.stdout or "verified 2" in out.stdout
    assert size < 6 << 30
