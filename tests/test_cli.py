"""The command line: put, take, stat, dump, verify on real directories; bad input never tracebacks."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import cli_command, run_cli, run_module

import filechannel
from filechannel import format as fmt
from filechannel.cli import channels as cli  # put and take, whose FileChannel and _put_batch the tests patch


@pytest.fixture
def filled(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    d = str(tmp_path / "ch")
    code, _, err = run_cli(
        capsys, "put", d, "--header", "src=test", "--batch", "4", stdin=b"one\ntwo\nthree\n\xff\xfe\nfive\n"
    )
    assert code == 0, err
    assert "put 5 events" in err
    return d


def test_put_and_take(filled: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "take", filled, "-n", "2")
    assert code == 0
    assert out == "one\ntwo\n"
    code, out, _ = run_cli(capsys, "take", filled, "-n", "10", "--json")
    assert code == 0
    recs = [json.loads(line) for line in out.splitlines()]
    assert [r["position"] for r in recs] == [2, 3, 4]
    assert recs[0] == {"position": 2, "headers": {"src": "test"}, "body": "three", "body_encoding": "utf-8"}
    assert (recs[1]["body"], recs[1]["body_encoding"]) == ("//4=", "base64")  # not UTF-8: base64
    code, out, _ = run_cli(capsys, "take", filled)
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
    run_cli(capsys, "take", filled, "-n", "1")
    code, out, _ = run_cli(capsys, "stat", filled, "--json")
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
    code, out, _ = run_cli(capsys, "stat", filled)
    assert code == 0
    assert "queue_size: 4" in out
    assert "last_woid:" in out
    with filechannel.open(filled, minimum_required_space=0):
        code, out, _ = run_cli(capsys, "stat", filled, "--json")
        assert code == 0
        assert json.loads(out)["in_use"] is True


def test_dump(filled: str, capsys: pytest.CaptureFixture[str]) -> None:
    run_cli(capsys, "take", filled, "-n", "2")
    code, out, _ = run_cli(capsys, "dump", filled, "--bodies")
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
    code, out, _ = run_cli(capsys, "verify", filled)
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
    code, out, err = run_cli(capsys, "verify", d)
    assert code == 1
    assert path in out
    assert f"at byte {h.header_len}" in out
    assert "problem" in err


def test_verify_notes_a_torn_tail_and_exits_0(filled: str, capsys: pytest.CaptureFixture[str]) -> None:
    files = sorted(n for n in os.listdir(os.path.join(filled, "data")) if n.endswith(".wal"))
    with open(os.path.join(filled, "data", files[-1]), "ab") as f:
        f.write(b"\x01\x00\x00\x00partial")
    code, out, _ = run_cli(capsys, "verify", filled)
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
    code, _out, err = run_cli(capsys, *args, stdin=b"x\n")
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
    code, _, err = run_cli(capsys, *args)
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


# -- issue 13: no silent loss at the command line ------------------------------------------------


def bodies(d: str) -> list[bytes]:
    """Every queued body, read by reopening the channel (and taking nothing for good)."""
    with filechannel.open(d, minimum_required_space=0) as ch:
        tx = ch.transaction()
        evs = tx.take_batch(ch.config.transaction_capacity)
        tx.rollback()
    return [e.body for e in evs]


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("filechannel"), err
    assert "error:" in lines[0]
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize(
    ("lines", "batch", "committed"),
    [(3, 10, 3), (5, 2, 5), (0, 10, 0)],
    ids=["same-batch", "later-batch", "first-line"],
)
def test_put_oversized_line_commits_the_lines_before_it_and_names_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], lines: int, batch: int, committed: int
) -> None:
    d = str(tmp_path / "ch")
    good = [b"line%d" % i for i in range(1, lines + 1)]
    stdin = b"".join(g + b"\n" for g in good) + b"x" * 200 + b"\nafter1\nafter2\n"
    code, _, err = run_cli(capsys, "put", d, "--max-event-size", "100", "--batch", str(batch), stdin=stdin)
    assert code == 2
    line = one_error_line(err)
    assert f"line {lines + 1}:" in line
    # The line is read no further than max_event_size allows: its size is not known, only that it is too big.
    assert "an event of more than 100 bytes" in line
    assert "max_event_size=100" in line
    assert f"the {committed} lines before it were committed" in line
    assert "--max-event-size" in line  # the fix
    assert bodies(d) == good  # exactly the valid lines before it; nothing after it


def test_put_reads_an_oversized_line_no_further_than_the_limit(tmp_path: Path) -> None:
    """A 100 MB line without a newline is refused after about max_event_size bytes, not read whole."""
    d = str(tmp_path / "ch")
    code = (
        "import io, sys\n"
        "from filechannel import cli\n"
        "class Huge(io.RawIOBase):\n"
        "    served = 0\n"
        "    def readable(self): return True\n"
        "    def readinto(self, b):\n"
        "        n = len(b); b[:n] = b'x' * n; Huge.served += n\n"
        "        if Huge.served > 1 << 20: raise SystemExit('read more than 1 MiB of the line')\n"
        "        return n\n"
        "sys.stdin = io.TextIOWrapper(io.BufferedReader(Huge(), 4096))\n"
        f"rc = cli.main(['put', {d!r}, '--max-event-size', '1000'])\n"
        "print('served', Huge.served, file=sys.stderr); sys.exit(rc)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "more than 1000 bytes" in r.stderr
    served = int(r.stderr.rsplit("served", 1)[1])
    assert served < 64 * 1024  # a few buffers, never the 100 MB a whole-line read would take


@pytest.mark.parametrize(
    ("header", "fits"),
    # An event is its line plus its encoded headers: 4 (count) + 8 (lengths) + the UTF-8 key and value.
    [(None, 96), ("k=v", 86), ("key=ü", 83)],
)
def test_put_line_limit_is_exactly_the_librarys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], header: str | None, fits: int
) -> None:
    d = str(tmp_path / "ch")
    hdr = ["--header", header] if header else []
    code, _, err = run_cli(capsys, "put", d, "--max-event-size", "100", *hdr, stdin=b"a" * fits + b"\n")
    assert (code, err) == (0, f"put 1 events (created the new channel {d})\n")
    code, _, err = run_cli(capsys, "put", d, "--max-event-size", "100", *hdr, stdin=b"b" * (fits + 1) + b"\nc\n")
    assert code == 2
    assert "line 1: an event of 101 bytes" in one_error_line(err)
    assert bodies(d) == [b"a" * fits]


class _Unread:
    """A stdin that fails the test if anything reads it."""

    @property
    def buffer(self) -> Any:
        raise AssertionError("stdin was read")


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--batch", "20000"], ["--batch 20000", "transaction capacity 10000", "--transaction-capacity"]),
        (["--batch", "60", "--transaction-capacity", "50"], ["--batch 60", "transaction capacity 50"]),
    ],
)
def test_put_batch_above_transaction_capacity_is_refused_before_reading_input(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    words: list[str],
) -> None:
    d = tmp_path / "ch"
    monkeypatch.setattr(sys, "stdin", _Unread())
    code, _, err = run_cli(capsys, "put", str(d), *argv)
    assert code == 2
    line = one_error_line(err)
    for w in words:
        assert w in line
    assert not d.exists()  # refused before the channel was created


def test_put_batch_equal_to_transaction_capacity_is_fine(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = str(tmp_path / "ch")
    stdin = b"".join(b"%d\n" % i for i in range(7))
    code, _, err = run_cli(capsys, "put", d, "--batch", "3", "--transaction-capacity", "3", stdin=stdin)
    assert (code, err) == (0, f"put 7 events (created the new channel {d})\n")
    assert bodies(d) == [b"%d" % i for i in range(7)]


def test_cli_options_reach_the_channel(
    filled: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[filechannel.ChannelConfig] = []
    real = cli.FileChannel

    def spy(directory: str, config: filechannel.ChannelConfig, **kw: Any) -> filechannel.FileChannel:
        seen.append(config)
        return real(directory, config, **kw)

    monkeypatch.setattr(cli, "FileChannel", spy)
    argv = ["--capacity", "500", "--transaction-capacity", "40", "--max-event-size", "2000", "--fsync", "interval"]
    code, _, _ = run_cli(capsys, "put", str(tmp_path / "c2"), *argv, "--batch", "40", stdin=b"x\n")
    assert code == 0
    c = seen[-1]
    assert (c.capacity, c.transaction_capacity, c.max_event_size, c.fsync) == (500, 40, 2000, "interval")
    code, _, _ = run_cli(capsys, "take", filled, "--transaction-capacity", "2", "--on-corruption", "skip", "-n", "5")
    assert code == 0
    c = seen[-1]
    assert (c.transaction_capacity, c.on_corruption, c.capacity) == (2, "skip", 1_000_000)
    code, _, _ = run_cli(capsys, "take", filled, "--transaction-capacity", "2000000")
    assert code == 0
    assert (seen[-1].transaction_capacity, seen[-1].capacity) == (2_000_000, 2_000_000)
    code, _, _ = run_cli(capsys, "checkpoint", filled, "--on-corruption", "skip")
    assert code == 0
    assert seen[-1].on_corruption == "skip"


def test_take_uses_transactions_of_transaction_capacity(filled: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "take", filled, "-n", "5", "--transaction-capacity", "2")
    assert (code, out.splitlines()) == (0, ["one", "two", "three", "\udcff\udcfe", "five"])  # bytes as they are
    code, out, _ = run_cli(capsys, "dump", filled)
    takes = [json.loads(r)["positions"] for r in out.splitlines() if json.loads(r)["op"] == "take"]
    assert takes == [[[0, 2]], [[2, 4]], [[4, 5]]]


BAD_VALUES: list[tuple[list[str], str]] = [
    (["put", "{new}", "--max-event-size", "0"], "--max-event-size 0"),
    (["put", "{new}", "--max-event-size", "-1"], "--max-event-size -1"),
    (["put", "{new}", "--max-event-size", str(1 << 40)], "--max-event-size"),
    (["put", "{new}", "--max-event-size", "8MiB"], "--max-event-size"),
    (["put", "{new}", "--capacity", "0"], "--capacity 0"),
    (["put", "{new}", "--capacity", "many"], "--capacity"),
    (["put", "{new}", "--transaction-capacity", "0"], "--transaction-capacity 0"),
    (["put", "{new}", "--transaction-capacity", "2000000"], "exceeds capacity=1000000"),
    (["put", "{new}", "--capacity", "10", "--transaction-capacity", "20", "--batch", "5"], "--transaction-capacity 20"),
    (["put", "{new}", "--batch", "0"], "--batch"),
    (["put", "{new}", "--header", "k=\udcff"], "not valid UTF-8"),
    (["put", "{new}", "--header", "\ud800=v"], "not valid UTF-8"),
    (["take", "{chan}", "--on-corruption", "ignore"], "--on-corruption"),
    (["take", "{chan}", "--transaction-capacity", "0"], "--transaction-capacity 0"),
    (["take", "{chan}", "--wait", "-1"], "--wait"),
    (["take", "{chan}", "--wait", "nan"], "--wait"),
    (["take", "{chan}", "-n", "-3"], "-n must be positive"),
    (["checkpoint", "{chan}", "--on-corruption", "sometimes"], "--on-corruption"),
]


@pytest.mark.parametrize(("argv", "words"), BAD_VALUES, ids=[" ".join(a[2:]) for a, _ in BAD_VALUES])
def test_bad_option_values_are_one_line_exit_2(
    filled: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], words: str
) -> None:
    new = tmp_path / "new"
    args = [a.format(new=new, chan=filled) for a in argv]
    code, _, err = run_cli(capsys, *args, stdin=b"x\n")
    assert code == 2
    assert words in one_error_line(err)
    assert not new.exists()  # refused before anything touched the disk
    assert len(bodies(filled)) == 5  # a refused take took nothing


@pytest.mark.parametrize("command", ["take", "stat", "verify", "dump", "checkpoint"])
def test_regular_file_and_missing_path_are_named_as_such(
    command: str, paths: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_cli(capsys, command, paths["file"])
    assert code == 2
    line = one_error_line(err)
    assert f"{paths['file']} is not a filechannel directory: it is a file" in line
    assert "no such" not in line
    code, _, err = run_cli(capsys, command, paths["missing"])
    assert code == 2
    line = one_error_line(err)
    assert f"{paths['missing']}: no such channel directory" in line
    assert "filechannel put" in line  # how to create one
    assert not os.path.exists(paths["missing"])


def test_put_to_a_regular_file_says_it_is_a_file(paths: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "put", paths["file"], stdin=b"x\n")
    assert code == 2
    assert "it is a file" in one_error_line(err)


class _LinesThenInterrupt:
    """A stdin that yields ``n`` lines, then raises KeyboardInterrupt as Ctrl-C would mid-read."""

    def __init__(self, n: int) -> None:
        self.n = n

    @property
    def buffer(self) -> Any:
        def gen() -> Any:
            for i in range(self.n):
                yield b"%d\n" % i
            raise KeyboardInterrupt

        return gen()


def test_put_interrupted_reports_exactly_what_was_committed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    d = str(tmp_path / "ch")
    monkeypatch.setattr(sys, "stdin", _LinesThenInterrupt(7))
    code, _, err = run_cli(capsys, "put", d, "--batch", "3")
    assert code == 130
    assert err == (
        "filechannel: interrupted: 6 events committed (the first 6 lines); "
        "the batch in progress (1 lines) was rolled back\n"
    )
    assert bodies(d) == [b"%d" % i for i in range(6)]


def test_sigint_during_a_commit_is_held_until_the_commit_is_counted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    d = str(tmp_path / "ch")
    real = cli._put_batch
    signalled: list[int] = []

    def commit_then_sigint(ch: filechannel.FileChannel, batch: list[bytes], headers: dict[str, str]) -> int:
        n = real(ch, batch, headers)
        if n and not signalled:
            signalled.append(n)
            signal.raise_signal(signal.SIGINT)  # Ctrl-C lands just after the commit, before it is counted
        return n

    monkeypatch.setattr(cli, "_put_batch", commit_then_sigint)
    # Python's KeyboardInterrupt handler, as at a terminal: pytest started from a background
    # job inherits SIGINT ignored, and Ctrl-C would then do nothing at all.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        code, _, err = run_cli(capsys, "put", d, "--batch", "3", stdin=b"".join(b"%d\n" % i for i in range(10)))
    finally:
        signal.signal(signal.SIGINT, previous)
    assert code == 130
    assert err.startswith("filechannel: interrupted: 3 events committed (the first 3 lines)"), err
    assert bodies(d) == [b"0", b"1", b"2"]


def test_put_error_mid_stream_says_how_many_lines_were_committed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    d = str(tmp_path / "ch")
    real = cli.ChannelConfig.from_options
    monkeypatch.setattr(cli.ChannelConfig, "from_options", lambda o: real({**o, "keep_alive": 0}))
    stdin = b"".join(b"%d\n" % i for i in range(8))
    code, _, err = run_cli(
        capsys, "put", d, "--capacity", "5", "--transaction-capacity", "3", "--batch", "3", stdin=stdin
    )
    assert code == 2
    line = one_error_line(err)
    assert "channel is full" in line
    assert "the first 3 lines were committed; the 3 lines of the batch in progress were not" in line
    assert bodies(d) == [b"0", b"1", b"2"]


class _InterruptingStdout(io.StringIO):
    """A stdout whose ``n``-th write raises KeyboardInterrupt (Ctrl-C while printing)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.writes = 0
        self.n = n

    def write(self, s: str) -> int:
        self.writes += 1
        if self.writes == self.n:
            raise KeyboardInterrupt
        return super().write(s)


