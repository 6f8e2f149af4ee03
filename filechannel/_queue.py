"""The queue's shared types: an entry, entries as columns, and the takes of one transaction.

It owns no queue (``_runs.RunQueue`` does) and no I/O: ``Entry`` is a
position and the pointer ``(file_id, offset, size)`` of the event's PUT
record; ``Columns`` holds entries as four parallel ``array('q')`` columns, as
a take pops them; ``Taken`` keeps what one transaction took in that form and
makes ``Entry`` tuples only when one is needed at a time.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator

Entry = tuple[int, int, int, int]
"""``(position, file_id, offset, size)``."""

Columns = tuple["array[int]", "array[int]", "array[int]", "array[int]"]
"""Entries as four parallel columns: positions, file ids, offsets, sizes."""


class Taken:
    """The entries one transaction has taken, kept as popped: column slices or tuples.

    A take pops the head as column slices (``RunQueue.pop_columns``);
    they become ``Entry`` tuples only when something needs them one by one (a
    rollback, a checkpoint, a damaged event). Parts are only appended, under
    the channel's lock, so a checkpoint reading :meth:`entries` under that lock
    sees every part whole; whoever removes entries assigns a new ``Taken``.
    """

    __slots__ = ("_parts", "count")

    def __init__(self, entries: list[Entry] | None = None) -> None:
        self._parts: list[list[Entry] | Columns] = [entries] if entries else []
        self.count = len(entries) if entries else 0

    def __len__(self) -> int:
        return self.count

    def add(self, part: list[Entry] | Columns, n: int | None = None) -> None:
        """Append entries popped from the queue (a list of entries, or columns), ``n`` of them."""
        if n is None:
            n = len(part[0]) if isinstance(part, tuple) else len(part)
        if n:
            self._parts.append(part)
            self.count += n

    def entries(self) -> list[Entry]:
        """Return every entry, in the order taken (a new list)."""
        out: list[Entry] = []
        for part in self._parts:
            if isinstance(part, tuple):
                out.extend(zip(*part, strict=True))
            else:
                out.extend(part)
        return out

    def __iter__(self) -> Iterator[Entry]:
        return iter(self.entries())

    def one_run(self) -> tuple[int, int, int] | None:
        """Return ``(file_id, first_position, count)`` for the usual take, else None.

        The usual take: every entry popped as columns in one call, one run of
        consecutive positions in one file.
        """
        if len(self._parts) != 1:
            return None
        part = self._parts[0]
        if not isinstance(part, tuple):
            return None
        pos, fid = part[0], part[1]
        n = len(pos)
        # The columns hold distinct positions in ascending order: first and last decide.
        if pos[n - 1] - pos[0] == n - 1 and fid == array("q", (fid[0],)) * n:  # compared in C
            return fid[0], pos[0], n
        return None
