"""The reports of issue 13, replayed as a new user met them, on real files."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

import filechannel
from filechannel.verify import verify_channel

OPTS = {"minimum_required_space": 0, "background": False}


def bodies() -> list[bytes]:
    return [b"event-%03d|" % i + b"x" * 80 for i in range(300)]


def build(d: str) -> str:
    with filechannel.open(d, **OPTS) as ch:
        evs = bodies()
        for t in range(3):  # 300 events in 3 transactions
            with ch.transaction() as tx:
                tx.put_many(evs[t * 100 : (t + 1) * 100])
    (seg,) = [n for n in os.listdir(os.path.join(d, "data")) if n.endswith(".wal")]
    return os.path.join(d, "data", seg)


def drain_skip(d: str) -> tuple[list[int], list[list[int]]]:
    with filechannel.open(d, **OPTS, on_corruption="skip") as ch:
        got: list[int] = []
        while True:
            with ch.transaction() as tx:
                evs = tx.take_batch(64)
            if not evs:
                break
            for e in evs:
                assert e.body == bodies()[e.position], f"altered event at {e.position}"
            got += [e.position for e in evs]
        return got, ch.stats()["lost_positions"]


def test_forty_single_byte_flips_are_each_reported_exactly(tmp_path: Path) -> None:
    pristine = str(tmp_path / "pristine")
    seg = build(pristine)
    size = os.path.getsize(seg)
    for k in range(40):
        off = k * size // 40
        d = str(tmp_path / f"c{k}")
        shutil.copytree(pristine, d)
        path = os.path.join(d, "data", os.path.basename(seg))
        raw = bytearray(Path(path).read_bytes())
        raw[off] ^= 0x20
        Path(path).write_bytes(bytes(raw))
        v = verify_channel(d)
        lost = {p for a, b in v.lost_positions for p in range(a, b)}
        # The default open either serves everything or refuses loudly.
        try:
            with filechannel.open(d, **OPTS) as ch:
                tx = ch.transaction()
                try:
                    served = [e.position for e in tx.take_batch(1000)]
                except filechannel.CorruptLogError:
                    served = None
                tx.rollback()
        except filechannel.CorruptLogError:
            served = None
        if served is not None:
            assert served == list(range(300)), f"flip at {off}: fewer events without an error"
            assert not lost, f"flip at {off}: verify reports loss that open did not see"
        # A skip-mode drain never blocks, serves intact events only, and lists exactly what it lost.
        got, reported = drain_skip(d)
        assert sorted(set(range(300)) - set(got)) == sorted(lost), f"flip at {off}: verify and the drain disagree"
        assert {p for a, b in reported for p in range(a, b)} == lost, f"flip at {off}"
        assert len(lost) <= 1, f"flip at {off}: one flipped byte lost {len(lost)} events"
        # and the loss is final: nothing comes back, nothing else goes
        with filechannel.open(d, **OPTS) as ch:
            tx = ch.transaction()
            assert [e.position for e in tx.take_batch(1000)] == []
            tx.rollback()


@pytest.mark.parametrize("cut", [60, 8, 1000])
def test_truncated_file_of_a_closed_channel_is_loss_not_a_torn_tail(tmp_path: Path, cut: int) -> None:
    d = str(tmp_path / "ch")
    seg = build(d)
    with open(seg, "r+b") as f:
        f.truncate(os.path.getsize(seg) - cut)
    v = verify_channel(d)
    assert not v.ok
    lost = {p for a, b in v.lost_positions for p in range(a, b)}
    with pytest.raises(filechannel.CorruptLogError, match="shorter than the checkpoint"):
        filechannel.open(d, **OPTS)
    got, reported = drain_skip(d)
    assert sorted(set(range(300)) - set(got)) == sorted(lost)
    assert {p for a, b in reported for p in range(a, b)} == lost
