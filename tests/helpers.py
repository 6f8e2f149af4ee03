"""Small helpers shared by the test modules (imported as ``helpers``)."""

from __future__ import annotations

import filechannel


def contents(ch: filechannel.FileChannel) -> list[tuple[int, bytes]]:
    """The queue as ``(position, body)`` pairs, read by taking everything and rolling back."""
    tx = ch.transaction()
    evs = tx.take_batch(100_000)
    tx.rollback()
    return [(e.position, e.body) for e in evs]


def put(ch: filechannel.FileChannel, *bodies: bytes) -> None:
    """Put ``bodies`` in one committed transaction."""
    with ch.transaction() as tx:
        for b in bodies:
            tx.put(b)
