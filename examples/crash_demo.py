"""The channel alone, without Spark: producer, kill -9, recovery, consumer, through a real directory.

1. A producer process puts numbered events in transactions of 50 and prints
   each acknowledged batch; after a moment it is killed with SIGKILL.
2. The channel is reopened: recovery must bring back every acknowledged event,
   whole transactions only, in order.
3. A consumer drains the channel in batches, checking order and positions.
4. ``filechannel verify`` checks the directory.

Run it with ``.venv/bin/python examples/crash_demo.py [DIR]`` (``DIR`` default:
``./demo-channel``, wiped first); ``scripts/demo.sh`` runs the whole pipeline
through Spark (``examples/pipeline.py``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import filechannel

BATCH = 50


def producer(directory: str) -> None:
    """Put batches forever, printing ``ACK first last`` after each commit returns."""
    with filechannel.open(directory, max_file_size=1 << 20) as ch:
        n = 0
        while True:
            with ch.transaction() as tx:
                for i in range(n, n + BATCH):
                    tx.put(f"event-{i}".encode(), headers={"producer": "demo"})
            print(f"ACK {n} {n + BATCH - 1}", flush=True)
            n += BATCH


def main() -> int:
    """Run the demo; return 0 when every check passes."""
    if len(sys.argv) > 2 and sys.argv[1] == "--producer":
        producer(sys.argv[2])
        return 0
    directory = sys.argv[1] if len(sys.argv) > 1 else "demo-channel"
    shutil.rmtree(directory, ignore_errors=True)
    print(f"[demo] channel directory: {directory}")

    proc = subprocess.Popen(
        [sys.executable, __file__, "--producer", directory], stdout=subprocess.PIPE, text=True, bufsize=1
    )
    acked = -1
    deadline = time.monotonic() + 1.5
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        acked = int(line.split()[2])
    os.kill(proc.pid, signal.SIGKILL)
    rest = proc.stdout.read()
    for line in rest.splitlines():
        acked = int(line.split()[2])
    proc.wait()
    if acked < 0:
        print("[demo] FAIL: the producer acknowledged nothing before it was killed")
        return 1
    print(f"[demo] producer killed with SIGKILL after acknowledging events 0..{acked}")

    t0 = time.monotonic()
    with filechannel.open(directory) as ch:
        print(f"[demo] reopened in {time.monotonic() - t0:.3f} s: {ch.size} events recovered")
        if ch.size < acked + 1 or ch.size % BATCH:
            print(f"[demo] FAIL: expected at least {acked + 1} events in whole transactions")
            return 1
        expect = 0
        while True:
            with ch.transaction() as tx:
                evs = tx.take_batch(500)
                for ev in evs:
                    if ev.body != f"event-{expect}".encode() or ev.position != expect:
                        print(f"[demo] FAIL: got {ev.body!r} at position {ev.position}, expected event-{expect}")
                        return 1
                    expect += 1
            if not evs:
                break
        print(f"[demo] consumer took {expect} events, in order, positions 0..{expect - 1}")
        st = ch.stats()
        print(f"[demo] stats: fsyncs={st['fsyncs']} files={st['files']} torn_tails={st['torn_tails_truncated']}")
    rc = subprocess.call([sys.executable, "-m", "filechannel", "verify", directory])
    print("[demo] OK" if rc == 0 else "[demo] FAIL: verify found problems")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
