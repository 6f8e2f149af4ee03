"""Small helpers shared by the test modules (imported as ``helpers``)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

import filechannel
from filechannel import cli
from filechannel import format as fmt
from filechannel.log import CHANNEL_FILE, decode_channel_file


def _no_accelerator() -> str:
    from filechannel._accel import PURE_PYTHON_ENV

    if os.environ.get(PURE_PYTHON_ENV, "") not in ("", "0"):
        return f"the pure-Python rerun ({PURE_PYTHON_ENV}=1): no C accelerator to compare with here"
    return "the C accelerator is not built"


NO_ACCELERATOR = _no_accelerator()
"""Why a test that needs the C accelerator skips: the pure-Python rerun, or no compiler at install."""
needs_c = pytest.mark.skipif(fmt.speedups is None, reason=NO_ACCELERATOR)


def contents(ch: filechannel.FileChannel) -> list[tuple[int, bytes]]:
    """The queue as ``(position, body)`` pairs, read by taking everything and rolling back."""
    tx = ch.transaction()
    evs = tx.take_batch(ch.config.transaction_capacity)
    tx.rollback()
    return [(e.position, e.body) for e in evs]


def put(ch: filechannel.FileChannel, *bodies: bytes) -> None:
    """Put ``bodies`` in one committed transaction."""
    with ch.transaction() as tx:
        for b in bodies:
            tx.put(b)


class WaitingPut:
    """:func:`put` of ``body`` in a thread of its own, for a test of a put that waits for room.

    ``done`` is set once the put returned or raised (``errors``: what it raised).
    """

    def __init__(self, ch: filechannel.FileChannel, body: bytes) -> None:
        self.done = threading.Event()
        self.errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, args=(ch, body), daemon=True)
        self._thread.start()

    def _run(self, ch: filechannel.FileChannel, body: bytes) -> None:
        try:
            put(ch, body)
        except BaseException as exc:
            self.errors.append(exc)
        self.done.set()

    def finish(self, timeout: float) -> None:
        """Assert that the put ends within ``timeout`` seconds, and without an error."""
        assert self.done.wait(timeout), "the waiting put did not resume when files retired"
        self._thread.join()
        assert not self.errors, self.errors


def put_records(d: str | Path) -> list[tuple[str, int, fmt.Record, int]]:
    """Every PUT record in the ``data`` directory of the channel at ``d``, in file order.

    As ``(data file path, file id, record, file seed)``: each file read frame by frame up to the
    first frame that does not decode (the zero-filled space after its last record).
    """
    cid, kind, _ = decode_channel_file(Path(d, CHANNEL_FILE).read_bytes())
    files = []
    for name in os.listdir(Path(d, "data")):
        if name.endswith(".wal"):
            buf = Path(d, "data", name).read_bytes()
            h = fmt.decode_file_header(buf)
            assert isinstance(h, fmt.FileHeader)
            files.append((h.file_id, str(Path(d, "data", name)), buf, h.header_len))
    found = []
    for fid, path, buf, off in sorted(files):
        seed = fmt.file_seed(kind, cid, fid)
        while True:
            try:
                rec = fmt.decode_record(buf, off, seed, kind, 1 << 30)
            except fmt.FormatError:
                break
            if not isinstance(rec, fmt.Record):
                break
            if rec.op == fmt.PUT:
                found.append((path, fid, rec, seed))
            off = rec.end
    return found


def decode_puts_outcome(results: list[Any]) -> list[Any]:
    """Comparable form of ``format.decode_puts`` results: values as they are, errors by type, offset and reason."""
    out: list[Any] = []
    for r in results:
        if isinstance(r, BaseException):
            assert isinstance(r, fmt.FormatError), r
            out.append((type(r).__name__, r.offset, r.reason, str(r)))
        else:
            assert type(r) in (tuple, bytes), r
            out.append(r)
    return out


def payload_fits(op: int, payload: bytes) -> bool:
    """Whether a record of ``op`` may carry ``payload`` (what ``decode_record`` checks before the checksum).

    Written out here, not taken from ``format``: COMMIT 16 bytes, ROLLBACK 8, BATCH_END 32, RETIRE 8,
    a TAKE its u32 range count then that many 16-byte ranges, a MARK 21 to 74 504, a PUT anything.
    """
    n = len(payload)
    fixed = {fmt.COMMIT: 16, fmt.ROLLBACK: 8, fmt.BATCH_END: 32, fmt.RETIRE: 8}
    if op in fixed:
        return n == fixed[op]
    if op == fmt.TAKE:
        return n >= 4 and (n - 4) % 16 == 0 and int.from_bytes(payload[:4], "little") == (n - 4) // 16
    if op == fmt.MARK:
        return 21 <= n <= 8 + 64 * (12 + 128 + 1024)
    return True


# -- running the CLI (tests/test_cli*.py) ---------------------------------------------------


class _Stdin:
    def __init__(self, data: bytes) -> None:
        self.buffer = io.BytesIO(data)


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str, stdin: bytes | None = None) -> tuple[int, str, str]:
    """Run ``filechannel ARGV`` in this process; return the exit code, stdout and stderr.

    stdout is captured as bytes (``take`` prints bodies as they are) and decoded with surrogateescape.
    """
    old, old_out = sys.stdin, sys.stdout
    if stdin is not None:
        sys.stdin = _Stdin(stdin)  # type: ignore[assignment]
    raw = io.BytesIO()
    out = old_out  # a test's own stdout is left as it is
    if type(old_out).__name__ == "CaptureIO":
        out = sys.stdout = io.TextIOWrapper(raw, encoding="utf-8", write_through=True)
    try:
        code = cli.main(list(argv))
    except SystemExit as exc:  # argparse
        code = int(exc.code or 0)
    finally:
        out.flush()
        if out is not old_out:
            out.detach()  # keep ``raw`` open
        sys.stdin, sys.stdout = old, old_out
    captured, err = capsys.readouterr()
    text = raw.getvalue().decode("utf-8", "surrogateescape") if out is not old_out else captured
    return code, text, err


def cli_command(*argv: str) -> list[str]:
    """The command line running ``filechannel ARGV`` in a new interpreter."""
    return [sys.executable, "-m", "filechannel", *argv]


def run_module(*argv: str, stdin: bytes = b"") -> subprocess.CompletedProcess[str]:
    """Run ``filechannel ARGV`` in a subprocess (text output, 60 s timeout)."""
    return subprocess.run(cli_command(*argv), input=stdin.decode(), capture_output=True, text=True, timeout=60)


def data_files(d: str | Path) -> list[str]:
    """The data files (``*.wal``) of the channel in ``d``'s default data directory, oldest first."""
    data = os.path.join(d, "data")
    return sorted(os.path.join(data, n) for n in os.listdir(data) if n.endswith(".wal"))


