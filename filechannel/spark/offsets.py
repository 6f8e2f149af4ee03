"""The Spark source's offsets, for both readers (channel directories and agents' channels).

This module owns what :mod:`filechannel.spark.source` and
:mod:`filechannel.spark.remote` share about offsets: the one way an offset is
built and parsed (:func:`make_offset`, :func:`parse_offset`; Spark compares
offsets as JSON strings, so they are canonical), ``startingPosition`` /
``endingPosition`` (checked, keyed by channel, resolved per channel), how a
micro-batch's read limit and ``minPartitions`` are shared among channels, and
the errors (with their hints) of a checkpoint that does not fit its channels.
No Spark is imported here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from filechannel.errors import ChannelError, ConfigError, DataLossError

__all__ = [
    "AHEAD_HINT",
    "BEHIND_HINT",
    "CheckpointMismatchError",
    "check_position_keys",
    "lost",
    "make_offset",
    "one_position",
    "parse_offset",
    "position_option",
    "resolve_position",
    "share",
    "share_partitions",
]


class CheckpointMismatchError(ChannelError):
    """A streaming query's Spark checkpoint does not belong to the channel or the consumer it reads."""


def position_option(opts: Mapping[str, str], name: str) -> str | None:
    """``startingPosition`` / ``endingPosition``: checked now, resolved per channel when it is read."""
    raw = opts.get(name.lower())
    if raw is None:
        return None
    value = raw.strip()
    try:
        per = json.loads(value) if value.startswith("{") else {"*": value}
    except ValueError as exc:
        raise ConfigError(name, f"is neither earliest, latest, a position nor a JSON object: {raw!r}") from exc
    if not isinstance(per, dict) or not per:
        raise ConfigError(name, f"must name at least one channel: {raw!r}")
    for v in per.values():
        one_position(name, v)
    return json.dumps(per, sort_keys=True)


def check_position_keys(option: str | None, name: str, channels: Mapping[str, str]) -> None:
    """Refuse a per-channel key of ``startingPosition`` / ``endingPosition`` that names no channel being read.

    ``channels`` maps the id of each channel read to its directory (or, for an
    agent's channel, a label); a key is a channel id, a directory, or ``*``.

    Raises:
        ConfigError: A key names none of them (a typo would otherwise read the default range).
    """
    if option is None:
        return
    known = {"*", *channels}
    known.update(where for where in channels.values() if os.path.isabs(where))  # as resolve_position matches
    for key in sorted(json.loads(option)):
        if key not in known:
            read = ", ".join(f"{cid} ({where})" for cid, where in sorted(channels.items())) or "none"
            raise ConfigError(
                name,
                f"names channel {key!r}, which is not one this query reads (it reads {read}): "
                "key each position by a channel id or directory read",
            )


def one_position(name: str, v: object) -> str | int:
    """One channel's value of option ``name``: ``"earliest"``, ``"latest"`` or a position >= 0.

    Raises:
        ConfigError: Anything else.
    """
    if isinstance(v, str) and v.strip().lower() in ("earliest", "latest"):
        return v.strip().lower()
    try:
        n = int(str(v).strip())
    except ValueError:
        n = -1
    if isinstance(v, bool) or n < 0:
        raise ConfigError(name, f"each position is earliest, latest or a position >= 0, got {v!r}")
    return n


def resolve_position(option: str | None, name: str, cid: str, path: str, start: int, end: int, default: str) -> int:
    """Where ``startingPosition`` / ``endingPosition`` puts channel ``cid`` (at ``path``), which holds ``[start, end)``.

    Raises:
        DataLossError: A position below what the channel still holds (those events were taken).
        ConfigError: A position beyond its end.
    """
    per: dict[str, Any] = json.loads(option) if option is not None else {}
    want = per.get(cid, per.get(path, per.get(os.path.abspath(path), per.get("*", default))))
    v = one_position(name, want)
    if v == "earliest":
        return start
    if v == "latest":
        return end
    assert isinstance(v, int)
    if v < start:
        raise DataLossError(v, start, f"{name} {v}: channel {path} holds positions from {start} (taken before)")
    if v > end:
        raise ConfigError(name, f"{v} is beyond what channel {path} holds (positions below {end})")
    return v


def make_offset(positions: Mapping[str, int], query: str) -> dict[str, Any]:
    """The one way an offset is built: canonical, since Spark compares offsets as JSON strings."""
    return {"positions": {cid: int(positions[cid]) for cid in sorted(positions)}, "query": query}


def parse_offset(offset: object) -> tuple[dict[str, int], str]:
    """Return ``(positions by channel id, query token)`` of an offset this source made.

    Raises:
        CheckpointMismatchError: It is not such an offset (a checkpoint of another source?).
    """
    if isinstance(offset, dict) and set(offset) == {"positions", "query"}:
        pos, query = offset["positions"], offset["query"]
        if (
            isinstance(pos, dict)
            and pos
            and isinstance(query, str)
            and all(isinstance(k, str) and type(v) is int and v >= 0 for k, v in pos.items())
        ):
            return dict(pos), query
    raise CheckpointMismatchError(
        f"filechannel source: the offset {json.dumps(offset)} in this query's checkpoint was not made by "
        "the filechannel source: the checkpoint belongs to another query; give this query its own checkpoint"
    )


def share(avail: Mapping[str, int], n: int) -> dict[str, int]:
    """Split at most ``n`` events among channels fairly (water-filling), never above what each has."""
    out: dict[str, int] = {}
    left = n
    items = sorted(avail.items(), key=lambda kv: (kv[1], kv[0]))
    for i, (cid, a) in enumerate(items):
        take = min(a, left // (len(items) - i))
        out[cid] = take
        left -= take
    return out


def share_partitions(counts: Mapping[str, int], n: int) -> dict[str, int]:
    """Share ``minPartitions`` = ``n`` among channels by their events in the range (at least one each)."""
    total = sum(counts.values())
    return {cid: max(1, -(-n * c // total)) for cid, c in counts.items()} if total else dict.fromkeys(counts, 1)


def lost(path: str, exc: DataLossError, hint: str) -> DataLossError:
    """``exc`` of channel ``path``, its message naming the channel and ``hint`` (what to do)."""
    return DataLossError(exc.start, exc.end, f"channel {path}: {exc.reason}; {hint}")


AHEAD_HINT = (
    "this query's Spark checkpoint has delivered positions the channel does not hold: was the channel directory "
    "restored from an older copy or replaced? Nothing is clamped silently; to accept the loss, start the query on "
    "a new checkpoint"
)
BEHIND_HINT = (
    "this query's Spark checkpoint is older than what its consumer acknowledged (a checkpoint restored from an "
    "older copy?), so those events cannot be delivered again; to accept it, start the query on a new checkpoint"
)
