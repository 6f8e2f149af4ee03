"""Decoders on crafted lengths and offsets: bounded memory, time linear in the input, only the project's errors.

Every input here is built to make a careless decoder allocate what a length
field claims or rescan what an offset points back to: frames claiming payloads
to the end of the file, BATCH_ENDs that verify on their own and each claim a
batch from the header to themselves (repeated for a MiB), TAKE frames whose
range count matches a huge length, checkpoint entries of 2**40 bytes or at
negative offsets, checkpoint runs of 2**40 events, overlapping or in unknown
files, holes outside their runs, counts near the format's maxima, an
``ANCHOR`` larger than memory, ``.ack`` files nested or numbered to break a
JSON parser, and every one of them truncated.

They run in one subprocess (``tests/fuzz/limits_worker.py``) whose address
space is capped with ``RLIMIT_AS`` (:data:`MEMORY`), each under a time limit of
``BASE_SECONDS + SECONDS_PER_MIB * size``. Each must end cleanly or with the
target's own error (``CorruptLogError``; ``FormatError`` for the checkpoint
decoder), never ``MemoryError``, ``OSError``, ``RecursionError`` or a timeout.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
import subprocess
import sys
from array import array
from pathlib import Path
from typing import Any

import pytest

import filechannel
from filechannel import checkpoint
from filechannel import format as fmt

pytest.importorskip("cryptography", reason="the crypto extra is not installed (README, Installing)")

from filechannel.crypto import Encryption

MEMORY = 1 << 30
BASE_SECONDS = 2.0
SECONDS_PER_MIB = (
    3.0  # about 6 times what a linear scan takes here; a quadratic one (as before issue 23) takes 20 times
)
TAIL = 2 << 20  # the crafted stretch after a valid prefix
HEAP = 256 << 20  # the heap limit of the cases larger than memory (RLIMIT_DATA)
SPARSE = 2 * HEAP  # a file larger than the heap allowed (a hole: costs no disk)
KEY = bytes(range(32))
OPTS: dict[str, Any] = {"minimum_required_space": 0, "background": False}
WORKER = Path(__file__).parent / "fuzz" / "limits_worker.py"
RNG = random.Random(23)


def budget(size: int) -> float:
    return BASE_SECONDS + SECONDS_PER_MIB * size / (1 << 20)


def segs(d: str) -> list[str]:
    data = os.path.join(d, "data")
    return sorted(os.path.join(data, n) for n in os.listdir(data) if n.endswith(".wal"))


def valid_end(buf: bytes) -> tuple[fmt.FileHeader, int]:
    """A data file's header and the end of its last record."""
    h = fmt.decode_file_header(buf)
    assert isinstance(h, fmt.FileHeader)
    seed = fmt.file_seed(h.crc_kind, h.channel_id, h.file_id)
    pos = h.header_len
    while pos < len(buf) and buf[pos]:
        r = fmt.decode_record(buf, pos, seed, h.crc_kind, 1 << 30)
        assert isinstance(r, fmt.Record)
        pos = r.end
    return h, pos


def head(op: int, n: int, woid: int) -> bytes:
    """A record header claiming ``n`` payload bytes, its checksum made up."""
    return struct.pack("<BBHIQQII", op, 0, 0, n, woid, 1, 0xDEADBEEF, 0)


