"""The command line against real pipes and signals: a closed stdout and SIGTERM never lose track of events.

* ``take`` commits a batch only once every event of it was written and flushed;
  output closed early (``| head -1``) rolls the batch back, says so on one line
  and exits 1 (no traceback, no "Exception ignored" noise at exit).
* SIGTERM during ``put`` or ``take`` is handled like Ctrl-C: deferred to the end
  of the commit in progress, then one line saying exactly what was committed,
  exit 143 (128 + 15).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

from helpers import cli_command

import filechannel


def _fill(d: str, bodies: list[bytes]) -> None:
    with filechannel.open(d, minimum_required_space=0) as ch, ch.transaction() as tx:
        tx.put_many(bodies)


def _queued(d: str) -> list[bytes]:
    """Every queued body, read by reopening the channel (and taking nothing for good)."""
    with filechannel.open(d, minimum_required_space=0) as ch:
        tx = ch.transaction()
        evs = tx.take_batch(ch.config.transaction_capacity)
        tx.rollback()
    return [e.body for e in evs]


def _clean_one_line(err: str) -> str:
    assert "Traceback" not in err, err
    assert "Exception ignored" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


_CLOSED = re.compile(
    r"filechannel: error: output closed: the batch in progress \((\d+) events\) was rolled back and is still "
    r"queued; (\d+) events were taken and committed before it"
)


def test_take_into_a_closed_pipe_rolls_back_and_exits_1(tmp_path: Path) -> None:
    d = str(tmp_path / "ch")
    _fill(d, [b"%d" % i for i in range(5)])
    r, w = os.pipe()
    os.close(r)  # the reader is gone before the first byte is written: every write is EPIPE
    try:
        proc = subprocess.run(cli_command("take", d, "-n", "2"), stdout=w, stderr=subprocess.PIPE)
    finally:
        os.close(w)
    err = proc.stderr.decode()
    assert proc.returncode == 1, err
    m = _CLOSED.fullmatch(_clean_one_line(err))
    assert m, err
    assert (int(m.group(1)), int(m.group(2))) == (2, 0)
    assert _queued(d) == [b"%d" % i for i in range(5)]  # nothing was taken


def test_take_piped_into_head_commits_only_what_was_written(tmp_path: Path) -> None:
    d = str(tmp_path / "ch")
    n = 3000
    _fill(d, [b"%05d-" % i + b"x" * 100 for i in range(n)])  # ~320 KB of output: far more than a pipe holds
    take = subprocess.Popen(
        cli_command("take", d, "-n", str(n), "--transaction-capacity", "200"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert take.stdout is not None
    assert take.stderr is not None
    head = subprocess.Popen(["head", "-1"], stdin=take.stdout, stdout=subprocess.PIPE)
    take.stdout.close()  # only head reads the pipe now
    first, _ = head.communicate(timeout=60)
    code = take.wait(timeout=60)
    err = take.stderr.read().decode()
    take.stderr.close()
    assert first.decode().startswith("00000-")
    assert code == 1, err
    m = _CLOSED.fullmatch(_clean_one_line(err))
    assert m, err
    committed = int(m.group(2))
    assert committed % 200 == 0
    assert committed < n
    # Exactly the batches the message calls committed are gone; the rest, in order, stay queued.
    assert _queued(d) == [b"%05d-" % i + b"x" * 100 for i in range(committed, n)]


def _wait_for_queue(d: str, want: int) -> None:
    deadline = time.monotonic() + 30
    queued = -1
    while queued != want:
        assert time.monotonic() < deadline, f"the child never committed {want} events (saw {queued})"
        time.sleep(0.05)
        if os.path.exists(os.path.join(d, "CHANNEL")):
            r = subprocess.run(cli_command("stat", d, "--json"), capture_output=True, text=True, timeout=60)
            if r.returncode == 0:
                queued = json.loads(r.stdout)["queue_size"]


def test_sigterm_during_put_prints_an_exact_summary(tmp_path: Path) -> None:
    d = str(tmp_path / "ch")
    proc = subprocess.Popen(cli_command("put", d, "--batch", "10"), stdin=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdin is not None
    assert proc.stderr is not None
    try:
        proc.stdin.write(b"".join(b"%d\n" % i for i in range(25)))  # two batches commit, 5 lines wait
        proc.stdin.flush()
        _wait_for_queue(d, 20)
        time.sleep(0.3)  # let the child read the 5 lines and block on the open pipe
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        err = proc.stderr.read().decode()
    finally:
        proc.stdin.close()
        if proc.poll() is None:  # pragma: no cover - only if the test failed
            proc.kill()
        proc.stderr.close()
    assert code == 128 + signal.SIGTERM, (code, err)
    m = re.fullmatch(
        r"filechannel: interrupted by SIGTERM: (\d+) events committed \(the first \1 lines\); "
        r"the batch in progress \((\d+) lines\) was rolled back",
        _clean_one_line(err),
    )
    assert m, err
    assert int(m.group(1)) == 20
    assert int(m.group(2)) <= 5
    assert _queued(d) == [b"%d" % i for i in range(20)]  # exactly what the summary claims


def test_sigterm_during_take_prints_an_exact_summary(tmp_path: Path) -> None:
    d = str(tmp_path / "ch")
    _fill(d, [b"%d" % i for i in range(7)])
    proc = subprocess.Popen(
        cli_command("take", d, "-n", "100", "--wait", "60"), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None
    assert proc.stderr is not None
    try:
        got = [proc.stdout.readline() for _ in range(7)]  # printed and flushed: the commit follows
        time.sleep(0.5)  # the commit is done and it waits for more
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        err = proc.stderr.read().decode()
    finally:
        if proc.poll() is None:  # pragma: no cover - only if the test failed
            proc.kill()
        proc.stdout.close()
        proc.stderr.close()
    assert got == [b"%d\n" % i for i in range(7)]
    assert code == 128 + signal.SIGTERM, (code, err)
    assert _clean_one_line(err) == (
        "filechannel: interrupted by SIGTERM: 7 events taken and committed; the batch in progress was rolled "
        "back (0 of its events were printed and stay in the channel)"
    )
    assert _queued(d) == []