def records(path: str) -> list[fmt.Record]:
    """Every record frame of a data file after its header, up to the first zero byte (no batch logic)."""
    buf = Path(path).read_bytes()
    h = fmt.decode_file_header(buf)
    assert isinstance(h, fmt.FileHeader)
    seed = fmt.file_seed(h.crc_kind, h.channel_id, h.file_id)
    out = []
    pos = h.header_len
    while pos < len(buf) and buf[pos]:
        r = fmt.decode_record(buf, pos, seed, h.crc_kind, 1 << 30)
        assert isinstance(r, fmt.Record)
        out.append(r)
        pos = r.end
    return out


def batch_ends(path: str) -> list[int]:
    """The end offset of every batch of a data file (each BATCH_END record's end), in order."""
    return [r.end for r in records(path) if r.op == fmt.BATCH_END]


def agent_command(dirs: list[str], port_file: str | Path, *extra: str) -> list[str]:
    """``filechannel serve DIRS --listen grpc://127.0.0.1:0 --port-file F EXTRA...`` as a child's argv."""
    return [
        sys.executable,
        "-m",
        "filechannel",
        "serve",
        *dirs,
        "--listen",
        "grpc://127.0.0.1:0",
        "--port-file",
        str(port_file),
        *extra,
    ]


def metric(text: str, name: str, **labels: str) -> float:
    """The value of the series ``name{labels...}`` in Prometheus text (0 when absent)."""
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
