"""An encrypted channel against its own past and its copies: diverged ANCHORs, replayed acks, reissued positions.

An attacker without the key but with write access to the channel directory
holds valid, MACed small files too: an older ``.ack``, or a ``cp -a`` copy's
``ANCHOR`` and data files (same channel id, same key). Each of them is valid
alone; what gives them away is that they disagree with the rest of the
channel. Every disagreement is damage under the one policy (``"fail"``
refuses the open; ``"skip"`` opens, reports it and never delivers a copy's
events), never "the newer (or longer) one wins".
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("cryptography", reason="the crypto extra is not installed (README, Installing)")

from helpers import data_files
from simfs import SimFS

import filechannel
from filechannel import format as fmt
from filechannel.cli import main as cli_main
from filechannel.crypto import Encryption
from filechannel.verify import verify_channel

KEY = bytes(range(32))
OPTS: dict[str, Any] = {"minimum_required_space": 0, "background": False, "checkpoint_interval": 0}


def enc() -> Encryption:
    return Encryption(keys={"k1": KEY}, active_key="k1")


def put_all(d: str, bodies: list[bytes], **kw: Any) -> None:
    with filechannel.open(d, encryption=enc(), **OPTS, **kw) as ch:
        for b in bodies:
            with ch.transaction() as tx:
                tx.put(b)


def put_and_ack(d: str, n: int, k: int) -> int:
    """Put ``n`` events ``event-<i>``, then acknowledge ``k`` of them as consumer ``r1``; its first position."""
    put_all(d, [b"event-%d" % i for i in range(n)])
    with filechannel.ChannelReader(d, "r1", encryption=enc()) as r:
        start, _end = r.available()
        r.ack(start + k)
    return start


def take_all(d: str, **kw: Any) -> tuple[list[bytes], dict[str, Any]]:
    out = []
    with filechannel.open(d, encryption=enc(), **OPTS, **kw) as ch:
        stats = ch.stats()
        while True:
            with ch.transaction() as tx:
                got = tx.take_batch(100)
            if not got:
                return out, stats
            out += [e.body for e in got]


def diverged(tmp_path: Path, original: list[bytes], copy: list[bytes]) -> tuple[str, str]:
    """A channel and its ``cp -a`` copy, each then written to by a key holder; returns their directories."""
    a = str(tmp_path / "a")
    put_all(a, [b"shared-%d" % i for i in range(3)])
    b = str(tmp_path / "b")
    shutil.copytree(a, b, symlinks=True)
    put_all(a, original)
    put_all(b, copy)
    return a, b


# -- item 1: a diverged copy's ANCHOR --------------------------------------------------------


@pytest.mark.parametrize("longer", [False, True])
def test_a_diverged_copys_newest_file_and_anchor_are_refused(tmp_path: Path, longer: bool) -> None:
    """The copy's newest data file *and* its ANCHOR swapped in: the checkpoint's MACed list disagrees."""
    original = [b"original-%d" % i for i in range(4)]
    copy = [b"copy-%d" % i for i in range(8 if longer else 4)]
    a, b = diverged(tmp_path, original, copy)
    fa, fb = data_files(a)[-1], data_files(b)[-1]
    assert os.path.basename(fa) == os.path.basename(fb)
    assert os.path.getsize(fb) >= os.path.getsize(fa)  # "the longer wins" would take the copy's
    shutil.copyfile(fb, fa)
    shutil.copyfile(os.path.join(b, "ANCHOR"), os.path.join(a, "ANCHOR"))
    with pytest.raises(filechannel.CorruptLogError, match="not the one this channel wrote"):
        filechannel.open(a, encryption=enc(), **OPTS)
    res = verify_channel(a, encryption=enc())
    assert not res.ok
    got, stats = take_all(a, on_corruption="skip")
    assert not any(x.startswith(b"copy-") for x in got), "a copy's events were delivered"
    assert stats["corruption_report"], "skip mode must report the swap"
    assert stats["lost_positions"], "the original's events in the replaced file are lost, and said so"


def test_an_older_anchor_put_back_is_recognised_by_its_generation() -> None:
    """ANCHOR older than the newest checkpoint hides batches only a newer ANCHOR vouched for: refused."""
    fs = SimFS()
    d = "/sim/ch"
    opts = {**OPTS, "fs": fs, "encryption": enc()}
    ch = filechannel.open(d, **opts)
    put_one = ch.transaction
    for body in (b"a", b"b"):
        with put_one() as tx:
            tx.put(body)
    old = fs.read(f"{d}/ANCHOR")  # valid, MACed: the attacker kept a copy
    ch.checkpoint()
    with put_one() as tx:
        tx.put(b"c")
    ch.checkpoint()
    w = ch._log._writers[0]
    vouched_by_checkpoint = w.offset
    for body in (b"d", b"e"):
        with put_one() as tx:
            tx.put(body)
    assert ch._log.refresh_anchor()  # ANCHOR now vouches for d and e; no checkpoint does
    seg = f"{d}/data/seg-{w.file_id:016x}.wal"
    crashed = fs.crash(0, "keep")  # the owner is killed
    crashed.write(f"{d}/ANCHOR", old)
    crashed.write(seg, crashed.read(seg)[:vouched_by_checkpoint])  # d and e cut whole
    attacked = crashed.snapshot()
    with pytest.raises(filechannel.CorruptLogError, match="ANCHOR is older than checkpoint"):
        filechannel.open(d, **{**opts, "fs": attacked})
    with filechannel.open(d, **{**opts, "fs": crashed.snapshot(), "on_corruption": "skip"}) as ch2:
        assert any("ANCHOR is older" in r for r in ch2.stats()["corruption_report"])
    res = verify_channel(d, fs=crashed.snapshot(), encryption=enc())
    assert not res.ok


# -- item 8: positions vouched for are never given out again -----------------------------------


def test_skip_mode_reports_the_positions_of_anchored_batches_cut_and_never_reissues_them() -> None:
    fs = SimFS()
    d = "/sim/ch"
    opts = {**OPTS, "fs": fs, "encryption": enc()}
    ch = filechannel.open(d, **opts)
    for body in (b"a", b"b"):
        with ch.transaction() as tx:
            tx.put(body)
    ch.checkpoint()
    w = ch._log._writers[0]
    vouched_by_checkpoint = w.offset
    with ch.transaction() as tx:
        tx.put(b"c")
        tx.put(b"d")
    with ch.transaction() as tx:
        tx.put(b"e")
    assert ch._log.refresh_anchor()  # positions 2..4 are vouched for by ANCHOR only
    seg = f"{d}/data/seg-{w.file_id:016x}.wal"
    crashed = fs.crash(0, "keep")
    crashed.write(seg, crashed.read(seg)[:vouched_by_checkpoint])  # c, d, e cut whole
    with pytest.raises(filechannel.CorruptLogError, match="shorter than"):
        filechannel.open(d, **{**opts, "fs": crashed.snapshot()})
    with filechannel.open(d, **{**opts, "fs": crashed, "on_corruption": "skip"}) as ch2:
        assert ch2.stats()["lost_positions"] == [[2, 5]]
        with ch2.transaction() as tx:
            tx.put(b"f")
        with ch2.transaction() as tx:
            got = [(e.position, e.body) for e in tx.take_batch(10)]
    assert got == [(0, b"a"), (1, b"b"), (5, b"f")]


# -- item 7: an older .ack put back ----------------------------------------------------------


def test_an_older_ack_put_back_is_refused_not_read_again(tmp_path: Path) -> None:
    """Choice: refused (CorruptLogError for the reader, verify reports it, the owner applies nothing for it)."""
    d = str(tmp_path / "c")
    start = put_and_ack(d, 8, 3)
    ack = Path(d, "consumers", "r1.ack")
    old = ack.read_bytes()  # valid and MACed: the attacker kept a copy
    with filechannel.ChannelReader(d, "r1", encryption=enc()) as r:
        r.ack(start + 6)
    with filechannel.open(d, encryption=enc(), **OPTS) as ch:  # the owner sees the newer ack (and applies it)
        assert ch.size == 2
    ack.write_bytes(old)
    with pytest.raises(filechannel.CorruptLogError, match="older than the one the channel's owner recorded"):
        filechannel.ChannelReader(d, "r1", encryption=enc()).available()
    res = verify_channel(d, encryption=enc())
    assert not res.ok
    assert any("older than the one the channel's owner recorded" in r.reason for r in res.reports)
    with filechannel.open(d, encryption=enc(), **OPTS) as ch:  # the owner applies nothing for it
        assert ch.size == 2
        assert "older than the one" in str(ch.stats()["consumers_problem"])


def test_a_reset_and_a_new_registration_are_not_taken_for_an_older_ack(tmp_path: Path) -> None:
    d = str(tmp_path / "c")
    start = put_and_ack(d, 8, 6)
    with filechannel.open(d, encryption=enc(), **OPTS):
        pass  # the owner records the ack it saw
    keystore = tmp_path / "keys.json"
    keystore.write_text(json.dumps({"k1": base64.b64encode(KEY).decode()}))
    keystore.chmod(0o600)
    args = ["consumers", d, "--reset", "r1", "--to-position", str(start + 6), "--keystore", str(keystore)]
    assert cli_main(args) == 0  # a reset moves back or forth: a newer write, not an older one
    with filechannel.open(d, encryption=enc(), **OPTS):
        pass
    with filechannel.ChannelReader(d, "r1", encryption=enc()) as r:
        assert r.available()[0] == start + 6
    assert cli_main(["consumers", d, "--remove", "r1"]) == 0
    with filechannel.ChannelReader(d, "r1", encryption=enc()) as r:  # registered again: a newer registration
        r.available()
    assert verify_channel(d, encryption=enc()).ok


# -- the authenticated list's codec ---------------------------------------------------------


def test_the_authenticated_list_round_trips_and_still_reads_the_version_without_generations() -> None:
    entry = fmt.AuthEntry(3, 4096, bytes(range(16)), bytes(range(16, 32)), 0)
    marks = (fmt.AckMark("r1", 1795442599091940751, 7), fmt.AckMark("spark.q-2", 5, 1))
    state = fmt.AuthState(2, (entry,), generation=9, next_position=1234, acks=marks)
    buf = fmt.encode_auth_state(state)
    assert buf[:8] == b"FCAUTH02"
    assert fmt.decode_auth_state(buf) == state
    # What earlier releases wrote (FCAUTH01): the entries only; no generation, position or marks.
    v1 = b"FCAUTH01" + struct.pack("<QI", 2, 1) + buf[36 : 36 + 52]
    assert fmt.decode_auth_state(v1) == fmt.AuthState(2, (entry,))
    for bad in (buf[:-1], buf + b"\0", buf[: 36 + 52], buf[:30], v1 + b"\0"):
        with pytest.raises(filechannel.FormatError):
            fmt.decode_auth_state(bad)


def test_anchor_rewritten_at_open_keeps_the_next_position_and_the_ack_marks(tmp_path: Path) -> None:
    """A key rotation rewrites ANCHOR at open: what it vouched for (positions, acks) stays vouched for."""
    d = str(tmp_path / "c")
    put_and_ack(d, 5, 2)
    with filechannel.open(d, encryption=enc(), **OPTS):
        pass  # the owner reads r1's ack; its close records it
    before = fmt.decode_auth_state(fmt.split_sealed(Path(d, "ANCHOR").read_bytes())[0])
    assert before.next_position == 5
    assert [a.name for a in before.acks] == ["r1"]
    rotated = Encryption(keys={"k1": KEY, "k2": bytes(range(1, 33))}, active_key="k2")
    with filechannel.open(d, encryption=rotated, **OPTS):
        body, key_id, _tag = fmt.split_sealed(Path(d, "ANCHOR").read_bytes())
        assert key_id == "k2"  # rewritten at this open
        now = fmt.decode_auth_state(body)
        assert now.generation > before.generation
        assert now.next_position == before.next_position
        assert now.acks == before.acks
