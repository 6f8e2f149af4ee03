"""The tailing source (filechannel/agent/tail.py): exactly-once lines through rotation, truncation and SIGKILL.

Each test drives ``TailSource.poll`` by hand (no thread) and reads back what the
channel holds, body and headers, in order. The kill loop runs the source in a
subprocess that is SIGKILLed again and again while this process appends and
rotates (by rename and by copy-truncate): at the end each line is in the
channel once, in order per file.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import filechannel
from filechannel.agent.tail import TailSource, parse_tail_specs
from filechannel.errors import ConfigError
from filechannel.testing.simfs import SimFS

OPTS: dict[str, Any] = {"minimum_required_space": 0, "background": False, "checkpoint_interval": 0}
ROOT = Path(__file__).resolve().parent.parent


def drain_events(ch: filechannel.FileChannel) -> list[tuple[bytes, dict[str, str]]]:
    out = []
    while True:
        with ch.transaction() as tx:
            evs = tx.take_batch(min(1000, ch.config.transaction_capacity))
        if not evs:
            return out
        out += [(e.body, dict(e.headers)) for e in evs]


def bodies(ch: filechannel.FileChannel) -> list[bytes]:
    return [b for b, _ in drain_events(ch)]


def append(path: Path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)


def lines(prefix: str, a: int, b: int) -> bytes:
    return b"".join(b"%s-%05d\n" % (prefix.encode(), i) for i in range(a, b))


def expect(prefix: str, a: int, b: int) -> list[bytes]:
    return [b"%s-%05d" % (prefix.encode(), i) for i in range(a, b)]


@pytest.fixture
def logdir(tmp_path: Path) -> Path:
    d = tmp_path / "logs"
    d.mkdir()
    return d


def source(ch: filechannel.FileChannel, logdir: Path, pattern: str = "app.log", **kw: Any) -> TailSource:
    kw.setdefault("rotate_grace", 0.0)
    return TailSource(ch, str(logdir / pattern), **kw)


def test_lines_headers_and_resume_from_marks(chan_dir: str, logdir: Path) -> None:
    log = logdir / "app.log"
    append(log, b"one\ntwo\n")
    with filechannel.open(chan_dir, **OPTS) as ch:
        src = source(ch, logdir)
        assert src.drain() == 2
        evs = drain_events(ch)
        assert evs == [
            (b"one", {"file": str(log), "offset": "0"}),
            (b"two", {"file": str(log), "offset": "4"}),
        ]
        (pos,) = src.positions().values()
        assert pos["offset"] == 8
        assert pos["inode"] == log.stat().st_ino
        assert pos["fp_len"] == 8
        src.stop()
    append(log, b"three\n")
    with filechannel.open(chan_dir, **OPTS) as ch:
        src = source(ch, logdir)
        assert src.drain() == 1
        assert drain_events(ch) == [(b"three", {"file": str(log), "offset": "8"})]
        src.stop()


def test_a_partial_last_line_waits_for_its_delimiter(chan_dir: str, logdir: Path) -> None:
    log = logdir / "app.log"
    append(log, b"a\nhalf")
    with filechannel.open(chan_dir, **OPTS) as ch:
        src = source(ch, logdir)
        src.drain()
        assert bodies(ch) == [b"a"]
        append(log, b"-more")
        src.drain()
        assert bodies(ch) == []
        src.stop()
    # a restart in between must not emit it either, nor lose it
    with filechannel.open(chan_dir, **OPTS) as ch:
        src = source(ch, logdir)
        src.drain()
        assert bodies(ch) == []
        append(log, b"-done\nb\n")
        src.drain()
        assert bodies(ch) == [b"half-more-done", b"b"]
        src.stop()


def test_a_custom_delimiter(chan_dir: str, logdir: Path) -> None:
    append(logdir / "app.log", b"x||y||z")
    with filechannel.open(chan_dir, **OPTS) as ch:
        src = source(ch, logdir, delimiter=b"||")
        src.drain()
        assert bodies(ch) == [b"x", b"y"]
        src.stop()


def test_rotation_by_rename_reads_the_old_file_to_its_end_even_across_a_restart(chan_dir: str, logdir: Path) -> None:
    log = logdir / "app.log"
    append(log, lines("a", 0, 10))
    with filechannel.open(chan_dir, **OPTS) as ch:
        src = source(ch, logdir, rotate_grace=60.0)
        src.drain()
        assert bodies(ch) == expect("a", 0, 10)
        # the writer still writes to the renamed file, then a new app.log begins
        append(log, lines("a", 10, 20))
        os.rename(log, logdir / "app.log.1")
        append(logdir / "app.log.1", lines("a", 20, 25))
        append(log, lines("b", 0, 5))
        src.drain()
        got = bodies(ch)
        assert sorted(got) == sorted(expect("a", 10, 25) + expect("b", 0, 5))
        assert [b for b in got if b.startswith(b"a")] == expect("a", 10, 25)
        # the agent stops; more is written to the rotated file, out of the glob: found by its inode
        src.stop()
    append(logdir / "app.log.1", lines("a", 25, 30))
    with filechannel.open(chan_dir, **OPTS) as ch:
        src = source(ch, logdir, rotate_grace=0.0)
        src.drain()
        assert bodies(ch) == expect("a", 25, 30)
        src.drain()  # finished (grace 0): its slot is freed and reused
        assert src.stats()["files_finished"] == 1
        assert len(src.positions()) == 1
        src.stop()


def test_rotation_by_copy_truncate_continues_in_the_copy(
    chan_dir: str, logdir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    log = logdir / "app.log"
    append(log, lines("a", 0, 100))  # more than the 1 KiB fingerprint
    with filechannel.open(chan_dir, **OPTS) as ch:
        src = source(ch, logdir)
        src.drain()
        assert bodies(ch) == expect("a", 0, 100)
        append(log, lines("a", 100, 120))  # not read yet when the rotation happens
        shutil.copyfile(log, logdir / "app.log.1")
        os.truncate(log, 0)
        append(log, lines("b", 0, 3))
        with caplog.at_level(logging.WARNING, "filechannel.agent.tail"):
            src.drain()
        got = bodies(ch)
        assert [b for b in got if b.startswith(b"a")] == expect("a", 100, 120)
        assert [b for b in got if b.startswith(b"b")] == expect("b", 0, 3)
        assert src.stats()["copies_followed"] == 1
        assert src.stats()["lost_bytes"] == 0
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        src.stop()


def test_copy_truncate_with_the_copy_inside_the_glob_is_not_read_twice(chan_dir: str, logdir: Path) -> None:
    log = logdir / "app.log"
    append(log, lines("a", 0, 100))
    with filechannel.open(chan_dir, **OPTS) as ch:
        src = source(ch, logdir, pattern="app.log*", rotate_grace=60.0)
        src.drain()
        assert bodies(ch) == expect("a", 0, 100)
        append(log, lines("a", 100, 110))
        shutil.copyfile(log, logdir / "app.log.1")
        src.drain()  # the copy appears before the truncation: held, not read from 0
        os.truncate(log, 0)
        append(log, lines("b", 0, 3))
        src.drain()
        got = bodies(ch)
        assert sorted(got) == sorted(expect("a", 0, 110)[100:] + expect("b", 0, 3))
        src.stop()
    # after a restart the copy is followed at its end, not read again
    with filechannel.open(chan_dir, **OPTS) as ch:
        src = source(ch, logdir, pattern="app.log*")
        assert src.drain() == 0
        src.stop()


def test_a_copy_of_a_file_with_nothing_put_yet_is_not_read_twice(chan_dir: str, logdir: Path) -> None:
    log = logdir / "app.log"
    append(log, lines("a", 0, 5))
    shutil.copyfile(log, logdir / "app.log.1")  # the copy is there before the original was ever read
    with filechannel.open(chan_dir, **OPTS) as ch:
        src = source(ch, logdir, pattern="app.log*", rotate_grace=60.0)
        src.drain()
        os.truncate(log, 0)
        append(log, lines("b", 0, 2))
        src.drain()
        assert bodies(ch) == expect("a", 0, 5) + expect("b", 0, 2)
        src.stop()


def test_truncation_in_place_restarts_at_zero_and_reports_the_loss(
    chan_dir: str, logdir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    log = logdir / "app.log"
    append(log, lines("a", 0, 5))
    with filechannel.open(chan_dir, **OPTS) as ch:
        src = source(ch, logdir)
        src.drain()
        bodies(ch)
        append(log, b"unread-1\nunread-2\n")
        src._check_files(src._scan())  # the source sees the file grow (size noted) ...
        os.truncate(log, 0)  # ... then it is truncated before those lines are read
        append(log, b"new\n")
        with caplog.at_level(logging.WARNING, "filechannel.agent.tail"):
            src.drain()
        assert bodies(ch) == [b"new"]
        assert src.stats()["truncations"] == 1
        assert src.stats()["lost_bytes"] == len(b"unread-1\nunread-2\n")
        assert any("truncated" in r.getMessage() and "lost" in r.getMessage() for r in caplog.records)
        src.stop()


def test_a_file_rewritten_past_the_offset_is_detected_by_its_fingerprint(chan_dir: str, logdir: Path) -> None:
    log = logdir / "app.log"
    append(log, b"old-1\nold-2\n")
    with filechannel.open(chan_dir, **OPTS) as ch:
        src = source(ch, logdir)
        src.drain()
        bodies(ch)
        with open(log, "r+b") as f:  # same inode, longer, other first bytes
            f.write(b"NEW-1\nNEW-2\nNEW-3\n")
        src.drain()
        assert bodies(ch) == [b"NEW-1", b"NEW-2", b"NEW-3"]
        src.stop()


def test_delete_and_recreate_is_a_new_file_and_the_old_one_is_read_to_its_end(
    chan_dir: str, logdir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    log = logdir / "app.log"
    append(log, lines("a", 0, 3))
    with filechannel.open(chan_dir, **OPTS) as ch:
        src = source(ch, logdir)
        src.drain()
        with open(log, "ab") as w:  # the writer keeps the deleted file open
            w.write(lines("a", 3, 5))
            w.flush()
            os.unlink(log)
            append(log, lines("b", 0, 2))
            w.write(lines("a", 5, 6))
            w.flush()
            src.drain()
        got = bodies(ch)
        assert [b for b in got if b.startswith(b"a")] == expect("a", 0, 6)
        assert [b for b in got if b.startswith(b"b")] == expect("b", 0, 2)
        src.stop()
    # deleted and recreated while the source is down (the inode may be reused): detected, read from 0
    os.unlink(log)
    append(log, lines("c", 0, 4))
    with filechannel.open(chan_dir, **OPTS) as ch:
        # (poll_interval: the wait below outlasts max(rotate_grace, 20 polls, 0.5 s) when the inode is not reused)
        src = source(ch, logdir, poll_interval=0.02)
        with caplog.at_level(logging.WARNING, "filechannel.agent.tail"):
            src.drain()
            time.sleep(0.6)  # a file not found is looked for again for a while before it is called gone
            src.drain()
        assert bodies(ch) == expect("c", 0, 4)
        assert any(r.levelno == logging.WARNING for r in caplog.records)
        src.stop()


def test_a_followed_file_missed_by_a_listing_at_restart_is_resumed_not_read_again(
    chan_dir: str, logdir: Path, tmp_path: Path
) -> None:
    log = logdir / "app.log"
    append(log, lines("a", 0, 10))
    with filechannel.open(chan_dir, **OPTS) as ch:
        src = source(ch, logdir, pattern="app.log*", rotate_grace=60.0)
        src.drain()
        assert bodies(ch) == expect("a", 0, 10)
        src.stop()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.rename(log, elsewhere / "app.log")  # invisible at the restart, as during a rename racing a listing
    with filechannel.open(chan_dir, **OPTS) as ch:
        src = source(ch, logdir, pattern="app.log*", rotate_grace=60.0)
        assert src.drain() == 0
        os.rename(elsewhere / "app.log", logdir / "app.log.1")
        append(logdir / "app.log.1", lines("a", 10, 12))
        src.drain()
        assert bodies(ch) == expect("a", 10, 12)
        src.stop()


def test_a_long_line_is_split_into_pieces_that_join_back(chan_dir: str, logdir: Path) -> None:
    log = logdir / "app.log"
    long = bytes(random.Random(1).choice(b"abcdef") for _ in range(10_000))
    append(log, b"short\n" + long + b"\nafter\n")
    with filechannel.open(chan_dir, max_event_size=1024, **OPTS) as ch:
        src = source(ch, logdir)
        src.drain()
        evs = drain_events(ch)
        assert evs[0] == (b"short", {"file": str(log), "offset": "0"})
        pieces = [e for e in evs[1:-1]]
        assert len(pieces) > 1
        assert all(h["split"] == "6" for _, h in pieces)
        assert b"".join(b for b, _ in pieces) == long
        assert evs[-1] == (b"after", {"file": str(log), "offset": str(6 + len(long) + 1)})
        assert src.stats()["split_lines"] == 1
        src.stop()


def test_batches_are_bounded(chan_dir: str, logdir: Path) -> None:
    append(logdir / "app.log", lines("a", 0, 250))
    with filechannel.open(chan_dir, **OPTS) as ch:
        src = source(ch, logdir, batch_size=100)
        assert [src.poll(), src.poll(), src.poll(), src.poll()] == [100, 100, 50, 0]
        with pytest.raises(ConfigError):
            source(ch, logdir, batch_size=ch.config.transaction_capacity + 1)
        src.stop()


def test_the_thread_stops_after_a_whole_transaction(chan_dir: str, logdir: Path) -> None:
    append(logdir / "app.log", lines("a", 0, 5000))
    with filechannel.open(chan_dir, **OPTS) as ch:
        src = source(ch, logdir, batch_size=50, poll_interval=0.01).start()
        time.sleep(0.05)
        src.stop()
        n = src.stats()["lines"]
        got = bodies(ch)
        assert got == expect("a", 0, n)
        assert (next(iter(src.positions().values()))["offset"]) == n * len(b"a-00000\n")


def test_a_full_channel_is_retried_without_loss(chan_dir: str, logdir: Path) -> None:
    append(logdir / "app.log", lines("a", 0, 14))
    with filechannel.open(chan_dir, capacity=10, transaction_capacity=10, keep_alive=0.0, **OPTS) as ch:
        src = source(ch, logdir, batch_size=4)
        src.drain()
        assert src.stats()["full_retries"] >= 1
        first = bodies(ch)
        src.drain()
        assert first + bodies(ch) == expect("a", 0, 14)
        src.stop()


def test_a_file_name_that_is_not_utf8_is_refused_not_fatal(chan_dir: str, logdir: Path) -> None:
    with open(os.path.join(os.fsencode(logdir), b"bad-\xff.log"), "wb") as f:
        f.write(b"x\n")
    append(logdir / "good.log", b"y\n")
    with filechannel.open(chan_dir, **OPTS) as ch:
        src = source(ch, logdir, pattern="*.log")
        src.drain()
        assert bodies(ch) == [b"y"]
        src.stop()


def test_parse_tail_specs() -> None:
    assert parse_tail_specs(["/l/*.log"], ["c1"]) == {"c1": ["/l/*.log"]}
    assert parse_tail_specs(["c2=/l/*.log", "c1=/m/x"], ["c1", "c2"]) == {"c2": ["/l/*.log"], "c1": ["/m/x"]}
    with pytest.raises(ConfigError):
        parse_tail_specs(["/l/*.log"], ["c1", "c2"])


# -- the kill loop -----------------------------------------------------------------------------------

CHILD = r"""
import sys, time
import filechannel
from filechannel.agent.tail import TailSource
ch = filechannel.open(sys.argv[1], minimum_required_space=0, checkpoint_interval=0)
src = TailSource(ch, sys.argv[2], batch_size=7, poll_interval=0.001, rotate_grace=0.2, read_size=4096)
print("ready", flush=True)
while True:
    src.poll()
    time.sleep(0.001)
