"""The Spark source's offsets, for both readers (channel directories and agents' channels).

This module owns what :mod:`filechannel.spark.source` and
:mod:`filechannel.spark.remote` share about offsets: the one way an offset is
built and parsed (:func:`make_offset`, :func:`parse_offset`; Spark compares
offsets as JSON strings, so they are canonical), ``startingPosition`` /
``endingPosition`` (checked, keyed by channel, resolved per channel), how a
micro-batch's read limit and ``minPartitions`` are shared among channels
(:class:`Pacing`: the ``availableNow`` end and the ``minEventsPerTrigger``
wait), the query token an offset carries (:func:`bind_query`), and the errors
(with their hints) of a checkpoint that does not fit its channels or its
consumer (:func:`identity_guard`). No Spark is imported here.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from filechannel.errors import ChannelError, ConfigError, ConsumerIdentityError, DataLossError

__all__ = [
    "AHEAD_HINT",
    "BEHIND_HINT",
    "CheckpointMismatchError",
    "Pacing",
    "bind_query",
    "check_position_keys",
    "identity_guard",
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


def bind_query(held: str | None, query: str) -> str:
    """The query token a reader reads under: ``held`` (the first it saw), which ``query`` must match.

    Raises:
        CheckpointMismatchError: Offsets of two queries in one checkpoint.
    """
    if held is not None and query != held:
        raise CheckpointMismatchError(
            f"filechannel source: offsets of two queries ({held!r} and {query!r}) in one checkpoint"
        )
    return query


@contextmanager
def identity_guard(consumer: str, where: str) -> Iterator[None]:
    """Turn a refused consumer identity (of ``consumer`` at channel ``where``) into the checkpoint's error.

    Raises:
        CheckpointMismatchError: The consumer belongs to another query (the body raised ``ConsumerIdentityError``).
    """
    try:
        yield
    except ConsumerIdentityError as exc:
        raise CheckpointMismatchError(
            f"filechannel source: consumer {consumer!r} of channel {where} belongs to another query "
            f"(identity {exc.recorded!r}; this query is {exc.given!r}): either this query's Spark checkpoint "
            "is not the one that consumer was reading with (lost, deleted or moved: a new checkpoint starts a "
            "new query), or a second query reads under the same name. Give a second query its own "
            "option('consumer', NAME); or, to continue under this name from its acknowledged position, set "
            "option('resetConsumer', 'true') (events the old query delivered after its last "
            "acknowledgement, at most its last micro-batch, are delivered again)"
        ) from exc


class Pacing:
    """How much of what the channels hold the next micro-batch takes, for both stream readers.

    Holds the ``availableNow`` end (:attr:`target`, set when Spark prepares such
    a query) and when fewer than ``minEventsPerTrigger`` events started waiting.

    Args:
        consumer: The consumer name (named in errors).
        max_trigger_delay: ``maxTriggerDelay`` in seconds: the longest a micro-batch waits for the minimum.
    """

    def __init__(self, consumer: str, max_trigger_delay: float) -> None:
        self.consumer = consumer
        self.max_trigger_delay = max_trigger_delay
        self.target: dict[str, int] | None = None  # availableNow: each channel's end at prepare time
        self.waiting_since: float | None = None  # minEventsPerTrigger: when fewer events started waiting

    def admit(self, avail: Mapping[str, int], cap: int | None, least: int | None) -> dict[str, int]:
        """How many events of each channel the next micro-batch takes, of ``avail``.

        At most ``cap`` in all (shared fairly; None: everything), and nothing
        while fewer than ``least`` are there (see :meth:`too_few`).
        """
        take = share(avail, cap) if cap is not None else dict(avail)
        if least is not None and self.too_few(sum(take.values()), least):
            return dict.fromkeys(take, 0)
        return take

    def too_few(self, n: int, least: int) -> bool:
        """``minEventsPerTrigger`` = ``least``: whether a micro-batch of ``n`` events waits for more.

        It waits no longer than ``maxTriggerDelay`` since events first waited; an
        ``availableNow`` query never waits.
        """
        if self.target is None and 0 < n < least:
            now = time.monotonic()
            if self.waiting_since is None:
                self.waiting_since = now
            if now - self.waiting_since < self.max_trigger_delay:
                return True
        self.waiting_since = None
        return False

    def available_from(self, where: str, cid: str, s: int, acked: int, end: int) -> int:
        """Events of channel ``cid`` (named ``where`` in errors) from ``s``, which holds ``[acked, end)``.

        Within the ``availableNow`` end, if one was recorded.

        Raises:
            DataLossError: ``s`` is beyond the channel's end, or below what this consumer acknowledged.
        """
        if s > end:
            raise lost(where, DataLossError(end, s, f"the channel holds positions below {end} only"), AHEAD_HINT)
        if s < acked:
            raise lost(
                where, DataLossError(s, acked, f"consumer {self.consumer!r} acknowledged them already"), BEHIND_HINT
            )
        if self.target is not None:
            end = min(end, self.target.get(cid, s))
        return max(0, end - s)