def crafted_tail(family: str, h: fmt.FileHeader, start: int, size: int) -> bytes:
    """``size`` bytes to put at ``start`` (8-aligned) of a data file with header ``h``."""
    seed = fmt.file_seed(h.crc_kind, h.channel_id, h.file_id)
    end = start + size
    out = bytearray()
    woid = 1 << 20
    be_len = 48 if h.authenticated else 32
    while len(out) + 32 <= size:
        at = start + len(out)
        woid += 1
        if family == "be_len_to_eof":
            out += head(fmt.BATCH_END, end - at - 32, woid)
        elif family == "be_claims_from_header":
            # A BATCH_END that verifies on its own and claims every byte from the header to itself.
            fixed = struct.pack("<QIIQQ", h.header_len, at - h.header_len, 0, 1, woid - 1) + bytes(be_len - 32)
            out += fmt.encode_record(fmt.BATCH_END, woid, 0, fixed, seed, h.crc_kind)
        elif family == "put_len_to_eof":
            out += head(fmt.PUT, end - at - 32, woid)
        elif family == "take_len_to_eof":
            k = max(0, (end - at - 36) // 16)
            out += head(fmt.TAKE, 4 + 16 * k, woid) + struct.pack("<I", k) + bytes(4)
        elif family == "random":
            out += RNG.randbytes(64)
        else:  # pragma: no cover
            raise AssertionError(family)
    return bytes(out[:size]).ljust(size, b"\0")


def make_channel(d: str, encrypted: bool) -> None:
    enc = Encryption(keys={"k1": KEY}, active_key="k1") if encrypted else None
    with filechannel.open(d, encryption=enc, checkpoint_interval=0, **OPTS) as ch:
        for t in range(5):
            with ch.transaction() as tx:
                for i in range(4):
                    tx.put(b"event-%d-%d" % (t, i) * 3)
        ch.checkpoint()


def drop_checkpoints(d: str) -> None:
    ck = os.path.join(d, "checkpoints")
    for n in os.listdir(ck):
        os.unlink(os.path.join(ck, n))


FAMILIES = ["be_len_to_eof", "be_claims_from_header", "put_len_to_eof", "take_len_to_eof", "random"]


def data_file_cases(root: Path) -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = []
    for encrypted in (False, True):
        base = str(root / f"base-{int(encrypted)}")
        make_channel(base, encrypted)
        drop_checkpoints(base)  # nothing vouches: the whole file is scanned
        key = KEY.hex() if encrypted else ""
        path = segs(base)[-1]
        orig = Path(path).read_bytes()
        h, end = valid_end(orig)
        inputs: dict[str, bytes] = {f: orig[:end] + crafted_tail(f, h, end, TAIL) for f in FAMILIES}
        # Truncated everywhere that matters: inside the header, inside records, inside the crafted tail.
        for cut in (8, 40, h.header_len - 4, h.header_len + 13, end - 9, end + 100):
            inputs[f"cut{cut}"] = (orig[:end] + crafted_tail("be_claims_from_header", h, end, 4096))[:cut]
        for name, buf in inputs.items():
            d = str(root / f"{name}-{int(encrypted)}")
            shutil.copytree(base, d)
            Path(segs(d)[-1]).write_bytes(buf)
            for target in ("verify", "reader", "scan"):
                label = f"data {name} {'encrypted' if encrypted else 'plain'} {target}"
                cases.append({"name": label, "target": target, "path": d, "key": key, "budget": budget(len(buf))})
    return cases


def sparse_cases(root: Path) -> list[dict[str, Any]]:
    """Files larger than the memory limit: a valid prefix followed by a hole (sparse: no disk space used)."""
    cases: list[dict[str, Any]] = []
    for encrypted in (False, True):
        d = str(root / f"sparse-{int(encrypted)}")
        make_channel(d, encrypted)
        with open(segs(d)[-1], "r+b") as f:
            f.truncate(SPARSE)
        for target in ("verify", "reader"):
            label = f"data sparse {SPARSE >> 20} MiB {'encrypted' if encrypted else 'plain'} {target}"
            key = KEY.hex() if encrypted else ""
            cases.append({"name": label, "target": target, "path": d, "key": key, "budget": budget(SPARSE)})
    return cases


def anchor_cases(root: Path) -> list[dict[str, Any]]:
    """An encrypted channel's ``ANCHOR`` far larger than its bound (sparse): refused as damaged, never read whole."""
    d = str(root / "anchor-sparse")
    make_channel(d, True)
    with open(os.path.join(d, "ANCHOR"), "r+b") as f:
        f.truncate(SPARSE)
    cases: list[dict[str, Any]] = []
    for target, policy in (("verify", "fail"), ("reader", "fail"), ("open", "fail"), ("open", "skip")):
        label = f"ANCHOR sparse {SPARSE >> 20} MiB {target} {policy}"
        cases.append({"name": label, "target": target, "path": d, "key": KEY.hex(), "budget": 10.0, "policy": policy})
    return cases


def checkpoint_cases(root: Path) -> list[dict[str, Any]]:
    base = str(root / "ck-base")
    make_channel(base, False)
    ck_dir = os.path.join(base, "checkpoints")
    with filechannel.open(base, checkpoint_interval=0, **OPTS) as ch:
        held = ch.transaction()
        held.take_batch(8)  # open at the checkpoint: its events are entries outside the runs
        ch.checkpoint()
        name = sorted(n for n in os.listdir(ck_dir) if n.endswith(".ckpt"))[-1]
        good = Path(ck_dir, name).read_bytes()
        held.rollback()
    drop_checkpoints(base)
    Path(ck_dir, name).write_bytes(good)
    h, _ = valid_end(Path(segs(base)[-1]).read_bytes())
    kind, cid = h.crc_kind, h.channel_id
    snap = checkpoint.decode(good, kind, cid)
    assert snap.runs, "a version 6 checkpoint with runs"
    assert len(snap.positions) == 8, "and entries outside them"
    run0 = snap.runs[0]

    def encoded(runs: list[Any] | None, holes: tuple[int, ...] | list[int] = (), **edit: int) -> bytes:
        """``snap`` re-encoded: version 6 with ``runs`` and ``holes``, version 2 (per-event columns) without runs."""
        cols = {c: array("q", getattr(snap, c)) for c in ("positions", "file_ids", "offsets", "sizes")}
        for col, v in edit.items():
            cols[col][len(cols[col]) // 2] = v
        s = checkpoint.Snapshot(
            snap.woid, snap.next_position, snap.next_txn_id, snap.next_file_id, cid, snap.created_ns,
            dict(snap.files), cols["positions"], cols["file_ids"], cols["offsets"], cols["sizes"],
            taken=dict(snap.taken), file_dirs=dict(snap.file_dirs), runs=runs, holes=list(holes),
        )  # fmt: skip
        return checkpoint.encode(s, kind)

    def run0_with(**edit: int) -> list[Any]:
        return [run0._replace(**edit), *snap.runs[1:]]

    def with_head(buf: bytes, **edit: int) -> bytes:
        fields = list(checkpoint._HEAD.unpack_from(buf, 0))
        order = ["magic", "version", "r", "kind", "cid", "woid", "np", "nt", "nf", "created", "n_files", "n_tf", "n"]
        for k, v in edit.items():
            fields[order.index(k)] = v
        body = checkpoint._HEAD.pack(*fields) + buf[checkpoint._HEAD.size : -4]
        return body + struct.pack("<I", fmt.crc(kind, body))

    def with_runs_head(n_runs: int | None = None, n_holes: int | None = None) -> bytes:
        # The runs table's counts, rewritten in place (it follows the taken table; no marks here).
        at = len(good) - 4 - 32 * len(snap.positions) - 32 * len(snap.runs) - 8 * len(snap.holes) - 16
        old_runs, old_holes = struct.unpack_from("<QQ", good, at)
        assert (old_runs, old_holes) == (len(snap.runs), len(snap.holes))
        head = struct.pack("<QQ", old_runs if n_runs is None else n_runs, old_holes if n_holes is None else n_holes)
        body = good[:at] + head + good[at + 16 : -4]
        return body + struct.pack("<I", fmt.crc(kind, body))

    def many_runs(n: int) -> bytes:
        # n one-event runs from the first run's offset, positions after the real ones (found nowhere).
        runs = [run0._replace(first=snap.next_position + i, length=1) for i in range(n)]
        return encoded(runs)

    def big_queue_v2(n: int) -> bytes:
        # Version 2: n per-event entries, all pointing at one record (valid each alone), positions increasing.
        fid, off, size = snap.file_ids[0], snap.offsets[0], snap.sizes[0]
        s = checkpoint.Snapshot(
            snap.woid, snap.next_position + n, snap.next_txn_id, snap.next_file_id, cid, snap.created_ns,
            dict(snap.files), array("q", range(n)), array("q", [fid]) * n, array("q", [off]) * n,
            array("q", [size]) * n, file_dirs=dict(snap.file_dirs),
        )  # fmt: skip
        return checkpoint.encode(s, kind)

    end = run0.first + run0.length
    v2 = encoded(None)
    assert struct.unpack_from("<H", v2, 8)[0] == 2
    inputs = {
        # version 6: the runs table
        "run_count_2**40": encoded(run0_with(length=1 << 40)),
        "run_count_2**63": encoded(run0_with(length=(1 << 63) + 5)),
        "run_past_int64": encoded(run0_with(first=(1 << 63) - 2, length=4)),
        "run_offset_huge": encoded(run0_with(offset=1 << 62)),
        "run_offset_negative": encoded(run0_with(offset=(1 << 64) - 4096)),
        "run_offset_in_header": encoded(run0_with(offset=8)),
        "run_file_unknown": encoded(run0_with(file_id=1 << 40)),
        "runs_overlap": encoded([run0, run0._replace(first=end - 1), *snap.runs[1:]]),
        "hole_outside_run": encoded(snap.runs, [end + 3]),
        "hole_negative": encoded(snap.runs, [-5]),
        "holes_repeated": encoded(snap.runs, [run0.first + 1, run0.first + 1]),
        "entry_out_of_order": encoded(snap.runs, positions=run0.first + 1),
        # the first run grown back over the last entry outside runs (positions still increase)
        "entry_inside_run": encoded(run0_with(first=snap.positions[-1], length=end - snap.positions[-1])),
        "entry_size_2**40": encoded(snap.runs, sizes=1 << 40),
        "entry_offset_negative": encoded(snap.runs, offsets=-4096),
        "runs_count_max": with_runs_head(n_runs=checkpoint.MAX_RUNS),
        "runs_count_2**63": with_runs_head(n_runs=1 << 63),
        "holes_count_max": with_runs_head(n_holes=checkpoint.MAX_ENTRIES),
        "holes_count_2**63": with_runs_head(n_holes=1 << 63),
        "count_2**33": with_head(good, n=1 << 33),
        "count_max": with_head(good, n=checkpoint.MAX_ENTRIES),
        "count_past_max": with_head(good, n=checkpoint.MAX_ENTRIES + 1),
        "files_max": with_head(good, n_files=fmt.MAX_LIVE_FILES),
        "files_past_max": with_head(good, n_files=fmt.MAX_LIVE_FILES + 1),
        "taken_max": with_head(good, n_tf=fmt.MAX_LIVE_FILES),
        "flags_unknown": with_head(good, r=4),
        "queue_64k_runs": many_runs(1 << 16),
        "truncated_head": good[:40],
        "truncated_runs": good[: len(good) - 4 - 32 * len(snap.positions) - 8],
        "truncated_body": good[:-9],
        # version 2 (per-event columns), still read
        "v2_size_2**40": encoded(None, sizes=1 << 40),
        "v2_size_negative": encoded(None, sizes=-(1 << 40)),
        "v2_offset_negative": encoded(None, offsets=-4096),
        "v2_offset_2**62": encoded(None, offsets=1 << 62),
        "v2_file_unknown": encoded(None, file_ids=1 << 40),
        "v2_count_2**33": with_head(v2, n=1 << 33),
        "v2_count_max": with_head(v2, n=checkpoint.MAX_ENTRIES),
        "v2_flags": with_head(v2, r=1),
        "v2_queue_64k_one_record": big_queue_v2(1 << 16),
        "v2_truncated_body": v2[:-9],
    }
    cases: list[dict[str, Any]] = []
    for name, buf in inputs.items():
        d = str(root / f"ck-{name}")
        shutil.copytree(base, d)
        p = os.path.join(d, "checkpoints", name_of(base))
        Path(p).write_bytes(buf)
        b = budget(len(buf))
        cases.append(
            {"name": f"checkpoint {name} decode", "target": "checkpoint_decode", "path": p, "budget": b,
             "crc_kind": kind, "channel_id": cid.hex()}
        )  # fmt: skip
        for target in ("verify", "reader"):
            cases.append({"name": f"checkpoint {name} {target}", "target": target, "path": d, "budget": b})
    return cases


def name_of(d: str) -> str:
    """The one checkpoint of ``d``."""
    (name,) = (n for n in os.listdir(os.path.join(d, "checkpoints")) if n.endswith(".ckpt"))
    return name


def ack_line(line: bytes) -> bytes:
    return line + b"\ncrc32:%08x\n" % fmt.crc(fmt.CRC32_ZLIB, line)


GOOD_ACK = b'{"version": 1, "name": "c1", "identity": null, "acked": 3, "registered_ns": 1}'


def ack_inputs() -> dict[str, bytes]:
    good = GOOD_ACK
    return {
        "nested_json": ack_line(b"[" * 200_000 + b"]" * 200_000),
        "nested_object": ack_line(b'{"a":' * 100_000 + b"1" + b"}" * 100_000),
        "huge_int": ack_line(good.replace(b"3", b"9" * 200_000, 1)),
        "long_line_no_crc": b"x" * (4 << 20),
        "acked_negative": ack_line(good.replace(b"3", b"-3", 1)),
        "truncated": ack_line(good)[:30],
        "sparse": b"",  # made below: larger than the memory limit
    }


def wal_cases(root: Path) -> list[dict[str, Any]]:
    base = str(root / "wal-base")
    with filechannel.WriteAheadLog(base) as w:
        for i in range(10):
            w.write(b"record-%d" % i, time=100 + i)
    cases: list[dict[str, Any]] = []
    path = segs(base)[-1]
    orig = Path(path).read_bytes()
    h, end = valid_end(orig)
    inputs = {f: orig[:end] + crafted_tail(f, h, end, TAIL) for f in FAMILIES}
    inputs["cut_header"] = orig[: h.header_len - 4]
    inputs["cut_record"] = orig[: end - 9]
    for name, buf in inputs.items():
        d = str(root / f"wal-{name}")
        shutil.copytree(base, d)
        Path(segs(d)[-1]).write_bytes(buf)
        b = budget(len(buf))
        cases.append({"name": f"wal {name} verify", "target": "wal_verify", "path": d, "budget": b})
        for policy in ("fail", "skip"):
            cases.append(
                {"name": f"wal {name} open {policy}", "target": "wal_open", "path": d, "budget": b, "policy": policy}
            )
    return cases


def run_worker(cases: list[dict[str, Any]], limit: str = "AS") -> list[dict[str, Any]]:
    memory = MEMORY if limit == "AS" else HEAP
    timeout = 30 + sum(c["budget"] for c in cases)
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent.parent), os.environ.get("PYTHONPATH", "")])
    )
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(memory), limit],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(cases), f"the worker died (exit {proc.returncode}): {proc.stderr[-2000:]}"
    return results


