"""Delivery checks: compare what went into a pipeline with what came out, and say what differs.

:func:`assert_exactly_once` and :func:`assert_at_least_once` take the produced
and the delivered items (events, bodies, Spark rows as dicts or ``Row``
objects, anything hashable once keyed) and fail with a short report: the
counts, then the first few missing, duplicated, unexpected and (when order is
asked for) reordered items, each with its index, never a diff of the whole
stream.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DeliveryError", "DeliveryReport", "assert_at_least_once", "assert_exactly_once", "compare"]

SHOW = 5  # how many items of each kind a report lists

Key = str | Callable[[Any], Any] | None


class DeliveryError(AssertionError):
    """What was delivered is not what was produced; ``report`` holds the details."""

    def __init__(self, report: DeliveryReport, message: str) -> None:
        super().__init__(message)
        self.report = report


@dataclass
class DeliveryReport:
    """The difference between produced and delivered items, by identity (the key).

    ``missing``: (identity, index in produced, copies lost); ``duplicated``:
    (identity, index in delivered of the first extra copy, extra copies);
    ``unexpected``: (identity, index in delivered), never produced;
    ``reordered``: (identity, index in delivered) of the first item delivered
    before one produced ahead of it (only when order was checked).
    """

    produced: int
    delivered: int
    missing: list[tuple[Any, int, int]] = field(default_factory=list)
    duplicated: list[tuple[Any, int, int]] = field(default_factory=list)
    unexpected: list[tuple[Any, int]] = field(default_factory=list)
    reordered: list[tuple[Any, int]] = field(default_factory=list)

    @property
    def lost(self) -> int:
        """Copies produced but not delivered."""
        return sum(n for _, _, n in self.missing)

    @property
    def extra(self) -> int:
        """Extra copies of produced items that were delivered more than once."""
        return sum(n for _, _, n in self.duplicated)

    def summary(self) -> str:
        """One line of counts."""
        return (
            f"produced {self.produced}, delivered {self.delivered}: missing {self.lost}, "
            f"duplicated {self.extra} ({len(self.duplicated)} items), unexpected {len(self.unexpected)}"
            + (", reordered" if self.reordered else "")
        )

    def describe(self, what: str) -> str:
        """The report: the counts, then the first few items of each kind."""
        lines = [f"{what}: {self.summary()}"]
        if self.missing:
            lines.append(f"  first missing (of {len(self.missing)}):")
            lines += [
                f"    {show(k)}  produced #{i}, {n} cop{'y' if n == 1 else 'ies'} lost"
                for k, i, n in self.missing[:SHOW]
            ]
        if self.duplicated:
            lines.append(f"  first duplicated (of {len(self.duplicated)}):")
            lines += [f"    {show(k)}  delivered again at #{i}, {n} extra" for k, i, n in self.duplicated[:SHOW]]
        if self.unexpected:
            lines.append(f"  first unexpected, never produced (of {len(self.unexpected)}):")
            lines += [f"    {show(k)}  delivered #{i}" for k, i in self.unexpected[:SHOW]]
        if self.reordered:
            k, i = self.reordered[0]
            lines.append(f"  first reordered: {show(k)}  delivered #{i} before an item produced ahead of it")
        return "\n".join(lines)


def show(item: Any, limit: int = 60) -> str:
    """A short repr of an identity (long values are cut, with their length)."""
    r = repr(item)
    if len(r) <= limit:
        return r
    size = f", {len(item)} bytes" if isinstance(item, bytes) else ""
    return f"{r[:limit]}...({len(r)} chars{size})"


def identity_of(key: Key) -> Callable[[Any], Hashable]:
    """The function that maps an item to its identity (bytes-like values become bytes)."""

    def norm(v: Any) -> Hashable:
        if isinstance(v, (bytearray, memoryview)):
            return bytes(v)
        if isinstance(v, list):
            return tuple(norm(x) for x in v)
        if isinstance(v, dict):
            return tuple(sorted((k, norm(x)) for k, x in v.items()))
        return v  # type: ignore[no-any-return]

    def default(item: Any) -> Hashable:
        # An Event (or anything with a ``body``), a row as a mapping with "body", or the item itself.
        body = getattr(item, "body", None)
        if body is not None and not callable(body):
            return norm(body)
        if isinstance(item, Mapping) and "body" in item:
            return norm(item["body"])
        as_dict = getattr(item, "asDict", None)  # a pyspark Row
        if callable(as_dict):
            d = as_dict()
            return norm(d["body"]) if "body" in d else norm(tuple(d.values()))
        return norm(item)

    if key is None:
        return default
    if isinstance(key, str):
        name = key

        def by_name(item: Any) -> Hashable:
            if isinstance(item, Mapping):
                return norm(item[name])
            try:
                return norm(item[name])  # a pyspark Row supports row["col"]
            except (TypeError, KeyError, IndexError, ValueError):
                return norm(getattr(item, name))

        return by_name
    if callable(key):
        fn = key
        return lambda item: norm(fn(item))
    raise TypeError(f"key must be None, a field name or a callable, not {type(key).__name__}")


def compare(
    produced: Iterable[Any], delivered: Iterable[Any], key: Key = None, ordered: bool = False
) -> DeliveryReport:
    """Compare produced and delivered items by identity; return what differs (nothing raised).

    Args:
        produced: What went in (events, bodies, rows...).
        delivered: What came out.
        key: Picks the identity: ``None`` (an item's ``body`` when it has one,
            else the item), a field name (``row[name]``), or a callable.
        ordered: Also report the first item delivered out of produced order
            (first deliveries only; duplicates do not count as reordering).
    """
    ident = identity_of(key)
    p_keys = [ident(x) for x in produced]
    d_keys = [ident(x) for x in delivered]
    p_count = Counter(p_keys)
    r = DeliveryReport(produced=len(p_keys), delivered=len(d_keys))
    seen: Counter[Hashable] = Counter()
    for i, k in enumerate(d_keys):
        seen[k] += 1
        if k not in p_count:
            r.unexpected.append((k, i))
        elif seen[k] == p_count[k] + 1:
            r.duplicated.append((k, i, 0))
    r.duplicated = [(k, i, seen[k] - p_count[k]) for k, i, _ in r.duplicated]
    first_index: dict[Hashable, int] = {}
    for i, k in enumerate(p_keys):
        first_index.setdefault(k, i)
        if seen[k] < p_count[k] and first_index[k] == i:
            r.missing.append((k, i, p_count[k] - seen[k]))
    if ordered:
        last = -1
        firsts: set[Hashable] = set()
        for i, k in enumerate(d_keys):
            if k in firsts or k not in first_index:
                continue
            firsts.add(k)
            if first_index[k] < last:
                r.reordered.append((k, i))
                break
            last = first_index[k]
    return r


def assert_exactly_once(
    produced: Iterable[Any], delivered: Iterable[Any], key: Key = None, *, ordered: bool = False
) -> DeliveryReport:
    """Fail unless every produced item was delivered exactly as many times as it was produced.

    Nothing missing, nothing doubled, nothing that was never produced (and, with
    ``ordered=True``, nothing out of order). Raises :class:`DeliveryError` (an
    ``AssertionError``) with a short report; returns the report when all is well.
    See :func:`compare` for ``key``.
    """
    __tracebackhide__ = True
    r = compare(produced, delivered, key, ordered)
    if r.missing or r.duplicated or r.unexpected or r.reordered:
        raise DeliveryError(r, r.describe("not exactly once"))
    return r


def assert_at_least_once(
    produced: Iterable[Any], delivered: Iterable[Any], key: Key = None, *, ordered: bool = False
) -> DeliveryReport:
    """Fail if a produced item was not delivered, or something never produced was.

    Duplicates are allowed (the report returned counts them). With
    ``ordered=True`` the first deliveries must follow the produced order.
    """
    __tracebackhide__ = True
    r = compare(produced, delivered, key, ordered)
    if r.missing or r.unexpected or r.reordered:
        raise DeliveryError(r, r.describe("not at least once"))
    return r
