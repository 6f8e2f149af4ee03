"""Event: the immutable event a channel holds, and the checks of what a caller puts.

This module owns the event as a value: :class:`Event` (body, headers and, once
committed, a position), the one shared empty headers dict every event without
headers carries, and the checks that turn what a caller passes to a put into
a body and headers (or a specific error). It sits at the bottom of the import
floors with ``format`` and ``errors`` only beneath it, so the read side
(``reader``), the agent client and the Spark executors use :class:`Event`
without loading the write stack (``log``, ``writer``, ``channel``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final, NamedTuple, NoReturn

from .errors import InvalidEventError

__all__ = [
    "NO_HEADERS",
    "Event",
    "as_body",
    "as_event",
    "bad_header_text",
    "check_headers",
    "coerce_event",
    "no_headers",
]


class NoHeaders(dict[str, str]):
    """The headers of every Event without headers: one shared, empty, read-only ``dict``.

    A ``dict`` (not a ``MappingProxyType``) so that ``json.dumps`` takes it and an
    Event pickles; read-only because it is shared. Pickling and copying give the
    same shared object back.
    """

    __slots__ = ()

    def _read_only(self, *args: object, **kwargs: object) -> NoReturn:
        raise TypeError("the headers of an Event without headers are shared and read-only: use dict(event.headers)")

    __setitem__ = __delitem__ = __ior__ = _read_only
    clear = pop = popitem = setdefault = update = _read_only  # type: ignore[assignment]

    def __reduce__(self) -> tuple[Callable[[], NoHeaders], tuple[()]]:
        return no_headers, ()


def no_headers() -> NoHeaders:
    """The shared empty headers (what an unpickled one becomes)."""
    return NO_HEADERS


NO_HEADERS: Final[NoHeaders] = NoHeaders()


class Event(NamedTuple):
    """An immutable event: a body, string headers and, once committed, a position.

    ``position`` is the event's place in the channel (0, 1, 2, ... in commit
    order), the same after any restart; it is ``None`` on an event built by
    the caller and set on every event a take returns. ``headers`` of a taken
    event is a ``dict`` (without headers, one shared empty dict that refuses
    changes), so an Event pickles and its headers go to ``json.dumps``.

    >>> Event(b"hello", {"source": "web-1"}).body
    b'hello'
    """

    body: bytes
    headers: Mapping[str, str] = NO_HEADERS
    position: int | None = None


as_event: Any = tuple.__new__
"""``as_event(Event, (body, headers, position))``: an Event without Python-level ``__new__``."""


def coerce_event(body: object, headers: Mapping[str, str] | None) -> tuple[bytes, Mapping[str, str] | None]:
    """Return ``(body, headers)`` for a put of an Event or a bytes-like body other than bytes."""
    if isinstance(body, Event):
        if headers is not None:
            raise TypeError("pass headers inside the Event, not beside it")
        headers = body.headers
        body = body.body
    if type(body) is bytes:
        return body, headers
    if isinstance(body, (bytearray, memoryview)):
        return bytes(body), headers
    raise TypeError(f"event body must be bytes-like, got {type(body).__name__}")


def as_body(b: object) -> bytes:
    """One body given to ``put_many``, as ``bytes`` (other bytes-like objects are copied)."""
    if type(b) is bytes:
        return b
    if isinstance(b, (bytearray, memoryview)):
        return bytes(b)
    what = "an Event: put Events one at a time with put()" if isinstance(b, Event) else type(b).__name__
    raise TypeError(f"event body must be bytes-like, got {what}")


def check_headers(headers: object) -> Mapping[str, str]:
    """Headers given to a put, checked (a mapping of str to str) and copied; ``None`` is no headers."""
    if headers is None:
        return NO_HEADERS
    if not isinstance(headers, Mapping):
        raise TypeError(f"headers must be a mapping of str to str, got {type(headers).__name__}")
    for k, v in headers.items():
        if not isinstance(k, str):
            raise TypeError(f"header key {k!r} is {type(k).__name__}, not str")
        if not isinstance(v, str):
            raise TypeError(f"header {k!r} has a {type(v).__name__} value, not str")
    return dict(headers)


def bad_header_text(headers: Mapping[str, str]) -> InvalidEventError:
    """Return the error for headers that do not encode as strict UTF-8, naming the first bad one.

    Only called after ``format.encode_event`` failed, so the common path pays nothing.
    """
    for k, v in headers.items():
        for part, text in (("key", k), ("value", v)):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                return InvalidEventError(
                    f"header {k!r}: its {part} is not valid UTF-8 text ({exc.reason} at index {exc.start}); "
                    "header keys and values must be Unicode text without lone surrogates: decode bytes "
                    "with errors='replace' (or base64), or carry them in the body"
                )
    return InvalidEventError("event headers are not valid UTF-8 text")  # pragma: no cover - encode failed above
