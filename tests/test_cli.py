"""The command line: put, take, stat, dump, verify on real directories; bad input never tracebacks."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import filechannel
from filechannel import cli
from filechannel import format as fmt


class _Stdin:
    def __init__(self, data: bytes) -> None:
        self.buffer = io.BytesIO(data)


def run(capsys: pytest.CaptureFixture[str], *argv: str, stdin: bytes | None = None) -> tuple[int, str, str]:
    old = sys.stdin
    if stdin is not None:
        sys.stdin = _Stdin(stdin)  # type: ignore[assignment]
    try:
        code = cli.main(list(argv))
    except SystemExit as exc:  # argparse
        code = int(exc.code or 0)
    finally:
        sys.stdin = old
    out, err = capsys.readouterr()
    return code, out, err


def run_module(*argv: str, stdin: bytes = b"") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "filechannel", *argv],
        input=stdin.decode(),
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def filled(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    d = str(tmp_path / "ch")
    code, _, err = run(
        capsys, "put", d, "--header", "src=test", "--batch", "4", stdin=b"one\ntwo\nthree\n\xff\xfe\nfive\n"
    )
    assert code == 0, err
    assert "put 5 events" in err
    return d


def test_put_and_take(filled: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "take", filled, "-n", "2")
    assert code == 0
    assert out == "one\ntwo\n"
    code, out, _ = run(capsys, "take", filled, "-n", "10", "--json")
    assert code == 0
    recs = [json.loads(line) for line in out.splitlines()]
    assert [r["position"] for r in recs] == [2, 3, 4]
    assert recs[0] == {"position": 2, "headers": {"src": "test"}, "body": "three"}
    assert recs[1]["body"] == "base64://4="  # not UTF-8: base64
    code, out, _ = run(capsys, "take", filled)
    assert (code, out) == (0, "")
    with filechannel.open(filled, minimum_required_space=0) as ch:
        assert ch.size == 0


def test_put_interval_fsync_and_module_entry_point(tmp_path: Path) -> None:
    d = str(tmp_path / "ch")
    r = run_module("put", d, "--fsync", "interval", stdin=b"".join(b"%d\n" % i for i in range(2500)))
    assert r.returncode == 0, r.stderr
    r = run_module("take", d, "-n", "3")
    assert (r.returncode, r.stdout) == (0, "0\n1\n2\n")


def test_stat(filled: str, capsys: pytest.CaptureFixture[str]) -> None:
    run(capsys, "take", filled, "-n", "1")
    code, out, _ = run(capsys, "stat", filled, "--json")
    assert code == 0
    info = json.loads(out)
    assert info["queue_size"] == 4
    assert info["head_position"] == 1
    assert info["tail_position"] == 4
    assert info["next_position"] == 5
    assert info["last_woid"] > 0
    assert info["in_use"] is False
    assert len(info["files"]) >= 1
    assert info["disk_bytes"] > 0
    code, out, _ = run(capsys, "stat", filled)
    assert code == 0
    assert "queue_size: 4" in out
    assert "last_woid:" in out
    with filechannel.open(filled, minimum_required_space=0):
        code, out, _ = run(capsys, "stat", filled, "--json")
        assert code == 0
        assert json.loads(out)["in_use"] is True


def test_dump(filled: str, capsys: pytest.CaptureFixture[str]) -> None:
    run(capsys, "take", filled, "-n", "2")
    code, out, _ = run(capsys, "dump", filled, "--bodies")
    assert code == 0
    recs = [json.loads(line) for line in out.splitlines()]
    assert all({"op", "woid", "txn", "file", "offset", "size"} <= set(r) for r in recs)
    woids = [r["woid"] for r in recs]
    assert woids == sorted(woids)
    puts = [r for r in recs if r["op"] == "put"]
    assert [p["position"] for p in puts] == [0, 1, 2, 3, 4]
    assert [p["body"] for p in puts][:3] == ["one", "two", "three"]
    assert puts[0]["headers"] == {"src": "test"}
    commits = [r for r in recs if r["op"] == "commit"]
    assert [(c["first_position"], c["puts"]) for c in commits[:2]] == [(0, 4), (4, 1)]
    takes = [r for r in recs if r["op"] == "take"]
    assert takes[0]["positions"] == [[0, 2]]
    # BATCH_END frames are not replayed records, so dump does not show them (see docs/cli.md).
    assert {r["op"] for r in recs} == {"put", "commit", "take"}
    assert all(r["file"].startswith("seg-") for r in recs)


def test_verify_clean(filled: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "verify", filled)
    assert code == 0
    assert "ok, 5 events queued" in out


def test_verify_names_file_and_offset_of_damage_in_an_older_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = str(tmp_path / "ch")
    with filechannel.open(d, max_file_size=4096, minimum_required_space=0) as ch:
        for _ in range(15):
            with ch.transaction() as tx:
                tx.put(b"v" * 600)
    files = sorted(n for n in os.listdir(os.path.join(d, "data")) if n.endswith(".wal"))
    assert len(files) > 2
    path = os.path.join(d, "data", files[0])
    with open(path, "rb") as f:
        h = fmt.decode_file_header(f.read(4096))
    assert isinstance(h, fmt.FileHeader)
    with open(path, "r+b") as f:
        f.seek(h.header_len + 50)
        f.write(b"\x00\x01\x02")
    code, out, err = run(capsys, "verify", d)
    assert code == 1
    assert path in out
    assert f"at byte {h.header_len}" in out
    assert "problem" in err


def test_verify_notes_a_torn_tail_and_exits_0(filled: str, capsys: pytest.CaptureFixture[str]) -> None:
    files = sorted(n for n in os.listdir(os.path.join(filled, "data")) if n.endswith(".wal"))
    with open(os.path.join(filled, "data", files[-1]), "ab") as f:
        f.write(b"\x01\x00\x00\x00partial")
    code, out, _ = run(capsys, "verify", filled)
    assert code == 0
    assert "torn tail" in out


BAD_INPUT: list[tuple[Any, ...]] = [
    ("take", "{missing}"),
    ("stat", "{missing}"),
    ("dump", "{missing}"),
    ("verify", "{missing}"),
    ("take", "{file}"),
    ("stat", "{file}"),
    ("dump", "{file}"),
    ("verify", "{file}"),
    ("put", "{file}"),
    ("take", "{foreign}"),
    ("stat", "{foreign}"),
    ("dump", "{foreign}"),
    ("verify", "{foreign}"),
    ("put", "{foreign}"),
    ("put", "{foreign}", "--header", "novalue"),
]


@pytest.fixture
def paths(tmp_path: Path) -> dict[str, str]:
    f = tmp_path / "plain.txt"
    f.write_text("not a channel")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "photo.jpg").write_bytes(b"\xff\xd8")
    return {"missing": str(tmp_path / "nope"), "file": str(f), "foreign": str(foreign)}


@pytest.mark.parametrize("argv", BAD_INPUT, ids=[" ".join(a) for a in BAD_INPUT])
def test_bad_input_one_line_exit_2(
    argv: tuple[str, ...], paths: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    args = [a.format(**paths) for a in argv]
    code, _out, err = run(capsys, *args, stdin=b"x\n")
    assert code == 2
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("filechannel: error:")
    assert "Traceback" not in err
    assert not os.path.exists(os.path.join(paths["foreign"], "CHANNEL"))


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["frobnicate"],
        ["take"],
        ["take", "{dir}", "-n", "0"],
        ["take", "{dir}", "-n", "many"],
        ["put", "{dir}", "--batch", "-1"],
        ["put", "{dir}", "--fsync", "never"],
        ["stat", "{dir}", "--bogus"],
    ],
)
def test_bad_options_exit_2_without_traceback(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [a.format(dir=str(tmp_path)) for a in argv]
    code, _, err = run(capsys, *args)
    assert code == 2
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("filechannel")
    assert "error:" in err.strip().splitlines()[-1]


def test_locked_channel_is_one_line_via_the_module(filled: str) -> None:
    with filechannel.open(filled, minimum_required_space=0):
        r = run_module("take", filled)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1
    assert "already open" in r.stderr
    assert "Traceback" not in r.stderr


def test_corrupt_channel_file_is_one_line(filled: str) -> None:
    with open(os.path.join(filled, "CHANNEL"), "r+b") as f:
        f.write(b"XX")
    for cmd in ("take", "stat", "dump", "verify"):
        r = run_module(cmd, filled)
        assert r.returncode == 2, (cmd, r.stdout, r.stderr)
        assert r.stderr.count("\n") == 1, r.stderr
        assert "CHANNEL" in r.stderr
        assert "Traceback" not in r.stderr
