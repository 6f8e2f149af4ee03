"""filechannel.testing.assert_exactly_once / assert_at_least_once: what they accept and how they report."""

from __future__ import annotations

import re

import pytest

from filechannel import Event
from filechannel.testing import DeliveryError, assert_at_least_once, assert_exactly_once
from filechannel.testing.checks import compare


def bodies(n: int, start: int = 0) -> list[bytes]:
    return [f"event-{i:05d}".encode() for i in range(start, start + n)]


def test_exactly_once_passes_in_any_order_and_returns_the_report() -> None:
    produced = bodies(100)
    r = assert_exactly_once(produced, list(reversed(produced)))
    assert (r.produced, r.delivered, r.lost, r.extra) == (100, 100, 0, 0)


def test_exactly_once_with_ordered_reports_the_first_reordered_item() -> None:
    produced = bodies(10)
    delivered = [*produced[:3], produced[5], *produced[3:5], *produced[6:]]
    assert_exactly_once(produced, delivered)  # order not asked for
    with pytest.raises(DeliveryError) as ei:
        assert_exactly_once(produced, delivered, ordered=True)
    assert ei.value.report.reordered == [(b"event-00003", 4)]
    assert "first reordered: b'event-00003'  delivered #4" in str(ei.value)


def test_a_short_readable_report_for_a_big_stream() -> None:
    produced = bodies(10_000)
    delivered = produced[:4000] + produced[4100:] + produced[9000:9050] + [b"stranger"]
    with pytest.raises(DeliveryError) as ei:
        assert_exactly_once(produced, delivered)
    msg = str(ei.value)
    lines = msg.splitlines()
    assert lines[0] == (
        "not exactly once: produced 10000, delivered 9951: missing 100, duplicated 50 (50 items), unexpected 1"
    )
    assert len(lines) < 25, msg  # a summary, never a diff of 10,000 items
    assert "first missing (of 100):" in msg
    assert "b'event-04000'  produced #4000, 1 copy lost" in msg
    assert "b'event-09000'  delivered again at #9900, 1 extra" in msg
    assert "b'stranger'  delivered #9950" in msg
    r = ei.value.report
    assert (r.lost, r.extra, len(r.unexpected)) == (100, 50, 1)


def test_at_least_once_allows_duplicates_but_not_loss_or_strangers() -> None:
    produced = bodies(5)
    r = assert_at_least_once(produced, produced + produced[:2])
    assert r.extra == 2
    with pytest.raises(DeliveryError, match=r"not at least once: .*missing 1"):
        assert_at_least_once(produced, produced[1:] + produced[1:])
    with pytest.raises(DeliveryError, match=r"unexpected 1"):
        assert_at_least_once(produced, [*produced, b"x"])


def test_events_rows_and_keys() -> None:
    produced = [Event(b"a", {"k": "1"}), Event(b"b", {"k": "2"})]
    rows = [{"position": 1, "body": bytearray(b"b")}, {"position": 0, "body": bytearray(b"a")}]
    assert_exactly_once(produced, rows)  # default identity: the body (bytearray == bytes)
    # a key by name applies to both sides (an Event's field, a row's column)
    assert_exactly_once(produced, [{"body": b"a"}, {"body": b"b"}], key="body")
    # a callable key: here the header, so two events with the same header count as one identity twice
    with pytest.raises(DeliveryError, match=re.escape("duplicated 1 (1 items)")):
        assert_exactly_once(
            produced,
            [Event(b"x", {"k": "1"}), Event(b"y", {"k": "1"}), Event(b"z", {"k": "2"})],
            key=lambda e: e.headers["k"],
        )


def test_a_value_produced_twice_must_arrive_twice() -> None:
    r = compare([b"a", b"a", b"b"], [b"a", b"b"])
    assert r.missing == [(b"a", 0, 1)]
    assert not r.duplicated


def test_a_bad_key_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="key must be None, a field name or a callable"):
        assert_exactly_once([b"a"], [b"a"], key=3)  # type: ignore[arg-type]
