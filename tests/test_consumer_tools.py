"""What a Kafka user looks for: peek, resetting a consumer's position, and a blocking poll."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from helpers import run_module

import filechannel

OPTS = {"minimum_required_space": 0, "background": False, "checkpoint_interval": 0}


def filled(tmp_path: Path, n: int = 10) -> str:
    d = str(tmp_path / "ch")
    with filechannel.open(d, **OPTS) as ch, ch.transaction() as tx:
        for i in range(n):
            tx.put(b"e%d" % i)
    return d


def test_peek_prints_without_taking(tmp_path: Path) -> None:
    d = filled(tmp_path)
    r = run_module("peek", d, "-n", "3")
    assert (r.returncode, r.stdout) == (0, "e0\ne1\ne2\n")
    r = run_module("peek", d, "-n", "2", "--start", "8", "--json")
    recs = [json.loads(x) for x in r.stdout.splitlines()]
    assert [(x["position"], x["body"]) for x in recs] == [(8, "e8"), (9, "e9")]
    with filechannel.open(d, **OPTS) as ch:
        assert ch.size == 10  # nothing taken
    r = run_module("peek", d, "--start", "11")
    assert r.returncode == 2
    assert "holds positions 0 to 10" in r.stderr


def test_reset_a_consumer_like_kafka(tmp_path: Path) -> None:
    d = filled(tmp_path)
    with filechannel.ChannelReader(d, "r1") as r:
        r.ack(6)
    r = run_module("consumers", d, "--reset", "r1", "--to-earliest", "--dry-run", "--json")
    assert json.loads(r.stdout) == {"directory": d, "consumer": "r1", "from": 6, "to": 0, "dry_run": True}
    assert filechannel.ChannelReader(d, "r1").acked == 6  # a dry run changes nothing
    r = run_module("consumers", d, "--reset", "r1", "--to-position", "3")
    assert r.returncode == 0, r.stderr
    with filechannel.ChannelReader(d, "r1") as rd:
        assert rd.acked == 3
        assert [e.body for e in rd.read(*rd.available())] == [b"e%d" % i for i in range(3, 10)]
    r = run_module("consumers", d, "--reset", "r1", "--to-latest")
    assert filechannel.ChannelReader(d, "r1").acked == 10
    for argv, msg in (
        (["--reset", "r1", "--to-position", "11"], "holds positions 0 to 10"),
        (["--reset", "r1"], "exactly one of"),
        (["--reset", "r1", "--to-earliest", "--to-latest"], "exactly one of"),
        (["--reset", "nobody", "--to-latest"], "no consumer named 'nobody'"),
        (["--to-latest"], "go with --reset NAME"),
    ):
        r = run_module("consumers", d, *argv)
        assert r.returncode == 2, argv
        assert msg in r.stderr, (argv, r.stderr)


def test_reset_of_an_encrypted_channel_needs_the_keystore(tmp_path: Path) -> None:
    pytest.importorskip("cryptography")
    ks = tmp_path / "keys.json"
    assert run_module("keygen", str(ks)).returncode == 0
    d = str(tmp_path / "ch")
    enc = filechannel.Encryption(keys=str(ks))
    with filechannel.open(d, encryption=enc, **OPTS) as ch, ch.transaction() as tx:
        tx.put_many([b"a", b"b", b"c"])
    with filechannel.ChannelReader(d, "r1", encryption=enc) as r:
        r.ack(2)
    r = run_module("consumers", d, "--reset", "r1", "--to-earliest")
    assert r.returncode == 2
    assert "--keystore" in r.stderr
    r = run_module("consumers", d, "--reset", "r1", "--to-earliest", "--keystore", str(ks))
    assert r.returncode == 0, r.stderr
    with filechannel.ChannelReader(d, "r1", encryption=enc) as rd:
        assert rd.acked == 0  # the reset ack carries a valid MAC


def test_poll_waits_for_new_events_and_goes_on_after_the_last(tmp_path: Path) -> None:
    d = filled(tmp_path, 3)
    with filechannel.ChannelReader(d, "r1") as r:
        assert [e.body for e in r.poll(2)] == [b"e0", b"e1"]
        assert [e.body for e in r.poll(10)] == [b"e2"]
        t0 = time.monotonic()
        assert r.poll(10, timeout=0.2) == []
        assert time.monotonic() - t0 >= 0.2

        def later() -> None:
            time.sleep(0.3)
            with filechannel.open(d, **OPTS) as ch, ch.transaction() as tx:
                tx.put(b"late")

        th = threading.Thread(target=later)
        th.start()
        try:
            got = r.poll(10, timeout=10)
        finally:
            th.join()
        assert [e.body for e in got] == [b"late"]
        r.ack(got[-1].position + 1)  # type: ignore[operator]
    with filechannel.ChannelReader(d, "r1") as r2:
        assert r2.poll(10) == []  # a new reader starts at the mark: everything was acknowledged
    with pytest.raises(ValueError, match="max_events"):
        filechannel.ChannelReader(d).poll(0)
    with pytest.raises(ValueError, match="timeout"):
        filechannel.ChannelReader(d).poll(1, timeout=-1)


def test_a_long_open_says_which_file_it_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = str(tmp_path / "ch")
    with filechannel.open(d, max_file_size=64 * 1024, **OPTS) as ch:
        for _ in range(6):
            with ch.transaction() as tx:
                tx.put_many([b"x" * 10_000] * 4)
    said: list[str] = []
    with filechannel.FileChannel(d, filechannel.ChannelConfig(minimum_required_space=0), progress=said.append):
        pass
    assert said
    assert all(m.startswith("reading ") for m in said)
    # The CLI's: silent on a fast open, and on anything but a terminal.
    from filechannel.cli import channels as cli

    monkeypatch.setattr(cli.sys.stderr, "isatty", lambda: False)
    assert cli._slow_open_progress() is None
    monkeypatch.setattr(cli.sys.stderr, "isatty", lambda: True)
    printed: list[str] = []
    monkeypatch.setattr("builtins.print", lambda *a, **k: printed.append(" ".join(map(str, a))))
    quick = cli._slow_open_progress(after=60)
    assert quick is not None
    quick("reading f1")
    assert printed == []
    slow = cli._slow_open_progress(after=0)
    assert slow is not None
    slow("reading f1")
    slow("reading f2")
    assert printed[0].startswith("filechannel: the open is recovering")
    assert printed[1:] == ["filechannel: reading f1", "filechannel: reading f2"]


@pytest.mark.parametrize(
    "extra",
    [["--reset", "r1", "--to-latest"], ["--to-latest"], ["--reset", "r1", "--dry-run", "--to-earliest"]],
)
def test_remove_with_reset_options_is_refused_and_changes_nothing(tmp_path: Path, extra: list[str]) -> None:
    d = filled(tmp_path)
    with filechannel.ChannelReader(d, "r1") as r:
        r.ack(4)
    r = run_module("consumers", d, "--remove", "r1", *extra)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "--remove conflicts with" in lines[0]
    assert extra[0] in lines[0]
    assert r.stdout == ""
    assert filechannel.ChannelReader(d, "r1").acked == 4  # neither removed nor reset