"""


def test_sigkill_loop_while_appending_and_rotating_keeps_every_line_once(chan_dir: str, logdir: Path) -> None:
    rng = random.Random(7)
    log = logdir / "app.log"
    # the rotated names stay in the glob: a file that is created and rotated away while the
    # source is down is then still seen (with "app.log" alone it would never be; docs/agents.md)
    pattern = str(logdir / "app.log*")
    filechannel.open(chan_dir, **OPTS).close()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    written: dict[int, int] = {}  # generation -> lines written
    gen, n, rotations, kills = 0, 0, 0, 0

    def write_some() -> None:
        nonlocal n
        k = rng.randint(1, 40)
        # sometimes a partial line, completed by the next write
        data = b"".join(b"g%03d-%06d\n" % (gen, n + i) for i in range(k))
        with open(log, "ab") as f:
            f.write(data)
        n += k
        written[gen] = n

    def rotate() -> None:
        nonlocal gen, n, rotations
        rotations += 1
        if rotations % 2:
            os.rename(log, logdir / f"app.log.{rotations}")
        else:
            shutil.copyfile(log, logdir / f"app.log.{rotations}")
            os.truncate(log, 0)
        gen, n = gen + 1, 0

    deadline = time.monotonic() + 25
    while kills < 25 or time.monotonic() < deadline - 20:
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, chan_dir, pattern], env=env, stdout=subprocess.PIPE, cwd=ROOT
        )
        assert child.stdout is not None
        assert child.stdout.readline() == b"ready\n"
        until = time.monotonic() + rng.uniform(0.05, 0.4)
        while time.monotonic() < until:
            write_some()
            if rng.random() < 0.08:
                rotate()
            time.sleep(rng.uniform(0, 0.01))
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()
        kills += 1
        if time.monotonic() > deadline:
            break
    assert rotations >= 3
    assert kills >= 10
    with filechannel.open(chan_dir, **OPTS) as ch:
        src = TailSource(ch, pattern, rotate_grace=0.0)
        src.drain()
        src.drain()
        got = bodies(ch)
        src.stop()
    per_gen: dict[int, list[int]] = {}
    for b in got:
        g, i = b.split(b"-")
        per_gen.setdefault(int(g[1:]), []).append(int(i))
    assert sorted(per_gen) == sorted(written)
    for g, count in written.items():
        assert per_gen[g] == list(range(count)), f"generation {g}: lines lost, repeated or out of order"


# -- filechannel serve --tail --------------------------------------------------------------------------


def serve_until(chan_dir: str, port_file: Path, n: int, *args: str) -> None:
    """Serve ``chan_dir`` (``filechannel serve`` with ``args``) until it holds ``n`` events, then SIGTERM it: exit 0."""
    from test_agent_process import AgentProcess

    from filechannel.reader import ChannelReader

    agent = AgentProcess([chan_dir], port_file, *args)
    try:
        deadline = time.monotonic() + 30
        while True:
            with ChannelReader(chan_dir) as view:
                if view.available()[1] >= n:
                    break
            assert agent.proc.poll() is None, agent.proc.communicate()[1]
            assert time.monotonic() < deadline, f"the agent put fewer than {n} lines within 30 s"
            time.sleep(0.1)
        agent.proc.send_signal(signal.SIGTERM)
        assert agent.proc.wait(30) == 0
    finally:
        agent.kill()


def test_serve_tail_follows_files_into_the_served_channel(chan_dir: str, logdir: Path, tmp_path: Path) -> None:
    pytest.importorskip("pyarrow.flight")
    filechannel.open(chan_dir, **OPTS).close()
    append(logdir / "app.log", lines("a", 0, 30))
    name = os.path.basename(chan_dir)
    serve_until(chan_dir, tmp_path / "port", 30, "--writable", "--tail", f"{name}={logdir / '*.log'}")
    with filechannel.open(chan_dir, **OPTS) as ch:
        assert bodies(ch) == expect("a", 0, 30)


def test_serve_tail_needs_writable(chan_dir: str) -> None:
    filechannel.open(chan_dir, **OPTS).close()
    r = subprocess.run(
        [sys.executable, "-m", "filechannel", "serve", chan_dir, "--listen", "grpc://127.0.0.1:0", "--tail", "/x/*"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert r.returncode != 0
    assert "--writable" in r.stderr
    assert "Traceback" not in r.stderr


def test_bench_tail_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bench import tail as bench_tail

    assert bench_tail.main(["--lines", "300", "--repeats", "1", "--data-dir", str(tmp_path)]) == 0
    assert "ratio tail/cat" in capsys.readouterr().out


# -- symlinks out of the glob's directory (issue 32 item 2) ---------------------------------------------


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    """A file outside the logs directory that must never become events (a keystore, say)."""
    d = tmp_path / "secrets"
    d.mkdir()
    p = d / "keys.json"
    p.write_bytes(b'{"k": "S3CRET-KEY-MATERIAL"}\n')
    os.chmod(p, 0o600)
    return p


def leaked(ch: filechannel.FileChannel) -> list[bytes]:
    return [b for b in bodies(ch) if b"S3CRET" in b]


def test_a_symlink_out_of_the_glob_directory_is_skipped_with_one_warning(
    chan_dir: str, logdir: Path, secret: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "filechannel.agent.tail")
    append(logdir / "app.log", b"ok\n")
    (logdir / "keys.log").symlink_to(secret)
    with filechannel.open(chan_dir, **OPTS) as ch:
        src = source(ch, logdir, pattern="*.log")
        for _ in range(5):
            src.poll()
        got = bodies(ch)
        assert got == [b"ok"]
        src.stop()
    warnings = [r.getMessage() for r in caplog.records if "keys.log" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert str(logdir / "keys.log") in warnings[0]
    assert str(secret) in warnings[0]
    assert "--tail-follow-symlinks" in warnings[0]
    assert src.stats()["links_refused"] == 1


def test_a_symlinked_directory_out_of_the_glob_directory_is_skipped(
    chan_dir: str, logdir: Path, secret: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "filechannel.agent.tail")
    (logdir / "sub").mkdir()
    append(logdir / "sub" / "app.log", b"ok\n")
    (logdir / "etc").symlink_to(secret.parent, target_is_directory=True)
    with filechannel.open(chan_dir, **OPTS) as ch:
        src = source(ch, logdir, pattern="**/*.json")
        src.drain()
        assert leaked(ch) == []
        src2 = TailSource(
            ch, [str(logdir / "**" / "*.log"), str(logdir / "*" / "keys.json")], name="t2", rotate_grace=0
        )
        src2.drain()
        assert bodies(ch) == [b"ok"]
        src.stop()
        src2.stop()
    assert any(str(logdir / "etc" / "keys.json") in r.getMessage() for r in caplog.records)


def test_a_symlink_inside_the_glob_directory_is_followed(chan_dir: str, logdir: Path) -> None:
    (logdir / "archive").mkdir()
    append(logdir / "archive" / "app-1.txt", b"one\ntwo\n")
    (logdir / "current.log").symlink_to(Path("archive") / "app-1.txt")  # relative, inside
    with filechannel.open(chan_dir, **OPTS) as ch:
        src = source(ch, logdir, pattern="*.log")
        src.drain()
        assert drain_events(ch) == [
            (b"one", {"file": str(logdir / "current.log"), "offset": "0"}),
            (b"two", {"file": str(logdir / "current.log"), "offset": "4"}),
        ]
        src.stop()


def test_follow_symlinks_opts_in_to_links_out_of_the_directory(chan_dir: str, logdir: Path, secret: Path) -> None:
    (logdir / "keys.log").symlink_to(secret)
    with filechannel.open(chan_dir, **OPTS) as ch:
        src = source(ch, logdir, pattern="*.log", follow_symlinks=True)
        src.drain()
        assert len(leaked(ch)) == 1
        src.stop()


def test_a_link_swapped_in_between_the_check_and_the_open_is_refused(
    chan_dir: str, logdir: Path, secret: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The scan sees a regular file; just before it is opened, it becomes a link to the secret.
    caplog.set_level(logging.WARNING, "filechannel.agent.tail")
    log = logdir / "app.log"
    append(log, b"ok\n")
    real_open = os.open
    swapped = []

    def racing_open(path: Any, flags: int, *a: Any, **kw: Any) -> int:
        if os.fspath(path) == str(log) and not swapped:
            swapped.append(1)
            log.unlink()
            log.symlink_to(secret)
        return real_open(path, flags, *a, **kw)

    with filechannel.open(chan_dir, **OPTS) as ch:
        src = source(ch, logdir)
        monkeypatch.setattr(os, "open", racing_open)
        src.poll()
        monkeypatch.setattr(os, "open", real_open)
        assert swapped
        assert leaked(ch) == []
        src.drain()
        assert leaked(ch) == []
        src.stop()
    assert any(str(log) in r.getMessage() and "symlink" in r.getMessage() for r in caplog.records)


def test_a_directory_swapped_for_a_link_between_the_check_and_the_open_is_refused(
    chan_dir: str, logdir: Path, secret: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # O_NOFOLLOW guards only the last component: a directory on the way swapped for a link to the
    # secret's directory is caught by checking what was opened (the glob's directory itself is the
    # operator's choice, and resolved at each scan: /var/log/app may well be a link).
    sub = logdir / "app"
    sub.mkdir()
    (sub / "keys.json").write_bytes(b"ok\n")
    real_open = os.open
    swapped = []

    def racing_open(path: Any, flags: int, *a: Any, **kw: Any) -> int:
        if os.fspath(path) == str(sub / "keys.json") and not swapped:
            swapped.append(1)
            shutil.rmtree(sub)
            sub.symlink_to(secret.parent, target_is_directory=True)
        return real_open(path, flags, *a, **kw)

    with filechannel.open(chan_dir, **OPTS) as ch:
        src = source(ch, logdir, pattern="*/*.json")  # the glob's directory is logdir: app is below it
        monkeypatch.setattr(os, "open", racing_open)
        src.poll()
        monkeypatch.setattr(os, "open", real_open)
        assert swapped
        src.drain()
        assert leaked(ch) == []
        src.stop()


# -- serve --tail on a small channel, and nothing announced before every part started (item 15) ----------


def test_the_batch_follows_a_small_transaction_capacity(chan_dir: str, logdir: Path) -> None:
    append(logdir / "app.log", lines("a", 0, 250))
    with filechannel.open(chan_dir, capacity=1000, transaction_capacity=100, **OPTS) as ch:
        src = source(ch, logdir)
        assert src.batch_size == 100
        assert [src.poll(), src.poll(), src.poll()] == [100, 100, 50]
        src.stop()
    with filechannel.open(chan_dir, **OPTS) as ch:
        assert source(ch, logdir).batch_size == 1000  # the default, below the default capacity (10000)
        assert bodies(ch) == expect("a", 0, 250)


def _serve(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "filechannel", "serve", *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        timeout=timeout,
    )


def test_serve_tail_starts_on_a_channel_with_a_small_transaction_capacity(
    chan_dir: str, logdir: Path, tmp_path: Path
) -> None:
    pytest.importorskip("pyarrow.flight")
    filechannel.open(chan_dir, capacity=1000, transaction_capacity=100, **OPTS).close()
    append(logdir / "app.log", lines("a", 0, 250))
    small = ("--capacity", "1000", "--transaction-capacity", "100")
    serve_until(chan_dir, tmp_path / "port", 250, "--writable", *small, "--tail", str(logdir / "*.log"))
    with filechannel.open(chan_dir, capacity=1000, transaction_capacity=100, **OPTS) as ch:
        assert bodies(ch) == expect("a", 0, 250)


def test_serve_announces_nothing_when_a_tail_source_cannot_start(tmp_path: Path, logdir: Path) -> None:
    pytest.importorskip("pyarrow.flight")
    pytest.importorskip("aiohttp")
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    for d in (a, b):
        filechannel.open(d, **OPTS).close()
    port, hport = tmp_path / "port", tmp_path / "hport"
    # two channels served, and the tail names neither: the tail source cannot start
    r = _serve(
        *(a, b),
        *("--listen", "grpc://127.0.0.1:0", "--port-file", str(port), "--writable"),
        *("--http", "127.0.0.1:0", "--http-port-file", str(hport)),
        *("--tail", f"nosuch={logdir / '*.log'}"),
    )
    assert r.returncode == 2, r.stderr
    said = r.stderr.strip().splitlines()
    assert said[-1].startswith("filechannel: error: --tail: "), r.stderr
    assert "give NAME=GLOB" in said[-1], r.stderr
    assert [line for line in said if "error" in line.lower()] == said[-1:], r.stderr  # one line
    # nothing announced: the log says which channels were opened, never that they are served
    assert not [line for line in said if "serving" in line or "HTTP source" in line or "tailing" in line], r.stderr
    assert not port.exists()
    assert not hport.exists()
    for d in (a, b):  # closed: each opens again at once
        filechannel.open(d, **OPTS).close()


def test_an_agent_whose_tail_fails_to_start_stops_every_part_and_writes_no_port_file(
    chan_dir: str, logdir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("pyarrow.flight")
    from filechannel.agent import server as server_mod
    from filechannel.agent.server import serve

    filechannel.open(chan_dir, **OPTS).close()
    written: list[str] = []
    real_replace = server_mod.replace_durably
    monkeypatch.setattr(server_mod, "replace_durably", lambda fs, tmp, path, data: written.append(path))

    def refuse(self: TailSource) -> TailSource:
        raise RuntimeError("the tail thread cannot start")

    monkeypatch.setattr(TailSource, "start", refuse)
    agent_options: dict[str, Any] = {
        "writable": True,
        "port_file": str(tmp_path / "port"),
        "tail": [str(logdir / "*.log")],
        "channel_options": {"minimum_required_space": 0},
    }
    with pytest.raises(RuntimeError, match="cannot start"):
        serve(chan_dir, "grpc://127.0.0.1:0", **agent_options)
    assert written == []
    monkeypatch.setattr(server_mod, "replace_durably", real_replace)
    filechannel.open(chan_dir, **OPTS).close()  # the agent closed its channel
    monkeypatch.undo()
    append(logdir / "app.log", b"x\n")
    agent = serve(chan_dir, "grpc://127.0.0.1:0", tail_options={"poll_interval": 0.01}, **agent_options)
    try:
        assert (tmp_path / "port").read_text() == f"{agent.port}\n"
        assert len(agent.tails) == 1
        assert agent.tails[0]._thread is not None
    finally:
        agent.stop()
    assert agent.tails[0]._thread is None  # stopped with the agent
    assert not (tmp_path / "port").exists()


# -- the positions commit with the lines (item 21) --------------------------------------------------------


class _CutCommit(SimFS):
    """A SimFS whose next data-file write, once armed, stops one byte short and fails with ``err``.

    The transaction's puts and its marks reach the file; its commit record does not.
    """

    armed: int | None = None
    cut: bytes = b""

    def pwrite_all(self, fd: int, data: Any, offset: int) -> None:
        if self.armed is not None:
            raw = bytes(data) if isinstance(data, (bytes, bytearray, memoryview)) else b"".join(data)
            self.cut, err, self.armed = raw, self.armed, None
            self.inject("pwrite_all", 1, err, short=len(raw) - 1)
        super().pwrite_all(fd, data, offset)


@pytest.mark.parametrize("err", [errno.EIO, errno.ENOSPC], ids=["EIO", "ENOSPC"])
def test_a_put_failing_after_the_marks_moves_no_position(logdir: Path, err: int) -> None:
    fs = _CutCommit()
    log = logdir / "app.log"
    append(log, lines("a", 0, 5))
    opts = {**OPTS, "fs": fs}
    ch = filechannel.open("/sim/ch", **opts)
    src = source(ch, logdir)
    assert src.poll() == 5
    before = src.positions()
    assert [p["offset"] for p in before.values()] == [40]
    append(log, lines("a", 5, 9))
    fs.armed = err
    if err == errno.ENOSPC:
        assert src.poll() == 0  # "the same lines are read again at the next poll"
        assert src.stats()["full_retries"] == 1
    else:
        with pytest.raises(OSError):
            src.poll()
    # the failed write held the new lines and the new position, all but its last byte
    assert b"a-00008" in fs.cut
    assert b"tail:tail:0" in fs.cut
    assert b'"offset":72' in fs.cut
    if err == errno.ENOSPC:
        assert src.positions() == before
        assert next(iter(src._files.values())).offset == 40  # nor in memory
        assert src.drain() == 4
        assert [p["offset"] for p in src.positions().values()] == [72]
        src.stop()
        ch.close()
        fs2: SimFS = fs
    else:
        src.stop()
        fs2 = fs.crash(0, "keep")  # every byte written reaches the disk: the puts and marks, not the commit
    with filechannel.open("/sim/ch", **{**OPTS, "fs": fs2}) as ch2:
        if err != errno.ENOSPC:
            assert TailSource(ch2, str(log)).positions() == before
        src2 = source(ch2, logdir)
        src2.drain()
        assert bodies(ch2) == expect("a", 0, 9)
        src2.stop()


def test_serve_passes_tail_follow_symlinks_and_needs_tail(
    chan_dir: str, logdir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("pyarrow.flight")
    from filechannel import cli
    from filechannel.agent import server as server_mod

    filechannel.open(chan_dir, **OPTS).close()
    base = ["serve", chan_dir, "--listen", "grpc://127.0.0.1:0", "--writable"]
    assert cli.main([*base, "--tail-follow-symlinks"]) == 2
    assert "--tail-follow-symlinks goes with --tail GLOB" in capsys.readouterr().err
    got: list[dict[str, Any]] = []

    def fake_serve(*a: Any, **kw: Any) -> Any:
        got.append(kw)
        raise ConfigError("listen", "stop here")

    monkeypatch.setattr(server_mod, "serve", fake_serve)
    glob = str(logdir / "*.log")
    assert cli.main([*base, "--tail", glob]) == 2
    assert cli.main([*base, "--tail", glob, "--tail-follow-symlinks"]) == 2
    assert [(kw["tail"], kw["tail_options"]) for kw in got] == [((glob,), {}), ((glob,), {"follow_symlinks": True})]
