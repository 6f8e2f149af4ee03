"""The model of ``filechannel top``: samples of channels, the rates between two of them, and the table.

This module owns what ``top`` shows and how it is computed, with no I/O: a
:class:`Sample` is what one target (a channel directory or an agent) said at
one moment; :func:`rows` turns the previous and the current sample into rows
(depth, put and take rates from the positions' movement, consumer lag, fsync
latency quantiles from a cumulative histogram, disk free, connections);
:func:`table` lays rows out as text lines and :func:`document` as the JSON
document of ``--once --json``. Reading the targets is ``top_sources.py``;
drawing on a terminal is ``top_screen.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ChannelReading",
    "ConsumerReading",
    "Sample",
    "document",
    "histogram_quantile",
    "human_bytes",
    "rate",
    "rows",
    "table",
]


@dataclass(frozen=True)
class ConsumerReading:
    """One external consumer of a channel: its acknowledged mark and the queued events (bytes) after it."""

    name: str
    acked: int
    lag_events: int
    lag_bytes: int | None = None


@dataclass(frozen=True)
class ChannelReading:
    """One channel at one moment.

    ``start``/``end``: the queued positions ``[start, end)`` (``end`` moves with
    every committed put, ``start`` with every committed take, and neither goes
    back, so their movement gives the rates). ``fsync_buckets``: the commits'
    fdatasync durations as a cumulative histogram ``[(upper bound, count)]``,
    the last bound ``inf`` (empty when the target does not expose it).
    """

    name: str
    start: int
    end: int
    depth_bytes: int | None = None
    disk_free: int | None = None
    fsync_buckets: tuple[tuple[float, float], ...] = ()
    consumers: tuple[ConsumerReading, ...] = ()


@dataclass(frozen=True)
class Sample:
    """What one target said at ``time`` (monotonic seconds), or why it could not be read (``error``)."""

    target: str
    kind: str  # "dir" or "agent"
    time: float
    channels: tuple[ChannelReading, ...] = ()
    connections: dict[str, int] | None = None
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def rate(before: int | None, after: int, seconds: float) -> float | None:
    """Per second from ``before`` to ``after`` over ``seconds``; None when it cannot be told.

    None without a previous value, over no time, or when the value went back
    (the channel was recreated, or another agent answered): a rate is never
    made up from a counter that restarted.
    """
    if before is None or not seconds > 0 or after < before:
        return None
    return (after - before) / seconds


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """The ``q`` quantile (0..1) of a cumulative histogram ``[(upper bound, count)]``, as Prometheus estimates it.

    Linear within the bucket that holds it (from 0 or the bucket below); a
    quantile in the ``+Inf`` bucket is the largest finite bound. None when the
    histogram is empty.
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be within 0 and 1, got {q}")
    if not buckets:
        return None
    ordered = sorted(buckets)
    total = ordered[-1][1]
    if total <= 0:
        return None
    want = q * total
    lo_bound, lo_count = 0.0, 0.0
    for bound, count in ordered:
        if count >= want:
            if math.isinf(bound):
                return lo_bound
            if count == lo_count:
                return bound
            return lo_bound + (bound - lo_bound) * (want - lo_count) / (count - lo_count)
        lo_bound, lo_count = bound, count
    return lo_bound


def _bucket_delta(
    before: tuple[tuple[float, float], ...], after: tuple[tuple[float, float], ...]
) -> tuple[tuple[float, float], ...]:
    """``after - before`` per bound: the fsyncs of the interval (empty if the bounds differ or it went back)."""
    if not before or [b for b, _ in before] != [b for b, _ in after]:
        return ()
    out = tuple((b, a - p) for (b, a), (_, p) in zip(after, before, strict=True))
    if any(n < 0 for _, n in out) or out[-1][1] <= 0:
        return ()
    return out


