"""The command line as a user runs it (subprocesses): output scripts can trust, hints that point the right way.

Issue 27: unambiguous bodies, JSON from every verb that reports, one shape for
consumers, ISO times, the lock holder, -v/--log-level, a notice when put creates a
channel, no stray LOCK after a refused open.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import filechannel
from filechannel.consumers import ConsumerStore

TRICKY = [b"base64:gIE=", b"\x80\x81"]  # the text that looked like bytes, and the bytes


def fc(*argv: str, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, "-m", "filechannel", *argv], input=stdin, capture_output=True, timeout=60, env=env
    )


def one_line(err: bytes) -> str:
    lines = err.decode().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.fixture
def tricky(tmp_path: Path) -> str:
    d = str(tmp_path / "ch")
    with filechannel.open(d, minimum_required_space=0) as ch, ch.transaction() as tx:
        tx.put_many(TRICKY)
    return d


def test_take_json_tells_text_from_bytes(tricky: str) -> None:
    r = fc("take", tricky, "-n", "2", "--json")
    assert r.returncode == 0, r.stderr
    recs = [json.loads(line) for line in r.stdout.splitlines()]
    assert [(x["body"], x["body_encoding"]) for x in recs] == [("base64:gIE=", "utf-8"), ("gIE=", "base64")]


def test_take_prints_the_bytes_as_put_read_them(tricky: str, tmp_path: Path) -> None:
    r = fc("take", tricky, "-n", "2")
    assert r.returncode == 0, r.stderr
    assert r.stdout == b"base64:gIE=\n\x80\x81\n"
    # take undoes put: the output put back gives the same events.
    d2 = str(tmp_path / "again")
    assert fc("put", d2, stdin=r.stdout).returncode == 0
    with filechannel.open(d2, minimum_required_space=0) as ch, ch.transaction() as tx:
        assert [e.body for e in tx.take_batch(2)] == TRICKY


def test_dump_bodies_tells_text_from_bytes(tricky: str) -> None:
    r = fc("dump", tricky, "--bodies")
    assert r.returncode == 0, r.stderr
    puts = [json.loads(line) for line in r.stdout.splitlines() if json.loads(line)["op"] == "put"]
    assert [(p["body"], p["body_encoding"]) for p in puts] == [("base64:gIE=", "utf-8"), ("gIE=", "base64")]


def test_wal_dump_data_tells_text_from_bytes(tmp_path: Path) -> None:
    d = str(tmp_path / "wal")
    with filechannel.WriteAheadLog(d) as w:
        w.write_many(TRICKY)
    r = fc("wal", "dump", d, "--data")
    assert r.returncode == 0, r.stderr
    recs = [json.loads(line) for line in r.stdout.splitlines() if json.loads(line)["kind"] == "record"]
    assert [(x["data"], x["data_encoding"]) for x in recs] == [("base64:gIE=", "utf-8"), ("gIE=", "base64")]


def test_put_json_and_the_notice_of_a_new_channel(tmp_path: Path) -> None:
    d = str(tmp_path / "typo")
    r = fc("put", d, stdin=b"a\nb\n")
    assert r.returncode == 0
    assert one_line(r.stderr) == f"put 2 events (created the new channel {d})"
    r = fc("put", d, stdin=b"c\n")
    assert one_line(r.stderr) == "put 1 events"  # an existing channel: no notice
    r = fc("put", d, "--json", stdin=b"d\n")
    assert (r.returncode, r.stderr) == (0, b"")
    assert json.loads(r.stdout) == {"directory": d, "created": False, "events": 1}
    d2 = str(tmp_path / "new")
    assert json.loads(fc("put", d2, "--json", stdin=b"x\n").stdout) == {"directory": d2, "created": True, "events": 1}


def test_verify_json(tricky: str, tmp_path: Path) -> None:
    r = fc("verify", tricky, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert (out["ok"], out["events_queued"], out["problems"], out["lost_positions"]) == (True, 2, [], [])
    seg = sorted((Path(tricky) / "data").glob("seg-*.wal"))[0]
    b = bytearray(seg.read_bytes())
    b[len(b) // 2 if len(b) < 4096 else 200] ^= 0xFF
    seg.write_bytes(bytes(b))
    dest = str(tmp_path / "salvaged")
    r = fc("verify", tricky, "--json", "--salvage", dest)
    out = json.loads(r.stdout)
    assert r.returncode == (0 if out["ok"] else 1)
    assert out["salvage_dir"] == dest
    assert isinstance(out["salvaged"], int)


def test_consumers_in_one_shape_and_json_with_remove(tricky: str) -> None:
    r = fc("consumers", tricky, "--json")
    out = json.loads(r.stdout)
    assert out == {"directory": tricky, "next_position": 2, "consumers": []}  # no null noise
    store = ConsumerStore(filechannel._fs.DEFAULT_FS, tricky)
    store.register("q", "job-1", 0)
    store.ack("q", "job-1", 1)
    listed = json.loads(fc("consumers", tricky, "--json").stdout)["consumers"]
    stat = json.loads(fc("stat", tricky, "--json").stdout)["consumers"]
    assert listed == stat
    (c,) = listed
    assert (c["name"], c["acked"], c["identity"], c["lag_events"]) == ("q", 1, "job-1", 1)
    assert set(c) == {"name", "acked", "identity", "registered_ns", "lag_events", "lag_bytes", "oldest_file"}
    r = fc("consumers", tricky, "--remove", "q", "--json")
    assert r.returncode == 0
    assert json.loads(r.stdout) == {"directory": tricky, "removed": "q", "acked": 1}


def test_stat_prints_last_open_time_as_iso_8601(tricky: str) -> None:
    text = fc("stat", tricky).stdout.decode()
    block = text.split("last_open:", 1)[1]
    time_line = next(line for line in block.splitlines() if line.strip().startswith("time:"))
    value = time_line.split("time:", 1)[1].strip()
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00", value), value
    last = json.loads(fc("stat", tricky, "--json").stdout)["last_open"]
    assert isinstance(last["time"], float)  # the epoch is kept in JSON
    assert last["time_iso"] == value


def test_hints_point_the_right_way(tricky: str, tmp_path: Path) -> None:
    # put --capacity 10: the flag given is blamed, not the default it collides with.
    line = one_line(fc("put", str(tmp_path / "c"), "--capacity", "10", stdin=b"a\n").stderr)
    assert line.startswith("filechannel: error: --capacity 10:")
    assert "transaction_capacity" not in line
    # --header =v: refused, one line.
    r = fc("put", tricky, "--header", "=v", stdin=b"a\n")
    assert r.returncode == 2
    assert "key is empty" in one_line(r.stderr)
    # A channel given to the WAL tools, and a WAL given to the channel tools.
    wal = str(tmp_path / "wal")
    filechannel.WriteAheadLog(wal).close()
    line = one_line(fc("wal", "dump", tricky).stderr)
    assert f"{tricky} is not a write-ahead log: it is a channel" in line
    line = one_line(fc("stat", wal).stderr)
    assert "it is a write-ahead log" in line
    assert "filechannel wal dump" in line
    # keygen DIR and --keystore DIR say "is a directory".
    assert "is a directory" in one_line(fc("keygen", str(tmp_path)).stderr)
    assert "is a directory" in one_line(fc("stat", tricky, "--keystore", str(tmp_path)).stderr)


def test_dump_bodies_without_a_key_suggests_keystore(tmp_path: Path) -> None:
    pytest.importorskip("cryptography", reason="the crypto extra is not installed")
    ks = str(tmp_path / "keys.json")
    assert fc("keygen", ks).returncode == 0
    d = str(tmp_path / "enc")
    assert fc("put", d, "--keystore", ks, stdin=b"secret\n").returncode == 0
    r = fc("dump", d, "--bodies")
    line = one_line(r.stderr)
    assert r.returncode == 2
    assert "--keystore" in line
    assert "on_corruption" not in line
    assert fc("dump", d).returncode == 0  # without --bodies no key is needed


def test_verbose_and_log_level_show_the_library_log(tricky: str) -> None:
    quiet = fc("take", tricky)
    assert b"info:" not in quiet.stderr
    for flags in (["-v"], ["--log-level", "info"], ["--log-level", "DEBUG"]):
        r = fc(*flags, "take", tricky, "-n", "1", "--wait", "0")
        assert r.returncode == 0, r.stderr
        assert b"filechannel: info: opened" in r.stderr, (flags, r.stderr)
    assert b"filechannel: debug:" not in fc("-v", "stat", tricky).stderr
    r = fc("--log-level", "loud", "stat", tricky)
    assert r.returncode == 2
    assert "invalid choice" in one_line(r.stderr)


def test_already_open_names_the_lock_holder(tricky: str) -> None:
    with filechannel.open(tricky, minimum_required_space=0):
        r = fc("take", tricky)
    line = one_line(r.stderr)
    assert r.returncode == 2
    assert re.search(rf"held by pid {os.getpid()} on host \S+ since \d{{4}}-\d\d-\d\dT", line), line


def test_a_refused_open_leaves_no_lock_behind(tmp_path: Path) -> None:
    d = tmp_path / "photos"
    d.mkdir(mode=0o700)
    (d / "cat.jpg").write_bytes(b"meow")
    r = fc("put", str(d), stdin=b"a\n")
    assert r.returncode == 2
    assert "no CHANNEL file" in one_line(r.stderr)
    assert sorted(os.listdir(d)) == ["cat.jpg"]


def _serve_log(tmp_path: Path, *flags: str, pre: tuple[str, ...] = ()) -> tuple[int, str]:
    """Run ``serve`` until it listens, stop it with SIGTERM; return its exit status and stderr."""
    import signal
    import time

    d = str(tmp_path / "served")
    if not os.path.exists(d):
        filechannel.open(d, minimum_required_space=0).close()
    port = tmp_path / "port"
    if port.exists():
        port.unlink()
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    argv = [*pre, "serve", d, "--listen", "grpc://127.0.0.1:0", "--port-file", str(port), *flags]
    proc = subprocess.Popen([sys.executable, "-m", "filechannel", *argv], env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not port.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, err


@pytest.mark.parametrize("level", ["info", "INFO", "Info"])
def test_serve_log_level_is_case_insensitive_and_logs_each_line_once(tmp_path: Path, level: str) -> None:
    rc, err = _serve_log(tmp_path, "--log-level", level)
    assert rc == 0, err
    serving = [line for line in err.splitlines() if "serving 1 channel(s)" in line]
    assert len(serving) == 1, err  # one handler, not the global one as well


def test_serve_log_level_warning_hides_info_and_a_bad_level_is_one_line(tmp_path: Path) -> None:
    rc, err = _serve_log(tmp_path, "--log-level", "WARNING")
    assert rc == 0, err
    assert "serving" not in err
    rc, err = _serve_log(tmp_path, "--log-level", "loud")
    assert rc == 2
    assert len(err.strip().splitlines()) == 1
    assert "invalid choice: 'loud'" in err
    assert "'debug', 'info', 'warning', 'error'" in err  # the same spelling as the global option


def test_the_global_log_level_reaches_serve(tmp_path: Path) -> None:
    rc, err = _serve_log(tmp_path, pre=("--log-level", "error"))  # not undone by serve's own default
    assert rc == 0, err
    assert "serving" not in err
    rc, err = _serve_log(tmp_path, pre=("-v",))
    assert rc == 0
    assert "serving" in err


def _help(*command: str) -> str:
    r = fc(*command, "--help")
    assert r.returncode == 0, r.stderr
    return " ".join(r.stdout.decode().split())  # argparse wraps lines


@pytest.mark.parametrize(
    ("command", "one"),
    [
        (("stat",), None),
        (("keygen",), None),
        (("peek",), None),
        (("consumers",), None),
        (("serve",), None),
        (("put",), None),
        (("take",), "1 when its output closed early"),
        (("verify",), "1 when it finds problems"),
        (("wal", "verify"), "1 when it finds problems"),
    ],
)
def test_each_command_states_only_its_own_exit_statuses(command: tuple[str, ...], one: str | None) -> None:
    text = _help(*command)
    epilog = text.split("Exit status:", 1)[1]
    assert text.count("Exit status:") == 1
    assert "0 on success" in epilog
    assert "2 on bad input" in epilog
    if one is None:
        assert " 1 " not in epilog, epilog
    else:
        assert one in epilog, epilog
    for phrase in ("take's output", "verify finds"):  # another command's status
        assert phrase not in epilog, (command, epilog)
    if command == ("serve",):
        assert "0 also when stopped by SIGTERM or SIGINT" in epilog
        assert "130" not in epilog


@pytest.mark.parametrize("command", ["stat", "peek", "dump", "verify", "consumers"])
def test_keystore_help_of_a_read_only_command_says_nothing_of_new_files(command: str) -> None:
    text = _help(command)
    assert "--keystore PATH" in text
    assert "encrypts new data files" not in text


def test_metavars_are_one_style_and_the_summary_of_consumers_mentions_reset() -> None:
    assert "--batch N" in _help("put")
    assert "-n N" in _help("take")
    assert "--wait SECONDS" in _help("take")
    assert "-n N" in _help("peek")
    top = _help()
    consumers = top.split("consumers", 1)[1].split("checkpoint", 1)[0]
    assert "reset" in consumers
