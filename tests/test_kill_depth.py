"""SIGKILL at depth: millions of queued events, a consumer taking from the head, checkpoints of runs.

The child fills a channel with 5 M small events (each body names the position
it must get: one producer, one data directory, so positions are assigned in
put order), while background checkpoints (of runs) are written; then a
consumer takes from the head in random batches, rolling some back, and prints
each committed take. The parent kills it with SIGKILL mid-way, reopens, and
checks every queued event in order: each at its own position, none that an
acknowledged take removed, every acknowledged put present unless taken, and
the recovery came from a checkpoint.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import filechannel

pytestmark = pytest.mark.slow

DEPTH = 5_000_000

_CHILD = r"""
import os, random, sys
import filechannel

d, depth, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ch = filechannel.open(d, fsync="interval", checkpoint_interval=0.3, capacity=1 << 40, minimum_required_space=0)
rng = random.Random(seed)

def say(line):
    os.write(1, (line + "\n").encode())

i = ch.stats()["next_position"]
while i < depth:
    n = min(10_000, depth - i)
    with ch.transaction() as tx:
        tx.put_many([b"%d|" % p + b"x" * 90 for p in range(i, i + n)])
    i += n
    say("P %d" % i)
ch.checkpoint()
say("deep")
while True:
    tx = ch.transaction()
    evs = tx.take_batch(rng.randint(1, 5000))
    if rng.random() < 0.2:
        tx.rollback()
        continue
    if evs:
        say("I %d %d" % (evs[0].position, evs[-1].position))
    tx.commit()
    if evs:
        say("T %d %d" % (evs[0].position, evs[-1].position))
    if rng.random() < 0.01:
        with ch.transaction() as tx:  # new puts keep coming at the tail
            tx.put_many([b"%d|" % p + b"x" * 90 for p in range(i, i + 100)])
        i += 100
        say("P %d" % i)
"""


def test_sigkill_at_depth_keeps_order_and_positions(tmp_path: Path) -> None:
    d = str(tmp_path / "ch")
    seed = random.randrange(1 << 30)
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, d, str(DEPTH), str(seed)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 600
    deep_at = None
    kill_after = random.uniform(0.5, 3.0)
    os.set_blocking(proc.stdout.fileno(), False)
    buf = b""
    try:
        while time.monotonic() < deadline:
            chunk = proc.stdout.read() or b""
            buf += chunk
            *done, buf = buf.split(b"\n")
            lines += [x.decode() for x in done]
            if deep_at is None and "deep" in lines:
                deep_at = time.monotonic()
            if deep_at is not None and time.monotonic() - deep_at > kill_after:
                break
            if proc.poll() is not None:
                pytest.fail(f"the child died: {proc.stderr.read().decode() if proc.stderr else ''}")
            time.sleep(0.01)
        else:
            pytest.fail("the child never reached its depth")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    acked_puts = max(int(x.split()[1]) for x in lines if x.startswith("P "))
    taken: list[tuple[int, int]] = [(int(a), int(b)) for _, a, b in (x.split() for x in lines if x.startswith("T "))]
    maybe: list[tuple[int, int]] = [(int(a), int(b)) for _, a, b in (x.split() for x in lines if x.startswith("I "))]
    assert taken, "the consumer took nothing before the kill"
    gone = {p for a, b in taken for p in range(a, b + 1)}
    might_be_gone = {p for a, b in maybe for p in range(a, b + 1)}

    ch = filechannel.open(d, capacity=1 << 40, minimum_required_space=0, checkpoint_interval=0)
    try:
        assert ch.stats()["recovery_source"] == "checkpoint"
        n = len(ch)
        seen = 0
        last = -1
        while True:
            with ch.transaction() as tx:
                evs = tx.take_batch(10_000)
            for e in evs:
                p = e.position
                assert p is not None
                assert p > last, f"position {p} after {last}: out of order"
                assert e.body.startswith(b"%d|" % p), f"position {p} holds {e.body[:20]!r}"
                assert p not in gone, f"position {p} was taken (acknowledged) before the kill"
                # Every acknowledged put in between is missing only if a take may have removed it.
                missing = [q for q in range(last + 1, p) if q not in might_be_gone]
                assert not missing, f"acknowledged positions {missing[:5]} are lost"
                last = p
            seen += len(evs)
            if not evs:
                break
        assert seen == n
        missing = [q for q in range(last + 1, acked_puts) if q not in might_be_gone]
        assert not missing, f"acknowledged positions {missing[:5]} at the tail are lost"
    finally:
        ch.close()