def test_take_interrupted_reports_what_was_committed_and_rolls_back_the_rest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    d = str(tmp_path / "ch")
    with filechannel.open(d, minimum_required_space=0) as ch, ch.transaction() as tx:
        tx.put_many([b"%d" % i for i in range(10)])
    out = _InterruptingStdout(6)  # batches of 4: 0-3 committed; 4 printed, 5 interrupted
    monkeypatch.setattr(sys, "stdout", out)
    code, _, err = run_cli(capsys, "take", d, "-n", "10", "--transaction-capacity", "4")
    assert code == 130
    assert err == (
        "filechannel: interrupted: 4 events taken and committed; the batch in progress was rolled back "
        "(1 of its events were printed and stay in the channel)\n"
    )
    assert out.getvalue() == "0\n1\n2\n3\n4\n"
    assert bodies(d) == [b"%d" % i for i in range(4, 10)]  # 4 is printed but not lost


def test_take_on_corruption_skip_reports_each_loss(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = str(tmp_path / "ch")
    with filechannel.open(d, max_file_size=4096, minimum_required_space=0) as ch:
        for i in range(15):
            with ch.transaction() as tx:
                tx.put(b"%02d" % i + b"v" * 600)
    files = sorted(n for n in os.listdir(os.path.join(d, "data")) if n.endswith(".wal"))
    path = os.path.join(d, "data", files[0])
    with open(path, "rb") as f:
        h = fmt.decode_file_header(f.read(4096))
    assert isinstance(h, fmt.FileHeader)
    with open(path, "r+b") as f:
        f.seek(h.header_len + 50)  # inside the first event's record
        f.write(b"\x00\x01\x02")
    code, out, err = run_cli(capsys, "take", d, "-n", "20")
    assert (code, out) == (2, "")
    line = one_error_line(err)
    assert path in line
    assert "--on-corruption skip" in line  # the remedy, as a command-line user types it
    code, out, err = run_cli(capsys, "take", d, "-n", "20", "--on-corruption", "skip")
    assert code == 0
    got = [b[:2] for b in out.splitlines()]
    assert "00" not in got
    assert len(got) >= 1
    warnings = [w for w in err.splitlines() if w.startswith("filechannel: warning:")]
    assert warnings, err
    assert any(path in w and "lost positions 0" in w for w in warnings), err


def _sigint_as_at_a_terminal() -> None:
    """In the child before exec: SIGINT's default disposition (a background job's pytest passes it on ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_sigint_during_put_prints_an_exact_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = str(tmp_path / "ch")
    proc = subprocess.Popen(
        cli_command("put", d, "--batch", "10"),
        stdin=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=_sigint_as_at_a_terminal,
    )
    assert proc.stdin is not None
    assert proc.stderr is not None
    try:
        proc.stdin.write(b"".join(b"%d\n" % i for i in range(25)))  # two batches commit, 5 lines wait
        proc.stdin.flush()
        deadline = time.monotonic() + 30
        queued = -1
        while queued != 20:
            assert time.monotonic() < deadline, f"the child never committed 20 events (saw {queued})"
            time.sleep(0.05)
            if os.path.exists(os.path.join(d, "CHANNEL")):
                code, out, _ = run_cli(capsys, "stat", d, "--json")
                if code == 0:
                    queued = json.loads(out)["queue_size"]
        time.sleep(0.3)  # let the child read the 5 lines and block on the open pipe
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=30)
        err = proc.stderr.read().decode()
    finally:
        proc.stdin.close()
        if proc.poll() is None:  # pragma: no cover - only if the test failed
            proc.kill()
        proc.stderr.close()
    assert code == 130, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    m = re.fullmatch(
        r"filechannel: interrupted: (\d+) events committed \(the first \1 lines\); "
        r"the batch in progress \((\d+) lines\) was rolled back",
        lines[0],
    )
    assert m, err
    assert int(m.group(1)) == 20
    assert int(m.group(2)) <= 5
    assert bodies(d) == [b"%d" % i for i in range(20)]  # exactly what the summary claims


def _flip_body(chan: str, needle: bytes) -> None:
    data = os.path.join(chan, "data")
    path = os.path.join(data, sorted(n for n in os.listdir(data) if n.endswith(".wal"))[0])
    raw = bytearray(Path(path).read_bytes())
    i = raw.find(needle, 200)
    assert i > 0
    raw[i] ^= 0x01
    Path(path).write_bytes(bytes(raw))


def test_verify_lists_lost_positions_and_salvages_the_rest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    chan, dest = str(tmp_path / "ch"), str(tmp_path / "salvaged")
    lines = b"".join(b"line-%04d\n" % i for i in range(300))
    assert run_cli(capsys, "put", chan, "--batch", "100", stdin=lines)[0] == 0
    _flip_body(chan, b"line-0149")
    code, out, _err = run_cli(capsys, "verify", chan, "--salvage", dest)
    assert code == 1
    assert "lost positions: 149 (1 events)" in out
    assert "salvaged 299 intact events" in out
    with filechannel.open(dest, minimum_required_space=0) as ch:
        tx = ch.transaction()
        got = [e.body for e in tx.take_batch(1000)]
        tx.rollback()
    assert got == [b"line-%04d" % i for i in range(300) if i != 149]
    # A skip-mode take drops exactly what verify called lost.
    code, out, _ = run_cli(capsys, "take", chan, "-n", "1000", "--on-corruption", "skip")
    assert code == 0
    assert out.splitlines() == [f"line-{i:04d}" for i in range(300) if i != 149]
    # the destination of a salvage must be new or empty
    code, _, err = run_cli(capsys, "verify", chan, "--salvage", dest)
    assert code == 2
    assert "new or empty" in err


def test_verify_and_stat_of_a_moved_channel_see_every_event(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = str(tmp_path / "m1"), str(tmp_path / "m2")
    assert run_cli(capsys, "put", a, stdin=b"".join(b"%d\n" % i for i in range(10)))[0] == 0
    os.rename(a, b)
    code, out, _ = run_cli(capsys, "verify", b)
    assert code == 0
    assert "ok, 10 events queued" in out
    code, out, _ = run_cli(capsys, "stat", b, "--json")
    assert json.loads(out)["queue_size"] == 10
    assert not os.path.exists(a)


def test_verify_reports_a_damaged_sole_checkpoint(filled: str, capsys: pytest.CaptureFixture[str]) -> None:
    ckdir = os.path.join(filled, "checkpoints")
    (ck,) = [n for n in os.listdir(ckdir) if n.endswith(".ckpt")]
    raw = bytearray(Path(ckdir, ck).read_bytes())
    raw[-10] ^= 0xFF
    Path(ckdir, ck).write_bytes(bytes(raw))
    code, out, _ = run_cli(capsys, "verify", filled)
    assert code == 1
    assert f"latent: checkpoint {os.path.join(ckdir, ck)}" in out
    assert "checksum mismatch" in out
