"""filechannel.testing.damage: reproducible, reported, and the channel's on_corruption reacts to it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import filechannel
from filechannel.testing import Damage, DamageError, damage
from filechannel.testing.simfs import SimFS

OPTS = {"background": False, "minimum_required_space": 0, "max_file_size": 4096}


ALL: dict[int, bytes] = {}  # every event build() commits, by position (the same on every build)


def build(path: Path | str, fs: SimFS | None = None) -> dict[int, bytes]:
    """A closed channel with several data files and some events taken; return the queue committed."""
    ch = filechannel.open(path, fs=fs, **OPTS)
    ALL.clear()
    for t in range(12):
        with ch.transaction() as tx:
            for i in range(8):
                body = f"t{t:02d}-e{i}-".encode() + bytes(40 + t)
                tx.put(body)
                ALL[t * 8 + i] = body
    with ch.transaction() as tx:
        tx.take_batch(10)
    queue = drain(ch)
    ch.close()
    return queue


def drain(ch: filechannel.FileChannel) -> dict[int, bytes]:
    tx = ch.transaction()
    evs = tx.take_batch(ch.config.transaction_capacity)
    tx.rollback()
    return {e.position: e.body for e in evs if e.position is not None}


def open_and_drain(fs: SimFS) -> dict[int, bytes]:
    ch = filechannel.open("/sim/ch", fs=fs, replay="full", **OPTS)
    try:
        return drain(ch)
    finally:
        ch.close()


def files(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("target", ["data", "checkpoint"])
@pytest.mark.parametrize("kind", ["flip", "truncate", "delete"])
def test_same_seed_same_damage_on_identical_directories(tmp_path: Path, kind: str, target: str) -> None:
    build(tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.copytree(tmp_path / "a", tmp_path / "c")
    da = damage(tmp_path / "a", kind, target=target, seed=7)
    db = damage(tmp_path / "b", kind, target=target, seed=7)
    assert files(tmp_path / "a") == files(tmp_path / "b")
    assert files(tmp_path / "a") != files(tmp_path / "c")  # it did something
    assert Path(da.path).relative_to(tmp_path / "a") == Path(db.path).relative_to(tmp_path / "b")
    assert (da.kind, da.target, da.offsets, da.size_before, da.size_after, da.record) == (
        db.kind,
        db.target,
        db.offsets,
        db.size_before,
        db.size_after,
        db.record,
    )
    # what it says it did is what it did
    before = (tmp_path / "c" / Path(da.path).relative_to(tmp_path / "a")).read_bytes()
    assert len(before) == da.size_before
    if kind == "delete":
        assert not Path(da.path).exists()
    else:
        after = Path(da.path).read_bytes()
        assert len(after) == da.size_after
        if kind == "flip":
            changed = [i for i in range(len(before)) if before[i] != after[i]]
            assert changed == list(da.offsets)
        else:
            assert after == before[: da.offsets[0]]
    if target == "data":
        assert da.record is not None
        lo, hi = da.record[0], da.record[0] + da.record[1]
        assert kind == "delete" or all(lo <= o < hi for o in da.offsets), "damage falls inside a written record"
    assert da.path in da.describe()


def test_seeds_choose_different_damage(tmp_path: Path) -> None:
    build(tmp_path / "a")
    seen = set()
    for seed in range(6):
        shutil.copytree(tmp_path / "a", tmp_path / f"s{seed}")
        d = damage(tmp_path / f"s{seed}", "flip", seed=seed, nbytes=3)
        assert len(d.offsets) == 3
        seen.add((Path(d.path).name, d.offsets))
    assert len(seen) == 6


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("kind", ["flip", "truncate", "delete"])
def test_on_corruption_reacts_to_damaged_data(tmp_path: Path, kind: str, seed: int) -> None:
    sim = SimFS()
    queue = build("/sim/ch", fs=sim)
    d = damage("/sim/ch", kind, seed=seed, fs=sim)
    assert isinstance(d, Damage)
    assert d.target == "data"
    pristine = sim.snapshot()
    # fail (the default): refused, naming the damage, at open or when the event is read
    with pytest.raises(filechannel.CorruptLogError):
        open_and_drain(sim)
    # skip: opens, never returns altered data, and reports the loss exactly (a damaged TAKE record may
    # bring taken events back: reported, see docs/format.md)
    ch = filechannel.open("/sim/ch", fs=pristine, replay="full", on_corruption="skip", **OPTS)
    try:
        got, st = drain(ch), ch.stats()
    finally:
        ch.close()
    assert st["corruption_report"], d.describe()
    for p, b in got.items():
        assert ALL[p] == b, f"altered event at position {p}"
    reported = {p for a, b in st["lost_positions"] for p in range(a, b)}
    assert set(queue) - set(got) <= reported, f"{d.describe()}: lost without a report"


@pytest.mark.parametrize("kind", ["flip", "truncate", "delete"])
def test_damaged_checkpoint_falls_back_to_the_same_queue(tmp_path: Path, kind: str) -> None:
    queue = build(tmp_path / "ch")
    d = damage(tmp_path / "ch", kind, target="checkpoint")
    assert d.path.endswith(".ckpt")
    ch = filechannel.open(tmp_path / "ch", **OPTS)
    try:
        assert drain(ch) == queue
        if kind != "delete":
            assert ch.stats()["checkpoint_fallbacks"] >= 1
    finally:
        ch.close()


def test_refuses_an_open_channel_and_bad_arguments(tmp_path: Path) -> None:
    build(tmp_path / "ch")
    ch = filechannel.open(tmp_path / "ch", **OPTS)
    try:
        with pytest.raises(filechannel.ChannelLockedError):
            damage(tmp_path / "ch", "flip")
    finally:
        ch.close()
    with pytest.raises(DamageError, match="unknown damage kind 'melt': use one of flip, truncate, delete"):
        damage(tmp_path / "ch", "melt")
    with pytest.raises(DamageError, match="unknown damage target 'index'"):
        damage(tmp_path / "ch", "flip", target="index")
    with pytest.raises(DamageError, match="not a channel"):
        damage(tmp_path / "nothing-here", "flip")
    assert issubclass(DamageError, filechannel.ChannelError)


def test_data_damage_reaches_every_data_directory(tmp_path: Path) -> None:
    """With several data directories (one of them outside the channel), any of them may be damaged."""
    d, outside = tmp_path / "ch", tmp_path / "disk2"
    ch = filechannel.open(d, data_dirs=[d / "data", outside], **OPTS)
    for t in range(24):
        with ch.transaction() as tx:
            tx.put_many([f"t{t}-{i}".encode() * 8 for i in range(8)])
    ch.close()
    dirs = {Path(damage(d, "flip", seed=seed).path).parent for seed in range(16)}
    assert dirs == {d / "data", outside}
    with pytest.raises(filechannel.CorruptLogError):
        filechannel.open(d, replay="full", **OPTS)
