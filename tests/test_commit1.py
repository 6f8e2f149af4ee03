"""One-event transactions (issue 26): the writer's lone-committer path, framed in one call.

``writer.frame_commit1`` frames a one-event transaction's whole write (its PUT,
COMMIT and BATCH_END) in one C call (``_speedups.frame_commit1``); its
pure-Python twin ``writer._frame_commit1`` composes the general path's
encoder calls. Both must give the same bytes on every input, and what they
write must read back through a reopen on both paths. (Durability of the path:
tests/test_group_commit.py and the ``w_one_event`` crash-point workload.)
"""

from __future__ import annotations

from typing import Any

import pytest
from helpers import NO_ACCELERATOR
from hypothesis import given, settings
from hypothesis import strategies as st

import filechannel
from filechannel import format as fmt
from filechannel import format as writer  # frame_commit1 and its twin live beside the other encoders
from filechannel.writer import Writer

C = fmt.speedups
needs_c = pytest.mark.skipif(C is None, reason=NO_ACCELERATOR)
U64 = st.integers(0, 2**64 - 3)


@needs_c
@settings(max_examples=300, deadline=None)
@given(
    kind=st.sampled_from([fmt.CRC32C, fmt.CRC32_ZLIB]),
    seed=st.integers(0, 2**32 - 1),
    woid=U64,
    txn_id=st.integers(0, 2**64 - 1),
    payload=st.binary(max_size=300),
    prefix=st.sampled_from([b"", fmt.EMPTY_HEADERS]),
    start=st.integers(0, 2**64 - 1),
    first=st.integers(0, 2**64 - 1),
)
def test_frame_commit1_is_byte_identical_to_the_general_path(
    kind: int, seed: int, woid: int, txn_id: int, payload: bytes, prefix: bytes, start: int, first: int
) -> None:
    c = C.frame_commit1(seed, kind, woid, txn_id, payload, prefix, start, first)
    py = writer._frame_commit1(seed, kind, woid, txn_id, payload, prefix, start, first)
    assert c == py
    # The PUT, then the COMMIT and the BATCH_END, at the sizes the writer accounts for.
    assert len(c) == fmt.record_size(len(prefix) + len(payload)) + writer._COMMIT1_TAIL


@needs_c
@pytest.mark.parametrize(
    "args",
    [
        (-1, 0, 0, 0),  # a negative woid
        (2**64 - 2, 0, 0, 0),  # woid + 2 does not fit
        (0, -1, 0, 0),
        (0, 0, -1, 0),
        (0, 0, 0, 2**64),
    ],
)
def test_frame_commit1_refuses_what_does_not_fit_and_so_does_the_twin(args: tuple[int, int, int, int]) -> None:
    woid, txn_id, start, first = args
    with pytest.raises(OverflowError):
        C.frame_commit1(1, fmt.CRC32C, woid, txn_id, b"x", b"", start, first)
    with pytest.raises((OverflowError, ValueError, fmt.struct.error)):
        writer._frame_commit1(1, fmt.CRC32C, woid, txn_id, b"x", b"", start, first)
    with pytest.raises(TypeError):
        C.frame_commit1(1, fmt.CRC32C, 0, 0, "text", b"", 0, 0)


@pytest.mark.parametrize("accel", [True, False], ids=["c", "pure"])
def test_one_event_commits_read_back_on_both_paths(tmp_path: Any, accel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if accel and C is None:
        pytest.skip(NO_ACCELERATOR)
    if not accel:
        monkeypatch.setattr(fmt, "speedups", None)
    lone: list[int] = []
    plain = Writer._write_commit1

    def spy(self: Writer, it: Any) -> None:
        lone.append(it.txn_id)
        plain(self, it)

    monkeypatch.setattr(Writer, "_write_commit1", spy)
    d = str(tmp_path / "ch")
    bodies = [bytes([65 + i % 26]) * (i * 37 % 500) for i in range(60)]
    with filechannel.open(d, max_file_size=8192) as ch:  # several rolls
        for i, b in enumerate(bodies):
            with ch.transaction() as tx:
                if i % 3:
                    tx.put(b)
                else:
                    tx.put(b, headers={"i": str(i)})
        with ch.transaction() as tx:
            tx.put_many([b"one"])  # put_many of one body takes put's path
    assert len(lone) >= 50  # all but the commits that started a file
    with filechannel.open(d, replay="full") as ch, ch.transaction() as tx:
        got = tx.take_batch(100)
    assert [e.body for e in got] == [*bodies, b"one"]
    assert [e.position for e in got] == list(range(61))
    assert [dict(e.headers) for e in got[:3]] == [{"i": "0"}, {}, {}]
