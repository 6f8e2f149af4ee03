"""The steps of :func:`~filechannel.testing.stream_test`: what a test says happens, in order.

Each step is a small frozen dataclass (:class:`AddData`, :class:`StartStream`,
:class:`StopStream`, :class:`ProcessAllAvailable`, :class:`CrashDriver`,
:class:`CrashProducer`, :class:`CrashAgent`, :class:`CheckAnswer`,
:class:`CheckExactlyOnce`, :class:`ExpectFailure`) with the ``str`` a failure
report shows; :data:`ACTIONS` lists them. What each one does is the runner's
(``stream.py``); this module only says what a test may ask for.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from filechannel.events import Event

# ------------------------------------------------------------------------------------------
# The steps


@dataclass(frozen=True)
class AddData:
    """Put ``events`` into the channel in one committed transaction (bytes, str as UTF-8, or Events)."""

    events: Sequence[bytes | str | Event]
    headers: Mapping[str, str] | None = None

    def __str__(self) -> str:
        return f"AddData({len(self.events)} events)"


@dataclass(frozen=True)
class StartStream:
    """Start the query (a driver process is started first if none runs)."""

    def __str__(self) -> str:
        return "StartStream()"


@dataclass(frozen=True)
class StopStream:
    """Stop the query cleanly (the driver process stays, ready for checks or a restart)."""

    def __str__(self) -> str:
        return "StopStream()"


@dataclass(frozen=True)
class ProcessAllAvailable:
    """Wait until the query has processed everything available (or the armed crash killed the driver)."""

    def __str__(self) -> str:
        return "ProcessAllAvailable()"


@dataclass(frozen=True)
class CrashDriver:
    """SIGKILL the driver with its JVM and workers: now, or with ``at="after_sink"`` after the next batch's sink.

    ``at="after_sink"`` kills the driver right after the ``foreachBatch`` function
    of the next batch returns (after the sink wrote, before Spark's commit log).
    With the stream running, the step returns once that happened (a StartStream
    can follow at once), or fails saying no batch came; before a StartStream it
    arms the crash, and that StartStream's first batch fires it.
    """

    at: str | None = None

    def __str__(self) -> str:
        return f"CrashDriver(at={self.at!r})" if self.at else "CrashDriver()"


@dataclass(frozen=True)
class CrashProducer:
    """SIGKILL the producer while a transaction holding ``uncommitted`` is open; the next AddData recovers."""

    uncommitted: Sequence[bytes] = (b"filechannel.testing: put in a transaction that never committed",)

    def __str__(self) -> str:
        return "CrashProducer()"


@dataclass(frozen=True)
class CrashAgent:
    """SIGKILL the agent serving the channel (``stream_test(..., agent=True)``), then start it again.

    ``down`` seconds pass before the restart (the query runs on meanwhile: its
    source holds the channel's position, or fails, as ``onAgentUnavailable``
    says). The new agent listens on the same port.
    """

    down: float = 0.0

    def __str__(self) -> str:
        return f"CrashAgent(down={self.down:g})" if self.down else "CrashAgent()"


@dataclass(frozen=True)
class CheckAnswer:
    """The sink holds exactly ``rows``, in any order.

    Each expected row is a mapping (compared with the row's columns), a tuple
    (compared with the row's values in column order), or a single value
    (for one-column output). bytes and bytearray compare equal.
    """

    rows: Sequence[Any]

    def __str__(self) -> str:
        return f"CheckAnswer({len(self.rows)} rows)"


@dataclass(frozen=True)
class CheckExactlyOnce:
    """Every event of every AddData is in the sink exactly once, and nothing else is.

    ``key`` picks a sink row's identity: a column name, a callable on the row
    (a dict), or ``None`` for the ``body`` column. ``produced_key`` picks an
    added event's identity (default: the same ``key`` applied to the Event,
    whose fields are ``body``, ``headers``, ``position``; with ``key=None``, its body).
    """

    key: str | Callable[[Any], Any] | None = None
    produced_key: Callable[[Event], Any] | None = None

    def __str__(self) -> str:
        return f"CheckExactlyOnce(key={self.key!r})" if self.key is not None else "CheckExactlyOnce()"


@dataclass(frozen=True)
class ExpectFailure:
    """The query fails (at its start or while running); its error matches the regular expression ``match``."""

    match: str | None = None

    def __str__(self) -> str:
        return f"ExpectFailure(match={self.match!r})"


ACTIONS = (
    AddData,
    StartStream,
    StopStream,
    ProcessAllAvailable,
    CrashDriver,
    CrashProducer,
    CrashAgent,
    CheckAnswer,
    CheckExactlyOnce,
    ExpectFailure,
)
