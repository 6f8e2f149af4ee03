"""fc_crashable_channel.crash() agrees with the project's crash harness (tests/test_crash_points.py).

A scripted workload runs on a CrashableChannel and is cut at each instant
between its steps (some with a transaction open), with every ``lose=`` and a
few seeds. At the same instant the harness's way is taken on a snapshot:
``SimFS.crash`` with the same mode and seed, then recovery. Both must give the
same queue, and the harness's oracle (``allowed_states``) must accept it:
with ``fsync="commit"`` exactly the committed transactions, with
``fsync="interval"`` a prefix of them keeping what ``sync()`` made durable.
"""

from __future__ import annotations

from typing import Any

import pytest
from test_crash_points import DIR, Effect, Snap, allowed_states, apply_effects, drain, next_pos, recover

import filechannel
from filechannel.testing import CrashableChannel
from filechannel.testing.crashable import LOSSES

OPTS: dict[str, Any] = {"background": False, "minimum_required_space": 0, "max_file_size": 4096}
INTERVAL: dict[str, Any] = dict(OPTS, fsync="interval", fsync_interval=3600.0)
INSTANTS = 9
# lose= -> the harness's crash mode (written out here, not taken from the code under test)
HARNESS_MODE = {"unsynced": "drop", "nothing": "keep", "torn": "torn_prefix"}


class Workload:
    """Runs the script on a CrashableChannel, keeping the harness's model (effects of returned commits)."""

    def __init__(self, opts: dict[str, Any]) -> None:
        self.cc = CrashableChannel(DIR, **opts)
        self.effects: list[Effect] = []
        self.durable_upto = 0
        self.open_tx: filechannel.Transaction | None = None
        self.n = 0

    def body(self, size: int) -> bytes:
        self.n += 1
        return f"ev{self.n:04d}:".encode().ljust(size, b"x")

    def commit(self, puts: list[int], takes: int = 0) -> None:
        bodies = [self.body(s) for s in puts]
        with self.cc.transaction() as tx:
            for b in bodies:
                tx.put(b)
            got = tx.take_batch(takes) if takes else []
        start = next_pos(self.effects)
        self.effects.append(Effect([(start + i, b) for i, b in enumerate(bodies)], [e.position for e in got]))

    def step(self, i: int) -> str:
        """Do step ``i``; return what the instant after it holds."""
        if self.open_tx is not None:
            self.open_tx.rollback()
            self.open_tx = None
        if i == 0:
            return "a new channel"
        if i == 1:
            self.commit([30, 40, 50])
            return "one commit"
        if i == 2:
            self.commit([60, 70], takes=2)
            return "a commit with puts and takes"
        if i == 3:
            self.open_tx = self.cc.transaction()
            self.open_tx.put(self.body(80))
            self.open_tx.put(self.body(90))
            return "an open transaction with puts"
        if i == 4:
            self.cc.checkpoint()
            return "after a checkpoint"
        if i == 5:
            for _ in range(3):
                self.commit([900] * 2)  # rolls data files (max_file_size 4096)
            return "after file rolls"
        if i == 6:
            self.open_tx = self.cc.transaction()
            self.open_tx.take_batch(3)
            return "an open transaction with takes"
        if i == 7:
            self.cc.sync()
            self.durable_upto = len(self.effects)
            self.commit([20])
            return "a commit after sync()"
        self.commit([25], takes=1)
        return "a commit with a take"


@pytest.mark.parametrize("opts", [OPTS, INTERVAL], ids=["commit", "interval"])
@pytest.mark.parametrize("lose", list(HARNESS_MODE))
@pytest.mark.parametrize("instant", range(INSTANTS))
def test_crash_agrees_with_the_harness(instant: int, lose: str, opts: dict[str, Any]) -> None:
    for seed in range(3):
        w = Workload(opts)
        what = ""
        for i in range(instant + 1):
            what = w.step(i)
        snapshot = w.cc.fs.snapshot()
        fsync = opts.get("fsync", "commit")
        allowed = allowed_states(Snap(snapshot, tuple(w.effects), None, w.durable_upto, what), fsync)
        harness = recover(snapshot.crash(seed, HARNESS_MODE[lose]), opts)
        reopened = w.cc.crash(lose=lose, seed=seed)
        state = (drain(reopened), reopened.marks())  # the harness's state: the queue and the marks
        assert state == harness, f"{what}, lose={lose}, seed={seed}: crash() and the harness disagree"
        assert state in allowed, f"{what}, lose={lose}, seed={seed}: {state} is not what the contract allows"
        got = state[0]
        if lose == "nothing" or fsync == "commit":
            assert got == apply_effects(w.effects), f"{what}, lose={lose}: a returned commit is missing"
        if lose == "unsynced" and fsync == "interval" and instant >= 7:
            # the commits after the last sync() were never fsynced: a power cut loses them
            assert got == apply_effects(w.effects[: w.durable_upto]), f"{what}: unsynced commits survived"
        # the reopened channel works: a new commit lands after every position ever acknowledged
        with w.cc.transaction() as tx:
            tx.put(b"after the crash")
        after = drain(w.cc.channel)
        assert after[:-1] == got
        assert after[-1][0] >= next_pos(w.effects[: w.durable_upto] if fsync == "interval" else w.effects)
        assert w.cc.crashes == 1
        w.cc.close()


def test_torn_keeps_part_of_an_unsynced_write_and_recovery_cuts_it() -> None:
    """With fsync="interval" an unsynced commit may survive in part: recovery keeps a prefix of the commits."""
    seen = set()
    for seed in range(20):
        w = Workload(INTERVAL)
        for i in range(2):
            w.step(i)
        w.commit([500, 500, 500])  # not synced
        got = drain(w.cc.crash(lose="torn", seed=seed))
        assert got in (apply_effects(w.effects[:k]) for k in range(len(w.effects) + 1))
        seen.add(len(got))
        w.cc.close()
    assert len(seen) > 1, "torn crashes should sometimes keep and sometimes lose the unsynced commits"


def test_the_losses_are_the_ones_documented() -> None:
    assert LOSSES == HARNESS_MODE


def test_crash_rejects_an_unknown_loss() -> None:
    cc = CrashableChannel()
    with pytest.raises(ValueError, match="lose must be one of 'unsynced', 'nothing', 'torn', not 'all'"):
        cc.crash(lose="all")
    cc.close()