def _fsync_quantiles(
    before: ChannelReading | None, after: ChannelReading
) -> tuple[float | None, float | None, str | None]:
    """p50 and p99 of the fsyncs of the last interval, else of every fsync since the channel opened."""
    if not after.fsync_buckets:
        return None, None, None
    window = "interval"
    hist = _bucket_delta(before.fsync_buckets, after.fsync_buckets) if before is not None else ()
    if not hist:
        hist, window = after.fsync_buckets, "since_open"
    p50, p99 = histogram_quantile(0.5, hist), histogram_quantile(0.99, hist)
    return p50, p99, (window if p50 is not None else None)


def rows(before: Sample | None, after: Sample) -> list[dict[str, Any]]:
    """One row per channel of ``after`` (rates against the same channel in ``before``), as plain JSON values.

    A target that could not be read gives one row with its ``error`` and no numbers.
    """
    if after.error is not None:
        return [{"target": after.target, "kind": after.kind, "channel": None, "error": after.error}]
    dt = after.time - before.time if before is not None and before.error is None else 0.0
    prev = {c.name: c for c in before.channels} if before is not None else {}
    out = []
    for ch in after.channels:
        p = prev.get(ch.name)
        p50, p99, window = _fsync_quantiles(p, ch)
        out.append(
            {
                "target": after.target,
                "kind": after.kind,
                "channel": ch.name,
                "error": None,
                "start": ch.start,
                "end": ch.end,
                "depth_events": max(0, ch.end - ch.start),
                "depth_bytes": ch.depth_bytes,
                "put_rate": rate(p.end if p else None, ch.end, dt),
                "take_rate": rate(p.start if p else None, ch.start, dt),
                "fsync_p50_seconds": p50,
                "fsync_p99_seconds": p99,
                "fsync_window": window,
                "disk_free_bytes": ch.disk_free,
                "connections": after.connections,
                "consumers": [
                    {"name": c.name, "acked": c.acked, "lag_events": c.lag_events, "lag_bytes": c.lag_bytes}
                    for c in ch.consumers
                ],
            }
        )
    return out


def document(before: Sequence[Sample | None], after: Sequence[Sample], wall_time: float) -> dict[str, Any]:
    """The JSON document of ``--once --json``: ``{"time", "channels": [row, ...]}`` (rows as :func:`rows`)."""
    out: list[dict[str, Any]] = []
    for b, a in zip(before, after, strict=True):
        out.extend(rows(b, a))
    return {"time": round(wall_time, 3), "channels": out}


def human_bytes(n: float | None) -> str:
    """``1.5M``-style bytes (powers of 1024), ``-`` for unknown."""
    if n is None:
        return "-"
    for unit in ("B", "K", "M", "G", "T"):
        if abs(n) < 1024 or unit == "T":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def _num(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.2f}"


HEADER = (
    f"{'CHANNEL':<24} {'DEPTH':>9} {'BYTES':>8} {'PUT/s':>9} {'TAKE/s':>9} "
    f"{'FSYNC p50/p99 ms':>17} {'DISK FREE':>9}  CONNS"
)


def _conns(c: dict[str, int] | None) -> str:
    if c is None:
        return "-"
    return " ".join(f"{k} {v}" for k, v in sorted(c.items())) or "0"


def table(all_rows: Sequence[dict[str, Any]]) -> list[str]:
    """The text lines of the rows: a header, then per target its channels and under each its consumers."""
    lines = [HEADER]
    target = None
    for r in all_rows:
        if r["target"] != target:
            target = r["target"]
            lines.append(f"{target} ({r['kind']})")
        if r["error"] is not None:
            lines.append(f"  unreachable: {r['error']}")
            continue
        fs = f"{_ms(r['fsync_p50_seconds'])}/{_ms(r['fsync_p99_seconds'])}"
        lines.append(
            f"  {r['channel']:<22.22} {r['depth_events']:>9} {human_bytes(r['depth_bytes']):>8} "
            f"{_num(r['put_rate']):>9} {_num(r['take_rate']):>9} {fs:>17} "
            f"{human_bytes(r['disk_free_bytes']):>9}  {_conns(r['connections'])}"
        )
        for c in r["consumers"]:
            lines.append(
                f"    consumer {c['name']}: acked {c['acked']}, lag {c['lag_events']} events"
                f" ({human_bytes(c['lag_bytes'])})"
            )
    return lines
