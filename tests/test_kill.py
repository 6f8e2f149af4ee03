"""A real crash test: a producer (and a consumer) killed with SIGKILL at random moments, many times.

The child process commits transactions and prints each one after ``commit()``
returns (acknowledged, durable with ``fsync="commit"``). The parent kills it
after a random delay, reopens the same directory and checks that the channel
holds every acknowledged put exactly once (minus acknowledged takes), whole
transactions only, and that every position keeps the body it had.
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

_CHILD = r"""
import os, random, sys, threading
import filechannel

d, role, run = sys.argv[1], sys.argv[2], int(sys.argv[3])
ch = filechannel.open(d, max_file_size=32 * 1024, minimum_required_space=0, checkpoint_interval=0.05)
lock = threading.Lock()

def say(line):
    with lock:
        os.write(1, (line + "\n").encode())

def produce():
    rng = random.Random(run)
    n = 0
    while True:
        k = rng.randint(1, 6)
        label = "%d.%d" % (run, n)
        with ch.transaction() as tx:
            for i in range(k):
                tx.put(b"%s/%d/%d|" % (label.encode(), i, k) + b"x" * rng.randint(0, 300), headers={"t": label})
        say("P %s %d" % (label, k))
        n += 1

def consume():
    rng = random.Random(-run)
    while True:
        tx = ch.transaction()
        evs = tx.take_batch(rng.randint(1, 8), timeout=0.01)
        if rng.random() < 0.2:
            tx.rollback()
            continue
        line = " ".join("%d:%s" % (e.position, e.body.split(b"|")[0].decode()) for e in evs)
        if evs:
            say("I " + line)  # about to commit: these may be gone after a kill
        tx.commit()
        if evs:
            say("T " + line)

say("ready")
threads = [threading.Thread(target=produce, daemon=True)]
if role == "both":
    threads.append(threading.Thread(target=consume, daemon=True))
for t in threads:
    t.start()
threads[0].join()
"""


def _key(body: bytes) -> str:
    return body.split(b"|")[0].decode()


def _run(tmp_path: Path, role: str, iterations: int, budget: float) -> int:
    d = str(tmp_path / "ch")
    rng = random.Random(1234 if role == "producer" else 4321)
    acked_puts: dict[str, int] = {}  # txn label -> number of events
    acked_takes: set[str] = set()  # event keys
    pos_of: dict[str, int] = {}  # event key -> position, as first seen
    drained: set[str] = set()  # keys the parent itself took and committed
    t_end = time.monotonic() + budget
    done = 0
    for run in range(iterations):
        if done >= 10 and time.monotonic() > t_end:
            break
        p = subprocess.Popen(
            [sys.executable, "-c", _CHILD, d, role, str(run)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        assert p.stdout is not None
        first = p.stdout.readline()
        assert first == b"ready\n", p.stderr.read() if p.stderr else b""
        time.sleep(rng.uniform(0, 0.3))
        p.send_signal(signal.SIGKILL)
        out, err = p.communicate(timeout=30)
        assert p.returncode == -signal.SIGKILL, err.decode()
        in_flight: set[str] = set()  # keys of take commits not acknowledged (only the last can have happened)
        lines = out.decode().split("\n")[:-1]  # a line cut by the kill has no newline: not acknowledged
        for line in lines:
            kind, _, rest = line.partition(" ")
            if kind == "P":
                label, k = rest.split()
                acked_puts[label] = int(k)
            elif kind in ("I", "T"):
                for item in rest.split():
                    pos, key = item.split(":", 1)
                    assert pos_of.setdefault(key, int(pos)) == int(pos), f"{key} changed position"
                    (acked_takes if kind == "T" else in_flight).add(key)

        with filechannel.open(d, minimum_required_space=0, transaction_capacity=100_000) as ch:
            tx = ch.transaction()
            evs = tx.take_batch(ch.config.transaction_capacity)
            tx.rollback()
            assert ch.size == len(evs)
            keys = [_key(e.body) for e in evs]
            positions = [e.position for e in evs]
            assert positions == sorted(positions)
            assert len(set(keys)) == len(keys), "an event is queued twice"
            for e, key in zip(evs, keys, strict=True):
                assert e.headers["t"] == key.split("/")[0]
                assert pos_of.setdefault(key, e.position) == e.position, f"{key} moved"  # type: ignore[arg-type]
            present = set(keys)
            assert not present & acked_takes, "an acknowledged take came back"
            assert not present & drained
            head = positions[0] if positions else None
            # Acknowledged puts are queued, or were taken (acknowledged, or by the one take
            # commit in flight at the kill, which took from the head).
            by_txn: dict[str, set[str]] = {}
            for key in present | acked_takes | drained:
                by_txn.setdefault(key.split("/")[0], set()).add(key)
            for label, k in acked_puts.items():
                want = {f"{label}/{i}/{k}" for i in range(k)}
                missing = want - present - acked_takes - drained
                for key in missing:
                    # Only possible for the consumer's unacknowledged last take commit.
                    assert key in in_flight - acked_takes, f"acknowledged event {key} lost"
                    assert head is None or pos_of[key] < head, f"acknowledged event {key} lost"
                    acked_takes.add(key)  # it is gone for good: do not look for it again
            # Whole transactions only (for transactions nobody took from).
            for key in present:
                label, _, k = key.split("/")
                mine = by_txn[label]
                if not mine & (acked_takes | drained) and role == "producer":
                    assert len(mine) == int(k), f"transaction {label} is partial: {sorted(mine)}"
            if role == "producer" and len(evs) > 3000:
                with ch.transaction() as tx2:
                    drained |= {_key(e.body) for e in tx2.take_batch(ch.config.transaction_capacity)}
        done += 1
    # The run must have done real work, or the test proves nothing.
    assert len(acked_puts) > 50
    if role == "both":
        assert len(acked_takes) > 50
    return done


@pytest.mark.parametrize("role", ["producer", "both"])
def test_sigkill_loop(tmp_path: Path, role: str) -> None:
    if not hasattr(signal, "SIGKILL"):  # pragma: no cover
        pytest.fail("needs SIGKILL")
    done = _run(tmp_path, role, iterations=30, budget=20.0)
    assert done >= 10
    # The directory is still a healthy channel.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run(
        [sys.executable, "-m", "filechannel", "verify", str(tmp_path / "ch")],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert r.returncode == 0, r.stdout + r.stderr
