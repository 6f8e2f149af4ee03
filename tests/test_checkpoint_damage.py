"""Damage in the newest data file's last batch, where a checkpoint vouches for that length.

Recovery reads damage past the end of the last verified batch of the newest
data file as a torn tail (a write the crash cut short: cut off, nothing was
acknowledged) only beyond the length the newest checkpoint recorded for the
file. Below it the bytes were durable and acknowledged, so a checksum
mismatch there is corruption (docs/checkpoints.md, docs/design.md "Recovery"):

* a default open raises ``CorruptLogError`` naming the file and the damaged
  offset, inside the damaged batch;
* ``on_corruption="skip"`` keeps every record that still verifies on its own
  (the batch's other events) and reports exactly the lost position.

Both replays are checked. Only the full scan reads the damaged batch at open
(a checkpoint replay resumes past it and meets the damage when the event is
taken), so the ``full`` cases are the ones that tell corruption from a torn
tail: reading this damage as a torn tail loses the batch's intact events, and
the open only sees "events the checkpoint vouched for are missing", at byte 0.

And what skip mode kept stays kept: the checkpoint written after a skip-mode
open must go on vouching for the salvaged records, or the next open cuts them
off as a torn tail (newest file) or reads them as below the checkpoint's
write-order floor (once the file is sealed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from helpers import contents, put
from simfs import SimFS

import filechannel
from filechannel import format as fmt
from filechannel.log import CHANNEL_FILE, decode_channel_file

DIR = "/sim/ch"
OPTS: dict[str, Any] = {"background": False, "minimum_required_space": 0, "max_file_size": 64 * 1024}


def body(txn: int, i: int) -> bytes:
    tag = f"txn{txn}-ev{i}:".encode()
    return tag + bytes([65 + (3 * txn + i) % 26]) * (120 - len(tag))


@dataclass
class Built:
    fs: SimFS
    full: list[tuple[int, bytes]]  # the queue: (position, body)
    path: str  # the newest (here the only) data file
    batch: tuple[int, int]  # its last batch: [start, end)
    target: int  # the offset of the flipped byte (inside an event body of that batch)
    lost: int  # the position of that event


def build() -> Built:
    fs = SimFS()
    ch = filechannel.open(DIR, fs=fs, **OPTS)
    for t in range(5):
        put(ch, *(body(t, i) for i in range(3)))  # one transaction, one batch
    # (Reading the queue here would roll back takes: a ROLLBACK note would become the last batch.)
    full = [(3 * t + i, body(t, i)) for t in range(5) for i in range(3)]
    ch.checkpoint()  # vouches for the data file's length: every batch above
    ch.close()
    paths = sorted(p for p in fs.files(DIR + "/data") if p.endswith(".wal"))
    assert len(paths) == 1
    path = paths[0]
    data = fs.read(path)
    cid, kind, _ = decode_channel_file(fs.read(f"{DIR}/{CHANNEL_FILE}"))
    h = fmt.decode_file_header(data)
    assert isinstance(h, fmt.FileHeader)
    seed = fmt.file_seed(kind, cid, h.file_id)
    # Walk the records: the last batch starts after the second-to-last BATCH_END.
    pos, starts = h.header_len, [h.header_len]
    while pos < len(data):
        r = fmt.decode_record(data, pos, seed, kind, 1 << 20)
        assert isinstance(r, fmt.Record)
        pos = r.end
        if r.op == fmt.BATCH_END:
            starts.append(pos)
    assert len(starts) == 6  # the header, then five batches
    start, end = starts[-2], starts[-1]
    assert end == len(data)  # the last batch ends the file (close trimmed the zero-filled space)
    damaged = body(4, 1)  # the middle event of the last transaction
    at = data.index(damaged, start, end)
    target = at + len(damaged) - 7
    lost = next(p for p, b in full if b == damaged)
    flipped = bytearray(data)
    flipped[target] ^= 0x20
    fs.write(path, bytes(flipped))
    return Built(fs, full, path, (start, end), target, lost)


@pytest.mark.parametrize("replay", ["checkpoint", "full"])
def test_damage_in_the_last_vouched_batch_of_the_newest_file_is_refused(replay: str) -> None:
    b = build()
    with pytest.raises(filechannel.CorruptLogError) as ei:
        filechannel.open(DIR, fs=b.fs, replay=replay, **OPTS)
    err = ei.value
    assert err.path == b.path, str(err)
    start, end = b.batch
    assert start <= err.offset < end, f"offset {err.offset} outside the damaged batch [{start}, {end}): {err}"
    assert err.offset <= b.target, str(err)
    assert b.path in str(err)
    assert f"byte {err.offset}" in str(err)
    # Refused, not repaired: the file is as it was (no torn tail cut off).
    assert len(b.fs.read(b.path)) == end


@pytest.mark.parametrize("replay", ["checkpoint", "full"])
def test_skip_mode_keeps_every_record_that_verifies_in_the_last_vouched_batch(replay: str) -> None:
    b = build()
    ch = filechannel.open(DIR, fs=b.fs, replay=replay, on_corruption="skip", **OPTS)
    try:
        got = contents(ch)
        st = ch.stats()
    finally:
        ch.close()
    # Everything but the damaged event, its two neighbours in the batch included, at their positions.
    assert got == [(p, x) for p, x in b.full if p != b.lost]
    assert st["lost_positions"] == [[b.lost, b.lost + 1]]
    assert st["corruptions_skipped"] >= 1
    assert any(b.path in r for r in st["corruption_report"]), st["corruption_report"]
    assert st["torn_tails_truncated"] == 0


@pytest.mark.parametrize("replay", ["checkpoint", "full"])
def test_salvaged_records_of_the_newest_file_survive_the_next_checkpoint(replay: str) -> None:
    """A skip-mode open keeps the batch's verifying records; its checkpoint must keep vouching for them.

    The damaged batch lies past the newest file's verified end. If the next
    checkpoint recorded only that end as the file's length, the next open would
    read the salvaged records as a torn tail and cut them off (their events lost).
    """
    b = build()
    ch = filechannel.open(DIR, fs=b.fs, replay=replay, on_corruption="skip", **OPTS)
    try:
        got = contents(ch)
        ch.checkpoint()
    finally:
        ch.close()
    assert got == [(p, x) for p, x in b.full if p != b.lost]
    for again in ("checkpoint", "full"):
        ch = filechannel.open(DIR, fs=b.fs, replay=again, on_corruption="skip", **OPTS)
        try:
            st = ch.stats()
            assert contents(ch) == got, f"{replay} then {again}: {st['corruption_report']}"
            assert st["torn_tails_truncated"] == 0
        finally:
            ch.close()
    assert len(b.fs.read(b.path)) == b.batch[1]  # nothing cut off
    ch = filechannel.open(DIR, fs=b.fs, replay=replay, on_corruption="skip", **OPTS)
    try:
        put(ch, b"after")  # new commits at a fresh position
        assert contents(ch) == [*got, (b.full[-1][0] + 1, b"after")]
    finally:
        ch.close()