def check(results: list[dict[str, Any]]) -> set[str]:
    bad = [r for r in results if not r["ok"]]
    assert not bad, "\n".join(f"{r['name']}: {r['outcome']} after {r['seconds']:.2f}s\n{r['detail']}" for r in bad)
    return {r["outcome"] for r in results}


def test_data_files(tmp_path: Path) -> None:
    check(run_worker(data_file_cases(tmp_path)))


def test_data_files_larger_than_memory(tmp_path: Path) -> None:
    """A data file bigger than the memory limit is read through a mapping or in chunks, never whole.

    The limit here is on the heap (``RLIMIT_DATA``): the scan maps data files read-only,
    which takes address space and no memory, so ``RLIMIT_AS`` would refuse the mapping
    itself (an ``OSError`` ENOMEM from ``mmap``) rather than test what is read.
    """
    check(run_worker(sparse_cases(tmp_path), "DATA"))


def test_an_anchor_larger_than_its_bound(tmp_path: Path) -> None:
    """Issue 32, item 20: without the bound on ``ANCHOR``'s size, its read is a ``MemoryError``."""
    results = run_worker(anchor_cases(tmp_path), "DATA")
    outcomes = check(results)
    assert "CorruptLogError" in outcomes  # refused where the policy is "fail": ANCHOR is damaged
    assert all(r["outcome"] == "ok" for r in results if r["name"].endswith("skip"))  # skip: reported, opened


def test_checkpoints(tmp_path: Path) -> None:
    outcomes = check(run_worker(checkpoint_cases(tmp_path)))
    assert {"ok", "FormatError"} <= outcomes


def test_write_ahead_log(tmp_path: Path) -> None:
    outcomes = check(run_worker(wal_cases(tmp_path)))
    assert {"ok", "CorruptLogError"} <= outcomes  # damage reached, not only refused at the door


@pytest.mark.parametrize(
    "name",
    [n for n in ack_inputs()],
)
def test_ack_files(tmp_path: Path, name: str) -> None:
    d = tmp_path / "ack"
    (d / "consumers").mkdir(parents=True)
    path = d / "consumers" / "c1.ack"
    buf = ack_inputs()[name]
    path.write_bytes(buf)
    limit = "AS"
    if name == "sparse":
        with open(path, "wb") as f:
            f.write(ack_line(GOOD_ACK))
            f.truncate(SPARSE)
        limit = "DATA"
    size = os.path.getsize(path)
    check(run_worker([{"name": f"ack {name}", "target": "acks", "path": str(d), "budget": budget(size)}], limit))
