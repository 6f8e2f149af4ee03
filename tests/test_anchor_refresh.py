"""An encrypted channel refreshes ``ANCHOR`` between checkpoints (``anchor_interval``).

Whole batches cut from the end of the newest data file, with the checkpoint
older than they are, used to go unnoticed for up to ``checkpoint_interval``.
With ``ANCHOR`` refreshed every ``anchor_interval`` seconds (when something was
committed), an owner SIGKILLed after a refresh, whose newest batches are then
cut, is refused at the next open. The crash points of the refresh itself are
in tests/test_crash_points.py (``w_anchor``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("cryptography", reason="the crypto extra is not installed (README, Installing)")

from helpers import batch_ends, data_files

import filechannel
from filechannel.crypto import Encryption

KEY = bytes(range(32))
ROOT = Path(__file__).resolve().parent.parent

CHILD = """
import sys, time
import filechannel
from filechannel.crypto import Encryption

enc = Encryption(keys={"k1": bytes(range(32))}, active_key="k1")
ch = filechannel.open(
    sys.argv[1], encryption=enc, minimum_required_space=0, checkpoint_interval=3600, anchor_interval=float(sys.argv[2])
)
for i in range(8):
    with ch.transaction() as tx:
        tx.put(b"event-%d" % i)
print("committed", flush=True)
time.sleep(3600)
"""


def enc() -> Encryption:
    return Encryption(keys={"k1": KEY}, active_key="k1")


def owner_killed_after_commits(d: str, anchor_interval: float) -> None:
    """Commit 8 one-event transactions in another process, wait ~10 refresh intervals, SIGKILL it."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.Popen(
        [sys.executable, "-c", CHILD, d, str(anchor_interval)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "committed"
        time.sleep(0.6)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(30)


def cut_last_batches(d: str, n: int) -> None:
    """Truncate the newest data file at a batch boundary, ``n`` batches before its end (a clean cut)."""
    path = data_files(d)[-1]
    with open(path, "r+b") as f:
        f.truncate(batch_ends(path)[-1 - n])


def test_batches_cut_after_a_refresh_are_caught_though_no_checkpoint_covers_them(tmp_path: Path) -> None:
    d = str(tmp_path / "c")
    owner_killed_after_commits(d, 0.05)
    cut_last_batches(d, 2)
    with pytest.raises(filechannel.CorruptLogError, match="shorter than"):
        filechannel.open(d, encryption=enc(), minimum_required_space=0)


def test_without_refreshes_the_same_cut_goes_unnoticed_until_the_next_checkpoint(tmp_path: Path) -> None:
    # The window anchor_interval closes (documented in docs/encryption.md): with it off, the
    # newest batches after the last checkpoint can be cut whole.
    d = str(tmp_path / "c")
    owner_killed_after_commits(d, 0)
    cut_last_batches(d, 2)
    with filechannel.open(d, encryption=enc(), minimum_required_space=0) as ch, ch.transaction() as tx:
        got = [e.body for e in tx.take_batch(100)]
    assert got == [b"event-%d" % i for i in range(6)]


def test_anchor_interval_is_checked() -> None:
    for bad in (-1, "1", float("nan")):
        with pytest.raises(filechannel.ConfigError, match="anchor_interval"):
            filechannel.ChannelConfig(anchor_interval=bad)  # type: ignore[arg-type]
