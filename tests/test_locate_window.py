"""How ``Log.locate_puts`` reads a data file to find a deep queue's head (issue 34).

Batches of ``put_many(10 000)`` of 100-byte events are 1.4 MB, longer than the
first window the locator reads (1 MiB). A window that holds no whole
transaction is walked record by record for nothing; the log learns from it, so
that happens once per log, not once per run (the spot check at reopen samples
the heads of up to 16 runs) nor at every file's end. And one call never walks
the same bytes twice: when its window ends before the events it needs, it goes
on from where the walk stopped instead of walking again from its start. Takes
still return every event once, in order, on the C path and the pure-Python one.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import helpers
import pytest

import filechannel
from filechannel import format as fmt
from filechannel import log as log_module
from filechannel import scan
from filechannel.log import Log

BATCH = 10_000
BATCHES = 12
BODY = b"x" * 100
# About two batches per data file: six runs for the spot check, and a file end every other batch.
OPTS: dict[str, Any] = {"minimum_required_space": 0, "max_file_size": 3 << 20, "checkpoint_interval": 0}


@pytest.fixture(params=["c", "python"])
def path_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test on the C path and on the pure-Python path."""
    if request.param == "python":
        monkeypatch.setattr(fmt, "speedups", None)
    elif fmt.speedups is None:
        pytest.skip(helpers.NO_ACCELERATOR)
    return str(request.param)


class _Walks:
    """Every walk ``locate_puts`` makes, per call: ``(start, window, eof, found, done)``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[list[tuple[int, int, bool, int, bool]]] = []
        walk = scan.committed_puts
        locate = Log.locate_puts

        def spy_walk(buf: bytes, base: int, start: int, *args: Any) -> Any:
            got = walk(buf, base, start, *args)
            eof = bool(args[6]) if len(args) > 6 else False
            self.calls[-1].append((start, len(buf), eof, len(got.offsets), got.done))
            return got

        def spy_locate(log: Log, *args: Any) -> Any:
            self.calls.append([])
            return locate(log, *args)

        monkeypatch.setattr(scan, "committed_puts", spy_walk)
        monkeypatch.setattr(Log, "locate_puts", spy_locate)

    def fruitless(self) -> int:
        """Walks of a full window (not the file's end) that found nothing: a batch longer than the window."""
        return sum(1 for c in self.calls for _s, _w, eof, found, done in c if not eof and not found and not done)


def _build(d: Path) -> None:
    with filechannel.open(d, **OPTS) as ch:
        for _ in range(BATCHES):
            with ch.transaction() as tx:
                tx.put_many([BODY] * BATCH)


def _take_all(ch: filechannel.FileChannel) -> list[int]:
    positions: list[int] = []
    while True:
        with ch.transaction() as tx:
            got = tx.take_batch(1000)
        if not got:
            return positions
        assert all(e.body == BODY for e in got)
        positions += [e.position for e in got]


def test_a_window_too_small_for_a_batch_is_walked_once_per_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path_kind: str
) -> None:
    _build(tmp_path / "ch")
    walks = _Walks(monkeypatch)
    with filechannel.open(tmp_path / "ch", **OPTS) as ch:
        spot_checked = len(walks.calls)
        positions = _take_all(ch)
    assert spot_checked >= 6, "the reopen's spot check did not sample the runs' heads"
    assert positions == list(range(positions[0], positions[0] + BATCH * BATCHES))
    # On main: one at every spot-checked run's head and more at the takes' file ends.
    assert walks.fruitless() <= 1, f"{walks.fruitless()} windows walked for nothing ({path_kind} path)"


def test_one_locate_never_walks_the_same_bytes_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path_kind: str
) -> None:
    _build(tmp_path / "ch")
    walks = _Walks(monkeypatch)
    with filechannel.open(tmp_path / "ch", **OPTS) as ch:
        positions = _take_all(ch)
    assert positions == list(range(positions[0], positions[0] + BATCH * BATCHES))
    again = 0
    for call in walks.calls:
        for (s0, _w0, _e0, found0, _d0), (s1, _w1, _e1, _f1, _d1) in itertools.pairwise(call):
            if found0 and s1 <= s0:  # the walk before found events, yet this one started no further
                again += 1
    assert sum(len(c) for c in walks.calls) > len(walks.calls), "no call needed a second window: nothing checked"
    assert again == 0, f"{again} walks went over bytes their call had walked already ({path_kind} path)"


def test_a_window_grown_for_one_huge_batch_shrinks_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One transaction of 14 MB, then small ones: later walks do not all read 16 MiB windows.

    (It guards the learned window itself: main learns nothing, so it has no such window to shrink.)
    """
    d = tmp_path / "ch"
    opts = {**OPTS, "max_file_size": 64 << 20, "transaction_capacity": 100_000}
    with filechannel.open(d, **opts) as ch:
        with ch.transaction() as tx:
            tx.put_many([BODY] * 100_000)
        for _ in range(300):
            with ch.transaction() as tx:
                tx.put_many([BODY] * 1000)
    monkeypatch.setattr(log_module, "LOCATE_CALM", 4)
    walks = _Walks(monkeypatch)
    with filechannel.open(d, **opts) as ch:
        positions = _take_all(ch)
    assert positions == list(range(positions[0], positions[0] + 400_000))
    widest = max(w for c in walks.calls for _s, w, _e, _f, _d in c)
    late = [w for c in walks.calls[len(walks.calls) // 2 :] for _s, w, eof, _f, _d in c if not eof]
    assert widest > 8 << 20, "the huge transaction never needed a wide window: nothing checked"
    assert late, "no full window late in the file: nothing checked"
    assert max(late) <= 4 << 20, f"walks late in the file still read windows of {max(late)} bytes"
